"""``qllm-report <sweep dir>``: one tidy table and the paper's figures from a sweep's runs.

A run directory is one that holds ``.hydra/config.yaml`` and ``summary.json`` (written last, so
a crashed or unfinished run has none and is left out). Writes, under ``<sweep>/report/`` (or
``--out``):

- ``table.csv``: one row per run and class (LS, BE, all): the varied settings (policy, rate,
  seed, ...) and every metric of the run's ``summary.json``;
- ``fig2_ls_ttft_vs_rate.png`` (the paper's Fig. 2: LS TTFT with the SLO line, and SLO
  attainment), ``fig3_throughput_vs_rate.png`` (Fig. 3), ``fig4_turnaround_vs_rate.png``
  (Fig. 4: LS and BE turnaround), ``ttft_cdf.png`` (TTFT CDFs per policy at a few rates).

Points are means over seeds, each seed counted once (runs that repeat a seed are averaged, with
a warning; a seed without requests of a class is left out of that class's mean, with a
warning); error bars are 95% t-intervals of the mean (none for one seed). Runs without a
``workload.rate`` (a trace at its own timestamps) are drawn at their measured arrival rate, with
a note.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from sim.cli import CONF_DIR  # noqa: E402
from sim.metrics import STATS  # noqa: E402

# Settings that identify a run; ``experiment`` is set by sim.reproduce, absent from sweeps.
CONFIG_COLUMNS = ["experiment", "policy", "workload", "profile", "rate", "seed",
                  "num_requests", "max_output_tokens", "ls_fraction", "slo_ls_ttft_s"]  # fmt: skip
CLASSES = ("LS", "BE", "all")
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "turnaround_s")  # per class in summary.json
POLICY_ORDER = ("fcfs", "iteration", "tgi-0.3", "priority", "alg1", "layer", "qllm")
FIGURES = {
    "ls_ttft": "fig2_ls_ttft_vs_rate.png",
    "throughput": "fig3_throughput_vs_rate.png",
    "turnaround": "fig4_turnaround_vs_rate.png",
    "cdf": "ttft_cdf.png",
}


class ReportError(Exception):
    """A problem with the report's input, said in one line."""


# ------------------------------------------------------------------------------ the table
def run_settings(cfg) -> dict:
    """The identifying settings of a run, from its resolved config (DictConfig or dict)."""
    if not isinstance(cfg, dict):
        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    w, slo = cfg.get("workload", {}), cfg.get("slo", {})
    return {
        "policy": cfg.get("policy", {}).get("name"),
        "workload": w.get("name"),
        "profile": cfg.get("profile", {}).get("name"),
        "rate": w.get("rate"),
        "seed": cfg.get("seed"),
        "num_requests": w.get("num_requests"),
        "max_output_tokens": w.get("max_output_tokens"),
        "ls_fraction": w.get("ls_fraction"),
        "slo_ls_ttft_s": slo.get("ls_ttft_s"),
    }


# the config keys that run_settings names otherwise, or that do not change results
NAMED_KEYS = {"policy.name", "workload.name", "profile.name", "workload.rate", "seed",
              "workload.num_requests", "workload.max_output_tokens", "workload.ls_fraction",
              "slo.ls_ttft_s", "progress", "resume"}  # fmt: skip
UNSET = "-"  # an extra setting that a run's config does not have


def flat_settings(config: dict, prefix: str = "") -> dict:
    """A resolved config as ``{"policy.max_batch_size": 32, ...}`` (lists as strings)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_settings(value, f"{name}."))
        else:
            out[name] = str(value) if isinstance(value, list) else value
    return out


@cache
def policy_defaults() -> dict[str, dict]:
    """Each policy's own options as its config file gives them (``conf/policy/*.yaml``), by the
    policy's name, flat (``{"policy.max_waiting_tokens": 20, ...}``)."""
    out = {}
    for path in sorted((CONF_DIR / "policy").glob("*.yaml")):
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        out[str(config.get("name", path.stem))] = flat_settings(config, "policy.")
    return out


def varying_settings(runs: list[tuple[str, dict]]) -> list[str]:
    """The config keys beyond ``run_settings``'s that take two values or more among the runs
    ((policy, flat config) each; a key one run lacks counts as a value): each is a setting of
    its own in the table (named by its key, ``memory.model``), so that runs that differ in it
    are neither averaged as seeds of one point nor compared as if only the policy differed.

    Left out: a policy's own options (``policy.*``) where every run of each policy holds that
    policy's own value from its config file (``policy._target_``, iteration's
    ``policy.max_waiting_tokens``, tgi-0.3's ``policy.waiting_served_ratio``): they differ
    between policies by construction, and the policy tells those runs apart already. An option
    set otherwise (``policy.max_batch_size=8`` for one policy only), or of a policy without a
    config file here, is a setting."""
    defaults = policy_defaults()
    keys = sorted({k for _, flat in runs for k in flat} - NAMED_KEYS)

    def own_option(key: str) -> bool:
        return key.startswith("policy.") and all(
            str(policy) in defaults
            and repr(flat.get(key, UNSET)) == repr(defaults[str(policy)].get(key, UNSET))
            for policy, flat in runs
        )

    varies = [k for k in keys if len({repr(flat.get(k, UNSET)) for _, flat in runs}) > 1]
    return [k for k in varies if not own_option(k)]


def summary_rows(settings: dict, summary: dict) -> list:
    """One row per class (LS, BE, all) of one run: its settings and every metric of its
    summary: ``<metric>_<stat>_s`` for each latency (``ttft_p95_s``, ``itl_max_s``, ...), the
    class's ``slo_attainment``, ``goodput``, ``preemptions``, ``recomputes`` and ``swaps``,
    and the run's throughput, makespan and counts (the same on the three rows)."""
    rows = []
    for cls in CLASSES:
        part = summary["classes"][cls]
        row = {**settings, "cls": cls, "count": part["count"]}
        for metric in LATENCIES:
            base = metric[: -len("_s")]
            for stat in STATS:
                row[f"{base}_{stat}_s"] = part[metric][stat]
        for key in ("slo_attainment", "goodput", "preemptions", "recomputes", "swaps"):
            row[key] = part.get(key)
        row.update(summary["throughput"])
        row.update({k: summary[k] for k in ("makespan_s", "arrived", "completed")})
        rows.append(row)
    return rows


def find_runs(sweep_dir: Path) -> list[Path]:
    """Finished run directories under ``sweep_dir`` (itself included), sorted."""
    return sorted(
        p.parent
        for p in sweep_dir.rglob("summary.json")
        if (p.parent / ".hydra" / "config.yaml").is_file()
    )


def load_sweep(sweep_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tidy table (one row per run and class) and the per-request TTFTs of every run."""
    import json

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReportError(f"{sweep_dir}: no such directory")
    runs = find_runs(sweep_dir)
    if not runs:
        raise ReportError(
            f"{sweep_dir}: no finished runs (a run directory holds .hydra/config.yaml and "
            "summary.json)"
        )
    loaded = []
    for run in runs:
        try:
            summary = json.loads((run / "summary.json").read_text())
            # the config stored with the results (qllm-sim) is the one that produced them
            config = summary.get("config") or OmegaConf.load(run / ".hydra" / "config.yaml")
            if not isinstance(config, dict):
                config = OmegaConf.to_container(config, resolve=True, enum_to_str=True)
            settings = run_settings(config)
        except Exception as e:  # noqa: BLE001  (any unreadable run is named, not a traceback)
            raise ReportError(f"{run}: unreadable run ({type(e).__name__}: {e})") from None
        loaded.append((run, summary, settings, flat_settings(config)))
    extra = varying_settings([(s["policy"], flat) for _, _, s, flat in loaded])
    for key in extra:  # numbers stay numbers (sorted as such) unless a run lacks the key
        values = [flat.get(key, UNSET) for *_, flat in loaded]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            for *_, flat in loaded:
                flat[key] = str(flat.get(key, UNSET))
    rows, frames = [], []
    for run, summary, settings, flat in loaded:
        settings.update({k: flat.get(k, UNSET) for k in extra})
        settings["run_dir"] = str(run.relative_to(sweep_dir))
        arrivals_per_s = np.nan  # unknown without the run's requests
        if (run / "requests.parquet").is_file():
            requests = pd.read_parquet(run / "requests.parquet",
                                       columns=["cls", "ttft_s", "arrival_s"])  # fmt: skip
            arrivals_per_s = arrival_rate(requests["arrival_s"])
            frames.append(requests.drop(columns="arrival_s").assign(**settings))
        try:
            rows += [{**row, "arrivals_per_s": arrivals_per_s}
                     for row in summary_rows(settings, summary)]  # fmt: skip
        except KeyError as e:
            raise ReportError(f"{run}: summary.json has no {e} (written by an older qllm-sim? "
                              "rerun the run)") from None  # fmt: skip
    # a run without workload.rate (a trace at its own timestamps) has rate NaN, not None
    table = tidy(pd.DataFrame(rows).assign(rate=lambda t: pd.to_numeric(t["rate"])))
    requests = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(requests):
        requests["rate"] = pd.to_numeric(requests["rate"])
    return table, requests


def arrival_rate(arrivals: pd.Series) -> float:
    """A run's measured arrival rate: (arrivals - 1) / their span, the mean rate that
    ``workload.rate`` sets (NaN for fewer than two arrivals, or all at one instant)."""
    span = arrivals.max() - arrivals.min() if len(arrivals) else 0.0
    return (len(arrivals) - 1) / span if len(arrivals) > 1 and span > 0 else np.nan


def mixed_inputs(sweep_dir: str | Path) -> list[str]:
    """Warnings for runs that do not compare although their settings say they do: made from
    several versions of the simulator's code, or from different files under one profile name
    (``summary.json``'s ``inputs``; runs from before it are counted apart). The real engine's
    runs (``qllm-realrun``: no profile in their config) read neither and are not counted."""
    import json

    code: set[str] = set()
    profile: dict[str, set] = {}
    workload: dict[str, set] = {}  # a workload file (its path), or a kind's installed data
    for run in find_runs(Path(sweep_dir)):
        summary = json.loads((run / "summary.json").read_text())
        inputs = summary.get("inputs") or {}
        config = summary.get("config") or {}
        if "profile" not in config:  # a real engine's run: no simulator code or profile read
            continue
        name = config["profile"].get("name")
        code.add(inputs.get("code") or "unknown")
        profile.setdefault(name, set()).add(inputs.get("profile") or "unknown")
        w = config.get("workload", {})
        source = w.get("path") or w.get("kind") or w.get("name")
        workload.setdefault(str(source), set()).add((inputs.get("workload"), inputs.get("data")))
    out = []
    if len(code) > 1:
        out.append(f"warning: these runs were made by {len(code)} versions of the simulator's "
                   "code (summary.json's inputs.code): rerun the older ones before comparing "
                   "them")  # fmt: skip
    for name, digests in sorted(profile.items(), key=lambda kv: str(kv[0])):
        if len(digests) > 1:
            out.append(f"warning: profile {name}: these runs read {len(digests)} different "
                       "sets of its files (summary.json's inputs.profile): a profile measured "
                       "again under the same name")  # fmt: skip
    for source, digests in sorted(workload.items()):
        if len(digests) > 1:
            out.append(f"warning: workload {source}: these runs read {len(digests)} different "
                       "versions of it (summary.json's inputs.workload and inputs.data: an "
                       "edited file, or other versions of the data packages)")  # fmt: skip
    return out


def tidy(table: pd.DataFrame) -> pd.DataFrame:
    """Settings first, then metrics; rows sorted by policy (in POLICY_ORDER), rate, seed, class."""
    setting_cols = [c for c in CONFIG_COLUMNS if c in table] + extra_columns(table) + ["cls"]
    first = setting_cols + [c for c in ("run_dir",) if c in table]
    table = table[first + [c for c in table.columns if c not in first]]
    order = {p: i for i, p in enumerate(POLICY_ORDER)}
    keys = [c for c in setting_cols if c not in ("policy", "cls")]
    return (
        table.assign(
            _p=table["policy"].map(lambda p: order.get(p, len(order))),
            _c=table["cls"].map({c: i for i, c in enumerate(CLASSES)}),
        )
        .sort_values(["_p", "policy", *keys, "_c"], na_position="first", kind="stable")
        .drop(columns=["_p", "_c"])
        .reset_index(drop=True)
    )


def series_columns(table: pd.DataFrame) -> list[str]:
    """The settings that tell the plotted lines apart: the policy, and any other setting
    (but rate and seed) that takes more than one value in the table: those of
    CONFIG_COLUMNS, and the config keys (``memory.model``) that ``load_sweep`` added because
    they vary."""
    cols = ["policy"]
    for c in [*CONFIG_COLUMNS, *extra_columns(table)]:
        if c in ("policy", "rate", "seed") or c not in table:
            continue
        if table[c].astype(str).nunique() > 1:
            cols.append(c)
    return cols


def extra_columns(table: pd.DataFrame) -> list[str]:
    """The config keys ``load_sweep`` added as settings (their names hold a dot; metrics'
    do not)."""
    return [c for c in table.columns if "." in c]


# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(dof: int) -> float:
    return _T975[dof - 1] if 1 <= dof <= len(_T975) else 1.96


def over_seeds(table: pd.DataFrame, cls: str, value: str, series: list[str] | None = None):
    """Mean, min, max, count and the 95% t-interval half-width (``ci95``; NaN for one seed) of
    ``value`` over seeds, per series and rate, for one class; and ``x``, where the point is
    drawn: its rate, or for runs without one (a trace at its own timestamps) the mean of their
    measured arrival rates (``arrivals_per_s``; NaN where unknown).

    Each seed counts once: the runs of one point that share a seed (the same sweep run twice
    into one directory) are first averaged into one value for that seed, so ``count`` is the
    number of distinct seeds and a copied run neither adds a sample nor narrows the interval
    (``repeated_seeds`` names them). A table without a ``seed`` column counts each row."""
    part = table[table["cls"] == cls]
    keys = [*(series or series_columns(table)), "rate"]
    measured = part["arrivals_per_s"] if "arrivals_per_s" in part else np.nan
    part = part.assign(
        _x=pd.to_numeric(part["rate"]).fillna(measured),
        _seed=part["seed"] if "seed" in part else np.arange(len(part)),
    )
    per_seed = part.groupby([*keys, "_seed"], dropna=False, sort=False)[[value, "_x"]].mean()
    stats = {s: (value, s) for s in ("mean", "min", "max", "count", "std")}
    out = (
        per_seed.reset_index()
        .groupby(keys, dropna=False, sort=False)
        .agg(**stats, x=("_x", "mean"))
        .reset_index()
    )
    half = out["std"] / np.sqrt(out["count"]) * out["count"].map(lambda n: t975(int(n) - 1))
    out["ci95"] = half.where(out["count"] > 1)
    return out.drop(columns="std").sort_values(keys, kind="stable")


def repeated_seeds(table: pd.DataFrame) -> list[str]:
    """A warning per point (series and rate) and seed that more than one run holds: they are
    counted once, as their mean (``over_seeds``)."""
    if "seed" not in table or "run_dir" not in table:
        return []
    keys = [*series_columns(table), "rate", "seed"]
    runs = table.drop_duplicates("run_dir").groupby(keys, dropna=False, sort=False)["run_dir"]
    out = []
    for key, dirs in runs:
        if len(dirs) > 1:
            *series, rate, seed = key
            where = _point(tuple(series), keys[:-2], rate)
            out.append(f"warning: {where}: seed {seed} is in {len(dirs)} runs "
                       f"({', '.join(sorted(dirs))}): counted once, as their mean")  # fmt: skip
    return out


def empty_classes(table: pd.DataFrame) -> list[str]:
    """A warning per point (series and rate) and class that some of its seeds had no request
    of: that class's figures there (its points, its rows of the terminal table) are means
    over the other seeds only (``over_seeds`` skips the empty ones)."""
    if "seed" not in table or "count" not in table:
        return []
    keys = [*series_columns(table), "rate"]
    out = []
    part = table[table["cls"].isin(["LS", "BE"])]
    for key, rows in part.groupby([*keys, "cls"], dropna=False, sort=False):
        *series, rate, cls = key
        empty = rows.loc[rows["count"] == 0, "seed"].drop_duplicates()
        seeds = rows["seed"].nunique()
        if len(empty) and len(empty) < seeds:
            where = _point(tuple(series), keys[:-1], rate)
            out.append(f"warning: {where}: no {cls} request in seed "
                       f"{', '.join(str(x) for x in sorted(empty))}: its {cls} figures are "
                       f"means over the other {seeds - len(empty)} seeds of {seeds}")  # fmt: skip
    return out


def _point(series: tuple, cols: list[str], rate) -> str:
    """``qllm, rate 2``: a point of the figures, as the warnings name it."""
    return _label(series, cols) + (f", rate {rate:g}" if pd.notna(rate) else ", no rate")


def _label(series: tuple, cols: list[str]) -> str:
    """``qllm, profile=a100x2-mixtral-fp16``; the experiment name alone."""
    parts = [str(v) if c in ("policy", "experiment") else f"{c}={v}"
             for c, v in zip(cols, series, strict=True)]  # fmt: skip
    return ", ".join(parts)


MEASURED_X = "arrival rate (req/s; measured for runs without workload.rate)"
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--")]


def draw_lines(ax, table: pd.DataFrame, cls: str, value: str, scale: float = 1.0,
               series: list[str] | None = None) -> None:  # fmt: skip
    """One line per series (by default: policy and every other setting that varies) of
    ``value`` for class ``cls`` against the rate: means over seeds, 95% t-interval bars.
    Marker and line style change from series to series, so that equal lines stay visible."""
    cols = series or series_columns(table)
    agg = over_seeds(table, cls, value, cols)
    if agg["rate"].isna().any():  # runs without a rate: at their measured one (rate_notes)
        ax.set_xlabel(MEASURED_X)
    agg = agg[agg["x"].notna()].sort_values([*cols, "x"], kind="stable")
    for i, (key, part) in enumerate(agg.groupby(cols, dropna=False, sort=False)):
        key = key if isinstance(key, tuple) else (key,)
        mean = part["mean"] * scale
        half = part["ci95"] * scale
        # on a log axis a bar below zero cannot be drawn: stop the lower bar just above zero
        err = np.vstack([np.where(mean > 0, np.minimum(half, mean * 0.999), half), half])
        marker, line = STYLES[i % len(STYLES)]
        ax.errorbar(part["x"], mean, yerr=err if part["count"].max() > 1 else None,
                    marker=marker, ls=line, ms=4 + (i % 3), capsize=3,
                    label=_label(key, cols))  # fmt: skip


def finish(fig, axes: Iterable, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        if not ax.get_xlabel():  # draw_lines names a measured rate
            ax.set_xlabel("arrival rate (req/s)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the figures
SLO_LINES = ("--", ":", "-.")


def slo_list(slo_s: float | Iterable[float] | None) -> list[float]:
    """One SLO, several (the runs used different ones) or none, as a sorted list."""
    if slo_s is None:
        return []
    return [float(slo_s)] if np.isscalar(slo_s) else sorted(float(v) for v in slo_s)


def slo_words(slos: list[float]) -> str:
    """``TTFT <= 3 s``; with several SLOs no single value: ``TTFT <= its run's SLO (0.5, 3 s)``."""
    if not slos:
        return "no LS TTFT SLO"
    if len(slos) == 1:
        return f"TTFT <= {slos[0]:g} s"
    return f"TTFT <= its run's SLO ({', '.join(f'{v:g}' for v in slos)} s)"


def plot_ls_ttft(table: pd.DataFrame, slo_s: float | Iterable[float] | None, path: Path,
                 title: str = "") -> Path:  # fmt: skip
    """The paper's Fig. 2: mean LS TTFT per rate against the SLO line (one per SLO the runs
    used, none without one), and SLO attainment."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    draw_lines(ax1, table, "LS", "ttft_mean_s")
    slos = slo_list(slo_s)
    for i, slo in enumerate(slos):
        ax1.axhline(slo, color="k", ls=SLO_LINES[i % len(SLO_LINES)], lw=1, label=f"SLO {slo:g} s")
    ax1.set(yscale="log", ylabel="LS mean TTFT (s)", title=f"LS time to first token {title}")
    draw_lines(ax2, table, "LS", "slo_attainment", scale=100)
    ax2.set(ylabel="LS requests with TTFT <= SLO (%)", ylim=(-3, 103),
            title=f"LS SLO attainment ({slo_words(slos)})")  # fmt: skip
    return finish(fig, (ax1, ax2), path)


def plot_throughput(table: pd.DataFrame, path: Path, title: str = "") -> Path:
    """The paper's Fig. 3: completed jobs per second (and output tokens per second)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    draw_lines(ax1, table, "all", "jobs_per_s")
    # completions over the makespan (drain included), not the steady window's throughput that
    # qllm-report's tables and the reproduction's ratios read: say which
    ax1.set(ylabel="jobs/s over the whole run (drain included)", title=f"Throughput {title}")
    draw_lines(ax2, table, "all", "output_tokens_per_s")
    ax2.set(ylabel="throughput (output tokens/s)", title=f"Token throughput {title}")
    return finish(fig, (ax1, ax2), path)


def plot_turnaround(table: pd.DataFrame, path: Path, title: str = "") -> Path:
    """The paper's Fig. 4: mean LS and BE turnaround (arrival to last token)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, cls in zip(axes, ("LS", "BE"), strict=True):
        draw_lines(ax, table, cls, "turnaround_mean_s")
        ax.set(yscale="log", ylabel=f"{cls} mean turnaround (s)", title=f"{cls} turnaround {title}")
    return finish(fig, axes, path)


def pick_rates(rates: Iterable[float], n: int = 4) -> list[float]:
    """Up to ``n`` rates spread evenly over the sorted distinct rates, ends included (NaN, a run
    without a rate, left out)."""
    rates = sorted({float(r) for r in rates if pd.notna(r)})
    if len(rates) <= n:
        return rates
    return [rates[i] for i in np.unique(np.linspace(0, len(rates) - 1, n).round().astype(int))]


def plot_ttft_cdf(requests: pd.DataFrame, slo_s: float | Iterable[float] | None, path: Path,
                  title: str = "") -> Path:  # fmt: skip
    """TTFT CDFs per policy (LS solid, BE dashed), all seeds pooled, one panel per rate (and
    one for the runs without a rate, a trace at its own timestamps). Each seed of a series
    weighs the same: runs that repeat a seed share its weight (``over_seeds``)."""
    rated = pick_rates(requests["rate"])
    rates = [*rated, np.nan] if requests["rate"].isna().any() else rated
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.8), squeeze=False)
    cols = series_columns(requests.assign(cls="all"))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    weight = pd.Series(1.0, index=requests.index)
    if {"seed", "run_dir"} <= set(requests):  # 1 / the runs of a (series, rate, seed)
        seeds = requests.groupby([*cols, "rate", "seed"], dropna=False)["run_dir"]
        weight = 1.0 / seeds.transform("nunique")
    for ax, rate in zip(axes[0], rates, strict=True):
        at = requests[requests["rate"].isna() if pd.isna(rate) else requests["rate"] == rate]
        for i, (series, part) in enumerate(at.groupby(cols, dropna=False, sort=False)):
            series = series if isinstance(series, tuple) else (series,)
            for cls, ls in (("LS", "-"), ("BE", "--")):
                one = part.loc[(part["cls"] == cls) & part["ttft_s"].notna(), "ttft_s"]
                order = np.argsort(one.to_numpy(), kind="stable")
                ttft, w = one.to_numpy()[order], weight[one.index].to_numpy()[order]
                if len(ttft):
                    ax.step(ttft, np.cumsum(w) / w.sum(), where="post",
                            color=colours[i % len(colours)], ls=ls,
                            label=f"{_label(series, cols)} {cls}")  # fmt: skip
        for slo in slo_list(slo_s):
            ax.axvline(slo, color="k", ls=":", lw=1)
        at_rate = "no workload.rate (trace timestamps)" if pd.isna(rate) else f"rate {rate:g} req/s"
        ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", ylim=(0, 1.02),
               title=f"{at_rate} {title}")  # fmt: skip
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(
    table: pd.DataFrame,
    requests: pd.DataFrame,
    out_dir: Path,
    slo_s: float | Iterable[float] | None,
    title: str = "",
) -> list[Path]:
    paths = [
        plot_ls_ttft(table, slo_s, out_dir / FIGURES["ls_ttft"], title),
        plot_throughput(table, out_dir / FIGURES["throughput"], title),
        plot_turnaround(table, out_dir / FIGURES["turnaround"], title),
    ]
    if len(requests):
        paths.append(plot_ttft_cdf(requests, slo_s, out_dir / FIGURES["cdf"], title))
    else:  # an earlier report's CDF, of other runs, would be read as this one's
        (out_dir / FIGURES["cdf"]).unlink(missing_ok=True)
    return paths


def cdf_notes(table: pd.DataFrame, requests: pd.DataFrame) -> list[str]:
    """A warning naming the runs left out of the TTFT CDF (no ``requests.parquet``), or a note
    that no CDF is drawn when none has one."""
    runs = sorted(set(table["run_dir"]))
    drawn = set(requests["run_dir"]) if len(requests) else set()
    missing = [r for r in runs if r not in drawn]
    if not missing:
        return []
    if not drawn:
        return [f"note: no run has a requests.parquet: no {FIGURES['cdf']} is drawn"]
    return [f"warning: {len(missing)} of {len(runs)} runs have no requests.parquet "
            f"({', '.join(missing)}): left out of {FIGURES['cdf']}"]  # fmt: skip


def slos_of(table: pd.DataFrame) -> list[float]:
    """The LS TTFT SLOs the runs used, sorted: one value, several (``slo_ls_ttft_s`` is then a
    setting of the lines, and no figure states a single SLO), or none (``slo.ls_ttft_s=null``:
    no SLO line)."""
    values = table["slo_ls_ttft_s"].dropna() if "slo_ls_ttft_s" in table else []
    return sorted({float(v) for v in values})


def slo_of(table: pd.DataFrame) -> float | None:
    """The one LS TTFT SLO the runs used (None if none has one); an error if they used
    several, for no single value describes them (``slos_of`` lists them)."""
    slos = slos_of(table)
    if len(slos) > 1:
        said = ", ".join(f"{v:g}" for v in slos)
        raise ReportError(f"these runs used {len(slos)} LS TTFT SLOs ({said} s): no single "
                          "one describes them (slos_of lists them)")  # fmt: skip
    return slos[0] if slos else None


def rate_notes(table: pd.DataFrame) -> list[str]:
    """A note on the x axis when runs have no ``workload.rate`` (a trace at its own timestamps),
    and a warning for those whose arrival rate is unknown too (left out of the figures)."""
    runs = table.drop_duplicates("run_dir") if "run_dir" in table else table
    unrated = runs[runs["rate"].isna()]
    if not len(unrated):
        return []
    out = [f"note: {len(unrated)} runs have no workload.rate (a trace at its own timestamps): "
           "the table's rate is '-' and the figures draw them at their measured arrival rate "
           "(arrivals_per_s: (arrivals - 1) / their span, the mean over seeds)"]  # fmt: skip
    unknown = unrated[unrated["arrivals_per_s"].isna()] if "arrivals_per_s" in runs else unrated
    if len(unknown):
        names = ", ".join(unknown["run_dir"]) if "run_dir" in unknown else f"{len(unknown)} runs"
        out.append(f"warning: {names}: no rate and no measured arrival rate (no "
                   "requests.parquet, or under two arrivals): left out of the figures")  # fmt: skip
    return out


def terminal_table(table: pd.DataFrame) -> str:
    """A short table: mean LS TTFT, LS SLO attainment, BE turnaround, BE p99 time per output
    token (starvation shows there) and jobs/s per series and rate (means over seeds)."""
    cols = series_columns(table)
    parts = []
    for cls, value, name in (("LS", "ttft_mean_s", "ls_ttft_s"), ("LS", "slo_attainment",
                             "ls_slo"), ("BE", "turnaround_mean_s", "be_turnaround_s"),
                             ("BE", "tpot_p99_s", "be_tpot_p99_s"),
                             ("all", "jobs_per_s", "jobs_per_s")):  # fmt: skip
        agg = over_seeds(table, cls, value).set_index([*cols, "rate"])
        unrated = agg.index.get_level_values("rate").isna()
        if not parts and unrated.any():  # the measured rate, where the rate is not set
            parts.append(agg["x"].where(unrated).rename("arrivals_per_s"))
        parts.append(agg["mean"].rename(name))
    wide = pd.concat(parts, axis=1).reset_index()
    if wide["rate"].isna().any():  # no rate: a trace at its own timestamps (rate_notes)
        for col in ("rate", "arrivals_per_s"):
            wide[col] = wide[col].map(lambda r: "-" if pd.isna(r) else f"{r:.3f}")
    return wide.to_string(index=False, float_format=lambda x: f"{x:.3f}")


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="qllm-report", description="Tidy table and figures from a qllm-sim sweep."
    )
    ap.add_argument("sweep_dir", type=Path, help="a multirun directory (or any directory "
                    "above finished run directories)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: "
                    "<sweep_dir>/report)")  # fmt: skip

    def fail(message: str) -> None:
        print(f"qllm-report: error: {message}", file=sys.stderr)
        sys.exit(2)

    ap.error = fail  # argparse's own errors: one line too, not the usage text first
    args = ap.parse_args(argv)
    try:
        table, requests = load_sweep(args.sweep_dir)
    except ReportError as e:
        fail(str(e))
    out = args.out or args.sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "table.csv", index=False)
    paths = write_figures(table, requests, out, slos_of(table))
    print(terminal_table(table))
    for warning in [*rate_notes(table), *repeated_seeds(table), *empty_classes(table),
                    *cdf_notes(table, requests),
                    *mixed_inputs(args.sweep_dir)]:  # fmt: skip
        print(warning, file=sys.stderr)
    runs = table["run_dir"].nunique()
    print(f"\n{runs} runs -> {out / 'table.csv'}, " + ", ".join(p.name for p in paths))


if __name__ == "__main__":
    cli()
