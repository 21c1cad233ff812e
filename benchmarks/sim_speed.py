"""Simulator cost: the paper workload (1,000 requests, rate 5/s) under each policy.

Prints one line per policy: ``policy=<name> memory=<model> requests_per_s=<float>
events_per_request=<float>``
where requests_per_s is simulated requests per wall-clock second of the executor (the
workload is built once, outside the timing; the median of --repeats runs is reported).
"""

from __future__ import annotations

import argparse
import statistics

from hydra import compose, initialize_config_dir

from sim.app import CONF_DIR
from sim.run import simulate
from sim.workloads import build_workload

POLICIES = ("fcfs", "iteration", "priority", "layer", "qllm", "vllm", "vllm-chunked", "sglang")
# the engines run their own paged memory; the others reserve (TGI's)
VARIANTS = {  # name -> (policy file, overrides)
    "vllm": ("vllm", ["memory.model=paged"]),
    "vllm-chunked": ("vllm", ["policy.enable_chunked_prefill=true", "memory.model=paged"]),
    "sglang": ("sglang", ["memory.model=paged"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = ap.parse_args()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for policy in args.policies:
            name, extra = VARIANTS.get(policy, (policy, []))
            cfg = compose("config", overrides=[
                f"policy={name}", "workload=paper", f"workload.rate={args.rate}",
                f"workload.num_requests={args.num_requests}", *extra])  # fmt: skip
            requests = build_workload(cfg.workload, seed=cfg.seed)
            walls, events = [], []
            for _ in range(args.repeats):
                executor = simulate(cfg, requests=requests).summary["executor"]
                walls.append(executor["wall_s"])
                events.append(executor["events"])
            wall = statistics.median(walls)
            print(f"policy={policy} memory={cfg.memory.model} "
                  f"requests_per_s={len(requests) / wall:.1f} "
                  f"events_per_request={events[0] / len(requests):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
