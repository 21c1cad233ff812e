"""Decode speed of the real engine (scheduler in the loop) against ``model.generate``.

B requests of P prompt tokens arrive at once and each generates N + 1 tokens; decode tokens/s
counts the B x N tokens of the decode iterations only (the engine: the summed durations of its
decode iterations, from the trace; generate: the time of N + 1 new tokens minus the time of
1, i.e. without its prefill), median of --repeats run in turn. Prints, per policy::

    policy=<name> engine_tokens_per_s=<float> generate_tokens_per_s=<float> ratio=<float>

and last ``ratio=<float>``, the lowest of them (goal: >= 0.9). ``iteration`` asks the
scheduler between iterations only; ``qllm`` also polls arrivals and asks at every expert.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from policies.core import BE, Request
from policies.scheduler import Scheduler
from profiler.models import build_model
from profiler.ops import ModelRunner
from realrun.clock import WallClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.trace import ChromeTrace
from sim.app import CONF_DIR
from sim.run import build_policy


def generate_decode_s(model, prompts: torch.Tensor, new_tokens: int) -> float:
    def timed(n: int) -> float:
        t = time.perf_counter()
        model.generate(prompts, do_sample=False, max_new_tokens=n)
        return time.perf_counter() - t

    return timed(new_tokens + 1) - timed(1)


def engine_decode_s(runner, policy: str, batch: int, prompt: int, new_tokens: int) -> float:
    requests = [Request(i, BE, 0.0, prompt, new_tokens + 1) for i in range(batch)]
    requests, prompts = build_prompts(requests, runner.config.vocab_size, prompt, seed=0)
    cfg = OmegaConf.load(CONF_DIR / "policy" / f"{policy}.yaml")
    sched = Scheduler(build_policy(cfg), kv_capacity_tokens=10**9)
    trace = ChromeTrace(stages=False)
    RealEngine(requests, prompts, sched, runner, WallClock(), trace).run()
    decode = [e["dur"] for e in trace.events if e.get("cat") == "decode"]
    assert len(decode) == new_tokens, "the batch must decode together"
    return sum(decode) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=["iteration", "qllm"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, info = build_model(args.model, device=args.device)
    runner = ModelRunner(model)
    prompts = torch.randint(0, info.shape.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(0)).to(info.device)  # fmt: skip
    model.generate(prompts, do_sample=False, max_new_tokens=4)  # warm-up
    tokens = args.batch * args.new_tokens
    for policy in args.policies:  # warm-up
        engine_decode_s(runner, policy, args.batch, args.prompt, 4)
    # Interleaved repeats: the machine's speed drifts by several percent within a minute.
    times: dict[str, list[float]] = {name: [] for name in ["generate", *args.policies]}
    for _ in range(args.repeats):
        times["generate"].append(generate_decode_s(model, prompts, args.new_tokens))
        for policy in args.policies:
            times[policy].append(
                engine_decode_s(runner, policy, args.batch, args.prompt, args.new_tokens)
            )
    ref = tokens / statistics.median(times["generate"])
    print(f"{info.name} on {info.device}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} decode steps")  # fmt: skip
    ratios = []
    for policy in args.policies:
        ours = tokens / statistics.median(times[policy])
        ratios.append(ours / ref)
        print(f"policy={policy} engine_tokens_per_s={ours:.1f} generate_tokens_per_s={ref:.1f} "
              f"ratio={ours / ref:.3f}")  # fmt: skip
    print(f"ratio={min(ratios):.3f}")


if __name__ == "__main__":
    main()
