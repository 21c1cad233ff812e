"""The profile format: the one module that owns it (torch-free, read by the simulator).

A profile is a directory with two files:

``profile.json``: metadata::

    {"schema_version": 3, "name": str, "source": "measured" | "analytic" | "calibrated",
     "description": str, "calibration": str,          # how the numbers were obtained
     "device": str, "dtype": str, "torch_version": str | null,
     "transformers_version": str | null, "created": "YYYY-MM-DD",
     "model": {"name", "num_layers", "num_experts", "top_k", "hidden_size",
               "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size"},
     "memory": {"kv_capacity_tokens", "kv_bytes_per_token", "activation_bytes_per_token",
                "swap_bytes_per_s"},                  # absent: SWAP_BYTES_PER_S
     "routing": {"expert_load": [[float] * num_experts] * num_layers | null,
                 "prompt_experts": [[str] * num_layers] | absent},
     "prefill_attention": "per_prompt" | "batched",     # absent: "per_prompt"
     "interference": float,                             # absent: 1.0 (Profile.interference)
     "extra": {...},                                    # free-form: settings, self-check
     "spread": {"median_factor", "worst_factor", "worst", "threshold", "noisy"}}  # measured

A key not named here (a misspelt one would read as its default) is refused on load.

``prefill_attention`` says how the modelled engine runs a prefill batch's attention:
``per_prompt`` (one call per prompt, as realrun's runner does: the batch pays the sum of
``attn_prefill`` over its prompts) or ``batched`` (one call over the whole batch, as TGI and
vLLM do: the batch pays ``attn_prefill_batch`` once).

``expert_load[l][e]`` is the fraction of layer l's token-to-expert assignments that expert e
received (each row sums to 1); null means uniform routing.

``prompt_experts`` (optional): the experts every token of each measured prompt picked, per
layer, token by token (token t's top_k ids at ``[t * top_k : (t + 1) * top_k]``; in the file
one string of space-separated ids per layer, empty for a layer that routes nothing, such as
DeepSeek-V3's dense first layers). The tokens of one
prompt do not route independently: in the tiny presets' prefills of 16 random tokens, 5.3-6.9
experts of 8 per layer received a token, where independent tokens would reach 7.7-7.9. The
simulator routes a prefill's tokens as a window of a measured prompt (``sim.latency.
RoutingModel``); without this field, independently.

``spread`` (measured profiles only: the others have no repeats) summarizes how much the
repeats behind the points scatter, written for the reader and recomputed from ops.csv on load:
``p90_ms / median_ms`` of each point of the ops that repeat one shape (``REPEATED_OPS``), its
median over those points, and the worst point. A worst factor above ``NOISY_SPREAD`` flags a
profile measured while something else used the machine (``noisy``); qllm-profile and every
loader warn about it in one line.

``points`` (written by ``Profile.save`` since 2026-12-04; hand-made profiles may leave it out):
how many rows ops.csv holds. A file that holds another count, or whose last row has no line
end, is refused: cut short (ops.csv is sorted by op, so a cut took the wake-up's rows first
and loaded as a profile without one), not a smaller profile. ``save`` writes each file whole
and renames it over the old one.

``ops.csv``: one row per measured point, times in milliseconds for ONE layer (the executor
multiplies per-layer ops by the number of layers)::

    op,batch_size,num_tokens,kv_tokens,median_ms,p90_ms,idle_ms,busy_ms

(``idle_ms`` came with schema version 2, ``busy_ms`` with 3; an older file has no such column
and reads as 0.)

========================  =============================  ==================================
op                        key columns (others are 0)     what was timed
========================  =============================  ==================================
``attn_prefill``          num_tokens                     one sequence's prefill through a
                                                         layer's norm + attention (n tokens,
                                                         empty cache)
``attn_decode``           batch_size, kv_tokens          a decode batch through a layer's
                                                         norm + attention, every sequence
                                                         with kv_tokens cached (the executor
                                                         pads a batch to its longest context,
                                                         so the model reads it at the max)
``attn_decode_bind``      batch_size, kv_tokens          optional: ``attn_decode`` in the
                                                         first step of a new decode batch,
                                                         which copies every sequence's cache
                                                         into the batch's padded buffer
                                                         (profiler.ops' ``_PaddedKV``); a
                                                         step of the same batch reuses it;
                                                         absent: binding is free
``router``                num_tokens                     post-attention norm + gate + top-k
                                                         + gather into per-expert queues
``expert``                num_tokens                     one expert's FFN on n tokens (the
                                                         weighted scatter-add of all experts
                                                         runs with the next attention or
                                                         lm_head: profiler.ops' combine);
                                                         n = 0 (optional): the stage of an
                                                         expert that received no token
                                                         (absent: 0)
``lm_head``               batch_size                     final norm + lm_head + greedy sampling
                                                         of one token per sequence
``step_overhead``         batch_size                     per-iteration framework cost:
                                                         embeddings, input preparation, Python
``prepare_decode``        batch_size                     optional: the prepare stage of a
                                                         decode step (embeddings, positions,
                                                         masks), part of ``step_overhead``
``prepare_prefill``       batch_size, num_tokens         optional: the prepare stage of a
                                                         prefill of num_tokens in all, in
                                                         batch_size prompts (0: one prompt,
                                                         or, in a profile before 2026-12-05,
                                                         any number: pooled)
``lm_head_prefill``       batch_size, num_tokens         optional: the lm_head stage of a
                                                         prefill of num_tokens in all (the
                                                         last layer's combine over all of
                                                         them, then ``lm_head``'s work), in
                                                         batch_size prompts as above. The
                                                         three together or none: a prefill or
                                                         mixed iteration of k sequences, N
                                                         new tokens, is charged
                                                         step_overhead(k) -
                                                         prepare_decode(k) +
                                                         prepare_prefill(N) and
                                                         lm_head_prefill(N) at its prompt
                                                         count (``sim.latency.PromptCurve``);
                                                         absent: step_overhead(k) and
                                                         lm_head(k)
``engine_host``           batch_size                     optional: the serving engine's host
                                                         time per iteration outside the
                                                         model and the admissions (the
                                                         scheduler's selection and
                                                         bookkeeping, starting the
                                                         iteration), measured on the real
                                                         engine (``qllm-validate``); charged
                                                         with ``step_overhead``; absent: 0
``engine_admit``          batch_size                     optional: the serving engine's host
                                                         time to admit batch_size requests
                                                         that arrived (queueing each, its
                                                         KV cache), a line through 0 fitted
                                                         on the real engine
                                                         (``qllm-validate``); the simulator
                                                         charges it before the next batch
                                                         runs; absent: 0
``attn_chunk``            num_tokens, kv_tokens          optional: one sequence's prefill
                                                         chunk of num_tokens over kv_tokens
                                                         already cached (chunked prefill),
                                                         through a layer's norm + attention;
                                                         kv_tokens = 0 is ``attn_prefill``;
                                                         absent: a chunk costs as a prefill
                                                         of its own tokens
``attn_prefill_outer``    batch_size, num_tokens         optional: the part of a prefill's
                                                         attention stage outside its prompts'
                                                         self-attention calls, num_tokens in
                                                         all (the previous layer's combine,
                                                         the input norm, joining the calls'
                                                         outputs, the residual): it runs once
                                                         per iteration, not per prompt; in
                                                         batch_size prompts as
                                                         ``prepare_prefill``
``attn_prefill_first``    num_tokens                     optional: the first
                                                         self-attention call of a prefill of
                                                         several prompts, for a first prompt
                                                         of num_tokens (slicing included):
                                                         it runs longer than one prompt's
                                                         call alone (``attn_prefill`` -
                                                         ``attn_prefill_outer``). Needs both
                                                         split ops below
``attn_prefill_next``     num_tokens                     optional: what a prompt of
                                                         num_tokens adds to a prefill's
                                                         attention stage when it is not the
                                                         batch's first: its self-attention
                                                         call, from the end of the one before
                                                         (the slicing included), on weights
                                                         the first call left warm. With
                                                         ``attn_prefill_outer``: a per-prompt
                                                         batch of prompts n_1..n_k, N tokens,
                                                         costs first(n_1) + next(n_2) + ... +
                                                         next(n_k) + outer(N) (a profile
                                                         without ``attn_prefill_first``:
                                                         attn_prefill(n_1) - outer(n_1) for
                                                         the first); absent: the sum of
                                                         attn_prefill(n_i)
``attn_prefill_batch``    batch_size, num_tokens         optional: a prefill batch of
                                                         batch_size prompts, num_tokens in
                                                         all, through a layer's norm +
                                                         attention in one call (the grid's
                                                         prompts are equally long)
``preempt_switch``        num_tokens                     optional: saving and restoring the
                                                         in-flight state of a suspended batch
                                                         of num_tokens new tokens, once per
                                                         resume, for the whole model (not per
                                                         layer); absent: preemption is free
``wake_up``               idle_ms, busy_ms               optional: the extra time still
                                                         to come, after busy_ms of (warm)
                                                         work, of the first iterations after
                                                         the device sat idle for idle_ms
                                                         (clocks down, caches cold), whole
                                                         model: busy_ms = 0 is all of it;
                                                         after a row's last busy_ms nothing
                                                         is left (a row of busy_ms = 0 alone
                                                         is charged whole to the first
                                                         batch); idle_ms = 0 is 0 by
                                                         definition; absent: none
========================  =============================  ==================================

Optional ops may have no points; every other op needs at least one.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1: no idle_ms column; 2: no busy_ms column
OPS: dict[str, tuple[str, ...]] = {
    "attn_prefill": ("num_tokens",),
    "attn_decode": ("batch_size", "kv_tokens"),
    "attn_decode_bind": ("batch_size", "kv_tokens"),
    "router": ("num_tokens",),
    "expert": ("num_tokens",),
    "lm_head": ("batch_size",),
    "step_overhead": ("batch_size",),
    "attn_prefill_batch": ("batch_size", "num_tokens"),
    "attn_prefill_outer": ("batch_size", "num_tokens"),
    "attn_prefill_first": ("num_tokens",),
    "attn_prefill_next": ("num_tokens",),
    "attn_chunk": ("num_tokens", "kv_tokens"),
    "preempt_switch": ("num_tokens",),
    "wake_up": ("idle_ms", "busy_ms"),
    "engine_host": ("batch_size",),
    "engine_admit": ("batch_size",),
    "prepare_decode": ("batch_size",),
    "prepare_prefill": ("batch_size", "num_tokens"),
    "lm_head_prefill": ("batch_size", "num_tokens"),
}
# a prefill's own prepare and lm_head stages: all three ops or none (LatencyModel.plan)
PREFILL_STAGE_OPS = ("prepare_decode", "prepare_prefill", "lm_head_prefill")
# a prefill's once-per-iteration stages, keyed by its prompt count too (0: one prompt)
PROMPT_COUNT_OPS = ("prepare_prefill", "lm_head_prefill", "attn_prefill_outer")
OPTIONAL_OPS = frozenset(
    {
        "attn_decode_bind",
        "attn_prefill_batch",
        "attn_prefill_outer",
        "attn_prefill_first",
        "attn_prefill_next",
        "attn_chunk",
        "preempt_switch",
        "wake_up",
        "engine_host",
        "engine_admit",
        *PREFILL_STAGE_OPS,
    }
)
PREFILL_ATTENTION = ("per_prompt", "batched")
# Ops whose samples repeat one shape (all layers of a few identical iterations). Expert points
# pool different queue sizes and step_overhead is one residual per shape: their spread is not
# noise.
REPEATED_OPS = ("attn_prefill", "attn_decode", "attn_decode_bind", "router", "lm_head")
# A point whose p90 exceeds its median this many times had at least a tenth of its repeats
# slowed down that much by something else. The tiny-mixtral profile of `make validate`, taken
# on a quiet machine (2026-11-30), had 1.54x at worst (median 1.22x; 1.78x and 1.35x in that
# of 2026-12-03, clock=cpu, between rounds of real runs); on this project's 2-core machine
# at a load of ~10 a threads=1 profile reached 2.7x (process clock) and 50x (wall clock), and
# with all threads some stages came out 1,600x slower.
NOISY_SPREAD = 2.0
COLUMNS = ("op", "batch_size", "num_tokens", "kv_tokens", "median_ms", "p90_ms", "idle_ms",
           "busy_ms")  # fmt: skip
VERSION_COLUMNS = {1: COLUMNS[:-2], 2: COLUMNS[:-1], 3: COLUMNS}
META_FILE = "profile.json"
# every key of profile.json that Profile.load reads (spread is recomputed from ops.csv)
META_KEYS = frozenset({"schema_version", "name", "source", "description", "calibration",
                       "device", "dtype", "torch_version", "transformers_version", "created",
                       "model", "memory", "routing", "prefill_attention", "interference",
                       "extra", "spread", "points"})  # fmt: skip
ROUTING_KEYS = frozenset({"expert_load", "prompt_experts"})
OPS_FILE = "ops.csv"


class ProfileError(ValueError):
    """A profile directory is missing or malformed."""


# The profiler's settings (conf/profiler.yaml, qllm-validate's profile.*), checked before torch
# loads: the grid's lists are free-form in the config, so a string or a float would be misread
GRID_KEYS = ("prefill_tokens", "decode_batch", "decode_kv", "expert_tokens")


class SettingsError(ValueError):
    """A profiler setting is out of range."""


def setting_int(key: str, value: Any, least: int | None = None) -> int:
    """A setting that must be an integer (``least`` or more, where given): a float or a string
    is refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"{key}={value}: must be an integer"
                            + ("" if least is None else f" >= {least}"))  # fmt: skip
    if least is not None and value < least:
        raise SettingsError(f"{key}={value}: must be an integer >= {least}")
    return value


def int_list(key: str, value: Any) -> list[int]:
    """A grid setting: a list of integers (a string was read character by character, '16' as
    batches 1 and 6, and a float truncated)."""
    values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if values is None or any(isinstance(x, bool) or not isinstance(x, int) for x in values):
        shown = values if values is not None else value
        raise SettingsError(f"{key}={shown}: must be a list of integers, e.g. [1,4,16]")
    return values


@dataclass(frozen=True)
class OpPoint:
    op: str
    batch_size: int = 0
    num_tokens: int = 0
    kv_tokens: int = 0
    median_ms: float = 0.0
    p90_ms: float = 0.0
    idle_ms: int = 0
    busy_ms: float = 0.0

    def key(self) -> tuple[int, ...]:
        return tuple(getattr(self, k) for k in OPS[self.op])

    def label(self) -> str:
        """e.g. ``attn_decode(batch_size=8, kv_tokens=512)``"""
        return f"{self.op}({', '.join(f'{k}={getattr(self, k)}' for k in OPS[self.op])})"


@dataclass(frozen=True)
class Spread:
    """How much a profile's repeats scatter (see the module docstring)."""

    median_factor: float
    worst_factor: float
    worst: str  # the worst point's label
    threshold: float = NOISY_SPREAD

    @property
    def noisy(self) -> bool:
        return self.worst_factor > self.threshold

    def warning(self, name: str) -> str:
        return (
            f"warning: profile {name} looks measured on a busy machine: {self.worst} has a p90 "
            f"{self.worst_factor:.1f}x its median (noisy above {self.threshold:g}x; median "
            f"over points {self.median_factor:.2f}x); re-profile on an idle machine "
            f"(on a CPU, threads=1 and clock=process shut most of the noise out)"
        )


def spread(points: list[OpPoint]) -> Spread | None:
    """The spread of ``points`` (None without a point of a repeated op)."""
    factors = sorted(
        (p.p90_ms / p.median_ms, p.label())
        for p in points
        if p.op in REPEATED_OPS and p.median_ms > 0
    )
    if not factors:
        return None
    mid = len(factors) // 2
    median = factors[mid][0] if len(factors) % 2 else (factors[mid - 1][0] + factors[mid][0]) / 2
    return Spread(round(median, 3), round(factors[-1][0], 3), factors[-1][1])


@dataclass
class ModelShape:
    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim * 2


# Host <-> device copy bandwidth of KV blocks swapped out and in, when a profile does not say:
# what a PCIe Gen4 x16 link (32 GB/s raw per direction) delivers to pinned-memory copies.
SWAP_BYTES_PER_S = 25e9
MIN_SWAP_BYTES_PER_S = 1e6  # below any host link: a figure in the wrong unit


@dataclass
class Memory:
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    swap_bytes_per_s: float = SWAP_BYTES_PER_S  # KV swapped to or from host memory


@dataclass
class Profile:
    name: str
    source: str
    description: str
    calibration: str
    device: str
    dtype: str
    model: ModelShape
    memory: Memory
    points: list[OpPoint]
    expert_load: list[list[float]] | None = None
    # per measured prompt, per layer: its tokens' expert ids, token by token ([] routes nothing)
    prompt_experts: list[list[list[int]]] | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    created: str = ""
    extra: dict = field(default_factory=dict)
    prefill_attention: str = "per_prompt"
    # the mean, over every timed iteration of the profile, of its time over the median of its
    # shape's repeats: how much slower than its point a random iteration ran on this machine
    # (1.0: none measured; a shared machine's slow stretches make it > 1). The latency model
    # scales every iteration op by it, so that it predicts mean times, as the metrics are means.
    interference: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = f"profile {self.name!r}"
        for p in self.points:
            if p.op not in OPS:
                raise ProfileError(f"{where}: unknown op {p.op!r}; expected one of {sorted(OPS)}")
            if not (math.isfinite(p.median_ms) and p.median_ms >= 0):
                raise ProfileError(f"{where}: {p.op} at {p.key()} has median_ms={p.median_ms}")
            if not (math.isfinite(p.busy_ms) and p.busy_ms >= 0):
                raise ProfileError(f"{where}: {p.op} at {p.key()} has busy_ms={p.busy_ms}")
            if not (math.isfinite(p.p90_ms) and p.p90_ms >= 0):  # a NaN hides the spread
                raise ProfileError(f"{where}: {p.op} at {p.key()} has p90_ms={p.p90_ms}")
            negative = [k for k in ("batch_size", "num_tokens", "kv_tokens", "idle_ms")
                        if getattr(p, k) < 0]  # fmt: skip
            if negative:
                raise ProfileError(f"{where}: {p.op} has {negative[0]}="
                                   f"{getattr(p, negative[0])} (a key is >= 0)")  # fmt: skip
            if p.op == "wake_up" and p.idle_ms == 0 and p.median_ms > 0:
                raise ProfileError(f"{where}: wake_up at idle_ms=0 has median_ms="
                                   f"{p.median_ms:g}: no idle time leaves nothing to wake "
                                   "from (it is 0 by definition)")  # fmt: skip
        for p in self.points:  # one prompt is 0: a 1 there would be a second key for it
            if p.op in PROMPT_COUNT_OPS and p.batch_size == 1:
                raise ProfileError(f"{where}: {p.label()}: a prefill's batch_size is its "
                                   "prompt count when 2 or more, 0 for one prompt")  # fmt: skip
        for op in PROMPT_COUNT_OPS:  # what more prompts add is read against one prompt's
            counts = {p.batch_size for p in self.points if p.op == op}
            if counts and 0 not in counts:
                raise ProfileError(f"{where}: {op} has no point of one prompt (batch_size 0), "
                                   f"only of {sorted(counts)} prompts")  # fmt: skip
        seen: set[tuple] = set()
        for p in self.points:  # the latency model keeps one point per key: the last
            keys = OPS[p.op]
            stray = [c for c in ("batch_size", "num_tokens", "kv_tokens", "idle_ms", "busy_ms")
                     if c not in keys and getattr(p, c)]  # fmt: skip
            if stray:
                raise ProfileError(f"{where}: {p.op} is keyed by {', '.join(keys)} only, but "
                                   f"a point sets {stray[0]}={getattr(p, stray[0])} (a "
                                   "mis-keyed row)")  # fmt: skip
            if (p.op, p.key()) in seen:
                raise ProfileError(f"{where}: two points of {p.label()} (a duplicated row): "
                                   "one would silently replace the other")  # fmt: skip
            seen.add((p.op, p.key()))
        missing = set(OPS) - OPTIONAL_OPS - {p.op for p in self.points}
        if missing:
            raise ProfileError(f"{where}: no points for ops {sorted(missing)}")
        split = {"attn_prefill_outer", "attn_prefill_next"} & {p.op for p in self.points}
        if len(split) == 1:  # the latency model would silently ignore the one given
            raise ProfileError(
                f"{where}: {split.pop()} needs both attn_prefill_outer and attn_prefill_next "
                "(a prefill's attention stage, split)"
            )
        if self.op_points("attn_prefill_first") and not split:  # else silently ignored
            raise ProfileError(
                f"{where}: attn_prefill_first needs attn_prefill_outer and attn_prefill_next "
                "(a prefill's attention stage, split)"
            )
        stage_ops = set(PREFILL_STAGE_OPS) & {p.op for p in self.points}
        if stage_ops and len(stage_ops) < len(PREFILL_STAGE_OPS):  # else silently ignored
            raise ProfileError(
                f"{where}: {', '.join(sorted(stage_ops))} without "
                f"{', '.join(sorted(set(PREFILL_STAGE_OPS) - stage_ops))}: a prefill's own "
                "prepare and lm_head stages need all three ops"
            )
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ProfileError(
                f"{where}: prefill_attention={self.prefill_attention!r}; expected one of "
                f"{list(PREFILL_ATTENTION)}"
            )
        if self.prefill_attention == "batched" and not self.op_points("attn_prefill_batch"):
            raise ProfileError(f"{where}: prefill_attention 'batched' needs attn_prefill_batch")
        m = self.model
        if min(m.num_layers, m.num_experts, m.top_k) < 1 or m.top_k > m.num_experts:
            raise ProfileError(f"{where}: bad model shape {asdict(m)}")
        if self.expert_load is not None:
            if len(self.expert_load) != m.num_layers or any(
                len(row) != m.num_experts for row in self.expert_load
            ):
                raise ProfileError(
                    f"{where}: expert_load must be {m.num_layers} rows of {m.num_experts}"
                )
            for row in self.expert_load:
                if min(row) < 0 or not math.isclose(sum(row), 1.0, rel_tol=1e-3):
                    raise ProfileError(f"{where}: each expert_load row must sum to 1")
        if self.prompt_experts is not None:
            self._validate_prompt_experts(where)
        if not (math.isfinite(self.interference) and self.interference > 0):
            raise ProfileError(f"{where}: interference={self.interference} must be > 0")
        if self.memory.kv_capacity_tokens < 1:
            raise ProfileError(f"{where}: kv_capacity_tokens must be >= 1")
        mem = self.memory
        if not (mem.kv_bytes_per_token >= 1 and mem.activation_bytes_per_token >= 0):
            raise ProfileError(f"{where}: kv_bytes_per_token must be >= 1 and "
                               f"activation_bytes_per_token >= 0, not {asdict(mem)}")  # fmt: skip
        if not self.memory.swap_bytes_per_s >= MIN_SWAP_BYTES_PER_S:
            # 25 typed for 25 GB/s would make every swap a billion times too slow
            raise ProfileError(f"{where}: swap_bytes_per_s={self.memory.swap_bytes_per_s:g} "
                               "is below 1 MB/s; it is in bytes per second (25 GB/s is "
                               "25e9)")  # fmt: skip

    def _validate_prompt_experts(self, where: str) -> None:
        m = self.model
        if not self.prompt_experts:
            raise ProfileError(f"{where}: prompt_experts must hold at least one prompt")
        for i, prompt in enumerate(self.prompt_experts):
            bad = f"{where}: prompt_experts[{i}]"
            if len(prompt) != m.num_layers:
                raise ProfileError(f"{bad} must have {m.num_layers} layers, not {len(prompt)}")
            lengths = {len(row) for row in prompt if row}
            if not lengths:
                raise ProfileError(f"{bad} routes no token in any layer")
            if len(lengths) > 1 or lengths.pop() % m.top_k:
                raise ProfileError(f"{bad}: every routed layer needs tokens x top_k={m.top_k} "
                                   f"expert ids, the same tokens in each")  # fmt: skip
            if any(not 0 <= e < m.num_experts for row in prompt for e in row):
                raise ProfileError(f"{bad}: expert ids must lie in [0, {m.num_experts})")
        routed = [[bool(row) for row in prompt] for prompt in self.prompt_experts]
        if any(r != routed[0] for r in routed):  # the simulator reads the dense layers off one
            raise ProfileError(f"{where}: prompt_experts must route the same layers in every "
                               f"prompt (an empty layer is dense)")  # fmt: skip

    def spread(self) -> Spread | None:
        return spread(self.points)

    def op_points(self, op: str) -> list[OpPoint]:
        return sorted((p for p in self.points if p.op == op), key=OpPoint.key)

    # ------------------------------------------------------------------------------------ I/O
    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "source": self.source,
            "description": self.description,
            "calibration": self.calibration,
            "device": self.device,
            "dtype": self.dtype,
            "torch_version": self.torch_version,
            "transformers_version": self.transformers_version,
            "created": self.created,
            "model": asdict(self.model),
            "memory": asdict(self.memory),
            "routing": {
                "expert_load": self.expert_load,
                **(
                    {
                        "prompt_experts": [
                            [" ".join(map(str, row)) for row in prompt]
                            for prompt in self.prompt_experts
                        ]
                    }
                    if self.prompt_experts is not None
                    else {}
                ),
            },  # fmt: skip
            "prefill_attention": self.prefill_attention,
            "interference": self.interference,
            "extra": self.extra,
        }
        if self.source == "measured" and self.spread() is not None:
            meta["spread"] = {**asdict(self.spread()), "noisy": self.spread().noisy}
        # ops.csv's row count: load refuses a file that holds another (cut short or edited)
        meta["points"] = len(self.points)
        # each file written whole, then renamed over the old one: a save stopped midway (a
        # time limit, a full disk) leaves the earlier profile or none, not a shorter one
        ops_part = directory / f"{OPS_FILE}.part"
        with open(ops_part, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for p in sorted(self.points, key=lambda p: (p.op, p.key())):
                w.writerow([p.op, p.batch_size, p.num_tokens, p.kv_tokens,
                            f"{p.median_ms:.6g}", f"{p.p90_ms:.6g}", p.idle_ms,
                            f"{p.busy_ms:.6g}"])  # fmt: skip
        meta_part = directory / f"{META_FILE}.part"
        meta_part.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(ops_part, directory / OPS_FILE)
        os.replace(meta_part, directory / META_FILE)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Profile:
        directory = Path(directory)
        meta_path, ops_path = directory / META_FILE, directory / OPS_FILE
        for path in (meta_path, ops_path):
            if not path.is_file():
                raise ProfileError(f"profile file not found: {path}")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{meta_path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        version = meta.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise ProfileError(
                f"{meta_path}: schema_version {version!r}, expected one of "
                f"{list(READABLE_VERSIONS)}"
            )
        columns = VERSION_COLUMNS[version]
        points = []
        with open(ops_path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != columns:
                raise ProfileError(f"{ops_path}: header must be {','.join(columns)}")
            for lineno, row in enumerate(reader, start=2):
                try:
                    if None in row or None in row.values():  # a field too many, or cut short
                        raise ValueError
                    points.append(
                        OpPoint(
                            op=row["op"],
                            batch_size=int(row["batch_size"]),
                            num_tokens=int(row["num_tokens"]),
                            kv_tokens=int(row["kv_tokens"]),
                            median_ms=float(row["median_ms"]),
                            p90_ms=float(row["p90_ms"]),
                            # columns of later versions: 0 where the version has none,
                            # and an empty field is malformed (it read as 0 until 2026-12-04)
                            idle_ms=int(row["idle_ms"]) if "idle_ms" in row else 0,
                            busy_ms=float(row["busy_ms"]) if "busy_ms" in row else 0.0,
                        )
                    )
                except (TypeError, ValueError):
                    raise ProfileError(f"{ops_path}:{lineno}: malformed row {row}") from None
        written = meta.get("points")
        if written is not None:  # saved by Profile.save (hand-made profiles have no count)
            if len(points) != written:
                raise ProfileError(f"{ops_path}: {len(points)} points where {META_FILE} says "
                                   f"{written} (a file cut short, or rows edited: measure it "
                                   f"again, or set \"points\" to the rows kept)")  # fmt: skip
            if ops_path.stat().st_size and not ops_path.read_bytes().endswith(b"\n"):
                raise ProfileError(f"{ops_path}: its last row has no line end (a file cut "
                                   "short: its last number may be a prefix of the one "
                                   "written); measure it again")  # fmt: skip
        unknown = sorted(set(meta) - META_KEYS)
        unknown += [f"routing.{k}" for k in sorted(set(meta.get("routing") or {}) - ROUTING_KEYS)]
        if unknown:  # a misspelt key would load as its default without a word
            raise ProfileError(f"{meta_path}: unknown key {unknown[0]!r}; expected keys "
                               f"{sorted(META_KEYS)}, routing.{sorted(ROUTING_KEYS)}")  # fmt: skip
        try:
            return cls(
                name=meta["name"],
                source=meta["source"],
                description=meta.get("description", ""),
                calibration=meta.get("calibration", ""),
                device=meta["device"],
                dtype=meta["dtype"],
                model=ModelShape(**meta["model"]),
                memory=Memory(**meta["memory"]),
                points=points,
                expert_load=(meta.get("routing") or {}).get("expert_load"),
                prompt_experts=_read_prompt_experts(
                    (meta.get("routing") or {}).get("prompt_experts"), meta_path
                ),  # fmt: skip
                torch_version=meta.get("torch_version"),
                transformers_version=meta.get("transformers_version"),
                created=meta.get("created", ""),
                extra=meta.get("extra") or {},
                prefill_attention=meta.get("prefill_attention", "per_prompt"),
                interference=float(meta.get("interference", 1.0)),
            )
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{meta_path}: missing or malformed field ({e})") from None


def _read_prompt_experts(rows: list | None, path: Path) -> list[list[list[int]]] | None:
    """``routing.prompt_experts`` as written by ``Profile.save``: per prompt, one string of
    space-separated expert ids per layer."""
    if rows is None:
        return None
    try:
        return [[[int(e) for e in layer.split()] for layer in prompt] for prompt in rows]
    except (AttributeError, TypeError, ValueError):
        raise ProfileError(f"{path}: routing.prompt_experts must be lists of strings of "
                           f"expert ids") from None  # fmt: skip
