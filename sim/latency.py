"""Latency model: how long each stage of an iteration takes, read from a profile table.

An iteration of a batch is planned as a flat list of stages::

    [step_overhead] + for each layer l: [attention(l), router(l), expert(l, 0..E-1)] + [lm_head]

An expert that received no token has a zero-length stage. ``Plan.offset(i)`` is the time at
which stage i starts (boundary i); a batch's cursor is such a boundary index. Which
boundaries allow preemption depends on the policy's granularity (``Plan.preemptible``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from policies.core import Batch, Granularity, Phase
from profiler.schema import OpPoint, Profile


class Curve1D:
    """Piecewise-linear interpolation; linear extrapolation beyond the last point, clamped below
    the first."""

    def __init__(self, points: list[OpPoint], key: str) -> None:
        table: dict[int, float] = {}
        for p in points:
            table[getattr(p, key)] = p.median_ms / 1e3
        self.xs = sorted(table)
        self.ys = [table[k] for k in self.xs]
        self.x, self.y = np.array(self.xs, dtype=float), np.array(self.ys, dtype=float)
        n = len(self.xs)
        # Extrapolate with the last segment's slope, but never downwards: a noisy last point
        # must not make large inputs cheap (or negative).
        slope = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2]) if n > 1 else 0.0
        self.slope = max(slope, 0.0)
        self._cache: dict[float, float] = {}

    def __call__(self, x) -> np.ndarray:
        """Vectorised over an array of x."""
        x = np.asarray(x, dtype=float)
        y = np.interp(x, self.x, self.y)
        if x.size and x.max() > self.xs[-1]:
            y = np.where(x > self.xs[-1], self.ys[-1] + self.slope * (x - self.xs[-1]), y)
        return y

    def scalar(self, x: float) -> float:
        """One point, memoised (the hot path asks for few distinct integers)."""
        y = self._cache.get(x)
        if y is None:
            xs, ys = self.xs, self.ys
            if x >= xs[-1]:
                y = ys[-1] + self.slope * (x - xs[-1])
            elif x <= xs[0]:
                y = ys[0]
            else:
                i = bisect.bisect_right(xs, x) - 1
                y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
            if len(self._cache) < 100_000:
                self._cache[x] = y
        return y


class Curve2D:
    """Bilinear interpolation on a (batch_size, kv_tokens) grid: interpolate along kv for each
    measured batch size, then along batch size (clamped below the grid, extrapolated linearly
    and never downwards above it)."""

    def __init__(self, points: list[OpPoint]) -> None:
        by_batch: dict[int, list[OpPoint]] = {}
        for p in points:
            by_batch.setdefault(p.batch_size, []).append(p)
        self.batches = sorted(by_batch)
        self.rows = [Curve1D(by_batch[b], "kv_tokens") for b in self.batches]

    def __call__(self, batch_size: float, kv_tokens: float) -> float:
        ys = [row.scalar(kv_tokens) for row in self.rows]
        if len(ys) == 1:
            return ys[0]
        xs = self.batches
        i = min(max(bisect.bisect_right(xs, batch_size) - 1, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        if batch_size <= x0:
            return y0
        if batch_size >= x1:  # beyond the grid: as Curve1D, never extrapolate downwards
            return y1 + max(y1 - y0, 0.0) * (batch_size - x1) / (x1 - x0)
        return y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)


class RoutingModel:
    """Tokens each expert receives in each layer.

    Each of the T tokens picks top_k experts; the per-layer count vector is drawn as a
    multinomial of T * top_k assignments over the layer's expert-load distribution, each count
    capped at T (a token cannot pick one expert twice; this drops the rare duplicate draws).
    ``uniform`` (default): every expert equally likely; ``zipf``: load proportional to
    1 / rank^skew with a random expert order per layer; ``profile``: the measured expert load
    stored in the profile.

    Drawing 32 layers of counts costs ~20 us, more than the rest of an iteration's planning, so
    for small token counts (decode batches) the model draws ``pool_size`` samples per token
    count once and then picks one of them at random for each iteration (a bootstrap of the
    same distribution). Larger token counts (prefills) are drawn fresh every time.
    """

    POOLED_MAX_TOKENS = 64

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        mode: str = "uniform",
        skew: float = 1.0,
        expert_load: list[list[float]] | None = None,
        seed: int = 0,
        pool_size: int = 64,
    ) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.pool_size = pool_size
        self.rng = np.random.default_rng([seed, 0xE7])
        if mode == "uniform":
            load = np.full((num_layers, num_experts), 1.0 / num_experts)
        elif mode == "zipf":
            base = 1.0 / np.arange(1, num_experts + 1) ** skew
            base /= base.sum()
            load = np.stack([self.rng.permutation(base) for _ in range(num_layers)])
        elif mode == "profile":
            if expert_load is None:
                raise ValueError("routing mode 'profile' needs a profile with expert_load")
            load = np.asarray(expert_load, dtype=float)
        else:
            raise ValueError(f"unknown routing mode {mode!r}")
        self.load = load / load.sum(axis=1, keepdims=True)

    def draw(self, num_tokens: int, size: int | None = None) -> np.ndarray:
        """Fresh counts: shape (num_layers, num_experts), or (size, num_layers, num_experts)."""
        shape = self.load.shape if size is None else (size, *self.load.shape)
        pvals = np.broadcast_to(self.load, shape)
        return np.minimum(self.rng.multinomial(num_tokens * self.top_k, pvals), num_tokens)

    def pooled(self, num_tokens: int) -> bool:
        return num_tokens <= self.POOLED_MAX_TOKENS and self.pool_size > 0

    def pick(self) -> int:
        return int(self.rng.integers(self.pool_size))


@dataclass
class Plan:
    """Stage times of one iteration (seconds), precomputed when the iteration starts."""

    overhead_s: float
    attention_s: float
    router_s: float
    experts_s: np.ndarray  # (num_layers, num_experts); 0 where the expert got no token
    lm_head_s: float
    expert_tokens: np.ndarray  # (num_layers, num_experts) token counts, for traces and tests

    @property
    def num_layers(self) -> int:
        return self.experts_s.shape[0]

    @property
    def stages_per_layer(self) -> int:
        return 2 + self.experts_s.shape[1]

    @property
    def num_stages(self) -> int:
        return 2 + self.num_layers * self.stages_per_layer

    @cached_property
    def total_s(self) -> float:
        layers = self.num_layers * (self.attention_s + self.router_s) + float(self.experts_s.sum())
        return self.overhead_s + layers + self.lm_head_s

    @cached_property
    def durations(self) -> np.ndarray:
        per_layer = np.empty((self.num_layers, self.stages_per_layer))
        per_layer[:, 0] = self.attention_s
        per_layer[:, 1] = self.router_s
        per_layer[:, 2:] = self.experts_s
        return np.concatenate([[self.overhead_s], per_layer.ravel(), [self.lm_head_s]])

    @cached_property
    def offsets(self) -> np.ndarray:
        """offsets[i]: time from the iteration's start to boundary i (0..num_stages)."""
        out = np.concatenate([[0.0], np.cumsum(self.durations)])
        out[-1] = self.total_s  # the same float as the one-timeout path uses
        return out

    def offset(self, boundary: int) -> float:
        if boundary == 0:
            return 0.0
        if boundary == self.num_stages:
            return self.total_s
        return float(self.offsets[boundary])

    def locate(self, boundary: int) -> tuple[int, int, int]:
        """(layer, stage, expert) that starts at an inner boundary; layer -1 is the overhead."""
        if boundary == 0:
            return (-1, 0, 0)
        layer, within = divmod(boundary - 1, self.stages_per_layer)
        return (layer, min(within, 2), max(within - 2, 0))

    def preemptible(self, granularity: Granularity) -> list[int]:
        return preemptible_boundaries(self.num_layers, self.stages_per_layer, granularity)

    def next_boundary(self, elapsed_s: float, granularity: Granularity) -> int | None:
        """The first preemptible inner boundary at or after ``elapsed_s``, or None."""
        candidates = self.preemptible(granularity)
        times = self.offsets[candidates]
        i = int(np.searchsorted(times, elapsed_s, side="left"))
        return candidates[i] if i < len(candidates) else None


_boundary_cache: dict[tuple[int, int, Granularity], list[int]] = {}


def preemptible_boundaries(
    num_layers: int, stages_per_layer: int, granularity: Granularity
) -> list[int]:
    """Inner boundary indices at which a policy of this granularity may preempt."""
    key = (num_layers, stages_per_layer, granularity)
    if key not in _boundary_cache:
        if granularity <= Granularity.ITERATION:
            out: list[int] = []
        elif granularity == Granularity.ROUTER:  # after router l = layer l's start + 2
            out = [3 + layer * stages_per_layer for layer in range(num_layers)]
        elif granularity == Granularity.LAYER:
            out = []
            for layer in range(num_layers):
                start = 1 + layer * stages_per_layer
                out += [start, start + 1, start + 2]  # layer start, after attention, after router
            out.append(1 + num_layers * stages_per_layer)  # after the last layer
        else:
            out = list(range(1, 2 + num_layers * stages_per_layer))
        _boundary_cache[key] = out
    return _boundary_cache[key]


class LatencyModel:
    """Plans iterations from a profile (per-layer op times) and a routing model."""

    def __init__(self, profile: Profile, routing: RoutingModel | None = None) -> None:
        self.profile = profile
        m = profile.model
        self.num_layers = m.num_layers
        self.routing = routing or RoutingModel(m.num_layers, m.num_experts, m.top_k)
        self.attn_prefill = Curve1D(profile.op_points("attn_prefill"), "num_tokens")
        self.attn_decode = Curve2D(profile.op_points("attn_decode"))
        self.router = Curve1D(profile.op_points("router"), "num_tokens")
        self.expert = Curve1D(profile.op_points("expert"), "num_tokens")
        self.lm_head = Curve1D(profile.op_points("lm_head"), "batch_size")
        self.overhead = Curve1D(profile.op_points("step_overhead"), "batch_size")
        self._pools: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def attention_s(self, batch: Batch) -> float:
        if batch.phase is Phase.PREFILL:
            return sum(self.attn_prefill.scalar(s.new_tokens) for s in batch.sequences)
        if batch.phase is Phase.MIXED:  # a chunk over a cached prefix: costed as its own tokens
            pre = [s for s in batch.sequences if s.phase is Phase.PREFILL]
            dec = [s for s in batch.sequences if s.phase is Phase.DECODE]
            t = sum(self.attn_prefill.scalar(s.new_tokens) for s in pre)
            if dec:
                t += self.attn_decode(len(dec), max(s.context_tokens for s in dec))
            return t
        # decode attention runs on the batch's caches right-padded to the longest context
        kv = max(s.context_tokens for s in batch.sequences)
        return self.attn_decode(batch.size, kv)

    def _expert_times(self, counts: np.ndarray) -> np.ndarray:
        return np.where(counts > 0, self.expert(counts), 0.0)

    def experts(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(token counts, stage times) of every expert in every layer for one iteration."""
        routing = self.routing
        if not routing.pooled(tokens):
            counts = routing.draw(tokens)
            return counts, self._expert_times(counts)
        pool = self._pools.get(tokens)
        if pool is None:
            counts = routing.draw(tokens, size=routing.pool_size)
            pool = self._pools[tokens] = (counts, self._expert_times(counts))
        i = routing.pick()
        return pool[0][i], pool[1][i]

    def plan(self, batch: Batch) -> Plan:
        tokens = batch.new_tokens
        counts, experts = self.experts(tokens)
        return Plan(
            overhead_s=self.overhead.scalar(batch.size),
            attention_s=self.attention_s(batch),
            router_s=self.router.scalar(tokens),
            experts_s=experts,
            lm_head_s=self.lm_head.scalar(batch.size),
            expert_tokens=counts,
        )
