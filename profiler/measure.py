"""Time the runner's stages inside real iterations and write a profile table.

The profiler runs whole iterations with the ``ModelRunner``, stage by stage as the real engine
does, and times every stage where it runs. Ops timed in isolation were up to 2x off on a
CPU: an expert whose weights are still in the caches from the previous call runs much faster
than inside an iteration, where the rest of the model streamed through the caches since.

- prefill iterations of one sequence of n tokens (``grid.prefill_tokens``) give
  ``attn_prefill(n)`` and ``router(n)``;
- prefill iterations of k sequences of the grid's longest prompt P each, k = N // P for each
  N of ``grid.prefill_batch_tokens`` (optional; k < 2 skipped) give ``router(k P)`` and
  their expert samples: a batched prefill (TGI's, up to ``max_batch_prefill_tokens`` = 4096)
  feeds the router and the experts many more tokens than one prompt, which their curves would
  otherwise extrapolate linearly from one prompt's. Their attention stage runs one call per
  prompt: it is filed split (below), not as ``attn_prefill``;
- prefill iterations of two prompts of each ``grid.prefill_tokens`` length n >= 2
  (``grid.prefill_pairs``, default true) and the batched prefills split their attention
  stages where they run: the clock is read around each prompt's self-attention call
  (``ModelRunner.call_clock``). What the stage spends outside the calls (the previous layer's
  combine, the input norm, joining the calls' outputs, the residual: once per iteration, over
  all N tokens) gives ``attn_prefill_outer(N)`` (single prompts give it too), the first call
  ``attn_prefill_first(n)``, and the mean of the calls after the first (each from the end of
  the one before) ``attn_prefill_next(n)``: a later prompt runs on weights the first call left
  warm. On tiny-mixtral (one thread) a later prompt of 32 tokens added 0.27 ms a layer against
  the first's 0.29 ms (its stage 0.38 ms, 0.09 of it outside the calls), and 8 prompts of 32
  tokens took 9.7 ms of attention where the sum of single prompts said 12.4 (the split, 9.4).
  The first call of several is not a single prompt's call: summed over the layers it ran
  0.06-0.17 ms (3-9%) longer than the call of one prompt of its length alone at 16-48
  tokens, 0-0.08 ms at 96, on tiny-qwen3-moe, tiny-mixtral and tiny-olmoe (2026-12-05, 40
  rounds in random order); charged a single prompt's call, as up to then, a prefill of two or
  more prompts came out short by about that much;
- decode iterations of B sequences with kv cached tokens each (``grid.decode_batch`` x
  ``grid.decode_kv``, distinct random prompts) give ``attn_decode(B, kv)``, ``router(B)``,
  ``lm_head(B)`` and ``step_overhead(B)``: the iteration's mean time minus the medians of its
  attention, router, expert and lm_head stages (that is the prepare stage, the stages of
  experts that received no token, the dispatch between stages, and the skew of stage times:
  the simulator adds per-stage medians, and this term makes them add up to the measured mean
  iteration, which is what mean TTFT and turnaround are made of; per visit it holds the time
  outside the stages, and ``fit_step_overhead`` then adds what the model still misses of the
  profile's own mean decode iterations, the stages' skew), and ``prepare_decode(B)``,
  that prepare stage alone (pooled over kv; it stays part of ``step_overhead``);
- every prefill iteration of N tokens in all (one prompt, a pair, a batch) gives
  ``prepare_prefill(k, N)`` and ``lm_head_prefill(k, N)``, its prepare and lm_head stages, and
  ``attn_prefill_outer(k, N)``, at its prompt count k (``batch_size``; 0 for one prompt: until
  2026-12-05 all were pooled at equal N, and one prompt was charged part of a pair's cost);
  each batched prefill's prompt count k is also timed at the longest prompt's P tokens, in k
  prompts of P // k (``Settings.prompt_counts``), so that what k prompts add over one prompt
  of as many tokens is measured (``sim.latency.PromptCurve``): at 256 tokens on
  tiny-qwen3-moe, 16 prompts spent about 0.5 ms more in prepare (a mask and a slice each)
  than one. A prefill's prepare embeds, positions and masks all its
  tokens, and its lm_head stage runs the last layer's combine over all of them, where a
  decode step's run over one token per sequence. Charged the decode's ``step_overhead`` and
  ``lm_head`` at its prompt count, as before these ops, the profile's own prefills came out
  1-7% short (self-check medians, 29 of 30 preset profiles of `make validate` 2026-12-02..03):
  in tiny-qwen3-moe's profile (2026-12-03) a prefill of 256 tokens spent 0.47 ms in prepare
  and 0.34 in lm_head against 0.18 and 0.18 of a decode step of one sequence, 4 prompts of
  256 tokens 1.19 and 0.74 ms;
- ``attn_decode_bind(B, kv)``: the attention of the first step of a new decode batch, which
  copies every sequence's cache into the batch's padded buffer (a step of the same batch
  reuses it): the same shapes, before each step one sequence replaced by a newly prefilled
  one (``Profiler.bind``). In the tiny-mixtral profiles of ``make validate`` (one thread) such
  a step's attention cost 1.2-1.6x a reused one at batch 1-4 and 1.6-2.0x at batch 16-32
  (2026-12-01; 1.1-1.7x and 1.5-2.0x on 2026-12-03);
  the rest of the step costs about the same;
- every expert stage of the prefill and decode iterations gives a sample of ``expert(n)``, n
  its queue size; samples are pooled in bins around ``grid.expert_tokens`` (a point per bin:
  median n, median time);
- ``attn_chunk(n, kv)`` (``grid.chunk_kv``, optional): iterations of one sequence feeding a
  chunk of n tokens (``grid.prefill_tokens``) over kv tokens it already cached; only their
  attention stages are filed (router and experts see n tokens, as in a prefill of n).
  ``attn_chunk(n, 0)`` is ``attn_prefill(n)``'s samples: a chunk over no prefix is a prefill;
- ``wake_up(idle_ms, busy_ms)``: for each idle time of ``wake.idle_ms``, ``wake.repeats``
  times, spread over the passes (``Settings.pass_wake_repeats``: measured after the last
  pass only, as up to 2026-12-04, the wake-up was that stretch's: in a `make validate` at
  05:51 that day, tiny-qwen3-moe's first step after 1 s of idle time ran 17-25 ms over its
  warm steps in all 9 repeats, 5.8-9.6 ms after 200 ms, where the first prefills of its real
  runs after gaps of 0.2-1 s ran 0.8 ms over their prediction on average): a window of a
  run's work after an idle gap (``Profiler._wake_window``: a prefill of a new prompt of
  ``wake.prompt_tokens``, decode steps of it, as many as take ``WAKE_WINDOW_MS`` warm, each
  rewound and fed a new random token, then a prefill of another such prompt) run back to
  back untimed (so that the last sample's slow-down is over
  and the device is busy when the gap starts), then the device left idle that long (waited
  as ``wake.wait`` says: sleep or spin, as the engine the profile is for waits;
  ``profiler.settings.IDLE_WAITS``), then
  such a window again, each iteration timed. A step's excess is its time over the median of
  the window's second half, by then warm, and the first prefill's its time over the last
  one's: a reference taken right after the slow-down, not from a window before the gap,
  because on a shared machine a whole 100 ms window runs up to 20% faster or slower than the
  one before it, and summed over the window that drift swamped a wake-up of 1-2 ms
  (tiny-olmoe's profile read 0 to 11.6 ms at 50 ms of idle time in three runs; this
  estimator, 1.0-3.5 ms). A run's first iteration after a gap is a prefill (the engine
  idles only when no request is left): timed on decode steps of one sequence re-fed one
  token, as up to 2026-12-04, the wake-up was charged 1.5x-2.2x what the real runs' first
  prefills after a gap of under 1 s showed (the curated validation of 2026-12-03 22:16: 1.3-3.0
  ms against 0.65-1.7 ms, per preset), and the decode step after it 0-0.15 ms against
  0.1-0.6 ms. The excess is read in bins (``WAKE_BINS``: the first four iterations one by
  one, then 4-7, 8-15, 16-31, within the first half of the steps): per bin, the median over
  the repeats of each one's mean excess over the bin's iterations. The slow-down ends at the
  first bin within the noise (the 90th percentile of the per-step median excess over the
  second half's steps, which are warm, over the square root of the bin's steps): it fades,
  it does not come back. Bins keep a tail of a few percent over 25 steps that a step alone
  is too noisy to show (in episodes in random order on this VM, steps 5-25 after 150 ms of
  sleep ran 1.5-10.5% slower than after none; a cut at the first step within the noise, the
  estimator before, dropped it after 2-4 steps). A point per boundary k of ``WAKE_POINTS``
  and the last: busy_ms the warm time of the first k iterations (the prefill's, then the
  steps'), the value the summed excess of the iterations after k: busy_ms = 0 holds the
  whole wake-up; p90 the 90th percentile of the repeats' own sums over the same iterations. A
  slow-down that outlasts half the window is under-counted. On the profile's CPU clock (on
  CUDA, wall clock, the device synchronised after each iteration, as the engine reads its
  tokens). A CPU's cores and a GPU's clocks slow down when idle (an idle H200 drops to 345
  MHz): the first iterations after a gap run slower; on this project's 2-core VM the first
  decode step of a tiny model after 10-200 ms of idle time ran 1.2-2.2 ms (40-70%) slower,
  the next ones 0-0.5 ms. The raw times are kept (``Profiler.wake_samples``, profile.json
  ``extra.wake_samples``: a row per window, [prefill, steps, prefill]; profiles before
  2026-12-04 hold steps only).

Each iteration runs ``warmup`` + ``repeats`` times (a decode or chunk's sequences rewound in
between; a prefill's on new sequences, alternately n // ``PREFILL_JITTER`` tokens a prompt
shorter and longer than the grid's n and folded back onto n: ``Profiler.prefill``), after
one untimed prefill and decode step at the grid's largest shapes; attention samples pool all
layers, a router sample is an iteration's mean over its layers (a dense layer, such as
DeepSeek-V3's first, runs its whole MLP in its router stage: a median over all layers' stages
dropped it; the latency model charges router x layers). Times: a CPU clock, or CUDA events
(made once, reused) recorded at every stage boundary (no extra synchronisation inside the
iteration). Each point keeps its median and p90:
the profile's ``spread`` (profiler/schema.py) flags a profile whose repeats scatter.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import platform
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.core import Stage
from profiler.models import ModelInfo, available_bytes, build_model, resolve_device
from profiler.ops import KVSequence, ModelRunner, StageRef
from profiler.probe import SpeedProbe
from profiler.schema import (  # noqa: F401 (SettingsError: measure.SettingsError, as before)
    Memory,
    OpPoint,
    Profile,
    SettingsError,
)
from profiler.settings import (  # noqa: F401 (measure.Settings etc., as before)
    CLOCKS,
    DECODE_WARMUP,
    WAKE_PROMPT_TOKENS,
    Settings,
    wait_idle,
)

# The busy time over which a wake-up is followed (the steps timed per sample: this much work,
# within WAKE_STEPS_RANGE; its second half is the warm reference): on this project's 2-core VM
# the slow-down after an idle gap faded over 1-8 decode steps of a tiny model (3-20 ms); the
# window leaves room for a slower device. Points are kept at WAKE_POINTS steps (and the last).
WAKE_WINDOW_MS = 100.0
WAKE_STEPS_RANGE = (4, 64)
WAKE_POINTS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
# the bins of steps (from, to) in which the wake-up's excess is read (module docstring)
# (a window has at most WAKE_STEPS_RANGE[1] steps, so its first half ends by step 32)
WAKE_BINS = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 8), (8, 16), (16, 32))


def wake_steps(warm_step_ms: float) -> int:
    """Decode steps that take WAKE_WINDOW_MS warm (within WAKE_STEPS_RANGE)."""
    low, high = WAKE_STEPS_RANGE
    return min(max(math.ceil(WAKE_WINDOW_MS / max(warm_step_ms, 1e-9)), low), high)


def wake_curve(idle_ms: int, times_ms: np.ndarray,
               first_ms: np.ndarray | None = None) -> list[OpPoint]:  # fmt: skip
    """The ``wake_up`` points at one idle time from the step times (ms) of each repeat's
    window after the gap (a row each): excess over the median of the row's second half, read
    in ``WAKE_BINS`` within the first half (per bin, the median over the rows of each row's
    mean excess over the bin's steps), up to the first bin within the noise (the 90th
    percentile of the second half's per-step median excess, over the square root of the
    bin's steps); a point at each of WAKE_POINTS below the window's length and at its end.
    ``first_ms`` (a row of two per window): the window's first iteration, a prefill, before
    those steps, and the same prefill again at the window's end, warm: it is then the
    curve's first step, its excess the first over the second (the windows of
    ``Profiler.wake_points``; without it, a window of decode steps alone)."""
    steps = times_ms.shape[1]
    half = steps // 2
    warm = np.median(times_ms[:, half:], axis=1, keepdims=True)
    excess = times_ms - warm
    # the noise of a step's median: what the warm steps' medians show, whose excess is none
    floor = float(np.percentile(np.abs(np.median(excess[:, half:], axis=0)), 90))
    lead, warm_first = 0, 0.0  # the prefill before the steps: a column of its own
    if first_ms is not None:
        first = np.asarray(first_ms, dtype=float)
        excess = np.concatenate([first[:, :1] - first[:, 1:2], excess], axis=1)
        lead, warm_first = 1, float(np.median(first[:, 1]))
    steps += lead
    med, rows = np.zeros(steps), np.zeros_like(excess)  # per step: the bin's excess
    for lo, hi in WAKE_BINS:
        hi = min(hi, half + lead)
        if lo >= hi:
            break
        each = excess[:, lo:hi].mean(axis=1, keepdims=True)
        value = float(np.median(each))
        if value <= floor / math.sqrt(hi - lo):
            break
        med[lo:hi], rows[:, lo:hi] = value, each

    def left(x: np.ndarray) -> np.ndarray:  # the excess still ahead after k steps, k = 0..steps
        return np.concatenate([np.cumsum(x[..., ::-1], axis=-1)[..., ::-1],
                               np.zeros(x.shape[:-1] + (1,))], axis=-1)  # fmt: skip

    kept = [k for k in WAKE_POINTS if k < steps] + [steps]
    # busy: the warm time of the first k iterations (the prefill's, then k - 1 steps')
    busy = np.array([warm_first * min(k, lead) + float(np.median(warm)) * max(k - lead, 0)
                     for k in kept])  # fmt: skip
    value = left(med)[kept]
    p90 = np.maximum(np.percentile(left(rows), 90, axis=0)[kept], value)
    return [OpPoint("wake_up", median_ms=float(m), p90_ms=float(p), idle_ms=idle_ms,
                    busy_ms=round(float(b), 4))
            for b, m, p in zip(busy, value, p90, strict=True)]  # fmt: skip


# Share of free device memory the KV cache may take (the rest: activations, allocator slack).
KV_MEMORY_SHARE = 0.9


# a prefill's attention, split
SPLIT_OPS = ("attn_prefill_outer", "attn_prefill_first", "attn_prefill_next")
# A prefill shape of n tokens a prompt is timed at n - n // PREFILL_JITTER and n +
# n // PREFILL_JITTER tokens a prompt, alternately, on new sequences every iteration
# (``Profiler.prefill``): a run's prefills write new caches, and no two in a row have the same
# lengths. Rewound and re-run at one length, as up to 2026-12-03, a prefill's attention
# stage ran faster than so: 3 new prompts of 48-80 tokens took 1.07x-1.11x its time at 64
# rewound (tiny-mixtral, tiny-qwen2-moe, paired iteration by iteration; one prompt 1.05x and
# 1.06x; new sequences of 64 1.03x-1.06x; 56 and 72 in turn 1.06x-1.07x), the other stages
# within 1-4%; and in the real runs the prefills of 2-8 prompts ran 1.06x-1.09x their
# prediction over the host-speed probe on four presets of the curated `make validate`
# (2026-12-03 18:33; 0.99x-1.01x on tiny-olmoe), 1.01x-1.09x in the two runs after the change
# (22:16, 23:05).
PREFILL_JITTER = 8


@dataclass
class StageTime:
    ref: StageRef
    tokens: int  # the expert's queue size (expert stages only)
    ms: float
    # a prefill's attention stage: each prompt's self-attention call, the first from just
    # before it, each later one from the end of the one before (the slicing for it included)
    calls: list[float] | None = None


class StageClock:
    """Times every stage of an iteration where it runs: a CPU clock read at each boundary, or
    CUDA events recorded at each boundary and read once the iteration is over. The events are
    made once and reused by every iteration (all are read before the next one records). Inside
    a prefill's attention stage it also reads the clock around each prompt's self-attention
    (``ModelRunner.call_clock``; on CUDA events of a second pool, reused the same way)."""

    def __init__(self, device: torch.device, clock: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self.clock = CLOCKS[clock]
        self.events: list = []  # CUDA events, one per stage boundary
        self.call_events: list = []  # and those read around the calls, in order of use
        self._calls = 0  # call events used by this iteration

    def iteration(self, runner: ModelRunner, seqs: list[KVSequence]) -> tuple[float, list]:
        """(total ms, [StageTime]) of one whole iteration of ``seqs``."""
        state = runner.begin(seqs)
        refs, tokens, calls, marks = [], [], [], [self._mark(0)]
        runner.call_clock, self._calls = self._call_mark, 0
        try:
            while not state.done:
                ref = runner.next_stage(state)
                tokens.append(state.queue_size(ref.expert) if ref.stage == "expert" else 0)
                state.call_marks = None
                runner.step(state)
                marks.append(self._mark(len(marks)))
                refs.append(ref)
                calls.append(state.call_marks)
        finally:
            runner.call_clock = None
        ms = self._elapsed(marks)
        return sum(ms), [StageTime(r, n, t, c and self._elapsed(c))
                         for r, n, t, c in zip(refs, tokens, ms, calls, strict=True)]  # fmt: skip

    def _call_mark(self):
        if not self.cuda:
            return self.clock()
        if self._calls == len(self.call_events):
            self.call_events.append(torch.cuda.Event(enable_timing=True))
        event = self.call_events[self._calls]
        self._calls += 1
        event.record()
        return event

    def _mark(self, boundary: int):
        if not self.cuda:
            return self.clock()
        if boundary == len(self.events):
            self.events.append(torch.cuda.Event(enable_timing=True))
        event = self.events[boundary]
        event.record()
        return event

    def _elapsed(self, marks: list) -> list[float]:
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]


def decode_lengths(batch: int, kv: int) -> list[int]:
    """The contexts of the profiler's decode batch of ``batch`` sequences at ``kv``: spread
    from kv/2 up to kv (``Profiler.decode``)."""
    return [max(1, round(kv * (1 - 0.5 * i / max(batch - 1, 1)))) for i in range(batch)]


def self_check(profile: Profile, totals: dict[tuple[int, int, int, int], list[float]],
               draws: int = 50) -> dict:  # fmt: skip
    """How far the latency model built from ``profile`` (as the simulator builds it: routing
    from the profile, interference applied; no engine_host, which these iterations do not
    have) is from the profile's own timed iterations: for each shape in ``totals``
    (``Profiler.totals``, keyed (batch, tokens, kv, sequences): a prefill of k prompts of n
    tokens each, as it ran (n -+ n // PREFILL_JITTER), is (0, k n, 0, k), a decode batch (B,
    B, kv, B) with ``decode_lengths`` contexts), its predicted mean iteration (over
    ``draws`` routing draws) against the mean of its repeats. No real run's noise enters: an
    error here is the model's own way of adding op times up (which is how a prefill's
    routing of independent tokens was found 27% long). Returns the shapes' rows and, per
    phase, the median and the worst error (signed, %)."""
    from policies.core import BE, Batch, Phase, Request, Sequence
    from sim.latency import LatencyModel, RoutingModel

    m = profile.model
    model = dataclasses.replace(profile, points=[p for p in profile.points
                                                 if p.op != "engine_host"])  # fmt: skip
    mode = "profile" if profile.expert_load is not None else "uniform"
    routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, mode=mode,
                           expert_load=profile.expert_load, seed=0,
                           prompt_experts=profile.prompt_experts)  # fmt: skip
    latency = LatencyModel(model, routing)
    rows = []
    for (batch, tokens, kv, sequences), times in sorted(totals.items()):
        if not times:
            continue
        if batch:
            seqs = [Sequence(Request(i, BE, 0.0, n, 2)) for i, n in
                    enumerate(decode_lengths(batch, kv))]  # fmt: skip
            for q in seqs:  # one token generated: its context is the prompt
                q.generated = 1
            shape = Batch(seqs, Phase.DECODE)
        else:
            shape = Batch([Sequence(Request(i, BE, 0.0, tokens // sequences, 2))
                           for i in range(sequences)], Phase.PREFILL)  # fmt: skip
        predicted = 1e3 * float(np.mean([latency.plan(shape).total_s for _ in range(draws)]))
        measured = float(np.mean(times))
        rows.append({"phase": "decode" if batch else "prefill", "batch_size": sequences,
                     "tokens": tokens, "kv_tokens": kv, "predicted_ms": round(predicted, 4),
                     "measured_ms": round(measured, 4),
                     "error_pct": round(100 * (predicted / measured - 1), 2)})  # fmt: skip
    out: dict = {"shapes": rows}
    for phase in ("prefill", "decode"):
        errors = [r["error_pct"] for r in rows if r["phase"] == phase]
        if errors:
            out[f"{phase}_median_pct"] = round(float(np.median(errors)), 2)
            out[f"{phase}_worst_pct"] = max(errors, key=abs)
    return out


def fit_step_overhead(profile: Profile, totals: dict[tuple[int, int, int, int], list[float]]
                      ) -> tuple[Profile, dict[int, float]]:  # fmt: skip
    """``profile`` with each ``step_overhead(B)`` moved by what the latency model, as built
    from it, still misses of the profile's own mean decode iterations of B sequences
    (``self_check``'s decode rows, their mean over the contexts, over ``interference``, which
    scales the term), at 0 at least; and those moves (ms, by B). Why: each visit's residual
    (``Profiler.record``) is its mean iteration minus the medians of its own stage samples, one
    or two iterations' (the repeats split over a dozen passes), so it holds the time outside
    the stages but not their skew, the stage samples' mean over their median over the whole
    profile, which the model's sum of medians lacks: the self-check's decode medians were
    -1.3% to -3.7% in every ``make validate`` from 2026-12-02 to 2026-12-05 (tiny presets, 5
    a run), never above 0. What is left shows in the self-check per context (each B is moved
    by its contexts' mean) and in the prefills (charged the decode's term at their prompt
    count), which the move is not fitted on."""
    rows = [r for r in self_check(profile, totals)["shapes"] if r["phase"] == "decode"]
    missed: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        missed[r["batch_size"]].append(r["measured_ms"] - r["predicted_ms"])
    moves = {b: float(np.mean(v)) / profile.interference for b, v in missed.items()}
    points = []
    for p in profile.points:
        if p.op == "step_overhead" and p.batch_size in moves:
            median = max(p.median_ms + moves[p.batch_size], 0.0)
            p = dataclasses.replace(p, median_ms=median,
                                    p90_ms=max(p.p90_ms + moves[p.batch_size], median))  # fmt: skip
        points.append(p)
    return dataclasses.replace(profile, points=points), moves


def self_check_line(check: dict) -> str:
    """One line for the reader: the profile's self-check (``self_check``)."""
    parts = []
    for phase in ("prefill", "decode"):
        if f"{phase}_median_pct" in check:
            worst = max((r for r in check["shapes"] if r["phase"] == phase),
                        key=lambda r: abs(r["error_pct"]))  # fmt: skip
            n = worst["tokens"]
            k = worst["batch_size"]
            at = (f"{n} token{'s' if n != 1 else ''}" + (f" in {k} prompts" if k > 1 else "")
                  if phase == "prefill"
                  else f"batch {k}, kv {worst['kv_tokens']}")  # fmt: skip
            parts.append(f"{phase} median {check[f'{phase}_median_pct']:+.1f}%, worst "
                         f"{worst['error_pct']:+.1f}% ({at})")  # fmt: skip
    return ("profile self-check (the latency model's mean iteration against the profile's own "
            "timed ones, per shape): " + "; ".join(parts))  # fmt: skip


def summarize(times_ms: list[float]) -> tuple[float, float]:
    return float(np.median(times_ms)), float(np.percentile(times_ms, 90))


class _Jittered:
    """``Profiler.record``'s samples of a jittered prefill: ``[key]`` is the list in
    ``Profiler.jittered`` of that grid key at its offset (``offset(key)``)."""

    def __init__(self, jittered: dict, offset) -> None:
        self.jittered, self.offset = jittered, offset

    def __getitem__(self, key: tuple[str, int, int, int]) -> list[float]:
        return self.jittered[(*key, self.offset(key))]


# A timed iteration over this many times its shape's median counts as this many in
# ``Profiler.interference``: beyond it, the sample is a stall (the host taking the core, a
# page fault), not the shape's speed, and a mean over the profile's 1,000-2,000 iterations
# turns one stall into a bias of every prediction: in `make validate` of 2026-12-03 14:36 a
# decode shape of tiny-qwen2-moe (batch 32, kv 16) had a mean of 21.3 ms over a median of
# about 5.5, its profile's interference came out 1.095 where the other four had 1.019-1.026,
# and its real runs ran 0.905-0.961x their predictions over their probes (the others'
# 0.930-1.050x). Slow stretches of the host within a profile (its passes 0.76x-1.25x of the
# medians) stay well under it.
STALL_RATIO = 3.0


class Profiler:
    """Runs the iterations of the grid with the runner and collects stage times per op."""

    def __init__(self, runner: ModelRunner, settings: Settings, device: torch.device,
                 probe: SpeedProbe | None = None, normalize: bool = True) -> None:  # fmt: skip
        self.runner = runner
        # the host-speed probe (profiler.probe), run at the start of every pass and after each
        # of its shapes: the profile's reference for the real runs that run it too
        # (``probe_summary``), and with ``normalize`` each shape's unit (``_visit``)
        self.probe = probe
        self.probe_times: list[tuple[int, float]] = []  # (pass, seconds) of each probe it ran
        # With a probe and ``normalize``, every sample of a shape's visit is filed divided by
        # the probe's mean time just before and just after it: in probe steps, not ms, so
        # that a shape timed while the host ran slow is not a slow shape. ``unit_ms`` (the
        # profile's mean probe) turns them back into ms where they are read (``table``,
        # ``expert_points``, ``totals_ms``). Why: one visit of a shape (its warm-up and a
        # pass's share of its repeats, some 20-100 ms) samples the host's speed of that
        # moment, which moved by a CV of 10-18% from one visit to the next (tiny-qwen2-moe,
        # 2026-12-03); a shape's median over 4 visits kept about 10.5% of it (the ratio of
        # one decode shape to another over 15 such profiles; 7% normalized), and the
        # profiles' decode steps of one sequence came out 11-20% slower against those of
        # two than the real engine ran them (tiny-qwen2-moe, tiny-olmoe, per load: `make
        # validate` 2026-12-03 12:54, iterations.csv.gz).
        self.normalize = probe is not None and normalize
        self.settings = settings
        self.clock = StageClock(device, settings.clock)
        self.gen = torch.Generator().manual_seed(settings.seed)
        # (op, batch_size, num_tokens, kv_tokens) -> stage times (ms)
        self.samples: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
        self.expert_samples: list[tuple[int, float]] = []
        # a jittered prefill's samples (``prefill``): (op, batch_size, num_tokens on the grid,
        # kv_tokens, the tokens' offset from it) -> stage times; ``table`` folds them
        self.jittered: dict[tuple[str, int, int, int, int], list[float]] = defaultdict(list)
        # the shapes (``totals``' keys) that a jittered prefill ran: each length in the passes
        # its pairs fell in, not all (``pass_speeds`` leaves them out)
        self.jittered_shapes: set[tuple[int, int, int, int]] = set()
        self.passes_done = 0
        # (batch, num_tokens, kv, sequences) -> every timed iteration's total (ms):
        # ``interference`` and ``self_check``
        self.totals: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
        self.totals_pass: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
        # each total's divisor (the probe's ms around its visit; 1.0 when not normalized)
        self.totals_unit: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
        # idle ms -> each repeat's step times (ms) after the gap: the wake-up's raw samples,
        # kept in profile.json (extra.wake_samples) so that its curve can be re-derived
        self.wake_samples: dict[int, list[list[float]]] = {}
        self.wake_runs: dict[int, list[np.ndarray]] = defaultdict(list)  # windows after a gap
        self.wake_window_steps: int | None = None  # the decode steps of a window (_wake_repeat)

    def random_ids(self, n: int) -> list[int]:
        vocab = self.runner.config.vocab_size
        return torch.randint(0, vocab, (n,), generator=self.gen).tolist()

    def prompts(self, lengths: list[int]) -> list[KVSequence]:
        return [self.runner.new_sequence(self.random_ids(n)) for n in lengths]

    def repeat(
        self, seqs: list[KVSequence], repeats: int | None = None, warmup: int | None = None
    ) -> list[tuple[float, list[StageTime]]]:
        """``repeats`` timed runs of one iteration of ``seqs`` (after ``warmup`` untimed: by
        default the settings'), rewinding the sequences after each and feeding new random
        tokens the next time: a real step feeds a token never fed before, which routes to
        other experts than the last step's. Re-fed, the same token takes the same experts,
        still in the caches: on this project's VM a decode step of one sequence ran 3-4%
        faster so (tiny-olmoe, tiny-qwen2-moe, tiny-mixtral; no difference from 4 sequences
        on). ``repeats``: by default the settings'."""
        repeats = self.settings.repeats if repeats is None else repeats
        warmup = self.settings.warmup if warmup is None else warmup
        marks = [(len(s.token_ids), s.num_cached) for s in seqs]
        runs = []
        for i in range(warmup + repeats):
            run = self.clock.iteration(self.runner, seqs)
            if i >= warmup:
                runs.append(run)
            for s, (n, c) in zip(seqs, marks, strict=True):
                s.truncate(n, c)
                s.token_ids[c:] = self.random_ids(n - c)
        return runs

    def record(self, runs: list, num_tokens: int, batch: int = 0, kv: int = 0,
               prompts: int = 1, jitter: int = 0) -> None:  # fmt: skip
        """File a shape's stage times under their ops: a prefill of ``num_tokens`` (batch 0)
        in ``prompts`` equal prompts (attention only when one prompt), or a decode ``batch`` with
        ``kv`` cached tokens each (which also gives lm_head and step_overhead). ``jitter``: a
        prefill's prompts are each that many tokens off their grid length (``prefill``): its
        samples are filed under the grid's lengths with the offset (``jittered``), which
        ``table`` folds onto them."""
        grid = num_tokens - jitter * prompts  # a prefill's tokens on the grid
        attention = ("attn_decode", batch, 0, kv) if batch else ("attn_prefill", 0, grid, 0)
        ops = {"router": ("router", 0, grid, 0)}
        # a prefill's once-per-iteration stages by its prompt count (one prompt: 0)
        count = prompts if prompts >= 2 else 0
        if batch:
            ops["lm_head"] = ("lm_head", batch, 0, 0)
            ops["prepare"] = ("prepare_decode", batch, 0, 0)
        else:
            ops["lm_head"] = ("lm_head_prefill", count, grid, 0)
            ops["prepare"] = ("prepare_prefill", count, grid, 0)
        if batch or prompts == 1:  # a prefill batch's attention stage runs every prompt's
            ops["attention"] = attention
        # a prefill's attention stage, split (attn_prefill_outer, attn_prefill_first, _next)
        outer = ("attn_prefill_outer", count, grid, 0)
        first_call = ("attn_prefill_first", 0, grid // prompts, 0)
        after_first = ("attn_prefill_next", 0, grid // prompts, 0)
        if jitter:  # whole-iteration ops are off by every prompt's offset, a call by one's
            offsets = {first_call: jitter, after_first: jitter}
            samples = _Jittered(self.jittered, lambda key: offsets.get(key, jitter * prompts))
        else:
            samples = self.samples
        counts: dict[tuple, int] = defaultdict(int)  # stages of each op in one iteration
        filed: dict[tuple, int] = defaultdict(int)  # samples of each op filed by this call
        expert_ms = []  # per run: the experts' summed time
        shape = (batch, num_tokens, kv, batch or prompts)
        if jitter:
            self.jittered_shapes.add(shape)
        self.totals[shape] += [total for total, _ in runs]
        self.totals_pass[shape] += [self.passes_done] * len(runs)
        self.totals_unit[shape] += [1.0] * len(runs)
        for _, stages in runs:
            experts, routers = 0.0, []
            for st in stages:
                stage = st.ref.stage
                if stage == "expert" and st.tokens:
                    self.expert_samples.append((st.tokens, st.ms))
                    experts += st.ms
                elif stage == "router":
                    routers.append(st.ms)
                elif stage in ops:
                    samples[ops[stage]].append(st.ms)
                    filed[ops[stage]] += 1
                if st.calls:  # a prefill's attention stage, its prompts' calls timed
                    samples[outer].append(st.ms - sum(st.calls))
                    if len(st.calls) > 1:
                        samples[first_call].append(st.calls[0])
                        samples[after_first].append(float(np.mean(st.calls[1:])))
            expert_ms.append(experts)
            if routers:
                # one sample per iteration, the mean over its layers: a dense layer (DeepSeek-V3's
                # first) runs its whole MLP in its router stage, which a median over all
                # layers' stages would drop, and the latency model charges router x layers
                samples[ops["router"]].append(float(np.mean(routers)))
                filed[ops["router"]] += 1
                counts[ops["router"]] = len(routers)
        for op, n in filed.items():
            counts.setdefault(op, n // len(runs))
        if batch:
            # mean iteration minus the stage medians the latency model will add up (the prepare
            # stage is not one of them: it is part of step_overhead; prepare_decode, filed
            # beside it, lets a prefill's plan swap it for its own)
            stage_ms = sum(counts[op] * summarize(self.samples[op][-n:])[0]
                           for op, n in filed.items() if op[0] != "prepare_decode")  # fmt: skip
            mean_total = float(np.mean([total for total, _ in runs]))
            residual = mean_total - stage_ms - float(np.median(expert_ms))
            self.samples[("step_overhead", batch, 0, 0)].append(max(residual, 0.0))

    def prefill(self, n: int, repeats: int | None = None, prompts: int = 1) -> None:
        """A prefill of ``prompts`` prompts of n tokens each, ``warmup`` untimed and ``repeats``
        timed, as a run's prefills run: new sequences every time (a new cache written), their
        prompts alternately d = n // PREFILL_JITTER tokens shorter and longer than n (so that
        no two in a row have the same lengths), the timed ones in pairs (``repeats`` rounded
        up: each pair one of each), their samples filed under n with the offset (``record``).
        A profile of one repeat a shape (``Settings.repeats``) times every prefill at n: one
        side alone has no midpoint."""
        repeats = self.settings.repeats if repeats is None else repeats
        d = n // PREFILL_JITTER if self.settings.repeats >= 2 else 0
        warmup = self.settings.warmup
        for i in range(warmup + repeats + (repeats % 2 if d else 0)):  # timed in pairs
            offset = -d if (i - warmup) % 2 == 0 else d  # the warm-up's last: longer
            run = self.clock.iteration(self.runner, self.prompts([n + offset] * prompts))
            if i >= self.settings.warmup:
                self.record([run], num_tokens=(n + offset) * prompts, prompts=prompts,
                            jitter=offset)  # fmt: skip

    def chunk(self, n: int, kv: int, repeats: int | None = None) -> None:
        """A chunk of n tokens over kv cached: only its attention is filed (``attn_chunk``)."""
        seqs = self.prompts([kv + n])
        self.runner.run(self.runner.begin(seqs, [kv]))  # the prefix: kv cached, n to feed
        for _, stages in self.repeat(seqs, repeats):
            self.samples[("attn_chunk", 0, n, kv)] += [st.ms for st in stages
                                                       if st.ref.stage == "attention"]  # fmt: skip

    def decode(self, batch: int, kv: int, repeats: int | None = None) -> None:
        # Contexts spread from kv/2 up to kv: in a real decode batch they differ, and the runner
        # then pads them to the longest (the latency model reads attn_decode at the max), a
        # path that equal lengths would skip.
        # Their prefill, then decode_warmup untimed steps (DECODE_WARMUP), then the timed ones.
        seqs = self.prompts(decode_lengths(batch, kv))
        self.runner.run(self.runner.begin(seqs))  # the prefill: kv cached, one token to feed
        runs = self.repeat(seqs, repeats, warmup=self.settings.decode_warmup)
        self.record(runs, num_tokens=batch, batch=batch, kv=kv)
        self.bind(seqs, repeats)

    def bind(self, seqs: list[KVSequence], repeats: int | None = None) -> None:
        """``attn_decode_bind``: steps of a new decode batch, made as a run makes them: before
        each, one sequence (in turn) leaves, and a new one of its length joins, just prefilled.
        Only attention stages are filed: binding happens there (and costs more when the last
        batch's buffer is still held than when it is freed: the leaver is dropped, as a
        finished sequence is: ``seqs`` is changed in place, its caller must hold no other
        reference to the sequences it replaces)."""
        key = ("attn_decode_bind", len(seqs), 0, max(s.num_cached for s in seqs))
        repeats = self.settings.repeats if repeats is None else repeats
        for i in range(self.settings.warmup + repeats):
            j = i % len(seqs)
            seqs[j] = self.prompts([seqs[j].num_cached])[0]
            self.runner.run(self.runner.begin([seqs[j]]))  # its prefill: one token to feed
            marks = [(len(s.token_ids), s.num_cached) for s in seqs]
            _, stages = self.clock.iteration(self.runner, seqs)
            if i >= self.settings.warmup:
                self.samples[key] += [st.ms for st in stages if st.ref.stage == "attention"]
            for s, (n, c) in zip(seqs, marks, strict=True):
                s.truncate(n, c)

    def warm_up(self) -> None:
        """One prefill of the largest prefill shape (the longest prompt, or the largest batch of
        them) and one decode step of the largest batch before
        anything is timed: the first calls of a new GEMM shape pick (on CUDA, load) kernels,
        and the per-shape warm-up alone would leave that to the first shape of each size."""
        s = self.settings
        prompts = max(s.prefill_batches, default=1)  # the largest prefill: one or a batch
        self.runner.run(self.runner.begin(self.prompts([max(s.prefill_tokens)] * prompts)))
        seqs = self.prompts([min(s.decode_kv)] * max(s.decode_batch))
        for _ in range(2):  # the prefill, then a decode step
            self.runner.run(self.runner.begin(seqs))

    def points(self, progress: bool = True) -> list[OpPoint]:
        """Every pass of the grid, then the wake-up: the profile's points."""
        bar = tqdm(total=self.settings.num_iterations * self.settings.passes, desc="profiling",
                   unit="shape", disable=not progress)  # fmt: skip
        while self.passes_done < self.settings.passes:
            self.grid_pass(bar)
        bar.close()
        return self.table() + self.wake_points()

    def grid_pass(self, bar: tqdm | None = None) -> None:
        """The next pass over the grid: every shape, with that pass's share of the repeats (a
        shape's samples spread over the passes, so that a stretch when the machine ran slow,
        seconds long on a shared machine, hits a few of each shape's samples, not all of some
        shapes': the medians then hold). Passes may be run with other work between them (the
        validation runs its real replays there)."""
        s = self.settings
        if self.passes_done >= s.passes:
            raise RuntimeError(f"all {s.passes} passes are done")
        if s.warmup:
            self.warm_up()
        before = self._probe() if self.probe is not None else None
        for run in self.pass_shapes():
            if before is None:
                run()
            else:
                before = self._visit(run, before)
            if bar is not None:
                bar.update()
        if s.wake_idle_ms:
            for _ in range(s.pass_wake_repeats(self.passes_done)):
                self._wake_repeat()
        self.passes_done += 1

    def _probe(self) -> float:
        seconds = self.probe()
        self.probe_times.append((self.passes_done, seconds))
        return seconds

    def _visit(self, run, before: float) -> float:
        """``run`` (a shape's visit), then the probe; with ``normalize``, what the visit filed
        divided by the probe's mean time around it (``before``, and the probe after it,
        which is returned: the next visit's ``before``)."""
        samples = {key: len(v) for key, v in self.samples.items()}
        jittered = {key: len(v) for key, v in self.jittered.items()}
        totals = {key: len(v) for key, v in self.totals.items()}
        experts = len(self.expert_samples)
        run()
        after = self._probe()
        if self.normalize:
            unit = 1e3 * (before + after) / 2  # ms per probe step around the visit
            for filed, counts in ((self.samples, samples), (self.jittered, jittered)):
                for key, v in filed.items():
                    v[counts.get(key, 0) :] = [t / unit for t in v[counts.get(key, 0) :]]
            for key, v in self.totals.items():
                k = totals.get(key, 0)
                v[k:] = [t / unit for t in v[k:]]
                self.totals_unit[key][k:] = [unit] * (len(v) - k)
            self.expert_samples[experts:] = [(n, t / unit) for n, t in
                                             self.expert_samples[experts:]]  # fmt: skip
        return after

    @property
    def unit_ms(self) -> float:
        """What a filed sample is in ms: the profile's mean probe (ms per probe step) when the
        samples are in probe steps (``normalize``), else 1."""
        if not self.normalize or not self.probe_times:
            return 1.0
        return 1e3 * float(np.mean([t for _, t in self.probe_times]))

    def totals_ms(self) -> dict[tuple[int, int, int, int], list[float]]:
        """``totals`` in ms (``unit_ms``): what ``self_check`` compares the profile with."""
        unit = self.unit_ms
        return {key: [t * unit for t in v] for key, v in self.totals.items()}

    def pass_shapes(self) -> list:
        """The next pass's shapes (``Settings.num_iterations`` of them), each a call that times
        its share of the repeats: in the grid's order (every prefill shape, then every decode
        shape), or with ``shuffle`` in a random order, another each pass. In the grid's order
        the prefill shapes of a pass run in one stretch of seconds and the decode shapes in the
        next, and this host's speed moves by that much: the prefill shapes' mean time over
        their medians ran 0.87x-1.08x the decode shapes' from one pass to the next
        (tiny-qwen3-moe and tiny-qwen2-moe, 4 passes each, 2026-12-03), which a profile of a
        few passes keeps as a bias of one phase against the other."""
        s = self.settings
        repeats = s.pass_repeats(self.passes_done)
        jittered = s.pass_prefill_repeats(self.passes_done)  # a jittered prefill's, in pairs

        def prefill_repeats(n: int) -> int:
            return jittered if n // PREFILL_JITTER else repeats

        pairs = set(s.prefill_pairs_tokens)
        shapes = []
        for n in s.prefill_tokens:
            shapes.append(functools.partial(self.prefill, n, prefill_repeats(n)))
            if n in pairs:
                shapes.append(functools.partial(self.prefill, n, prefill_repeats(n), prompts=2))
            shapes += [functools.partial(self.chunk, n, kv, repeats) for kv in s.chunk_kv]
        longest = max(s.prefill_tokens)
        shapes += [functools.partial(self.prefill, longest, prefill_repeats(longest), prompts=k)
                   for k in s.prefill_batches]  # fmt: skip
        shapes += [functools.partial(self.prefill, longest // k,
                                     prefill_repeats(longest // k), prompts=k)
                   for k in s.prompt_counts]  # fmt: skip
        shapes += [functools.partial(self.decode, b, kv, repeats)
                   for kv in s.decode_kv for b in s.decode_batch]  # fmt: skip
        if s.shuffle:
            random.Random(f"{s.seed}/pass {self.passes_done}").shuffle(shapes)
        return shapes

    def _run_s(self, seqs: list[KVSequence]) -> float:
        """Seconds of one iteration of ``seqs`` on the profile's clock (on CUDA, wall: the
        runner returns the tokens, so the device has finished)."""
        clock = time.perf_counter if self.clock.cuda else self.clock.clock
        start = clock()
        self.runner.run(self.runner.begin(seqs))
        return clock() - start

    def _steps_s(self, seqs: list[KVSequence], steps: int) -> np.ndarray:
        """Seconds of each of ``steps`` decode steps of ``seqs`` (``_run_s``), rewound after
        each and fed new random tokens (as ``repeat``), so that they are alike: fed the token
        the last one chose, a random-weight model soon repeats a few tokens, whose experts
        stay in the caches, and a wake-up window's second half ran faster than its first
        steps for that alone."""
        marks = [(len(s.token_ids), s.num_cached) for s in seqs]
        times = []
        for _ in range(steps):
            times.append(self._run_s(seqs))
            for s, (n, c) in zip(seqs, marks, strict=True):
                s.truncate(n, c)
                s.token_ids[c:] = self.random_ids(n - c)
        return np.array(times)

    def _wake_window(self, steps: int) -> np.ndarray:
        """One wake-up window, as a run's work after an idle gap: a prefill of a new prompt
        of ``wake_prompt_tokens``, ``steps`` decode steps of it (``_steps_s``), then a
        prefill of another such prompt, warm by then. Milliseconds of each:
        [prefill, step 1, ..., step n, prefill]."""
        first, last = self.prompts([self.settings.wake_prompt_tokens] * 2)
        prefill = self._run_s([first])  # one token left to feed
        return 1e3 * np.array([prefill, *self._steps_s([first], steps), self._run_s([last])])

    def _wake_repeat(self) -> None:
        """One repeat of the wake-up (``wake_runs``): for each idle time in turn (interleaved:
        drifts hit them alike), a window untimed (busy, and past the last one's slow-down),
        the device idle that long, a window timed. The first call sizes the windows: decode
        steps that take ``WAKE_WINDOW_MS`` warm."""
        s = self.settings
        if self.wake_window_steps is None:
            seqs = self.prompts([s.wake_prompt_tokens])
            self.runner.run(self.runner.begin(seqs))  # the prefill: one token left to feed
            warm_ms = 1e3 * float(np.median(self._steps_s(seqs, WAKE_STEPS_RANGE[0] * 4)))
            self.wake_window_steps = wake_steps(warm_ms)
        for idle_ms in s.wake_idle_ms:
            self._wake_window(self.wake_window_steps)
            wait_idle(idle_ms / 1e3, s.wake_wait)
            self.wake_runs[idle_ms].append(self._wake_window(self.wake_window_steps))

    def wake_points(self, top_up: bool = True) -> list[OpPoint]:
        """``wake_up`` at each idle time (module docstring), from the repeats the passes ran
        and those still to run (all of them before any pass); none when wake.idle_ms is
        empty. ``top_up`` False: from the repeats the passes ran, where they ran one (a
        validation stopped by its time budget: ``realrun.validate.RunBudget``)."""
        s = self.settings
        if not s.wake_idle_ms:
            return []
        done = min((len(self.wake_runs[idle_ms]) for idle_ms in s.wake_idle_ms), default=0)
        for _ in range(s.wake_repeats - done if top_up or not done else 0):
            self._wake_repeat()
        points = [OpPoint("wake_up", idle_ms=0)]
        for idle_ms, windows in sorted(self.wake_runs.items()):
            rows = np.array(windows)
            points += wake_curve(idle_ms, rows[:, 1:-1], rows[:, [0, -1]])
            self.wake_samples[idle_ms] = [[round(float(t), 4) for t in row] for row in rows]
        return points

    def interference(self) -> float:
        """``Profile.interference``: the mean over every timed prefill and decode iteration of
        its total over the median total of its shape's repeats (1.0 before any), each ratio
        counted as at most ``STALL_RATIO``."""
        ratios = [min(t / m, STALL_RATIO) for totals in self.totals.values()
                  if (m := float(np.median(totals))) > 0 for t in totals]  # fmt: skip
        return float(np.mean(ratios)) if ratios else 1.0

    def probe_summary(self) -> dict | None:
        """The probe's times during the passes (``extra.probe``): ``mean_ms`` (the reference
        that the real runs' probes are read against), per pass ``pass_mean_ms``, ``count``,
        ``every_ms``; None without a probe or before any ran."""
        if self.probe is None or not self.probe_times:
            return None
        times = [t for _, t in self.probe_times]
        by_pass: dict[int, list[float]] = defaultdict(list)
        for k, t in self.probe_times:
            by_pass[k].append(t)
        return {
            "mean_ms": round(1e3 * float(np.mean(times)), 5),
            "pass_mean_ms": [round(1e3 * float(np.mean(by_pass[k])), 5) for k in sorted(by_pass)],
            "count": len(times),
            "placement": "each pass's start and after each shape",
            "normalized": self.normalize,  # the shapes' samples divided by the probe around them
            **self.probe.identity(),
        }

    def pass_speeds(self) -> list[float]:
        """Per pass of the grid, ``interference`` of its timed iterations alone: the mean of
        each one's total over the median of its shape's repeats in every pass. How fast the
        machine ran pass by pass against the whole profile (1.1: 10% slower); passes with
        other work between them (the validation's rounds of real runs) show its drift. The
        jittered prefills' shapes are left out: their pairs fall in some passes only (9 of 12
        in the validation's profile), so they have no median of every pass to be read against."""
        ratios: dict[int, list[float]] = defaultdict(list)
        for key, stored in self.totals.items():  # as timed (not in probe steps)
            if key in self.jittered_shapes:
                continue
            totals = [t * u for t, u in zip(stored, self.totals_unit[key], strict=True)]
            m = float(np.median(totals))
            if m > 0:
                for t, k in zip(totals, self.totals_pass[key], strict=True):
                    ratios[k].append(t / m)
        return [float(np.mean(ratios[k])) for k in sorted(ratios)]

    def folded(self) -> dict[tuple[str, int, int, int], list[float]]:
        """``samples`` with the jittered prefills' folded onto their grid lengths: where a
        shape was timed both shorter and longer, each side's samples are moved by the
        difference between its median and the mean of the two sides' medians (the point at n
        is then the midpoint of those at n - d and n + d: exact where the op is linear in the
        tokens over that span, and the spread of the samples is each side's own); a shape
        timed on one side only keeps its samples at the length it ran."""
        samples = defaultdict(list, {key: list(v) for key, v in self.samples.items()})
        sides: dict[tuple[str, int, int, int], dict[int, list[float]]] = defaultdict(dict)
        for (op, batch, tokens, kv, offset), times in self.jittered.items():
            if times:
                sides[(op, batch, tokens, kv)][offset] = times
        for (op, batch, tokens, kv), by_offset in sides.items():
            if len(by_offset) == 2 and sum(by_offset) == 0:
                medians = {o: float(np.median(t)) for o, t in by_offset.items()}
                mid = sum(medians.values()) / 2
                for o, times in by_offset.items():
                    samples[(op, batch, tokens, kv)] += [t - medians[o] + mid for t in times]
            else:
                for o, times in by_offset.items():
                    samples[(op, batch, tokens + o, kv)] += times
        return samples

    def table(self) -> list[OpPoint]:
        samples = self.folded()
        if self.settings.chunk_kv:  # a chunk over no prefix is a prefill
            for n in self.settings.prefill_tokens:
                samples[("attn_chunk", 0, n, 0)] = list(samples[("attn_prefill", 0, n, 0)])
        pts, unit = [], self.unit_ms
        for (op, batch, tokens, kv), times in sorted(samples.items()):
            if op in SPLIT_OPS and not self.settings.prefill_pairs:
                # without the pairs, attn_prefill_first and _next have only the longest
                # prompt's point (from batched prefills), which a curve would hold for every
                # length, and none at all without them: no split (per_prompt sums
                # attn_prefill)
                continue
            med, p90 = summarize(times)
            pts.append(OpPoint(op, batch, tokens, kv, median_ms=med * unit, p90_ms=p90 * unit))
        return pts + self.expert_points()

    def expert_points(self) -> list[OpPoint]:
        """One point per ``grid.expert_tokens`` bin (bins split halfway, on a log scale,
        between grid values): the median queue size and the median time of its samples."""
        grid = self.settings.expert_tokens
        edges = [math.sqrt(a * b) for a, b in zip(grid, grid[1:], strict=False)]
        bins: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for n, ms in self.expert_samples:
            bins[int(np.searchsorted(edges, n))].append((n, ms))
        pts, unit = [], self.unit_ms
        for i in sorted(bins):
            ns, ms = zip(*bins[i], strict=True)
            med, p90 = summarize(list(ms))
            pts.append(OpPoint("expert", num_tokens=round(float(np.median(ns))),
                               median_ms=med * unit, p90_ms=p90 * unit))  # fmt: skip
        return pts

    def routing_stats(
        self, prompts: list[list[int]]
    ) -> tuple[list[list[float]], list[list[list[int]]]]:
        """From real prefills of ``prompts``: (``expert_load``, ``prompt_experts``). The load is
        the fraction of each layer's token-to-expert assignments per expert (a dense layer,
        which routes nothing, gets a uniform row); the prompt experts, per prompt and layer,
        the expert ids each token picked, token by token (empty for a dense layer)."""
        r = self.runner
        counts = np.zeros((r.num_layers, r.num_experts))
        traces = []
        for p in prompts:
            trace: list[list[int]] = [[] for _ in range(r.num_layers)]
            state = r.begin([r.new_sequence(p)])
            while not state.done:
                ref = r.step(state)
                if ref.stage == "router" and state.routing is not None:
                    routing = state.routing
                    counts[ref.layer] += routing.counts
                    # queue entries are sorted by expert: each token's ids, in expert order
                    experts = np.repeat(np.arange(r.num_experts), routing.counts)
                    tokens = routing.token_idx.cpu().numpy()
                    trace[ref.layer] = experts[np.argsort(tokens, kind="stable")].tolist()
            traces.append(trace)
        counts[counts.sum(axis=1) == 0] = 1.0
        return (counts / counts.sum(axis=1, keepdims=True)).tolist(), traces

    def memory(self) -> Memory:
        """KV bytes per token and activation bytes a suspended iteration holds per token,
        measured on a real prefill; KV capacity from the device's free memory."""
        n = 64
        seq = self.prompts([n])[0]
        after_router = self.runner.flat_index(min(self.runner.moe_layers), Stage.ROUTER) + 1
        state = self.runner.run(self.runner.begin([seq]), until=after_router)
        held = state.held_bytes()
        self.runner.run(state)
        kv_per_token = max(1, seq.kv_bytes() // n)
        capacity = int(available_bytes(self.runner.device) * KV_MEMORY_SHARE) // kv_per_token
        return Memory(max(1, capacity), kv_per_token, max(1, held // n))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def profile_model(
    model: torch.nn.Module,
    info: ModelInfo,
    settings: Settings,
    name: str,
    prompts: list[list[int]] | None = None,
    progress: bool = True,
) -> Profile:
    """Profile an already built model. ``prompts`` feed the routing statistics (default:
    ``routing_prompts`` random prompts)."""
    prof = Profiler(ModelRunner(model), settings, info.device)
    return build_profile(prof, info, name, prof.points(progress), prompts)


def build_profile(
    prof: Profiler,
    info: ModelInfo,
    name: str,
    points: list[OpPoint],
    prompts: list[list[int]] | None = None,
) -> Profile:
    """The Profile of ``points`` measured by ``prof`` (all of its passes and the wake-up:
    ``prof.points()``; or, for a first estimate, the passes so far: ``prof.table()``)."""
    settings = prof.settings
    if prompts is None:
        prompts = [prof.random_ids(settings.routing_prompt_tokens)
                   for _ in range(settings.routing_prompts)]  # fmt: skip
    load, prompt_experts = prof.routing_stats(prompts)
    device = device_name(info.device)
    timing = "CUDA events" if info.device.type == "cuda" else f"{settings.clock} clock"
    profile = Profile(
        name=name,
        source="measured",
        description=f"{info.name} ({info.num_params / 1e6:.1f}M parameters, {info.source}) "
        f"on {device}, stages timed inside real iterations of the stepped runner",
        calibration=f"profiler.measure: median of {settings.repeats} iterations per shape "
        f"in {prof.passes_done} passes, each after {settings.warmup} warm-up iterations "
        f"({settings.decode_warmup} untimed steps before a decode shape's"
        + (
            f"; a prefill of n tokens timed in pairs, at n -/+ n // {PREFILL_JITTER}"
            if settings.repeats >= 2
            else ""
        )
        + f"), {timing}"
        + (
            ", each shape's samples divided by the host-speed probe around them (in units of "
            "the profile's mean probe)"
            if prof.normalize
            else ""
        ),
        device=device,
        dtype=str(info.dtype).removeprefix("torch."),
        model=info.shape,
        memory=prof.memory(),
        points=points,
        expert_load=load,
        prompt_experts=prompt_experts,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        created=datetime.date.today().isoformat(),
        interference=prof.interference(),
        extra={
            "self_check": None,  # below: it needs the profile
            "pass_speeds": [round(x, 4) for x in prof.pass_speeds()],
            "wake_samples": {str(k): v for k, v in prof.wake_samples.items()},
            "settings": asdict(settings),
            "threads": torch.get_num_threads(),
            "device_type": info.device.type,
            "model_source": info.source,
        },
    )
    if (probe := prof.probe_summary()) is not None:
        profile.extra["probe"] = probe
    totals = prof.totals_ms()
    profile, moves = fit_step_overhead(profile, totals)
    profile.extra["step_overhead_fit_ms"] = {str(b): round(m, 5) for b, m in sorted(moves.items())}
    profile.extra["self_check"] = self_check(profile, totals)
    return profile


def run(cfg: Any, progress: bool = True) -> tuple[Profile, Path]:
    """Build the configured model, profile it and save the profile (the ``qllm-profile`` app;
    ``cfg`` is conf/profiler.yaml composed). Returns the profile and its directory."""
    settings = Settings.from_config(cfg)
    threads = cfg.get("threads")
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise SettingsError(f"threads={threads}: an integer >= 1, or null (torch's default)")
        torch.set_num_threads(threads)
    if settings.clock == "process" and torch.get_num_threads() > 1:
        if resolve_device(str(cfg["device"])).type == "cpu":  # CUDA times with events
            raise SettingsError(
                f"clock=process with {torch.get_num_threads()} torch threads (threads="
                f"{threads}): process time sums every thread's CPU time, not an iteration's "
                "latency; set threads=1, or clock=wall"
            )
    model_cfg = cfg["model"]
    if isinstance(model_cfg, DictConfig):  # config overrides reach transformers as plain values
        model_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    out = cfg["output"]
    if out.get("name"):  # refused before the model is built
        check_output_name(out["name"], Path(out["dir"]))
    model, info = build_model(model_cfg, device=cfg["device"], dtype=cfg["dtype"],
                              seed=settings.seed)  # fmt: skip
    name = out.get("name") or f"{info.name}-{info.device.type}"
    check_output_name(name, Path(out["dir"]))
    prompts = texts_to_prompts(model_cfg, cfg["routing"].get("text_file"))
    profile = profile_model(model, info, settings, name, prompts, progress)
    return profile, profile.save(Path(out["dir"]) / name)


def check_output_name(name: str, out_dir: Path) -> None:
    """Refuse to write a profile where ``profile=<name>`` would not read it: under the measured
    profiles' directory, with the name of a built-in profile (which is looked up first)."""
    from sim import profiles

    if profiles.builtin(name) and out_dir.resolve() == profiles.MEASURED_DIR.resolve():
        raise SettingsError(
            f"output.name={name}: a built-in profile has this name, and profile={name} would "
            "read that one; choose another output.name"
        )


def texts_to_prompts(model_cfg: Any, text_file: str | None) -> list[list[int]] | None:
    """Routing prompts from a text file (one prompt per non-empty line), tokenized by the
    checkpoint's own tokenizer; None (random ids) without a file."""
    if not text_file:
        return None
    from transformers import AutoTokenizer

    path = model_cfg.get("path")
    if not path:
        raise SettingsError("routing.text_file needs model.path (a checkpoint with a tokenizer)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        lines = [ln for ln in Path(text_file).read_text().splitlines() if ln.strip()]
    except (OSError, ValueError) as e:  # ValueError: a checkpoint without a tokenizer
        raise SettingsError(f"routing.text_file={text_file}: {str(e).splitlines()[0]}") from None
    if not lines:
        raise SettingsError(f"routing.text_file={text_file} has no text")
    return [tokenizer(ln)["input_ids"] for ln in lines]
