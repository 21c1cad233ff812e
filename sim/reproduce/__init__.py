"""``make reproduce``: the QLLM paper's experiment in the simulator, under every reading of it,
and what the paper left out.

The paper's setup (its Sec. 5): ShareGPT prompts, 20% of jobs LS at random, Poisson arrivals,
maximum batch 32, LS TTFT SLO 3 s, Mixtral-8x7B 4-bit under HF eager on one A100 (profile
``a100-mixtral-nf4-hf``); the baseline HF TGI is our ``iteration`` policy, against ``qllm``.
Where the paper is silent we take the authors' repository defaults (256 jobs per run,
``max_new_tokens=50``). Nothing is tuned to match the paper.

The package: ``experiments`` (what is run: each experiment a small declaration), ``grid``
(running it), ``stats`` (headline quantities with paired-bootstrap 95% intervals),
``analysis`` (comparison.json), ``figures`` and ``writeup`` (README.md from ``README.md.j2``).
Writes ``results/paper/`` by default: ``table.csv.gz``, ``comparison.json``, figures, README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sim import profiles
from sim.config import UserError
from sim.reproduce.experiments import (
    BASELINE,
    EXPERIMENTS,
    GRANULARITIES,
    OURS,
    PAPER,
    RATES,
    by_name,
)
from sim.reproduce.stats import compare, slo_max_rate

__all__ = ["BASELINE", "EXPERIMENTS", "GRANULARITIES", "OURS", "PAPER", "compare", "main",
           "slo_max_rate"]  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="reproduce", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/paper"))
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help=f"keep these of each experiment's rates (default: {RATES} and each "
                    "experiment's own)")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=None,
                    help="replicates per point for every experiment (default: 20 for the "
                    "paper setup, 10 for the others)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=None,
                    help="jobs per run instead of the paper setup's 256, an experiment "
                    "of its own length (jobs1000) scaled in proportion (quick checks)")  # fmt: skip
    ap.add_argument("--experiments", nargs="+", default=[e.name for e in EXPERIMENTS],
                    choices=[e.name for e in EXPERIMENTS])  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = ap.parse_args(argv)
    if "paper" not in args.experiments:
        print("reproduce: error: --experiments must include paper", file=sys.stderr)
        return 2
    if args.seeds is not None and args.seeds < 2:
        print(f"reproduce: error: --seeds={args.seeds}: must be >= 2 (intervals need "
              "replicates)", file=sys.stderr)  # fmt: skip
        return 2
    start = time.perf_counter()
    experiments = by_name(args.experiments)
    missing = {p for e in experiments for p in (e.changes.get("profile"),
               *e.axes.get("profile", ())) if p} - set(profiles.available())  # fmt: skip
    if missing:
        print(f"reproduce: warning: profiles {sorted(missing)} not found; skipping the "
              "experiments that need them", file=sys.stderr)  # fmt: skip
        experiments = [e for e in experiments if not ({e.changes.get("profile"),
                       *e.axes.get("profile", ())} & missing)]  # fmt: skip
    from sim.reproduce.analysis import comparison
    from sim.reproduce.figures import write_figures
    from sim.reproduce.grid import run_grid
    from sim.reproduce.writeup import write_readme

    try:
        table, requests = run_grid(experiments, args.seeds, args.rates, args.num_requests,
                                   args.jobs)  # fmt: skip
    except UserError as e:
        print(f"reproduce: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # 4 significant digits, gzipped: the tidy table of ~18,000 rows stays a small curated file
    table.to_csv(args.out / "table.csv.gz", index=False, float_format="%.4g")
    c, where = comparison(table)
    (args.out / "comparison.json").write_text(json.dumps(c, indent=2) + "\n")
    paths = write_figures(table, requests, where, args.out)
    write_readme(c, args.out)
    print("\n" + "\n".join(f"{k:30s} paper {_show(PAPER[k]):>8s}   ours {_show(c[k]):>8s}   "
                           f"95% {c['ci95'][k]}" for k in PAPER))  # fmt: skip
    print(
        f"\nwrote {args.out}/: table.csv.gz, comparison.json, README.md, "
        f"{', '.join(p.name for p in paths)} in {time.perf_counter() - start:.0f} s"
    )
    return 0


def _show(x) -> str:
    return "null" if x is None else f"{x:.2f}"
