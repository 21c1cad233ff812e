"""Which unstated settings fit all of the paper at once? (``python -m sim.reproduce.fit``)

The paper does not state its jobs per run, output cap, the rates it tested, or whether its LS
share is exact. This searches them: the paper's setup with ``workload.num_requests`` x
``workload.max_output_tokens`` x ``workload.ls_fraction`` varied (``iteration`` against
``qllm``, every rate of the reproduction, a few replicates), then every window of consecutive
tested rates (at least ``MIN_RATES``) as the set the paper might have averaged over. For each
(setting, window) the six headline ratios are computed as the reproduction does (from per-rate
means over replicates; throughput in steady state), and the worst of their fold errors against
the paper's (max(ours / paper, paper / ours)) says whether all land within 2x at once. The
default reproduction stays untuned; this is a separate table.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sim.reproduce.experiments import PAPER, QLLM, RATES, TGI, Experiment
from sim.reproduce.stats import throughput_column

FIGURES = (
    "ls_ttft_reduction_avg",
    "ls_ttft_reduction_max",
    "ls_turnaround_reduction_max",
    "be_turnaround_ratio_avg",
    "be_turnaround_ratio_max",
    "throughput_ratio_avg",
)
AXES = {
    "workload.num_requests": (128, 256, 512, 1000),
    "workload.max_output_tokens": (25, 50, 100, 200),
    "workload.ls_fraction": (0.2,),
}
SETTINGS = ("num_requests", "max_output_tokens", "ls_fraction")
MIN_RATES = 3
WITHIN = 2.0


def per_rate(table: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, rate): the baseline's and qllm's means over replicates of LS TTFT, LS and
    BE turnaround and throughput (in steady state unless a run of that setting has no steady
    window, as the reproduction decides per experiment), and the ratios the paper reports."""
    frames = []
    for _, setting in table.groupby(list(SETTINGS)):
        tput = throughput_column(setting, TGI.label)
        cols = {("LS", "ttft_mean_s"): "ls_ttft", ("LS", "turnaround_mean_s"): "ls_ta",
                ("BE", "turnaround_mean_s"): "be_ta", ("all", tput): "tput"}  # fmt: skip
        parts = []
        for (cls, value), name in cols.items():
            part = setting[setting["cls"] == cls]
            m = part.groupby([*SETTINGS, "rate", "policy"])[value].mean().unstack("policy")
            names = {TGI.label: f"{name}_base", QLLM.label: f"{name}_ours"}
            parts.append(m.rename(columns=names))
        frame = pd.concat(parts, axis=1).reset_index()
        frames.append(frame.assign(throughput=tput))
    df = pd.concat(frames, ignore_index=True)
    df["ttft_red"] = df["ls_ttft_base"] / df["ls_ttft_ours"]
    df["turn_red"] = df["ls_ta_base"] / df["ls_ta_ours"]
    df["be_ratio"] = df["be_ta_ours"] / df["be_ta_base"]
    df["tput_ratio"] = df["tput_ours"] / df["tput_base"]
    return df


def windows(rates: pd.DataFrame) -> pd.DataFrame:
    """Every (setting, window of >= MIN_RATES consecutive rates): the six figures, each one's
    fold error against the paper's, the worst of them and how many lie within 2x."""
    rows = []
    for key, pt in rates.groupby(list(SETTINGS)):
        pt = pt.sort_values("rate")
        n = len(pt)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            if hi - lo < MIN_RATES:
                continue
            w = pt.iloc[lo:hi]
            figs = {
                "ls_ttft_reduction_avg": w["ttft_red"].mean(),
                "ls_ttft_reduction_max": w["ttft_red"].max(),
                "ls_turnaround_reduction_max": w["turn_red"].max(),
                "be_turnaround_ratio_avg": w["be_ratio"].mean(),
                "be_turnaround_ratio_max": w["be_ratio"].max(),
                "throughput_ratio_avg": w["tput_ratio"].mean(),
            }
            fold = {k: fold_error(v, PAPER[k]) for k, v in figs.items()}
            rows.append({**dict(zip(SETTINGS, key, strict=True)),
                         "rates": f"{w['rate'].iloc[0]:g}-{w['rate'].iloc[-1]:g}",
                         "num_rates": hi - lo, **figs,
                         "within_2x": sum(f <= WITHIN for f in fold.values()),
                         "worst_fold": max(fold.values()),
                         "worst": max(fold, key=fold.get)})  # fmt: skip
    return pd.DataFrame(rows)


def fold_error(ours: float, paper: float) -> float:
    if not (ours > 0 and paper > 0) or not np.isfinite(ours):
        return float("inf")
    return max(ours / paper, paper / ours)


def best_per_setting(w: pd.DataFrame) -> pd.DataFrame:
    """Each setting's window with the smallest worst fold error."""
    idx = w.groupby(list(SETTINGS))["worst_fold"].idxmin()
    return w.loc[idx].sort_values("worst_fold").reset_index(drop=True)


def markdown(best: pd.DataFrame) -> str:
    head = ["jobs", "cap", "LS share", "rates", *[_short(k) for k in FIGURES],
            "within 2x", "worst (fold)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| paper | | 0.2 | | " + " | ".join(f"{PAPER[k]:g}" for k in FIGURES)
                 + " | 6 | |")  # fmt: skip
    for r in best.itertuples():
        figs = " | ".join(f"{getattr(r, k):.2f}" for k in FIGURES)
        lines.append(f"| {r.num_requests} | {r.max_output_tokens} | {r.ls_fraction:g} | "
                     f"{r.rates} | {figs} | {r.within_2x} | {_short(r.worst)} "
                     f"({r.worst_fold:.1f}x) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _short(key: str) -> str:
    return {"ls_ttft_reduction_avg": "LS TTFT red. avg", "ls_ttft_reduction_max":
            "LS TTFT red. max", "ls_turnaround_reduction_max": "LS turnaround red. max",
            "be_turnaround_ratio_avg": "BE ratio avg", "be_turnaround_ratio_max": "BE ratio max",
            "throughput_ratio_avg": "throughput ratio avg"}[key]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="reproduce.fit", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/fit"))
    ap.add_argument("--seeds", type=int, default=None, help="replicates per point (default 3)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--num-requests", type=int, nargs="+", default=None)
    ap.add_argument("--max-output-tokens", type=int, nargs="+", default=None)
    ap.add_argument("--ls-fraction", type=float, nargs="+", default=None)
    ap.add_argument("--table", type=Path, default=None,
                    help="analyse an earlier search's table.csv.gz instead of running")  # fmt: skip
    args = ap.parse_args(argv)
    if args.table is not None:  # a search already made: its own settings, nothing to run
        given = [flag for flag, v in (("--seeds", args.seeds),
                 ("--num-requests", args.num_requests), ("--max-output-tokens",
                 args.max_output_tokens), ("--ls-fraction", args.ls_fraction)) if v]  # fmt: skip
        if given:
            print(f"reproduce.fit: error: {given[0]} sets up a search to run; with --table the "
                  "table's own settings are analysed", file=sys.stderr)  # fmt: skip
            return 2
    args.seeds = 3 if args.seeds is None else args.seeds
    if args.seeds < 1:
        print(f"reproduce.fit: error: --seeds={args.seeds}: must be >= 1", file=sys.stderr)
        return 2
    axes = dict(AXES)
    for key, given in (("workload.num_requests", args.num_requests),
                       ("workload.max_output_tokens", args.max_output_tokens),
                       ("workload.ls_fraction", args.ls_fraction)):  # fmt: skip
        if given:
            axes[key] = tuple(given)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table is not None:
        table = pd.read_csv(args.table)
        experiments = sorted(set(table["experiment"])) if "experiment" in table else []
        if len(experiments) > 1:  # several experiments' runs would be pooled as one
            if "fit" not in experiments:
                print(f"reproduce.fit: error: --table {args.table} holds the runs of "
                      f"{len(experiments)} experiments ({', '.join(experiments)}), not a fit "
                      "search's", file=sys.stderr)  # fmt: skip
                return 2
            table = table[table["experiment"] == "fit"]
    else:
        from sim.reproduce.grid import run_grid

        exp = Experiment("fit", "unstated settings against the paper", (TGI, QLLM),
                         rates=RATES, axes=axes, seeds=args.seeds)  # fmt: skip
        table, _ = run_grid([exp], args.seeds, jobs=args.jobs)
        table.to_csv(args.out / "table.csv.gz", index=False, float_format="%.4g")
    w = windows(per_rate(table))
    w.to_csv(args.out / "windows.csv", index=False, float_format="%.4g")
    best = best_per_setting(w)
    (args.out / "best.md").write_text(markdown(best))
    print(markdown(best))
    fits = w[w["within_2x"] == len(FIGURES)]
    print(f"{len(fits)} of {len(w)} (setting, rate window) pairs land all six within 2x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
