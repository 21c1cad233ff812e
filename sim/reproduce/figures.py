"""The reproduction's figures (PNG), from the tidy table."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from sim.report import (  # noqa: E402
    FIGURES,
    draw_lines,
    finish,
    plot_ls_ttft,
    plot_throughput,
    plot_ttft_cdf,
    plot_turnaround,
)
from sim.reproduce.experiments import BASELINE, GRANULARITIES, OURS, READINGS, SLO_S  # noqa: E402


def _of(table: pd.DataFrame, experiment: str, arms=None) -> pd.DataFrame:
    part = table[table["experiment"] == experiment]
    return part if arms is None else part[part["policy"].isin(arms)]


def plot_panels(table: pd.DataFrame, panels, path: Path, title: str) -> Path:
    """A row of panels, each (class, column, y label, log scale)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
    for ax, (cls, value, ylabel, log) in zip(axes, panels, strict=True):
        draw_lines(ax, table, cls, value)
        if value == "ttft_mean_s" and cls == "LS":
            ax.axhline(SLO_S, color="k", ls="--", lw=1, label=f"SLO {SLO_S:g} s")
        ax.set(ylabel=ylabel, yscale="log" if log else "linear")
    fig.suptitle(title)
    return finish(fig, axes, path)


def plot_where(where: dict, path: Path) -> Path:
    """LS TTFT gain of qllm over alg1 against the LS share, one panel per load, one line per
    profile."""
    loads = sorted({k[2] for k in where})
    fig, axes = plt.subplots(1, len(loads), figsize=(4.6 * len(loads), 4), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for profile in sorted({k[0] for k in where}):
            pts = sorted((k[1], v) for k, v in where.items() if k[0] == profile and k[2] == load)
            ax.plot(
                [x for x, _ in pts],
                [v["gain"] for _, v in pts],
                marker="o",
                label=f"{profile} (iteration {pts[0][1]['decode_step_ms']:.0f} ms)",
            )
        ax.axhline(1.0, color="k", lw=1)
        ax.set(xlabel="LS fraction", ylabel="LS TTFT alg1 / qllm", xscale="log",
               title=f"load {load:g} (req/s on the paper's profile)")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Where sub-iteration preemption matters: gain of qllm over Algorithm 1 alone")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_starvation(table: pd.DataFrame, path: Path) -> Path:
    """LS TTFT p99 against the longest BE wait for a first token, one point per
    ``be_max_wait_s`` setting, one line per rate (means over replicates)."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ls = table[table["cls"] == "LS"].groupby(["rate", "policy"])["ttft_p99_s"].mean()
    be = table[table["cls"] == "BE"].groupby(["rate", "policy"])["ttft_max_s"].mean()
    for rate in sorted(table["rate"].unique()):
        arms = ls.loc[rate].index
        ax.plot(be.loc[rate][arms], ls.loc[rate][arms], marker="o", label=f"{rate:g} req/s")
        for arm in arms:
            ax.annotate(arm.replace("qllm-wait", "≤"), (be.loc[rate][arm], ls.loc[rate][arm]),
                        fontsize=6)  # fmt: skip
    ax.set(xlabel="longest BE wait for a first token (s)", ylabel="LS p99 TTFT (s)",
           xscale="log", title="BE starvation guard (qllm, policy.be_max_wait_s)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(table: pd.DataFrame, requests: pd.DataFrame, where: dict, out: Path):
    paths = []
    exps = set(table["experiment"])
    two = [BASELINE, OURS]
    title = "(paper setup)"
    if "paper" in exps:
        main = _of(table, "paper", two)
        paths += [
            plot_ls_ttft(main, SLO_S, out / FIGURES["ls_ttft"], title),
            plot_throughput(main, out / FIGURES["throughput"], title),
            plot_turnaround(main, out / FIGURES["turnaround"], title),
        ]
        if len(requests):
            req = requests[requests["policy"].isin(two)]
            paths.append(plot_ttft_cdf(req, SLO_S, out / FIGURES["cdf"], title))
        paths.append(plot_panels(_of(table, "paper", GRANULARITIES), [
            ("LS", "ttft_mean_s", "LS mean TTFT (s)", True),
            ("LS", "preemptions", "LS preemptions per run", False),
            ("BE", "preemptions", "BE preemptions per run", False),
            ("BE", "tpot_p99_s", "BE p99 time per output token (s)", True),
        ], out / "granularity.png", "What each mechanism adds (paper setup)"))  # fmt: skip
        arms = list(dict.fromkeys(a for _, b, o, _ in READINGS for a in (b, o)))
        paths.append(plot_panels(_of(table, "paper", arms), [
            ("LS", "ttft_mean_s", "LS mean TTFT (s)", True),
            ("BE", "turnaround_mean_s", "BE mean turnaround (s)", True),
            ("all", "jobs_per_s", "jobs/s over the whole run (drain included)", False),
        ], out / "readings.png", "Readings of the comparison (paper setup)"))  # fmt: skip
    for name, file, heading in (
        ("card", "card_workload.png", "Card workload: HumanEval LS, ShareGPT BE"),
        ("fp16", "fp16_profile.png", "fp16 on two A100s (iterations ~10x faster)"),
    ):
        if name in exps:
            paths.append(plot_panels(_of(table, name), [
                ("LS", "ttft_mean_s", "LS mean TTFT (s)", True),
                ("BE", "turnaround_mean_s", "BE mean turnaround (s)", True),
                ("BE", "ttft_max_s", "longest BE wait for a first token (s)", True),
            ], out / file, heading))  # fmt: skip
    sens = [e for e in ("paper", "uncapped", "jobs1000") if e in exps]
    if len(sens) > 1:
        part = table[table["experiment"].isin(sens) & table["policy"].isin(two)]
        paths.append(plot_panels(part, [
            ("LS", "ttft_mean_s", "LS mean TTFT (s)", True),
            ("LS", "turnaround_mean_s", "LS mean turnaround (s)", True),
            ("BE", "turnaround_mean_s", "BE mean turnaround (s)", True),
        ], out / "sensitivity.png", "Sensitivity to what the paper does not state"))  # fmt: skip
    if where:
        paths.append(plot_where(where, out / "where_preemption_matters.png"))
    if "starvation" in exps:
        paths.append(plot_starvation(_of(table, "starvation"), out / "starvation.png"))
    return paths
