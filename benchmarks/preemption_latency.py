"""How long an LS request waits for the processor on the real engine: from its arrival to the
start of its first operation (``Sequence.scheduled_s``: the scheduler hands the engine its
batch, whose first stage starts at once), under each policy.

Background: --be requests arrive at t=0 with long outputs and keep the model decoding; LS
requests (short prompts, a few tokens) arrive as a Poisson stream meanwhile. Prints one line
per policy, then the ratios against qllm::

    policy=<name> ls_start_latency_median_ms=<float> p90_ms=<float> n=<int> preemptions=<int>
    iteration_over_qllm=<float> priority_over_qllm=<float>

``iteration`` (TGI's router) makes an LS arrival wait for a join it allows (up to
max_waiting_tokens decode steps); ``priority`` admits LS first but only between iterations;
``layer`` and ``qllm`` preempt the running batch at the next layer stage / expert.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from omegaconf import OmegaConf

from policies.core import BE, LS, Request
from policies.scheduler import Scheduler
from profiler.models import build_model
from profiler.ops import ModelRunner
from realrun.clock import WallClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.run import warm_up
from sim.app import CONF_DIR
from sim.run import build_policy

POLICIES = ("iteration", "priority", "layer", "qllm")


def workload(args) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    be = [Request(i, BE, 0.0, args.be_prompt, args.be_output) for i in range(args.be)]
    start = args.ls_after_s + np.cumsum(rng.exponential(1 / args.ls_rate, args.ls))
    ls = [Request(args.be + j, LS, float(t), args.ls_prompt, args.ls_output)
          for j, t in enumerate(start)]  # fmt: skip
    return be + ls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--be", type=int, default=8)
    ap.add_argument("--be-prompt", type=int, default=128)
    ap.add_argument("--be-output", type=int, default=800)
    ap.add_argument("--ls", type=int, default=40)
    ap.add_argument("--ls-rate", type=float, default=10.0, help="LS arrivals per second")
    ap.add_argument("--ls-after-s", type=float, default=0.1)
    ap.add_argument("--ls-prompt", type=int, default=32)
    ap.add_argument("--ls-output", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, info = build_model(args.model, device=args.device)
    runner = ModelRunner(model)
    requests, prompts = build_prompts(workload(args), info.shape.vocab_size, 4096, args.seed)
    warm_up(runner, args.be_prompt)
    print(f"{info.name} on {info.device}: {args.be} BE x {args.be_output} tokens in the "
          f"background, {args.ls} LS arrivals at {args.ls_rate}/s")  # fmt: skip
    medians, rows = {}, []
    for name in args.policies:
        policy = build_policy(OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml"))
        sched = Scheduler(policy, kv_capacity_tokens=10**9)
        result = RealEngine(requests, prompts, sched, runner, WallClock()).run()
        waits = [1e3 * (s.scheduled_s - s.request.arrival_s)
                 for s in result.sequences if s.cls == LS]  # fmt: skip
        medians[name] = statistics.median(waits)
        p90 = float(np.percentile(waits, 90))
        rows.append({"policy": name, "ls_start_latency_median_ms": medians[name], "p90_ms": p90,
                     "n": len(waits), "preemptions": result.preemptions})  # fmt: skip
        print(f"policy={name} ls_start_latency_median_ms={medians[name]:.3f} p90_ms={p90:.3f} "
              f"n={len(waits)} preemptions={result.preemptions}")  # fmt: skip
    if "qllm" in medians:
        print(" ".join(f"{name}_over_qllm={medians[name] / medians['qllm']:.1f}"
                       for name in ("iteration", "priority") if name in medians))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": info.name, "device": str(info.device), "args": vars(args),
                       "policies": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
