"""How well a measured profile predicts the runner: tiny-mixtral on this machine.

Profiles tiny-mixtral in-process, builds ``sim.latency.LatencyModel`` from the profile (routing
drawn from the profile's measured expert load), then times with the runner, stage by stage as
the real engine drives it, (a) the whole prefill iteration of one 128-token sequence (the mean
over 4 prompts) and (b) a decode iteration of 8 sequences with 256 KV tokens each (median of
--repeats), and compares each with the mean ``plan(batch).total_s`` of the same batch::

    prefill_error_pct=<float> decode_error_pct=<float>

(signed: positive when the model predicts more than the runner takes). Goal: both within 15%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from policies.core import Batch, Phase, Request, Sequence
from profiler.app import compose_config
from profiler.measure import CLOCKS, Settings, profile_model
from profiler.models import build_model
from profiler.ops import KVSequence, ModelRunner
from sim.latency import LatencyModel, RoutingModel

PREFILL_TOKENS = 128
# Prompts averaged for the prefill: which experts a prompt's tokens reach (and so how many
# experts run at all) varies from prompt to prompt, and the model only knows the average.
PREFILL_PROMPTS = 4
DECODE_BATCH, DECODE_KV = 8, 256
# Grid shapes around, not at, the two compared shapes: the model interpolates.
GRID = [
    "grid.prefill_tokens=[16,64,96,192,384]",
    "grid.decode_batch=[1,4,12,16]",
    "grid.decode_kv=[64,192,512]",
]
PLANS = 500  # routing draws averaged per prediction


def iteration_ms(runner: ModelRunner, seqs: list[KVSequence], repeats: int, clock) -> float:
    """Median time of one iteration of ``seqs``, stepped stage by stage as the engine does."""
    marks = [(len(s.token_ids), s.num_cached) for s in seqs]
    times = []
    for _ in range(repeats + 2):
        t = clock()
        state = runner.begin(seqs)
        while not state.done:
            runner.step(state)
        times.append((clock() - t) * 1e3)
        for s, (n, c) in zip(seqs, marks, strict=True):
            s.truncate(n, c)
    return statistics.median(times[2:])


def predicted_ms(latency: LatencyModel, batch: Batch) -> float:
    return 1e3 * float(np.mean([latency.plan(batch).total_s for _ in range(PLANS)]))


def sim_batch(phase: Phase, size: int, prompt: int, generated: int) -> Batch:
    seqs = [Sequence(Request(i, "BE", 0.0, prompt, 64), generated=generated) for i in range(size)]
    return Batch(seqs, phase)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="process",
                    help="process: CPU time, steady when other jobs share the machine")  # fmt: skip
    args = ap.parse_args()
    # One torch thread: the process clock then measures what an idle machine's wall clock
    # would, and OpenMP teams on a shared CPU make every timing erratic.
    torch.set_num_threads(1)
    clock = CLOCKS[args.clock]
    cfg = compose_config([*GRID, "device=cpu", f"clock={args.clock}", "repeats=20"])
    settings = Settings.from_config(cfg)
    model, info = build_model(cfg.model, device="cpu", dtype=cfg.dtype, seed=settings.seed)
    t = time.perf_counter()
    profile = profile_model(model, info, settings, "accuracy", progress=False)
    print(f"profiled tiny-mixtral in {time.perf_counter() - t:.1f} s")
    shape = profile.model
    routing = RoutingModel(shape.num_layers, shape.num_experts, shape.top_k, mode="profile",
                           expert_load=profile.expert_load,
                           prompt_experts=profile.prompt_experts)  # fmt: skip
    latency = LatencyModel(profile, routing)

    runner = ModelRunner(model)
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, shape.vocab_size, (n,), generator=gen).tolist()

    prefill = statistics.mean(
        iteration_ms(runner, [runner.new_sequence(ids(PREFILL_TOKENS))], args.repeats, clock)
        for _ in range(PREFILL_PROMPTS)
    )
    decoders = [runner.new_sequence(ids(DECODE_KV)) for _ in range(DECODE_BATCH)]
    runner.run(runner.begin(decoders))  # prefilled: 256 cached, one new token each
    decode = iteration_ms(runner, decoders, args.repeats, clock)

    pred_prefill = predicted_ms(latency, sim_batch(Phase.PREFILL, 1, PREFILL_TOKENS, 0))
    pred_decode = predicted_ms(latency, sim_batch(Phase.DECODE, DECODE_BATCH, DECODE_KV, 1))
    print(f"prefill: measured {prefill:.3f} ms, predicted {pred_prefill:.3f} ms")
    print(f"decode:  measured {decode:.3f} ms, predicted {pred_decode:.3f} ms")
    print(
        f"prefill_error_pct={100 * (pred_prefill - prefill) / prefill:.2f} "
        f"decode_error_pct={100 * (pred_decode - decode) / decode:.2f}"
    )


if __name__ == "__main__":
    main()
