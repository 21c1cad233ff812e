"""What swap preemption buys over recompute under memory pressure, on the paper setup.

The paper workload (256 requests, 20% LS, outputs capped at --max-output-tokens, the paper's
50 by default) on paged KV memory capped at --kv-capacity-tokens, per profile,
nf4-equivalent load (scaled to the profile's decode speed, as ``make reproduce`` does) and
policy: means over --seeds seeds of LS TTFT, BE
turnaround and KV preemptions, with ``memory.preemption=recompute`` and ``=swap`` (vLLM's
default 4 GiB of host swap space, copied at the profile's ``memory.swap_bytes_per_s``).
Prints one line per point: ``profile=<p> load=<x> policy=<arm> recompute: ... swap: ...``.
"""

from __future__ import annotations

import argparse

import numpy as np
from hydra import compose, initialize_config_dir

from sim.app import CONF_DIR
from sim.reproduce.grid import rate_scale
from sim.run import simulate

ARMS = {  # label -> overrides (the "engines" experiment's arms)
    "vllm-priority": ["policy=vllm", "policy.scheduling_policy=priority", "policy.max_num_seqs=32"],
    "sglang": ["policy=sglang"],
    "qllm-evict": ["policy=qllm", "policy.evict_be_for_ls=true"],
}
PROFILES = ("a100-mixtral-nf4-hf", "h100x2-mixtral-bf16")


def run(profile: str, rate: float, arm: str, preemption: str, seed: int, kv: int,
        max_output: str) -> dict:  # fmt: skip
    cfg = compose("config", overrides=[
        *ARMS[arm], "workload=paper", "workload.num_requests=256", "workload.ls_fraction=0.2",
        f"workload.max_output_tokens={max_output}", f"workload.rate={rate}", f"profile={profile}",
        f"profile.kv_capacity_tokens={kv}", "memory.model=paged",
        f"memory.preemption={preemption}", f"seed={seed}",
    ])  # fmt: skip
    c = simulate(cfg).summary["classes"]
    return {"ls_ttft_s": c["LS"]["ttft_s"]["mean"],
            "be_turnaround_s": c["BE"]["turnaround_s"]["mean"],
            "recomputes": c["all"]["recomputes"], "swaps": c["all"]["swaps"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-capacity-tokens", type=int, default=4000)
    ap.add_argument("--loads", type=float, nargs="+", default=[3.0, 5.0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES))
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    ap.add_argument("--max-output-tokens", default="50", help="null: ShareGPT's own lengths")
    args = ap.parse_args()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for profile in args.profiles:
            scale = rate_scale(profile)
            for load in args.loads:
                for arm in args.arms:
                    line = [f"profile={profile} load={load:g} policy={arm}"]
                    for preemption in ("recompute", "swap"):
                        fixed = (args.kv_capacity_tokens, args.max_output_tokens)
                        runs = [run(profile, load * scale, arm, preemption, seed, *fixed)
                                for seed in range(args.seeds)]  # fmt: skip
                        mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
                        line.append(f"{preemption}: ls_ttft_s={mean['ls_ttft_s']:.3f} "
                                    f"be_turnaround_s={mean['be_turnaround_s']:.2f} "
                                    f"recomputes={mean['recomputes']:.1f} "
                                    f"swaps={mean['swaps']:.1f}")  # fmt: skip
                    print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
