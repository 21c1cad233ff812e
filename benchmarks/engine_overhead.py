"""Decode speed of the real engine (scheduler in the loop) against ``model.generate``.

B requests of P prompt tokens arrive at once and each generates N + 1 tokens; decode tokens/s
counts the B x N tokens of the decode iterations only (the engine: the summed durations of its
decode iterations, from the trace; generate: the time of N + 1 new tokens minus the time of
1, i.e. without its prefill), median of --repeats run in turn. Prints, per policy::

    policy=<name> engine_tokens_per_s=<float> generate_tokens_per_s=<float> ratio=<float>
        ratio_range=<min>-<max>      (the ratio of each interleaved repeat)

then ``ratio=<float>``, the lowest policy's (goal: >= 1.0), then where the time goes: host ms
per decode iteration by stage for the engine and for generate (a separate, instrumented run),
and one MoE layer's experts on their own: the runner stepping expert by expert against the
model's own experts implementation (transformers' fused ``grouped_mm`` by default) and its
eager loop. ``iteration`` asks the scheduler between iterations only; ``qllm`` also polls
arrivals and asks at every expert.

Clock (``--clock auto``): on a CPU this thread's CPU time. With one torch thread all the work
runs in this thread, so other processes of a shared machine do not count (they still slow the
caches a little); ``--clock wall`` for wall time. On CUDA, wall time (the device works
asynchronously; the runner reads the tokens back every iteration, and generate every step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from omegaconf import OmegaConf

from policies.core import BE, Request
from policies.scheduler import Scheduler
from profiler.models import build_model
from profiler.ops import IterationState, ModelRunner, Routing
from realrun.clock import WallClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.trace import ChromeTrace
from sim.app import CONF_DIR
from sim.run import build_policy

STAGES = ("attention", "router", "experts", "lm_head")


class ThreadClock(WallClock):
    """The engine's clock read as this thread's CPU time."""

    def start(self) -> None:
        self.t0 = time.thread_time()

    def now(self) -> float:
        return time.thread_time() - self.t0


def generate_decode_s(model, prompts: torch.Tensor, new_tokens: int, clock) -> float:
    def timed(n: int) -> float:
        t = clock()
        model.generate(prompts, do_sample=False, max_new_tokens=n)
        return clock() - t

    return timed(new_tokens + 1) - timed(1)


def engine_decode_s(runner, policy: str, batch: int, prompt: int, new_tokens: int,
                    clock: WallClock) -> float:  # fmt: skip
    requests = [Request(i, BE, 0.0, prompt, new_tokens + 1) for i in range(batch)]
    requests, prompts = build_prompts(requests, runner.config.vocab_size, prompt, seed=0)
    cfg = OmegaConf.load(CONF_DIR / "policy" / f"{policy}.yaml")
    sched = Scheduler(build_policy(cfg), kv_capacity_tokens=10**9)
    trace = ChromeTrace(stages=False)
    RealEngine(requests, prompts, sched, runner, clock, trace).run()
    decode = [e["dur"] for e in trace.events if e.get("cat") == "decode"]
    assert len(decode) == new_tokens, "the batch must decode together"
    return sum(decode) / 1e6


def engine_stages_ms(runner, args, clock, policy: str) -> dict[str, float]:
    """Host ms per decode iteration by stage: the runner's stages timed where they run (the
    prepare stage and the engine's own work between stages are ``other``)."""
    acc: dict[str, float] = defaultdict(float)
    run_stage = runner._run

    def timed(ref, state) -> None:
        t = clock()
        run_stage(ref, state)
        if state.is_decode:
            acc["experts" if ref.stage == "expert" else ref.stage] += clock() - t

    runner._run = timed
    try:
        total = engine_decode_s(runner, policy, args.batch, args.prompt, args.new_tokens,
                                make_clock(args))  # fmt: skip
    finally:
        del runner._run
    return per_iteration_ms(acc, total, args.new_tokens)


def generate_stages_ms(model, prompts, args, clock) -> dict[str, float]:
    """Host ms per decode step of generate by stage, from forward hooks on the model's
    modules (norms go with the stage that follows them; the residual adds, the mask, the
    argmax and generate's loop are ``other``)."""
    acc: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}
    handles = []

    def hook(stage: str, module: torch.nn.Module) -> None:
        def pre(m, *_args, **_kwargs) -> None:
            started[id(m)] = clock()

        def post(m, *_args, **_kwargs) -> None:
            acc[stage] += clock() - started[id(m)]

        handles.extend([module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post)])  # fmt: skip

    for layer in model.model.layers:
        hook("attention", layer.input_layernorm)
        hook("attention", layer.self_attn)
        hook("router", layer.post_attention_layernorm)
        if hasattr(layer.mlp, "experts"):
            hook("router", layer.mlp.gate)
            hook("experts", layer.mlp.experts)
    hook("lm_head", model.model.norm)
    hook("lm_head", model.lm_head)
    try:
        # the prefill's share, measured alone: one generate of one token (one forward), not
        # generate_decode_s, which runs two generates (three forwards)
        model.generate(prompts, do_sample=False, max_new_tokens=1)
        one = dict(acc)
        acc.clear()
        t = clock()
        model.generate(prompts, do_sample=False, max_new_tokens=args.new_tokens + 1)
        total = clock() - t
        acc_decode = {k: acc[k] - one.get(k, 0.0) for k in acc}
        t = clock()
        model.generate(prompts, do_sample=False, max_new_tokens=1)
        total -= clock() - t
    finally:
        for h in handles:
            h.remove()
    return per_iteration_ms(acc_decode, total, args.new_tokens)


def per_iteration_ms(acc: dict[str, float], total_s: float, n: int) -> dict[str, float]:
    out = {k: acc.get(k, 0.0) * 1e3 / n for k in STAGES}
    out["other"] = total_s * 1e3 / n - sum(out.values())
    out["total"] = total_s * 1e3 / n
    return out


def experts_alone_ms(model, runner: ModelRunner, batch: int, clock, reps: int) -> dict:
    """One MoE layer's experts on ``batch`` tokens routed by its own gate: the runner's
    stepped experts against the model's experts module."""
    layer = runner.moe_layers[0]
    mlp = runner.layers[layer].mlp
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, runner.config.hidden_size, generator=gen).to(runner.device,
                                                                         runner.dtype)  # fmt: skip
    _, top_w, top_idx = mlp.gate(x)

    def stepped() -> None:  # queues, one stage per expert, the combine (+ a residual add)
        state = IterationState(sequences=[], hidden=x, pending_layer=layer)
        state.routing = Routing.build(x, top_idx, top_w, runner.num_experts)
        for e in range(runner.num_experts):
            runner.expert(layer, e, state)
        runner.finish_layer(state)

    def fused() -> None:
        mlp.experts(x, top_idx, top_w)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        sync()
        t = clock()
        for _ in range(reps):
            fn()
        sync()
        return (clock() - t) * 1e3 / reps

    impl = model.config._experts_implementation or "eager"
    out = {"stepped": timed(stepped), impl: timed(fused)}
    if impl != "eager":
        model.config._experts_implementation = "eager"
        try:
            out["eager"] = timed(fused)
        finally:
            model.config._experts_implementation = impl
    return out


def make_clock(args) -> WallClock:
    return ThreadClock() if args.clock == "cpu" else WallClock()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto")
    ap.add_argument("--policies", nargs="+", default=["iteration", "qllm"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, info = build_model(args.model, device=args.device)
    if args.clock == "auto":
        args.clock = "cpu" if info.device.type == "cpu" else "wall"
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    load_before = os.getloadavg()[0]
    runner = ModelRunner(model)
    prompts = torch.randint(0, info.shape.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(0)).to(info.device)  # fmt: skip
    model.generate(prompts, do_sample=False, max_new_tokens=4)  # warm-up
    tokens = args.batch * args.new_tokens
    for policy in args.policies:  # warm-up
        engine_decode_s(runner, policy, args.batch, args.prompt, 4, make_clock(args))
    # Interleaved repeats: the machine's speed drifts by several percent within a minute.
    times: dict[str, list[float]] = {name: [] for name in ["generate", *args.policies]}
    for _ in range(args.repeats):
        times["generate"].append(generate_decode_s(model, prompts, args.new_tokens, clock))
        for policy in args.policies:
            times[policy].append(engine_decode_s(runner, policy, args.batch, args.prompt,
                                                 args.new_tokens, make_clock(args)))  # fmt: skip
    ref = tokens / statistics.median(times["generate"])
    print(f"{info.name} on {info.device}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} decode steps, {args.threads} thread(s), {args.clock} clock, "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")  # fmt: skip
    ratios = []
    for policy in args.policies:
        ours = tokens / statistics.median(times[policy])
        each = [g / e for g, e in zip(times["generate"], times[policy], strict=True)]
        ratios.append(ours / ref)
        print(f"policy={policy} engine_tokens_per_s={ours:.1f} generate_tokens_per_s={ref:.1f} "
              f"ratio={ours / ref:.3f} ratio_range={min(each):.3f}-{max(each):.3f}")  # fmt: skip
    print(f"ratio={min(ratios):.3f}")

    engine = engine_stages_ms(runner, args, clock, args.policies[0])
    hf = generate_stages_ms(model, prompts, args, clock)
    print(
        f"host ms per decode iteration ({args.policies[0]} engine / generate, instrumented; "
        f"engine other = prepare + scheduler, generate other = its loop, masks, adds):"
    )
    for stage in (*STAGES, "other", "total"):
        print(f"  {stage:<9} engine={engine[stage]:.3f} generate={hf[stage]:.3f}")
    alone = experts_alone_ms(model, runner, args.batch, clock, reps=200)
    print(
        f"experts alone, one layer, {args.batch} tokens, ms: "
        + " ".join(f"{k}={v:.3f}" for k, v in alone.items())
    )


if __name__ == "__main__":
    main()
