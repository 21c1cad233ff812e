"""comparison.json: the paper's quantities under every reading, and what lies beyond them."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.reproduce.experiments import BASELINE, ENGINES, EXPERIMENTS, OURS, READINGS, SLO_S
from sim.reproduce.grid import decode_step_s
from sim.reproduce.stats import Paired, _ci, arms_table, compare


def _of(table: pd.DataFrame, experiment: str) -> pd.DataFrame:
    return table[table["experiment"] == experiment]


def _order(experiment: str) -> list[str]:
    return [a.label for e in EXPERIMENTS if e.name == experiment for a in e.arms]


def readings(paper: pd.DataFrame) -> dict:
    arms = set(paper["policy"])
    out = {}
    for label, base, ours, what in READINGS:
        if {base, ours} <= arms:
            c = compare(paper, base, ours)
            c.pop("per_rate")
            out[label] = {"what": what, **c}
    return out


def where(table: pd.DataFrame) -> dict:
    """(profile, ls_fraction, load) -> LS TTFT of alg1, layer and qllm, the gains alg1 / qllm
    and layer / qllm with 95% intervals, qllm's BE preemptions per run, and the profile's decode
    iteration time."""
    out = {}
    part = _of(table, "where")
    for (profile, frac, load), pt in part.groupby(["profile", "ls_fraction", "base_rate"]):
        p = Paired(pt, ["alg1", "layer", "qllm"])
        a, ba = p.means("alg1", "LS", "ttft_mean_s")
        lay, blay = p.means("layer", "LS", "ttft_mean_s")
        q, bq = p.means("qllm", "LS", "ttft_mean_s")
        pre = pt[(pt["policy"] == "qllm") & (pt["cls"] == "BE")]["preemptions"].mean()
        out[(profile, float(frac), float(load))] = {
            "rate": float(p.rates[0]),
            "alg1_ls_ttft_s": float(a[0]),
            "qllm_ls_ttft_s": float(q[0]),
            "layer_ls_ttft_s": float(lay[0]),
            "gain": float(a[0] / q[0]),
            "gain_ci95": _ci(ba[:, 0] / bq[:, 0]),
            "expert_over_layer": float(lay[0] / q[0]),
            "expert_over_layer_ci95": _ci(blay[:, 0] / bq[:, 0]),
            "qllm_be_preemptions_per_run": float(pre),
            "decode_step_ms": decode_step_s(profile) * 1e3,
        }
    return out


def engines(table: pd.DataFrame) -> list[dict]:
    """Per (profile, KV capacity, load): each arm's LS TTFT, LS and BE turnaround, LS goodput,
    and preemptions and recomputes per run (BE); and the best engine's LS TTFT over the best
    qllm arm's."""
    part = _of(table, "engines")
    out = []
    kv = "kv_capacity_tokens"
    for (profile, cap, load), pt in part.groupby(["profile", kv, "base_rate"], dropna=False):
        row: dict = {"profile": profile, "kv_capacity": "profile's" if pd.isna(cap) or
                     str(cap) in ("null", "None") else str(cap), "load": float(load),
                     "rate": float(pt["rate"].iloc[0]), "arms": {}}  # fmt: skip
        for arm in _order("engines"):
            a = pt[pt["policy"] == arm]
            if not len(a):
                continue
            ls, be = a[a["cls"] == "LS"], a[a["cls"] == "BE"]
            row["arms"][arm] = {
                "ls_ttft_s": float(ls["ttft_mean_s"].mean()),
                "ls_turnaround_s": float(ls["turnaround_mean_s"].mean()),
                "be_turnaround_s": float(be["turnaround_mean_s"].mean()),
                "ls_goodput": float(ls["goodput"].mean()),
                "be_preemptions": float(be["preemptions"].mean()),
                "recomputes": float(a[a["cls"] == "all"]["recomputes"].mean()),
            }
        arms = row["arms"]
        best_engine = min((v["ls_ttft_s"], k) for k, v in arms.items() if k in ENGINES)
        best_qllm = min((v["ls_ttft_s"], k) for k, v in arms.items() if k.startswith("qllm"))
        row["best_engine"], row["best_qllm"] = best_engine[1], best_qllm[1]
        row["engine_over_qllm"] = best_engine[0] / best_qllm[0]
        out.append(row)
    return out


def starvation(table: pd.DataFrame) -> dict:
    part = _of(table, "starvation")
    out = {}
    for rate, pt in part.groupby("rate"):
        ls = pt[pt["cls"] == "LS"].groupby("policy")["ttft_p99_s"].mean()
        be = pt[pt["cls"] == "BE"]
        out[f"{rate:g}"] = {
            arm: {
                "ls_ttft_p99_s": float(ls[arm]),
                "be_longest_first_token_wait_s": float(be[be.policy == arm]["ttft_max_s"].mean()),
                "be_turnaround_p99_s": float(be[be.policy == arm]["turnaround_p99_s"].mean()),
            }
            for arm in _order("starvation")
            if arm in ls
        }
    return out


def merge(table: pd.DataFrame) -> dict:
    """Per rate, each arm's means over replicates (LS TTFT mean and p99, LS and BE turnaround,
    BE p99 turnaround, jobs per second, merges per run), and the paired ratio merge / no merge
    of the BE turnaround: its median and range over replicates."""
    part = _of(table, "merge")
    out = {}
    for rate, pt in part.groupby("rate"):
        row: dict = {"arms": {}}
        for arm in _order("merge"):
            a = pt[pt["policy"] == arm]
            ls, be, every = a[a["cls"] == "LS"], a[a["cls"] == "BE"], a[a["cls"] == "all"]
            row["arms"][arm] = {
                "ls_ttft_s": float(ls["ttft_mean_s"].mean()),
                "ls_ttft_p99_s": float(ls["ttft_p99_s"].mean()),
                "ls_turnaround_s": float(ls["turnaround_mean_s"].mean()),
                "be_turnaround_s": float(be["turnaround_mean_s"].mean()),
                "be_turnaround_p99_s": float(be["turnaround_p99_s"].mean()),
                "jobs_per_s": float(every["jobs_per_s"].mean()),
                "merges": float(every["merges"].mean()),
            }
        be = pt[pt["cls"] == "BE"].pivot_table(index="replicate", columns="policy",
                                                values="turnaround_mean_s")  # fmt: skip
        plain, merged = _order("merge")
        ratio = be[merged] / be[plain]
        row["be_turnaround_ratio"] = {"median": float(ratio.median()), "min": float(ratio.min()),
                                      "max": float(ratio.max())}  # fmt: skip
        out[f"{rate:g}"] = row
    return out


def comparison(table: pd.DataFrame) -> tuple[dict, dict]:
    """(comparison.json's content, the ``where`` grid keyed by tuples for the figure)."""
    paper = _of(table, "paper")
    result = compare(paper)
    result["readings"] = readings(paper)
    beyond: dict = {"granularity": arms_table(paper, order=_order("paper"))}
    exps = set(table["experiment"])
    for name in ("card", "fp16"):
        if name in exps:
            part = _of(table, name)
            beyond[name] = {**compare(part), "granularity": arms_table(part, order=_order(name))}
    result["beyond_the_paper"] = beyond
    result["sensitivity"] = {}
    for name in ("uncapped", "jobs1000"):
        if name in exps:
            c = compare(_of(table, name))
            c.pop("per_rate")
            result["sensitivity"][name] = c
    grid = where(table) if "where" in exps else {}
    result["where"] = [
        {"profile": k[0], "ls_fraction": k[1], "load": k[2], **v} for k, v in grid.items()
    ]
    result["starvation"] = starvation(table) if "starvation" in exps else {}
    result["merge"] = merge(table) if "merge" in exps else {}
    result["engines"] = engines(table) if "engines" in exps else []
    reps = paper.groupby(["policy", "rate"])["replicate"].nunique()
    result["setup"] = {
        "rates": sorted(float(r) for r in paper["rate"].unique()),
        "replicates": int(reps.min()),
        "num_requests": int(paper["num_requests"].iloc[0]),
        "max_output_tokens": int(paper["max_output_tokens"].iloc[0]),
        "ls_fraction": float(paper["ls_fraction"].iloc[0]),
        "baseline": BASELINE,
        "ours": OURS,
        "slo_rule": f"mean LS TTFT (averaged over replicates) <= {SLO_S:g} s at every rate up "
        "to it",
        "experiments": sorted(exps),
        "qllm_drain_fraction": _drain(paper),
    }
    for name, key in (
        ("where", "where"),
        ("engines", "engines"),
        ("merge", "merge"),
        ("uncapped", "sensitivity"),
        ("jobs1000", "sensitivity"),
    ):
        part = _of(table, name)
        if name == "jobs1000" and len(part):  # its runs' length as run (--num-requests scales it)
            result["setup"]["jobs1000_num_requests"] = int(part["num_requests"].iloc[0])
        if len(part):
            result["setup"][f"{key}_replicates"] = int(part["replicate"].nunique())
            result["setup"][f"{key}_rates"] = ", ".join(
                f"{r:g}" for r in sorted(part["base_rate"].unique())
            )
    return result, grid


def _drain(paper: pd.DataFrame) -> dict:
    """Per rate, the share of qllm's makespan after the last arrival (the drain)."""
    part = paper[(paper["policy"] == OURS) & (paper["cls"] == "all")]
    if "last_arrival_s" not in part:
        return {}
    drain = 1 - part["last_arrival_s"] / part["makespan_s"]
    return {f"{r:g}": float(v) for r, v in drain.groupby(part["rate"]).mean().items()}


def verdict(ours: float | None, paper: float | None, ci: list | None = None) -> str:
    """Consistent when the paper's value lies in our 95% interval (or within 5%), close within
    25%, else lower or higher."""
    if ours is None or paper is None:
        return "Agrees" if ours == paper else "Differs"
    # an SLO max rate's interval may start at none (met at no rate: below every one)
    if ci and ci[1] is not None and (ci[0] is None or ci[0] <= paper) and paper <= ci[1]:
        return "Consistent (the paper's value is inside our 95% interval)"
    side = "lower" if ours < paper else "higher"
    if abs(ours - paper) <= 0.05 * abs(paper):
        return "Agrees"
    if abs(ours - paper) <= 0.25 * abs(paper):
        return f"Close ({side})"
    return side.capitalize()


def spread(values) -> tuple[float, float]:
    v = np.asarray(list(values), dtype=float)
    return float(np.nanmin(v)), float(np.nanmax(v))
