"""Our engine under ``iteration`` (or --policy) against transformers' continuous batching.

The same requests (synthetic lengths, Poisson arrivals at --rate; --rate 0: all at t=0) go
through (a) our real engine with the ``iteration`` policy (TGI's router rules) and (b) the
``ContinuousBatchingManager`` behind ``model.generate_batch`` (attention ``sdpa``, its
paged-cache path, FIFO scheduler). Prints::

    engine=ours policy=<name> tokens_per_s=<float> ttft_mean_s=<float>
    engine=hf_cb tokens_per_s=<float> ttft_mean_s=<float>
    tokens_per_s_ratio=<ours/hf> ttft_ratio=<ours/hf> same_tokens=<n>/<n>

tokens/s is output tokens over the makespan (first arrival to last token). TTFT: ours from the
scheduler (first token time minus arrival). ``generate_batch`` takes every prompt at once, so
arrivals are replayed through the same manager's ``add_request`` (what ``generate_batch``
calls), from this thread at each arrival time, with ``record_timestamps=True``: TTFT is the
first token's timestamp minus the arrival time, on the same ``perf_counter`` clock. The
manager is set up and warmed up before the clock starts, as our engine is.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from omegaconf import OmegaConf
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from policies.scheduler import Scheduler
from profiler.models import build_model
from profiler.ops import ModelRunner
from realrun.clock import WallClock
from realrun.prompts import build_prompts
from realrun.run import execute, warm_up
from sim.app import CONF_DIR
from sim.config import LengthConfig, LengthDist, SloConfig, WorkloadConfig, WorkloadKind
from sim.run import build_policy
from sim.workloads import build_workload


def requests_for(args, vocab_size: int):
    lognormal = LengthDist.lognormal
    w = WorkloadConfig(
        kind=WorkloadKind.synthetic,
        num_requests=args.requests,
        rate=args.rate or 1.0,
        ls_fraction=0.0,
        prompt=LengthConfig(lognormal, args.prompt, 8, 4 * args.prompt),
        output=LengthConfig(lognormal, args.output, 4, 4 * args.output, 0.5),
    )
    requests = build_workload(w, seed=args.seed)
    if not args.rate:
        requests = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
    return build_prompts(requests, vocab_size, 4 * args.prompt, args.seed)


def run_ours(runner, requests, prompts, slo, policy_name: str):
    policy = build_policy(OmegaConf.load(CONF_DIR / "policy" / f"{policy_name}.yaml"))
    out = execute(requests, prompts, Scheduler(policy, kv_capacity_tokens=10**9), runner, slo,
                  WallClock())  # fmt: skip
    s = out.summary
    tokens_per_s = s["throughput"]["output_tokens_per_s"]
    return tokens_per_s, s["classes"]["all"]["ttft_s"]["mean"], out.result.tokens


def run_hf(model, requests, prompts):
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r.output_tokens for r in requests))  # fmt: skip
    # A fixed cache sized for the workload: the default sizing probes device memory.
    total = sum(r.prompt_tokens + r.output_tokens for r in requests)
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=total // 32 + 2 * len(requests),
                                  max_batch_tokens=4096)  # fmt: skip
    with model.continuous_batching_context_manager(
        generation_config=gen, block=True, continuous_batching_config=cb
    ) as manager:
        t0 = time.perf_counter()
        for r in sorted(requests, key=lambda r: r.arrival_s):
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            manager.add_request(prompts[r.id], request_id=str(r.id),
                                max_new_tokens=r.output_tokens, record_timestamps=True)  # fmt: skip
        results = {}
        while len(results) < len(requests):
            out = manager.get_result(timeout=10)
            if out is None:
                raise RuntimeError("the continuous-batching manager stopped producing results")
            if out.is_finished():
                results[int(out.request_id)] = out
    arrival = {r.id: t0 + r.arrival_s for r in requests}
    ttft = statistics.fmean(o.timestamps[0] - arrival[i] for i, o in results.items())
    makespan = max(o.timestamps[-1] for o in results.values()) - t0
    tokens = sum(len(o.generated_tokens) for o in results.values())
    return tokens / makespan, ttft, {i: o.generated_tokens for i, o in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=30.0, help="requests/s; 0: all at t=0")
    ap.add_argument("--prompt", type=int, default=64, help="median prompt tokens")
    ap.add_argument("--output", type=int, default=32, help="median output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="iteration", help="our engine's policy")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, info = build_model(args.model, device=args.device)
    runner = ModelRunner(model)
    requests, prompts = requests_for(args, info.shape.vocab_size)
    warm_up(runner, max(r.prompt_tokens for r in requests))
    slo = SloConfig()
    print(f"{info.name} on {info.device}: {len(requests)} requests, "
          f"{'all at t=0' if not args.rate else f'{args.rate}/s'}")  # fmt: skip
    ours_tps, ours_ttft, ours_tokens = run_ours(runner, requests, prompts, slo, args.policy)
    hf_tps, hf_ttft, hf_tokens = run_hf(model, requests, prompts)
    same = sum(ours_tokens[i] == hf_tokens.get(i) for i in ours_tokens)
    print(f"engine=ours policy={args.policy} tokens_per_s={ours_tps:.1f} "
          f"ttft_mean_s={ours_ttft:.4f}")  # fmt: skip
    print(f"engine=hf_cb tokens_per_s={hf_tps:.1f} ttft_mean_s={hf_ttft:.4f}")
    print(f"tokens_per_s_ratio={ours_tps / hf_tps:.3f} ttft_ratio={ours_ttft / hf_ttft:.3f} "
          f"same_tokens={same}/{len(requests)}")  # fmt: skip


if __name__ == "__main__":
    main()
