"""Workloads: the list of requests a simulation replays.

A workload fixes, for each request, its arrival time, class (LS or BE) and lengths, drawn from a
data set (ShareGPT, HumanEval), a trace or a synthetic distribution. Three independent random
streams (arrivals, classes, length sampling; a synthetic workload's prompt and output lengths
each their own, since 2026-12-04) derive from the seed, so changing one choice, say the
arrival process or the prompt distribution, leaves the others as they were.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from policies.core import BE, LS, Request
from sim.config import Arrival, UserError, WorkloadKind
from sim.workloads import arrivals, humaneval, sharegpt, synthetic, trace
from sim.workloads.cache import Pool

__all__ = ["Workload", "build_workload", "stream_workload"]


# a daily curve over a run that spans no whole number of periods changes its mean rate: by
# more than this share, a warning
DIURNAL_RATE_TOLERANCE = 0.02


def build_workload(cfg: Any, seed: int) -> list[Request]:
    """Requests sorted by arrival, with ids 0..n-1; the same (cfg, seed) gives the same list.

    ``cfg`` is a WorkloadConfig, as a dataclass or an OmegaConf DictConfig.
    """
    return list(stream_workload(cfg, seed))


def stream_workload(cfg: Any, seed: int) -> Workload:
    """``build_workload``'s requests as columns, each Request made only when iterated to."""
    kind, arrival, n = WorkloadKind(cfg.kind), Arrival(cfg.arrival), cfg.num_requests
    if n < 1:
        raise UserError(f"workload.num_requests={n}: must be >= 1")
    if arrival is Arrival.trace and kind is not WorkloadKind.trace:
        raise UserError(f"workload.arrival=trace: needs workload.kind=trace, not {kind.value}")
    if arrival is not Arrival.trace and cfg.rate is None:
        raise UserError("workload.rate=None: required unless workload.arrival=trace")
    seeds = np.random.SeedSequence(seed).spawn(3)
    arrival_rng, class_rng, sample_rng = (np.random.default_rng(s) for s in seeds)
    is_ls = class_rng.random(n) < cfg.ls_fraction
    path = Path(cfg.path).expanduser() if cfg.path else None

    jobs = _Jobs(n)
    timestamps = None
    if kind is WorkloadKind.trace:
        if path is None:
            raise UserError("workload.path=None: workload.kind=trace needs a trace CSV")
        timestamps, pool = trace.read_trace(path)
        jobs.fill(np.arange(n), pool, np.arange(n) % len(pool), "trace")  # rows in trace order
    elif kind is WorkloadKind.synthetic:
        # prompt and output lengths from streams of their own: another prompt distribution
        # leaves the output lengths as they were (one stream shifted every output length)
        prompt_rng, output_rng = (np.random.default_rng(s) for s in seeds[2].spawn(2))
        prompt = synthetic.lengths(cfg.prompt, n, prompt_rng)
        output = synthetic.lengths(cfg.output, n, output_rng)
        jobs.fill(np.arange(n), Pool(prompt, output), np.arange(n), "synthetic")
    elif kind is WorkloadKind.card:
        # The design card's mix: code completions are latency-sensitive, chat is best-effort.
        for where, load, source in (
            (np.flatnonzero(is_ls), humaneval.load_pool, "humaneval"),
            (np.flatnonzero(~is_ls), lambda: _sharegpt(cfg, path), "sharegpt"),
        ):
            if where.size:  # a pool no job needs is not even loaded
                pool = load()
                jobs.fill(where, pool, _draw(len(pool), where.size, sample_rng), source)
    else:
        pool = humaneval.load_pool() if kind is WorkloadKind.humaneval else _sharegpt(cfg, path)
        jobs.fill(np.arange(n), pool, _draw(len(pool), n, sample_rng), kind.value)

    if cfg.max_output_tokens is not None:
        jobs.output = np.minimum(jobs.output, cfg.max_output_tokens)
    if arrival is Arrival.trace:
        times = arrivals.replay(timestamps, n, cfg.rate)
        if cfg.rate is not None and n > 1 and times[-1] <= 0:
            raise UserError(f"workload.rate={cfg.rate:g}: the {n} requests replayed from the "
                            "trace all arrive at one instant, which no rescaling gives a rate; "
                            "set workload.rate=null, or replay more of the trace")  # fmt: skip
    elif arrival is Arrival.gamma:
        times = arrivals.gamma(n, cfg.rate, cfg.cv, arrival_rng)
    else:
        times = arrivals.poisson(n, cfg.rate, arrival_rng)
    if getattr(cfg, "peak_to_trough", None) is not None:
        flat, times = times, arrivals.diurnal(times, cfg.peak_to_trough, cfg.period_s)
        if n > 1 and times[-1] > 0 and abs(flat[-1] / times[-1] - 1) > DIURNAL_RATE_TOLERANCE:
            print(f"warning: workload.peak_to_trough={cfg.peak_to_trough:g}: the run spans "
                  f"{times[-1] / cfg.period_s:.3g} of a period (workload.period_s="
                  f"{cfg.period_s:g}), and the curve keeps the mean rate over whole periods "
                  f"only: its arrivals come at {flat[-1] / times[-1]:.2f}x the rate they "
                  f"would without it ({(n - 1) / times[-1]:.3g} req/s)",
                  file=sys.stderr)  # fmt: skip

    # Every arrival process yields non-decreasing times, so index order is arrival order.
    return Workload(times, is_ls, jobs)


class Workload:
    """A workload's requests as columns (ids 0..n-1, in arrival order): about 50 bytes a
    request where a list of Request objects takes some 300, and iterating makes each Request
    as the replay reaches it, so a run of millions of requests never holds them all."""

    CHUNK = 4096  # requests converted to Python values at a time

    def __init__(self, times: np.ndarray, is_ls: np.ndarray, jobs: _Jobs) -> None:
        # a streamed run replays requests in index order, unsorted: a time out of order would
        # be admitted late without a word
        if np.any(np.diff(times) < 0):
            raise ValueError("arrival times must not decrease (requests stream in index order)")
        self.times, self.is_ls, self.jobs = times, is_ls, jobs

    def __len__(self) -> int:
        return len(self.times)

    def request(self, i: int) -> Request:
        """Request ``i`` alone, as iterating makes it."""
        ls, jobs = bool(self.is_ls[i]), self.jobs
        return Request(id=i, cls=LS if ls else BE, arrival_s=float(self.times[i]),
                       prompt_tokens=int(jobs.prompt[i]), output_tokens=int(jobs.output[i]),
                       source=jobs.source[i], text=jobs.text[i])  # fmt: skip

    def __iter__(self) -> Iterator[Request]:
        jobs = self.jobs
        for start in range(0, len(self), self.CHUNK):
            end = start + self.CHUNK
            yield from (
                Request(id=i, cls=LS if ls else BE, arrival_s=t, prompt_tokens=p,
                        output_tokens=o, source=source, text=text)
                for i, ls, t, p, o, source, text in zip(
                    range(start, min(end, len(self))), self.is_ls[start:end].tolist(),
                    self.times[start:end].tolist(), jobs.prompt[start:end].tolist(),
                    jobs.output[start:end].tolist(), jobs.source[start:end],
                    jobs.text[start:end], strict=True)
            )  # fmt: skip


class _Jobs:
    """Lengths, sources and texts of the n jobs, filled in pool by pool."""

    def __init__(self, n: int) -> None:
        self.prompt = np.zeros(n, dtype=np.int64)
        self.output = np.zeros(n, dtype=np.int64)
        self.source: list[str] = [""] * n
        self.text: list[str | None] = [None] * n

    def fill(self, where: np.ndarray, pool: Pool, rows: np.ndarray, source: str) -> None:
        self.prompt[where] = pool.prompt_tokens[rows]
        self.output[where] = pool.output_tokens[rows]
        for i, row in zip(where, rows, strict=True):
            self.source[i] = source
            self.text[i] = pool.text[row] if pool.text is not None else None


def _draw(pool_size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows of a seeded permutation of the pool, cycling when n exceeds the pool."""
    return rng.permutation(pool_size)[np.arange(n) % pool_size]


def _sharegpt(cfg: Any, path: Path | None) -> Pool:
    return sharegpt.load_pool(
        path,
        min_tokens=cfg.min_tokens,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_total_tokens=cfg.max_total_tokens,
    )
