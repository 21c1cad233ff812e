"""Latency model: how long each stage of an iteration takes, read from a profile table.

An iteration of a batch is planned as a flat list of stages::

    [step_overhead] + for each layer l: [attention(l), router(l), expert(l, 0..E-1)] + [lm_head]

A prefill or mixed iteration's first and last stages are its own when the profile measured
them (``prepare_prefill``, ``lm_head_prefill``: over all its new tokens, in its prompts
(``PromptCurve``), where a decode step's run over one token per sequence). An expert that
received no token has a zero-length stage.
``Plan.offset(i)`` is the time at which stage i starts (boundary i); a batch's cursor is such
a boundary index. Which boundaries allow preemption depends on the policy's granularity
(``Plan.preemptible``).
A suspended batch pays ``LatencyModel.switch_s`` (the profile's context-switch cost) when it
resumes, before the stage at its cursor; the first batches after an idle stretch pay
``LatencyModel.wake_s`` before they start: the profile's wake-up cost at that idle time, each
batch its share of it over the busy time it covers (``wake_up`` by busy time). KV
swapped between host and device for an iteration (``Batch.swap_tokens``) is copied before it
runs: its time, at the profile's ``swap_bytes_per_s``, is part of the iteration's first stage.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from policies.core import Batch, Granularity, Phase
from profiler.schema import PREFILL_ATTENTION, PREFILL_STAGE_OPS, OpPoint, Profile

# ops that Profile.interference does not scale: the wake-up is an excess over warm steps
# measured on the same machine at the same time
UNSCALED_OPS = frozenset({"wake_up"})


class Curve1D:
    """Piecewise-linear interpolation; linear extrapolation beyond the last point, clamped below
    the first. ``beyond`` is the largest input seen past the last point (None: none was), set
    in the extrapolating branch only, to warn once per run."""

    def __init__(self, points: list[OpPoint], key: str) -> None:
        self.op, self.key = points[0].op, key
        self.beyond: float | None = None
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
        self._xs_int = np.array(self.xs, dtype=np.int64) if n > 1 else None

    def __call__(self, x) -> np.ndarray:
        """Vectorised over an array of x."""
        x = np.asarray(x, dtype=float)
        y = np.interp(x, self.x, self.y)
        if x.size and x.max() > self.xs[-1]:
            self._beyond(float(x.max()))
            y = np.where(x > self.xs[-1], self.ys[-1] + self.slope * (x - self.xs[-1]), y)
        return y

    def _beyond(self, x: float) -> None:
        if self.beyond is None or x > self.beyond:
            self.beyond = x

    def extrapolations(self) -> list[str]:
        if self.beyond is None:
            return []
        return [f"{self.op} {self.key} up to {self.beyond:g} (grid ends at {self.xs[-1]:g})"]

    def within(self, x: np.ndarray) -> np.ndarray:
        """``scalar`` at integers x on an integer grid, none beyond it, by the same float
        operations in the same order, so the very same floats (a fast-forwarded run plans its
        iterations' attention at once)."""
        if self._xs_int is None:
            return np.full(len(x), self.ys[0])
        xs, y = self._xs_int, self.y
        i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
        inner = y[i] + (y[i + 1] - y[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
        return np.where(x >= xs[-1], self.ys[-1], np.where(x <= xs[0], self.ys[0], inner))

    def scalar(self, x: float) -> float:
        """One point, memoised (the hot path asks for few distinct integers)."""
        y = self._cache.get(x)
        if y is None:
            xs, ys = self.xs, self.ys
            if x >= xs[-1]:
                y = ys[-1] + self.slope * (x - xs[-1])
                if x > xs[-1]:
                    self._beyond(x)
            elif x <= xs[0]:
                y = ys[0]
            else:
                i = bisect.bisect_right(xs, x) - 1
                y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
            if len(self._cache) < 100_000:
                self._cache[x] = y
        return y


class Curve2D:
    """Bilinear interpolation on a (``row_key``, ``key``) grid: interpolate along ``key`` for
    each measured row (by default a batch size), then along the rows (clamped below the grid,
    extrapolated linearly and never downwards above it)."""

    def __init__(
        self, points: list[OpPoint], key: str = "kv_tokens", row_key: str = "batch_size"
    ) -> None:
        by_row: dict[int, list[OpPoint]] = {}
        for p in points:
            by_row.setdefault(getattr(p, row_key), []).append(p)
        self.batches = sorted(by_row)
        self.rows = [Curve1D(by_row[b], key) for b in self.batches]
        self.op, self.row_key = points[0].op, row_key
        self.beyond_batch: float | None = None

    def extrapolations(self) -> list[str]:
        beyond = [row for row in self.rows if row.beyond is not None]  # the largest input's
        out = max(beyond, key=lambda row: row.beyond).extrapolations() if beyond else []
        if self.beyond_batch is not None:
            out.append(f"{self.op} {self.row_key} up to {self.beyond_batch:g} "
                       f"(grid ends at {self.batches[-1]})")  # fmt: skip
        return out

    def _note_beyond(self, batch_size: float) -> None:
        if batch_size > self.batches[-1] and (self.beyond_batch or 0) < batch_size:
            self.beyond_batch = batch_size

    def within(self, batch_size: int, keys: np.ndarray) -> np.ndarray:
        """``self(batch_size, k)`` for each k of ``keys`` (integers within the grid) as
        ``Curve1D.within`` computes it: the same floats. The batch size has been seen by a
        call already (which noted any extrapolation)."""
        rows = self.rows
        if len(rows) == 1:
            return rows[0].within(keys)
        xs = self.batches
        i = min(max(bisect.bisect_right(xs, batch_size) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        y0, y1 = rows[i].within(keys), rows[i + 1].within(keys)
        if batch_size <= x0:
            return y0
        if batch_size >= x1:
            return y1 + np.maximum(y1 - y0, 0.0) * (batch_size - x1) / (x1 - x0)
        return y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)

    def __call__(self, batch_size: float, kv_tokens: float) -> float:
        """At (row, key): (batch_size, kv_tokens) by default."""
        rows = self.rows
        if len(rows) == 1:  # one row (e.g. grid.decode_batch=[1]): held for every row key,
            self._note_beyond(batch_size)  # which past it is an extrapolation like any other
            return rows[0].scalar(kv_tokens)
        xs = self.batches
        i = min(max(bisect.bisect_right(xs, batch_size) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        y0, y1 = rows[i].scalar(kv_tokens), rows[i + 1].scalar(kv_tokens)
        if batch_size <= x0:
            return y0
        if batch_size >= x1:  # beyond the grid: as Curve1D, never extrapolate downwards
            self._note_beyond(batch_size)
            return y1 + max(y1 - y0, 0.0) * (batch_size - x1) / (x1 - x0)
        return y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)


class PromptCurve:
    """A prefill's once-per-iteration stage (``prepare_prefill``, ``attn_prefill_outer``,
    ``lm_head_prefill``) at N new tokens in k prompts. The profile's points at batch_size 0 are
    one prompt's (in a profile before 2026-12-05, pooled over prompt counts), at batch_size
    k >= 2 k prompts'. What k prompts add over one prompt of as many tokens, ``extra(k)``, is
    read where both were measured: the median, over k's points within the one-prompt grid, of
    their difference to the one-prompt curve there; interpolated in k from 0 at k = 1, and
    held per prompt past the largest k measured (each prompt adds its own mask, slice and
    row). k prompts of N tokens cost ``one(N) + extra(k)``; past the one-prompt grid,
    ``one`` goes on through the k-prompt points there, less their ``extra``. Without k-prompt
    points within the one-prompt grid (no pairs profiled, or an older profile) there is no
    extra, and the points past it are read as they are, as before."""

    def __init__(self, points: list[OpPoint]) -> None:
        self.op = points[0].op
        ones = [p for p in points if p.batch_size == 0]
        if not ones:
            raise ValueError(f"{self.op}: no point of one prompt (batch_size 0)")
        inside = Curve1D(ones, "num_tokens")
        lo, hi = inside.xs[0], inside.xs[-1]
        by_count: dict[int, list[OpPoint]] = defaultdict(list)
        for p in points:
            if p.batch_size >= 2:
                by_count[p.batch_size].append(p)
        extra = {}
        for k, pts in by_count.items():
            diffs = [p.median_ms / 1e3 - inside.scalar(p.num_tokens)
                     for p in pts if lo <= p.num_tokens <= hi]  # fmt: skip
            if diffs:
                extra[k] = float(np.median(diffs))
        self.counts = [1, *sorted(extra)]
        self.extras = [0.0, *(extra[k] for k in sorted(extra))]
        past: dict[int, list[float]] = defaultdict(list)  # beyond the one-prompt grid
        for k, pts in by_count.items():
            for p in pts:
                if p.num_tokens > hi:
                    past[p.num_tokens].append(p.median_ms - 1e3 * self._extra(k))
        self.one = Curve1D(ones + [OpPoint(self.op, num_tokens=n, median_ms=float(np.median(v)))
                                   for n, v in past.items()], "num_tokens")  # fmt: skip
        self._cache: dict[tuple[int, int], float] = {}
        self.beyond_k: int | None = None  # the most prompts charged past the largest measured

    def extra(self, k: int) -> float:
        """Seconds that k prompts add over one prompt of as many tokens (a k past the largest
        measured is noted for ``extrapolations``)."""
        if k > self.counts[-1] > 1 and (self.beyond_k is None or k > self.beyond_k):
            self.beyond_k = k
        return self._extra(k)

    def _extra(self, k: int) -> float:
        if k <= 1 or len(self.counts) == 1:
            return 0.0
        top = self.counts[-1]
        if k >= top:
            return self.extras[-1] * (k - 1) / (top - 1)
        return float(np.interp(k, self.counts, self.extras))

    def scalar(self, k: int, num_tokens: int) -> float:
        """Seconds of the stage for ``num_tokens`` in ``k`` prompts (never below 0)."""
        y = self._cache.get((k, num_tokens))
        if y is None:
            y = max(self.one.scalar(num_tokens) + self.extra(k), 0.0)
            if len(self._cache) < 100_000:
                self._cache[(k, num_tokens)] = y
        return y

    def extrapolations(self) -> list[str]:
        out = self.one.extrapolations()
        if self.beyond_k is not None:
            out.append(f"{self.op} prompts up to {self.beyond_k} (held per prompt past "
                       f"{self.counts[-1]})")  # fmt: skip
        return out


class RoutingModel:
    """Tokens each expert receives in each layer.

    Each of the T tokens picks top_k DISTINCT experts, sequentially without replacement
    (Plackett-Luce: the next pick follows the weights of the experts not yet picked), the
    tokens independent of each other. ``uniform`` (default): every expert equally likely;
    ``zipf``: load proportional to 1 / rank^skew with a random expert order per layer;
    ``profile``: the measured expert load stored in the profile (each expert's share of the
    layer's token-to-expert assignments).

    When the ordered top-k tuples are few (``num_experts! / (num_experts - top_k)!`` at most
    ``MAX_TUPLES``; Mixtral's 8 experts, top-2: 56), a token's expert SET is one of the
    C(E, k) subsets with probabilities computed exactly, so a layer's counts are one multinomial
    draw of T tokens over the subsets times the subsets' incidence matrix: exact, and as cheap
    for a 4,096-token prefill as for one token. The Plackett-Luce weights are then fitted so
    that each expert's expected share of assignments equals its load (a layer in which one
    expert's load reaches 1/k cannot be met, since no token picks an expert twice, and keeps
    its load as the weights). Larger expert sets draw
    Gumbel-top-k per token with the load as weights (shares then only approximately the load
    when it is skewed).

    Even so, drawing 32 layers of counts costs more than the rest of an iteration's planning,
    so for small token counts (decode batches) the model keeps ``pool_size`` samples per token
    count (``pool``) and picks one of them at random for each iteration (a bootstrap of the
    same distribution); larger token counts (prefills) sum samples of the pools (``summed``).

    Tokens of one prompt do not route independently (in the tiny presets' prefills of 16 random
    tokens, 5.3-6.9 of 8 experts per layer got a token, not the 7.7-7.9 of independent
    tokens): with ``prompt_experts`` (the profile's measured prompts, each token's experts per
    layer) in ``profile`` mode, ``prompt_counts`` routes each sequence's prefill tokens as a
    window of consecutive tokens of a measured prompt picked at random (windows of several
    prompts when it is longer than they are: longer prompts are taken as that independent).
    Decode tokens, one per sequence, are independent of each other. A layer that the measured
    prompts do not route (a dense MLP, as DeepSeek-V3's first layers) gets no token in any
    iteration (``dense``), in every routing mode; without measured prompts every layer
    routes.

    Those picks of a pool sample are drawn ahead, ``PICK_BLOCK`` at a time (``picks``): numpy
    draws the same numbers in one call as in single calls, so the picks are those of drawing
    each when it is needed; before any other draw, the generator is put back where the picks
    taken so far leave it (``_sync``). A fast-forwarded run takes its iterations' picks at once
    and gives back those of the iterations it did not run (``unpick``).
    """

    POOLED_MAX_TOKENS = 64
    MAX_TUPLES = 5040  # 10 experts top-4, or 71 experts top-2
    FIT_ITERATIONS = 200
    PICK_BLOCK = 256

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
        prompt_experts: list[list[list[int]]] | None = None,
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
        # per measured prompt: (tokens, layers, top_k) expert ids, -1 in a layer it does not
        # route; None: tokens route independently
        self.prompts: list[np.ndarray] | None = None
        # layers that route nothing (a dense MLP: DeepSeek-V3's first), as the measured prompts
        # say; their experts get no token (None: every layer routes)
        self.dense: np.ndarray | None = None
        if prompt_experts:  # which layers are dense is the model's, whatever the mode
            prompts = [_prompt_ids(p, top_k) for p in prompt_experts]
            routed = prompts[0][0, :, 0] >= 0
            self.dense = None if routed.all() else ~routed
            if mode == "profile":
                self.prompts = prompts
        if int(np.min(np.count_nonzero(self.load, axis=1))) < top_k:
            raise ValueError(f"every layer needs at least top_k={top_k} experts with load > 0")
        self.subset_p: np.ndarray | None = None  # (num_layers, C(E, k)), the exact path
        self._pools: list[np.ndarray] = []
        self._picks: list[int] = []  # picks drawn ahead; those from _next on are not taken
        self._picks_array = np.empty(0, dtype=np.int64)
        self._next = 0
        self._picks_state: dict | None = None  # the generator's state before they were drawn
        if math.perm(num_experts, top_k) <= self.MAX_TUPLES:
            subsets = list(itertools.combinations(range(num_experts), top_k))
            self.incidence = np.zeros((len(subsets), num_experts), dtype=np.int64)
            for i, s in enumerate(subsets):
                self.incidence[i, list(s)] = 1
            self.subset_p = self._fit_subsets(subsets)
            # layer l's CDF over the subsets, shifted to [l, l + 1]: one sorted array for all
            cdf = np.cumsum(self.subset_p, axis=1)
            cdf[:, -1] = 1.0
            self._flat_cdf = (cdf + np.arange(num_layers)[:, None]).ravel()
        else:
            with np.errstate(divide="ignore"):
                self.log_load = np.log(self.load)

    def _subset_probabilities(self, weights: np.ndarray, subsets: list[tuple]) -> np.ndarray:
        """P(a token's top-k set is S) per layer: the sum over S's orderings of the
        Plackett-Luce probability prod_j w[e_j] / (the weight of the experts not yet picked)."""
        k = self.top_k
        orders = np.array([o for s in subsets for o in itertools.permutations(s)])  # (P, k)
        w = weights[:, orders]  # (L, P, k)
        # The weight left is summed over the experts left, not taken as 1 - the weight picked:
        # that difference rounds to 0 when one expert holds all but ~1e-16 of a layer's load,
        # which would give the near-unloaded experts infinite odds.
        unpicked = np.ones((len(orders), k, weights.shape[1]))
        rows = np.arange(len(orders))
        for j in range(1, k):
            for later in range(j, k):
                unpicked[rows, later, orders[:, j - 1]] = 0.0
        # never 0: every layer has at least top_k loaded experts, so one is left to pick
        left = (unpicked.reshape(-1, weights.shape[1]) @ weights.T).T.reshape(w.shape)
        p = np.prod(w / left, axis=-1)
        return p.reshape(weights.shape[0], len(subsets), math.factorial(k)).sum(axis=-1)

    def _fit_subsets(self, subsets: list[tuple]) -> np.ndarray:
        """Subset probabilities whose expected shares of assignments match the load: fixed
        point w <- w * load / share from w = load (exact at once for a uniform load), in the
        layers whose load is feasible (every share below 1/k); others keep w = load."""
        target, w = self.load, self.load.copy()
        fit = target.max(axis=1) * self.top_k < 1.0 - 1e-3
        p = self._subset_probabilities(w, subsets)
        for _ in range(self.FIT_ITERATIONS):
            share = p @ self.incidence / self.top_k
            if not fit.any() or np.allclose(share[fit], target[fit], rtol=1e-9, atol=1e-12):
                break
            with np.errstate(invalid="ignore"):  # 0 / 0: an unloaded expert, which stays 0
                step = np.nan_to_num(target / share)
            w[fit] *= step[fit]
            w /= w.sum(axis=1, keepdims=True)
            p = self._subset_probabilities(w, subsets)
        return p / p.sum(axis=1, keepdims=True)

    def draw(self, num_tokens: int, size: int | None = None) -> np.ndarray:
        """Fresh counts: shape (num_layers, num_experts), or (size, num_layers, num_experts).
        Every layer's counts sum to num_tokens * top_k, each at most num_tokens."""
        self._sync()
        if self.subset_p is not None:
            shape = self.subset_p.shape if size is None else (size, *self.subset_p.shape)
            picks = self.rng.multinomial(num_tokens, np.broadcast_to(self.subset_p, shape))
            counts = picks @ self.incidence
            if self.dense is not None:
                counts[..., self.dense, :] = 0
            return counts
        n, (layers, experts) = (1 if size is None else size), self.load.shape
        keys = self.rng.gumbel(size=(n, layers, num_tokens, experts)) + self.log_load[:, None]
        top = np.argpartition(-keys, self.top_k - 1, axis=-1)[..., : self.top_k]
        rows = np.arange(n * layers).repeat(num_tokens * self.top_k) * experts
        counts = np.bincount(rows + top.ravel(), minlength=n * layers * experts)
        counts = counts.reshape(n, layers, experts)
        if self.dense is not None:
            counts[:, self.dense] = 0
        return counts[0] if size is None else counts

    def prompt_counts(self, lengths: list[int]) -> np.ndarray:
        """Counts (num_layers, num_experts) of prefills of ``lengths`` tokens, one sequence
        each: each a window of consecutive tokens of a measured prompt at random (``prompts``
        must be set). A layer the prompts do not route (dense) gets no token."""
        self._sync()
        prompts, windows = self.prompts, []
        for n in lengths:
            while n > 0:
                ids = prompts[int(self.rng.integers(len(prompts)))]
                m = min(n, len(ids))
                start = int(self.rng.integers(len(ids) - m + 1))
                windows.append(ids[start : start + m])
                n -= m
        layers, experts = self.load.shape
        if not windows:
            return np.zeros((layers, experts), dtype=np.int64)
        ids = np.concatenate(windows)
        flat = (ids + (np.arange(layers) * experts)[:, None])[ids >= 0]
        counts = np.bincount(flat, minlength=layers * experts).reshape(layers, experts)
        return counts  # a layer the prompts do not route (dense) has none

    def pooled(self, num_tokens: int) -> bool:
        return num_tokens <= self.POOLED_MAX_TOKENS and self.pool_size > 0

    def pool(self, num_tokens: int) -> np.ndarray:
        """``pool_size`` samples of counts for a pooled token count, shape (pool_size,
        num_layers, num_experts). The pools are nested: the pool of n tokens is that of n - 1
        tokens plus one fresh token per sample, so every pool is an exact sample and building
        all of them up to n costs n single-token draws."""
        pools = self._pools
        while len(pools) < num_tokens:  # pools[i] holds i + 1 tokens
            one = self._one_token()
            pools.append(one if not pools else pools[-1] + one)
        return pools[num_tokens - 1]

    def _one_token(self) -> np.ndarray:
        """One token's picks in every layer of every pool sample (inverse CDF over subsets)."""
        self._sync()
        if self.subset_p is None:
            return self.draw(1, size=self.pool_size)
        layers, subsets = self.subset_p.shape
        u = self.rng.random((self.pool_size, layers)) + np.arange(layers)
        index = np.searchsorted(self._flat_cdf, u, side="right") - np.arange(layers) * subsets
        counts = self.incidence[np.minimum(index, subsets - 1)]
        if self.dense is not None:
            counts[:, self.dense] = 0
        return counts

    def pick(self) -> int:
        """A pool sample, at random: ``int(rng.integers(pool_size))``."""
        if self._next == len(self._picks):
            self._draw_picks(1)
        self._next += 1
        return self._picks[self._next - 1]

    def picks(self, k: int) -> np.ndarray:
        """The next k picks: ``rng.integers(pool_size, size=k)``."""
        if self._next + k > len(self._picks):
            self._draw_picks(k)
        start = self._next
        self._next += k
        return self._picks_array[start : self._next]

    def unpick(self, k: int) -> None:
        """Give back the last k picks taken (nothing was drawn since): the next takes them."""
        self._next -= k

    def _draw_picks(self, k: int) -> None:
        self._sync()
        self._picks_state = self.rng.bit_generator.state
        self._picks_array = self.rng.integers(self.pool_size, size=max(k, self.PICK_BLOCK))
        self._picks = self._picks_array.tolist()
        self._next = 0

    def _sync(self) -> None:
        """Put the generator where drawing only the picks taken so far would have left it."""
        if self._picks_state is None:
            return
        if self._next < len(self._picks):
            self.rng.bit_generator.state = self._picks_state
            if self._next:
                self.rng.integers(self.pool_size, size=self._next)
        self._picks, self._picks_array, self._next = [], self._picks_array[:0], 0
        self._picks_state = None

    def summed(self, num_tokens: int) -> np.ndarray:
        """Counts for more tokens than the largest pool: tokens route independently, so the
        counts of q * POOLED_MAX_TOKENS + r tokens are the sum of q samples of the largest
        pool and one of the r-token pool, each picked at random (as ``pick``). Costs a few
        microseconds where a fresh ``draw`` of 32 layers costs ~100."""
        if self.pool_size == 0:
            return self.draw(num_tokens)
        q, r = divmod(num_tokens, self.POOLED_MAX_TOKENS)
        picks = self.picks(q)
        counts = self.pool(self.POOLED_MAX_TOKENS)[picks].sum(axis=0)
        return counts + self.pool(r)[self.pick()] if r else counts


def _prompt_ids(layers: list[list[int]], top_k: int) -> np.ndarray:
    """One measured prompt's expert ids as (tokens, layers, top_k), -1 in a layer with none."""
    tokens = max(len(row) for row in layers) // top_k
    ids = np.full((tokens, len(layers), top_k), -1, dtype=np.int64)
    for layer, row in enumerate(layers):
        if row:
            ids[:, layer] = np.asarray(row, dtype=np.int64).reshape(tokens, top_k)
    return ids


@dataclass
class Plan:
    """Stage times of one iteration (seconds), precomputed when the iteration starts."""

    overhead_s: float
    attention_s: float
    router_s: float
    experts_s: np.ndarray  # (num_layers, num_experts); 0 where the expert got no token
    lm_head_s: float
    expert_tokens: np.ndarray  # (num_layers, num_experts) token counts, for traces and tests
    kv_tokens: int | None = None  # a decode batch's longest context (None: not a decode's)
    # the iteration's time, computed on creation (every plan's is read, and a cached_property's
    # first read, which takes a lock under Python 3.11, costs more than this sum)
    total_s: float = field(init=False)

    def __post_init__(self) -> None:
        layers = self.experts_s.shape[0] * (self.attention_s + self.router_s)
        self.total_s = self.overhead_s + (layers + float(self.experts_s.sum())) + self.lm_head_s

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


class WakeUp:
    """The profile's ``wake_up``: per idle time (a row), the extra time still to come after
    some busy time, interpolated in both (linearly between rows; held at the last row beyond
    it: a device that has clocked down fully stays down). Past a row's last busy time nothing
    is left, so a row of busy_ms = 0 alone is all charged to the first batch. A profile
    without a row of idle_ms = 0 (a hand-made one: the profiler writes it) has nothing to
    wake from after no idle time, so below its first row the cost falls linearly to 0 at
    0 ms (its first row's cost was charged after any gap, however short)."""

    def __init__(self, points: list[OpPoint]) -> None:
        rows: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for p in points:
            rows[p.idle_ms].append((p.busy_ms, p.median_ms))
        if 0 not in rows:
            rows[0].append((0.0, 0.0))
        self.idle_ms = sorted(rows)
        self.rows = [tuple(np.array(col) for col in zip(*sorted(rows[i]), strict=True))
                     for i in self.idle_ms]  # fmt: skip
        self.window_s = max(busy[-1] for busy, _ in self.rows) / 1e3

    @staticmethod
    def _row(row: tuple[np.ndarray, np.ndarray], busy_ms: float) -> float:
        busy, left = row
        return 0.0 if busy_ms > busy[-1] else float(np.interp(busy_ms, busy, left))

    def left_ms(self, idle_ms: float, busy_ms: float) -> float:
        xs = self.idle_ms
        if idle_ms <= xs[0]:
            return self._row(self.rows[0], busy_ms)
        if idle_ms >= xs[-1]:
            return self._row(self.rows[-1], busy_ms)
        i = bisect.bisect_right(xs, idle_ms) - 1
        y0, y1 = self._row(self.rows[i], busy_ms), self._row(self.rows[i + 1], busy_ms)
        return y0 + (y1 - y0) * (idle_ms - xs[i]) / (xs[i + 1] - xs[i])


def overhead_points(profile: Profile) -> list[OpPoint]:
    """``step_overhead`` with the engine's host time (``engine_host``, optional) added at
    every batch size either has a point at, up to where ``step_overhead``'s grid ends (past
    it the sum is extrapolated as the model reads it, and warned of): both are charged once
    per iteration. ``engine_host`` is a line fitted to the host time per iteration
    (``realrun.validate.fit_host``, points at its ends), read along it where it ends first
    (until 2026-12-04 the sum stopped there, and step_overhead's measured points past it,
    such as batch 32 of the H200 profile of run 4 whose engine_host ended at 24, went
    unused, with a warning that step_overhead was extrapolated)."""
    overhead = profile.op_points("step_overhead")
    host = profile.op_points("engine_host")
    if not host:
        return overhead
    end = max(p.batch_size for p in overhead)
    sizes = sorted(b for b in {p.batch_size for p in overhead} | {p.batch_size for p in host}
                   if b <= end)  # fmt: skip
    total = (Curve1D(overhead, "batch_size")(sizes) + Curve1D(host, "batch_size")(sizes)) * 1e3
    return [OpPoint("step_overhead", batch_size=b, median_ms=float(t), p90_ms=float(t))
            for b, t in zip(sizes, total, strict=True)]  # fmt: skip


class LatencyModel:
    """Plans iterations from a profile (per-layer op times) and a routing model.

    ``prefill_attention`` (default: the profile's own) says how a prefill batch's attention is
    costed: ``per_prompt``, the sum of ``attn_prefill`` over its prompts (one call per prompt,
    as realrun's runner does), or ``batched``, ``attn_prefill_batch`` once on (prompts, total
    tokens) (one call over the batch, as TGI and vLLM do). A mixed iteration's prefill chunk
    over a cached prefix costs the profile's ``attn_chunk`` (prefix, chunk) when it has that
    op, else ``attn_prefill`` of the chunk's own tokens. ``switch_s`` is the context-switch
    cost a suspended batch pays when it resumes: the profile's ``preempt_switch`` at the batch's
    new tokens, 0 for a profile without that op. ``plan(batch, bind=True)``: the batch's decode
    steps bind a new padded KV buffer (the executor knows: a decode batch other than the last
    one), whose attention costs the profile's ``attn_decode_bind`` (absent: ``attn_decode``)."""

    EXPERT_TABLE_MAX_TOKENS = 65536  # _expert_times' table: 512 KB at most

    def __init__(
        self,
        profile: Profile,
        routing: RoutingModel | None = None,
        prefill_attention: str | None = None,
    ) -> None:
        m = profile.model
        if profile.interference != 1.0:  # predict mean iteration times (Profile.interference)
            profile = dataclasses.replace(profile, points=[
                p if p.op in UNSCALED_OPS else dataclasses.replace(
                    p, median_ms=p.median_ms * profile.interference,
                    p90_ms=p.p90_ms * profile.interference)
                for p in profile.points])  # fmt: skip
        self.routing = routing or RoutingModel(m.num_layers, m.num_experts, m.top_k)
        self.attn_prefill = Curve1D(profile.op_points("attn_prefill"), "num_tokens")
        self.attn_decode = Curve2D(profile.op_points("attn_decode"))
        self._decode_grid_kv = min(row.xs[-1] for row in self.attn_decode.rows)
        bind_points = profile.op_points("attn_decode_bind")
        self.attn_decode_bind = Curve2D(bind_points) if bind_points else None
        self.router = Curve1D(profile.op_points("router"), "num_tokens")
        self.expert = Curve1D(profile.op_points("expert"), "num_tokens")
        # an expert stage with no token: the profile's expert point at 0 tokens, if any
        self.expert_idle_s = self.expert.ys[0] if self.expert.xs[0] == 0 else 0.0
        # _expert_times at 0 .. the grid's last count (interpolated, never extrapolated)
        grid = np.arange(min(int(self.expert.xs[-1]), self.EXPERT_TABLE_MAX_TOKENS) + 1)
        self._expert_table = np.where(grid > 0, np.interp(grid, self.expert.x, self.expert.y),
                                      self.expert_idle_s)  # fmt: skip
        self.lm_head = Curve1D(profile.op_points("lm_head"), "batch_size")
        self.overhead = Curve1D(overhead_points(profile), "batch_size")
        # a prefill's own prepare and lm_head stages (the three ops, or None: a profile
        # without them charges a prefill the decode's, at its prompt count)
        staged = [profile.op_points(op) for op in PREFILL_STAGE_OPS]
        self.prepare_decode, self.prepare_prefill, self.lm_head_prefill = (
            (Curve1D(staged[0], "batch_size"), PromptCurve(staged[1]), PromptCurve(staged[2]))
            if all(staged) else (None, None, None)
        )  # fmt: skip
        self.prefill_attention = prefill_attention or profile.prefill_attention
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"must be one of {list(PREFILL_ATTENTION)}")
        batch_points = profile.op_points("attn_prefill_batch")
        if self.prefill_attention == "batched" and not batch_points:
            raise ValueError(
                f"profile {profile.name!r} has no attn_prefill_batch points; use per_prompt"
            )
        self.attn_prefill_batch = Curve2D(batch_points, "num_tokens") if batch_points else None
        # a per-prompt prefill's attention stage split: its once-per-iteration part and what
        # each prompt after the first adds (None: the profile does not split it)
        outer, later = (
            profile.op_points("attn_prefill_outer"),
            profile.op_points("attn_prefill_next"),
        )
        self.attn_prefill_outer = PromptCurve(outer) if outer and later else None
        self.attn_prefill_next = Curve1D(later, "num_tokens") if outer and later else None
        # and the first prompt's call (None: a profile before it, charged a single prompt's)
        first = profile.op_points("attn_prefill_first")
        self.attn_prefill_first = (
            Curve1D(first, "num_tokens") if first and self.attn_prefill_next is not None else None
        )
        self.prefill_batched = self.prefill_attention == "batched"
        chunk_points = profile.op_points("attn_chunk")
        self.attn_chunk = (Curve2D(chunk_points, "num_tokens", row_key="kv_tokens")
                           if chunk_points else None)  # fmt: skip
        switch_points = profile.op_points("preempt_switch")
        self.switch = Curve1D(switch_points, "num_tokens") if switch_points else None
        admit_points = profile.op_points("engine_admit")
        # the engine's host time to admit k arrivals (None: the profile has none, free)
        self.admit = Curve1D(admit_points, "batch_size") if admit_points else None
        wake_points = profile.op_points("wake_up")
        self.wake = WakeUp(wake_points) if wake_points else None
        # busy time after a wake-up past which nothing of it is left (0: all at the first batch)
        self.wake_window_s = self.wake.window_s if self.wake is not None else 0.0
        self._pools: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        mem = profile.memory
        self.swap_s_per_token = mem.kv_bytes_per_token / mem.swap_bytes_per_s
        self._pool_sums: dict[int, np.ndarray] = {}  # each pool sample's float(times.sum())
        self._attention_blocks: dict[tuple[int, int], np.ndarray] = {}  # decode_attention_s

    def curves(self) -> list[Curve1D | Curve2D | PromptCurve]:
        curves = [self.attn_prefill, self.attn_decode, self.attn_decode_bind, self.router]
        curves += [self.expert, self.lm_head]
        curves += [self.overhead, self.attn_prefill_batch, self.attn_chunk, self.switch]
        curves += [self.attn_prefill_outer, self.attn_prefill_first, self.attn_prefill_next]
        curves += [self.prepare_decode, self.prepare_prefill, self.lm_head_prefill, self.admit]
        return [c for c in curves if c is not None]

    def extrapolations(self) -> list[str]:
        """Every op this model has extrapolated beyond its profile grid so far, with the
        largest input (empty when it never left the grids)."""
        return [line for c in self.curves() for line in c.extrapolations()]

    def admit_s(self, arrivals: int) -> float:
        """The engine's host time to admit ``arrivals`` requests at once (the profile's
        ``engine_admit``; 0 without it)."""
        if self.admit is None or arrivals <= 0:
            return 0.0
        return self.admit.scalar(arrivals)

    def switch_s(self, batch: Batch) -> float:
        return self.switch.scalar(batch.new_tokens) if self.switch is not None else 0.0

    def wake_s(self, idle_s: float, busy_s: float = 0.0, run_s: float = math.inf) -> float:
        """The wake-up's extra time in a batch that runs ``run_s`` (warm) from ``busy_s`` of
        work after the device sat idle for ``idle_s``: what the profile's ``wake_up`` leaves
        at busy_s minus what it leaves at busy_s + run_s (by default all of it); 0 without
        that op."""
        if self.wake is None or idle_s <= 0:
            return 0.0
        idle_ms = round(idle_s * 1e3, 3)
        return max(self.wake.left_ms(idle_ms, busy_s * 1e3)
                   - self.wake.left_ms(idle_ms, (busy_s + run_s) * 1e3), 0.0) / 1e3  # fmt: skip

    def attention_s(self, batch: Batch, bind: bool = False, kv: int | None = None) -> float:
        """``kv``: a decode batch's longest context, when the caller knows it."""
        decode = (
            self.attn_decode if not bind or self.attn_decode_bind is None else self.attn_decode_bind
        )
        if batch.phase is Phase.PREFILL:
            if self.prefill_batched:
                return self.attn_prefill_batch(batch.size, batch.new_tokens)
            if batch.size > 1 and self.attn_prefill_next is not None:
                return self.prefill_attention_split(batch)
            return sum(self.attn_prefill.scalar(s.new_tokens) for s in batch.sequences)
        if batch.phase is Phase.MIXED:  # prefill chunks one by one, decode steps batched
            pre = [s for s in batch.sequences if s.phase is Phase.PREFILL]
            dec = [s for s in batch.sequences if s.phase is Phase.DECODE]
            t = sum(self.chunk_attention_s(s.context_tokens, s.new_tokens) for s in pre)
            if dec:
                t += decode(len(dec), max(s.context_tokens for s in dec))
            return t
        # decode attention runs on the batch's caches right-padded to the longest context
        return decode(batch.size, decode_kv(batch) if kv is None else kv)

    def prefill_attention_split(self, batch: Batch) -> float:
        """A per-prompt prefill of several prompts as the runner runs it: the first prompt's
        call (``attn_prefill_first``; a profile without it: the first prompt's stage,
        ``attn_prefill``, without its once-per-iteration part), what each later prompt adds
        (``attn_prefill_next``: its call on weights the first left warm), and the
        once-per-iteration part over all the batch's tokens (``attn_prefill_outer``)."""
        first, *later = batch.sequences
        outer = self.attn_prefill_outer
        if self.attn_prefill_first is not None:
            t = self.attn_prefill_first.scalar(first.new_tokens)
        else:
            t = self.attn_prefill.scalar(first.new_tokens) - outer.scalar(0, first.new_tokens)
        t += sum(self.attn_prefill_next.scalar(s.new_tokens) for s in later)
        return t + outer.scalar(batch.size, batch.new_tokens)

    def chunk_attention_s(self, prefix_tokens: int, chunk_tokens: int) -> float:
        """A prefill chunk's attention over its cached prefix: ``attn_chunk`` when the profile
        has it, else a prefill of the chunk's own tokens (the prefix unread)."""
        if prefix_tokens and self.attn_chunk is not None:
            return self.attn_chunk(prefix_tokens, chunk_tokens)
        return self.attn_prefill.scalar(chunk_tokens)

    def _expert_times(self, counts: np.ndarray) -> np.ndarray:
        """Each expert's stage time at its token count: looked up in a table of the grid's
        integers (the same floats: ``np.interp`` at the same points) when every count lies
        on the grid, which spares a prefill the interpolation of all its experts."""
        table = self._expert_table
        if counts.max() < len(table):
            return table[counts]
        return np.where(counts > 0, self.expert(counts), self.expert_idle_s)

    def experts(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(token counts, stage times) of every expert in every layer for one iteration."""
        routing = self.routing
        if not routing.pooled(tokens):
            counts = routing.summed(tokens)
            return counts, self._expert_times(counts)
        pool = self._pools.get(tokens)
        if pool is None:
            counts = routing.pool(tokens)
            pool = self._pools[tokens] = (counts, self._expert_times(counts))
        i = routing.pick()
        return pool[0][i], pool[1][i]

    def prefill_experts(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """``experts`` of a prefill or mixed batch when the routing knows measured prompts:
        each prefill sequence's tokens a window of one (``RoutingModel.prompt_counts``), the
        decode tokens independent."""
        routing = self.routing
        lengths = [s.new_tokens for s in batch.sequences if s.phase is Phase.PREFILL]
        counts = routing.prompt_counts(lengths)
        decodes = batch.size - len(lengths)
        if decodes:
            counts = counts + (routing.pool(decodes)[routing.pick()] if routing.pooled(decodes)
                               else routing.summed(decodes))  # fmt: skip
        return counts, self._expert_times(counts)

    def plan(self, batch: Batch, bind: bool = False) -> Plan:
        tokens = batch.new_tokens
        if self.routing.prompts is not None and batch.phase is not Phase.DECODE:
            counts, experts = self.prefill_experts(batch)
        else:
            counts, experts = self.experts(tokens)
        kv = decode_kv(batch) if batch.phase is Phase.DECODE else None
        overhead, lm_head = self.overhead.scalar(batch.size), None
        if kv is None and self.prepare_prefill is not None:  # its own prepare and lm_head
            prompts = (
                batch.size
                if batch.phase is Phase.PREFILL
                else sum(s.phase is Phase.PREFILL for s in batch.sequences)
            )  # a mixed one's chunks
            overhead = (max(overhead - self.prepare_decode.scalar(batch.size), 0.0)
                        + self.prepare_prefill.scalar(prompts, tokens))  # fmt: skip
            lm_head = self.lm_head_prefill.scalar(prompts, tokens)
        return Plan(
            overhead_s=overhead + batch.swap_tokens * self.swap_s_per_token,
            attention_s=self.attention_s(batch, bind, kv),
            router_s=self.router.scalar(tokens),
            experts_s=experts,
            lm_head_s=self.lm_head.scalar(batch.size) if lm_head is None else lm_head,
            expert_tokens=counts,
            kv_tokens=kv,
        )

    def decode_run(self, batch: Batch, n: int) -> DecodeRun | None:
        """The next n iterations of a decode batch whose first iteration is planned
        (``batch.plan``), planned at once: each one token longer in context, its experts a
        random pick of the pool as ``plan`` would draw it. Fewer when the longest context would
        leave the attention grid (where ``plan`` would note an extrapolation); None when that
        leaves one iteration, or the batch's routing is not pooled."""
        size = batch.size
        kv = batch.plan.kv_tokens
        if kv is None:
            kv = decode_kv(batch)
        n = min(n, self._decode_grid_kv - kv + 1)
        if n < 2 or not self.routing.pooled(size) or size not in self._pools:
            return None
        sums = self._pool_sums.get(size)
        if sums is None:
            sums = np.array([float(t.sum()) for t in self._pools[size][1]])
            self._pool_sums[size] = sums
        return DecodeRun(self, batch.plan, size, kv, n, sums)

    ATTENTION_BLOCK_TOKENS = 1024

    def decode_attention_s(self, size: int, kv: int, n: int) -> np.ndarray:
        """``attn_decode`` at (size, kv), (size, kv + 1), ... n points within the grid: slices
        of blocks of contexts computed once each by ``Curve2D.within`` (the same floats), so
        that a run costs a few numpy calls, not a Python loop over its iterations."""
        block = self.ATTENTION_BLOCK_TOKENS
        first, last = kv // block, (kv + n - 1) // block
        parts = [self._attention_block(size, b) for b in range(first, last + 1)]
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        start = kv - first * block
        return rows[start : start + n]

    def _attention_block(self, size: int, b: int) -> np.ndarray:
        rows = self._attention_blocks.get((size, b))
        if rows is None:
            block = self.ATTENTION_BLOCK_TOKENS
            keys = np.arange(b * block, min((b + 1) * block, self._decode_grid_kv + 1))
            rows = self._attention_blocks[(size, b)] = self.attn_decode.within(size, keys)
        return rows


def decode_kv(batch: Batch) -> int:
    """The longest context of a decode batch: ``Sequence.context_tokens``, the phase known."""
    return max([q.request.prompt_tokens + q.generated for q in batch.sequences]) - 1


class DecodeRun:
    """n decode iterations of one batch, planned at once: the first is ``first``; the others
    take their routing picks at once (``RoutingModel.picks``: the numbers of n - 1 single
    draws). ``keep(j)`` gives back the picks of the iterations after the j-th."""

    def __init__(
        self, model: LatencyModel, first: Plan, size: int, kv: int, n: int, sums: np.ndarray
    ) -> None:
        self.model, self.size = model, size
        self.picks = model.routing.picks(n - 1)
        # the later iterations' stage times as ``plan`` computes them (not copied from the
        # first plan, which may carry a cost of its own, such as one of starting a batch)
        self.overhead_s = model.overhead.scalar(size)
        self.router_s = model.router.scalar(size)
        self.lm_head_s = model.lm_head.scalar(size)
        # attention_s of iteration i (from 2): the longest context is i - 1 tokens longer
        self.attention_s = model.decode_attention_s(size, kv + 1, n - 1)
        layers = first.num_layers * (self.attention_s + self.router_s) + sums[self.picks]
        rest = self.overhead_s + layers + self.lm_head_s  # Plan.total_s, in its order
        self.totals_s = np.concatenate([[first.total_s], rest])

    def keep(self, j: int) -> None:
        """Only iterations 1..j run: as if j - 1 picks had been drawn."""
        self.model.routing.unpick(len(self.totals_s) - j)

    def plan(self, i: int) -> Plan:
        """Iteration i's plan (i >= 2), as ``LatencyModel.plan`` would have made it."""
        counts, times = self.model._pools[self.size]
        pick = self.picks[i - 2]
        return Plan(
            overhead_s=self.overhead_s,
            attention_s=float(self.attention_s[i - 2]),
            router_s=self.router_s,
            experts_s=times[pick],
            lm_head_s=self.lm_head_s,
            expert_tokens=counts[pick],
        )
