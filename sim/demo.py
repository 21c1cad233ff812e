"""``make demo``: fcfs, iteration (TGI) and qllm on the paper workload at a few rates.

Prints a table (LS and BE TTFT and turnaround per policy and rate, and the LS TTFT ratio
iteration / qllm) and writes ``results/demo/summary.csv`` and ``results/demo/slo_curve.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sim.app import CONF_DIR, OVERLOAD_RATIO, load_rates  # noqa: E402  (registers the config)
from sim.config import UserError  # noqa: E402
from sim.run import simulate  # noqa: E402
from sim.workloads import build_workload  # noqa: E402

POLICIES = ("fcfs", "iteration", "qllm")


def run_grid(policies, rates, num_requests: int | None, seed: int, overrides=()) -> pd.DataFrame:
    rows = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        jobs = [(p, r) for r in rates for p in policies]
        workloads = {}
        for policy, rate in tqdm(jobs, desc="simulating", unit="run"):
            cfg = compose(
                "config",
                overrides=[
                    f"policy={policy}",
                    "workload=paper",
                    f"workload.rate={rate}",
                    f"seed={seed}",
                    *overrides,
                    *([f"workload.num_requests={num_requests}"] if num_requests else []),
                ],
            )
            if rate not in workloads:  # the same arrivals for every policy at a rate
                workloads[rate] = build_workload(cfg.workload, seed=cfg.seed)
            out = simulate(cfg, requests=workloads[rate])
            s, rates_seen = out.summary, load_rates(out.requests)
            ls, be = s["classes"]["LS"], s["classes"]["BE"]
            rows.append({
                "policy": policy, "rate": rate,
                "ls_ttft_s": ls["ttft_s"]["mean"], "ls_ttft_p90_s": ls["ttft_s"]["p90"],
                "be_ttft_s": be["ttft_s"]["mean"],
                "ls_turnaround_s": ls["turnaround_s"]["mean"],
                "be_turnaround_s": be["turnaround_s"]["mean"],
                "ls_slo": ls["slo_attainment"], "jobs_per_s": s["throughput"]["jobs_per_s"],
                # arrivals over completions (qllm-sim's overload warning above 1.5)
                "load": rates_seen[0] / rates_seen[1] if rates_seen else float("nan"),
                "sim_wall_s": s["executor"]["wall_s"],
            })  # fmt: skip
    return pd.DataFrame(rows)


def ttft_ratio(df: pd.DataFrame, baseline="iteration", ours="qllm") -> pd.Series:
    wide = df.pivot(index="rate", columns="policy", values="ls_ttft_s")
    return wide[baseline] / wide[ours]


def overloaded_rates(df: pd.DataFrame, policy: str) -> set[float]:
    """The rates at which ``policy``'s runs were overloaded (arrivals over completions above
    qllm-sim's OVERLOAD_RATIO)."""
    part = df[df["policy"] == policy]
    return set(part.loc[part["load"] > OVERLOAD_RATIO, "rate"])


def overload_note(df: pd.DataFrame, num_requests: int) -> str:
    """What qllm-sim warns of for the same runs: where arrivals outpaced completions, the
    latencies measure the backlog of a run of ``num_requests`` (they grow with it)."""
    over = df[df["load"] > OVERLOAD_RATIO]
    if over.empty:
        return "\nload = arrivals / completions: every run kept up (at most 1.5)"
    runs = ", ".join(f"{p} at {r:g}" for p, r in zip(over["policy"], over["rate"], strict=True))
    return (
        f"\nwarning: load = arrivals / completions; above {OVERLOAD_RATIO:g} ({runs}) the "
        f"queue grows all run long: those latencies measure the backlog of "
        f"{num_requests} requests and grow with --num-requests, not a steady state"
    )


def plot_slo_curve(df: pd.DataFrame, slo_s: float, path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, part in df.groupby("policy", sort=False):
        ax1.plot(part["rate"], part["ls_ttft_s"], marker="o", label=policy)
        ax2.plot(part["rate"], 100 * part["ls_slo"], marker="o", label=policy)
    ax1.axhline(slo_s, color="k", ls="--", lw=1, label=f"SLO {slo_s:g} s")
    ax1.set(yscale="log", xlabel="arrival rate (req/s)", ylabel="LS mean TTFT (s)",
            title="LS time to first token")  # fmt: skip
    ax2.set(xlabel="arrival rate (req/s)", ylabel="LS requests meeting SLO (%)",
            title=f"SLO attainment (TTFT <= {slo_s:g} s)", ylim=(0, 105))  # fmt: skip
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 3, 5, 7])
    ap.add_argument("--num-requests", type=int, default=None, help="default: the preset's 256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/demo"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        df = run_grid(POLICIES, args.rates, args.num_requests, args.seed)
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "summary.csv", index=False)
    plot_slo_curve(df, 3.0, args.out / "slo_curve.png")
    shown = df.drop(columns=["sim_wall_s"]).copy()
    print(
        f"\nPaper workload (ShareGPT, 20% LS, Poisson, output cap 50), "
        f"{args.num_requests or 256} requests per run, profile a100-mixtral-nf4-hf; "
        "times in seconds (means), ls_slo = share of LS requests with TTFT <= 3 s\n"
    )
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(overload_note(df, args.num_requests or 256))
    ratio = ttft_ratio(df)
    over = overloaded_rates(df, "iteration")
    steady = ratio[[r not in over for r in ratio.index]]
    print("\nLS TTFT ratio iteration/qllm: "
          + "  ".join(f"rate {r:g}{'*' if r in over else ''}: {v:.1f}x" for r, v in ratio.items())
          + (f"  (mean {steady.mean():.1f}x where iteration keeps up)" if len(steady) else "")
          + ("  * iteration overloaded: the ratio grows with the run's length" if over
             else ""))  # fmt: skip
    print(
        f"\nwrote {args.out / 'summary.csv'} and {args.out / 'slo_curve.png'} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
