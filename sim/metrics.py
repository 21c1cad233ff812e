"""Per-request table and run summary: one schema for the simulator and the real engine.

Names follow ``vllm bench serve`` where one exists: TTFT, TPOT, ITL and E2EL (our
``turnaround_s``, the paper's word); statistics are numpy's (population std, linear
percentiles), as vLLM computes them.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from policies.core import BE, LS
from policies.core import Sequence as Seq

REQUEST_COLUMNS = [
    "id",
    "cls",
    "source",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "turnaround_s",
    "tpot_s",
    "itl_max_s",
    "preemptions",
    "recomputes",
    "swaps",
]
STATS = ("mean", "std", "p50", "p90", "p95", "p99", "max")
PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def requests_frame(sequences: list[Seq]) -> pd.DataFrame:
    """The per-request table of these sequences, by id."""
    return Records.of(sequences).frame()


def stats(values: Any) -> dict:
    """mean, std (population, ddof=0), p50/p90/p95/p99 (numpy's linear percentiles) and max
    of the values that are not NaN; every field null when there are none."""
    v = np.array(values, dtype=np.float64)  # a copy of our own: the percentiles may reorder it
    nan = np.isnan(v)
    if nan.any():
        v = v[~nan]
    if len(v) == 0:
        return dict.fromkeys(STATS)
    out = {"mean": float(v.mean()), "std": float(v.std())}
    pct = np.percentile(v, list(PERCENTILES.values()), overwrite_input=True)
    return {**out, **{k: float(p) for k, p in zip(PERCENTILES, pct, strict=True)},
            "max": float(v.max())}  # fmt: skip


def _raw(values: np.ndarray) -> memoryview:
    """An array's bytes without a copy (``array.frombytes`` takes them; ``tobytes`` would
    copy every gap once more)."""
    return memoryview(np.ascontiguousarray(values)).cast("B")


class GapStats:
    """One class's gaps between tokens, in bounded memory. While there are at most
    ``exact_up_to`` of them, every one is kept and ``stats`` is numpy's on all of them,
    exactly. Past that, each full buffer is folded into running moments (count, mean, sum of
    squared deviations, combined as in Chan et al.'s parallel variance; min, max) and a
    histogram of the gaps' float32 bit patterns with 2**12 bins per power of two: a
    percentile is then read from the middles of the bins holding the two gaps numpy's linear
    rule interpolates between, within 2**-13 of the exact figure (relative; a test bounds it),
    and mean, std and max stay exact up to float64 rounding. The default keeps 4M gaps
    (16 MB) a class: some 20,000 requests of the conversation trace, 80,000 of the paper
    workload, have exact figures."""

    MANTISSA_BITS = 12
    SHIFT = 23 - MANTISSA_BITS  # float32 has 23 mantissa bits; a bin keeps the top 12
    BINS = 1 << (31 - SHIFT)  # every non-negative float32 (a gap is never negative)
    FOLD = 1 << 20

    def __init__(self, exact_up_to: int = 1 << 22) -> None:
        self.exact_up_to = exact_up_to
        self.buffer = array("f")  # the gaps not folded yet
        self.lengths: array | None = array("q")  # of each request's gaps, while all are kept
        self.hist: np.ndarray | None = None  # counts per bin, once a buffer was folded
        self.count, self.mean, self.m2 = 0, 0.0, 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, gaps: array) -> None:
        self.buffer.extend(gaps)
        if self.lengths is not None:
            self.lengths.append(len(gaps))
        if len(self.buffer) >= self.exact_up_to:
            self._fold()

    def add_many(self, gaps: np.ndarray, lengths: np.ndarray) -> None:
        """``add`` of several requests' gaps at once: ``gaps`` (float32) holds them one
        request after another, ``lengths`` how many each has; folded where one ``add`` at a
        time would fold (after the request that fills the buffer), so the same statistics."""
        lengths = np.asarray(lengths, dtype=np.int64)
        start = pos = 0
        while start < len(lengths):
            ends = np.cumsum(lengths[start:])
            room = self.exact_up_to - len(self.buffer)
            stop = start + min(int(np.searchsorted(ends, room, side="left")), len(ends) - 1) + 1
            take = int(ends[stop - start - 1])
            self.buffer.frombytes(_raw(gaps[pos : pos + take]))
            if self.lengths is not None:
                self.lengths.frombytes(_raw(lengths[start:stop]))
            pos, start = pos + take, stop
            if len(self.buffer) >= self.exact_up_to:
                self._fold()

    def reordered(self, order: np.ndarray) -> GapStats:
        """While every gap is kept: these gaps with the requests' in this order of their
        ``add`` calls (the exact mean and std are sums, whose rounding depends on the order);
        else these statistics themselves."""
        if self.lengths is None:
            return self
        lengths = np.frombuffer(self.lengths, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        n = lengths[order]
        index = np.repeat(starts[order] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        out = GapStats(self.exact_up_to)
        out.buffer.frombytes(np.frombuffer(self.buffer, dtype=np.float32)[index].tobytes())
        out.lengths = array("q", n.tobytes())
        return out

    def _fold(self) -> None:
        """Move the buffer into the moments and the histogram."""
        v = np.frombuffer(self.buffer, dtype=np.float32)
        if self.hist is None:
            self.hist = np.zeros(self.BINS, dtype=np.int64)
            self.lengths = None
        for start in range(0, len(v), self.FOLD):  # slices: float64 copies of 8 MB at most
            part = v[start : start + self.FOLD]
            self.hist += np.bincount(part.view(np.uint32) >> self.SHIFT, minlength=self.BINS)
            w = part.astype(np.float64)
            mean = float(w.mean())
            self._combine(len(w), mean, float(np.square(w - mean).sum()), w.min(), w.max())
        del v  # the buffer cannot be replaced while a view of it exists
        self.buffer = array("f")

    def _combine(self, n: int, mean: float, m2: float, lo: float, hi: float) -> None:
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total
        self.min, self.max = min(self.min, float(lo)), max(self.max, float(hi))

    @classmethod
    def merged(cls, parts: list[GapStats]) -> GapStats:
        """The statistics of all the parts' gaps together (``all``: LS, then BE)."""
        out = cls(exact_up_to=min(p.exact_up_to for p in parts))
        for p in parts:
            out.add(p.buffer)
        if all(p.hist is None for p in parts) and out.hist is None:
            return out  # every gap kept: exact
        out._fold()
        for p in parts:
            if p.hist is not None:
                out.hist += p.hist
                out._combine(p.count, p.mean, p.m2, p.min, p.max)
        return out

    def stats(self) -> dict:
        """What ``stats`` gives on every gap: exactly while all are kept, else from the
        moments and the histogram."""
        if self.hist is None:
            return stats(np.frombuffer(self.buffer, dtype=np.float32))
        self._fold()
        if not self.count:
            return dict.fromkeys(STATS)
        cum = np.cumsum(self.hist)

        def at(rank: int) -> float:  # the rank-th smallest gap (from 0): its bin's middle
            b = np.uint32(np.searchsorted(cum, rank, side="right"))
            edges = np.array([b, b + 1], dtype=np.uint32) << np.uint32(self.SHIFT)
            return min(max(float(edges.view(np.float32).mean(dtype=np.float64)), self.min),
                       self.max)  # fmt: skip

        out = {"mean": self.mean, "std": math.sqrt(self.m2 / self.count)}
        for name, q in PERCENTILES.items():  # numpy's linear rule on the bins' middles
            h = (self.count - 1) * q / 100
            i = math.floor(h)
            lo = at(i)
            out[name] = lo + (h - i) * (at(min(i + 1, self.count - 1)) - lo)
        return {**out, "max": self.max}


class Records:
    """Requests as columns: what requests.parquet and the summary need of each, some 100
    bytes a request, and their gaps between tokens folded into one ``GapStats`` per class. A
    long simulation adds each sequence as it finishes and drops the object. The real engine's
    unfinished requests are added too (no finish, no gaps counted)."""

    def __init__(self, exact_gaps_up_to: int = 1 << 22, replica_order: bool = False) -> None:
        """``replica_order``: exact ITL statistics take the gaps replica by replica, each
        replica's requests in arrival order, as from a kept ``SimResult.sequences``, rather
        than in the order the requests were added (their order of finishing)."""
        self.replica_order = replica_order
        self.id = array("q")
        self.ls = array("b")
        self.source = array("h")  # index into the keys of self.sources
        self.sources: dict[str, int] = {}
        self.arrival_s = array("d")
        self.prompt_tokens = array("q")
        self.output_tokens = array("q")
        self.first_token_s = array("d")
        self.finish_s = array("d")
        self.itl_max_s = array("d")
        self.preemptions = array("q")
        self.recomputes = array("q")
        self.swaps = array("q")
        self.replica = array("q")
        self.gaps = {LS: GapStats(exact_gaps_up_to), BE: GapStats(exact_gaps_up_to)}

    @classmethod
    def of(cls, sequences: list[Seq]) -> Records:
        records = cls()
        for s in sequences:
            records.add(s)
        return records

    def __len__(self) -> int:
        return len(self.id)

    def add(self, s: Seq, replica: int = 0) -> None:
        r = s.request
        finished = s.finish_s is not None
        self.id.append(r.id)
        self.ls.append(r.cls == LS)
        self.source.append(self.sources.setdefault(r.source, len(self.sources)))
        self.arrival_s.append(r.arrival_s)
        self.prompt_tokens.append(r.prompt_tokens)
        self.output_tokens.append(r.output_tokens)
        self.first_token_s.append(math.nan if s.first_token_s is None else s.first_token_s)
        self.finish_s.append(s.finish_s if finished else math.nan)
        # a finished request of one token has no gap between tokens: no ITL
        two = finished and r.output_tokens > 1
        gaps = np.frombuffer(s.token_gaps_s, dtype=np.float32)  # max(): one float32 of them
        self.itl_max_s.append(float(gaps.max()) if two else math.nan)
        self.preemptions.append(s.preemptions)
        self.recomputes.append(s.recomputes)
        self.swaps.append(s.swaps)
        self.replica.append(replica)
        if finished:
            self.gaps[r.cls].add(s.token_gaps_s)

    def add_columns(self, ids: np.ndarray, ls: np.ndarray, source: np.ndarray,
                    arrival_s: np.ndarray, prompt_tokens: np.ndarray,
                    output_tokens: np.ndarray, first_token_s: np.ndarray,
                    finish_s: np.ndarray, itl_max_s: np.ndarray, replica: np.ndarray,
                    gaps: dict[str, tuple[np.ndarray, np.ndarray]],
                    preemptions: np.ndarray) -> None:  # fmt: skip
        """``add`` of finished requests given as columns (the compiled executor's), in the
        order they finished: ``source`` indexes ``self.sources``' keys; no recomputes or
        swaps; ``gaps[cls]``: (the class's gaps one request after another, their counts), as
        ``GapStats.add_many`` takes them."""

        def put(a: array, values: np.ndarray) -> None:
            a.frombytes(_raw(np.asarray(values, dtype=a.typecode)))

        n = len(ids)
        put(self.id, ids)
        put(self.ls, ls.astype(np.int8))
        put(self.source, source)
        put(self.arrival_s, arrival_s)
        put(self.prompt_tokens, prompt_tokens)
        put(self.output_tokens, output_tokens)
        put(self.first_token_s, first_token_s)
        put(self.finish_s, finish_s)
        put(self.itl_max_s, np.where(output_tokens > 1, itl_max_s, math.nan))
        zeros = np.zeros(n, dtype=np.int64)
        put(self.preemptions, preemptions)
        for a in (self.recomputes, self.swaps):
            put(a, zeros)
        put(self.replica, replica)
        for cls, (values, lengths) in gaps.items():
            if len(lengths):
                self.gaps[cls].add_many(values, lengths)

    def gap_stats(self) -> dict[str, GapStats]:
        """The gaps of each class (in replica order, if asked: see ``__init__``)."""
        if self.replica_order:
            finished = ~np.isnan(np.frombuffer(self.finish_s))
            ls = np.frombuffer(self.ls, dtype=np.int8).astype(bool)
            keys = [np.frombuffer(a, dtype=a.typecode) for a in (self.id, self.arrival_s,
                                                                 self.replica)]  # fmt: skip
            return {cls: self.gaps[cls].reordered(np.lexsort([k[mine] for k in keys]))
                    for cls, mine in ((LS, finished & ls), (BE, finished & ~ls))}  # fmt: skip
        return self.gaps

    def frame(self, with_replica: bool = False) -> pd.DataFrame:
        """requests.parquet's table, by id (with each request's replica, if asked)."""
        order = np.argsort(np.frombuffer(self.id, dtype=np.int64), kind="stable")

        def col(a: array) -> np.ndarray:
            return np.frombuffer(a, dtype=a.typecode)[order]

        arrival, first, finish = col(self.arrival_s), col(self.first_token_s), col(self.finish_s)
        output = col(self.output_tokens)
        tpot = np.full(len(order), math.nan)
        np.divide(finish - first, output - 1, out=tpot, where=~np.isnan(finish) & (output > 1))
        names = np.array([*self.sources, ""], dtype=object)  # "": never indexed, keeps it 1-d
        df = pd.DataFrame({
            "id": col(self.id), "cls": np.where(col(self.ls), LS, BE).astype(object),
            "source": names[col(self.source)], "arrival_s": arrival,
            "prompt_tokens": col(self.prompt_tokens), "output_tokens": output,
            "first_token_s": first, "finish_s": finish, "ttft_s": first - arrival,
            "turnaround_s": finish - arrival, "tpot_s": tpot, "itl_max_s": col(self.itl_max_s),
            "preemptions": col(self.preemptions), "recomputes": col(self.recomputes),
            "swaps": col(self.swaps),
        })  # fmt: skip
        if with_replica:
            df["replica"] = col(self.replica)
        return df


def summarize(
    df: pd.DataFrame,
    gaps: dict[str, GapStats],
    makespan_s: float,
    arrived: int,
    executor: dict,
    slo: Any,
) -> dict:
    """The run summary (see README, "Outputs", for every field).

    A request meets an SLO when it finished and its TTFT (TPOT) is at most the class's
    ``slo.<cls>_ttft_s`` (``slo.<cls>_tpot_s``); a request that did not finish misses it.
    ``slo_attainment`` is the fraction of a class's requests that met its TTFT SLO, ``goodput``
    the fraction that met every SLO set for the class (a one-token output meets any TPOT SLO);
    a class without such an SLO has none (null), and ``all`` counts only the requests of the
    classes that have one (null when no class has).

    ``steady_jobs_per_s`` leaves out warm-up and drain: with the n arrival times sorted,
    a[0] <= ... <= a[n-1], the window runs from a[floor(n/10)] to a[n-1], and the figure is the
    number of requests finished in (start, end] divided by end - start (null when end <= start).
    """
    done = df["finish_s"].notna()
    ttft_slo = {LS: slo.ls_ttft_s, BE: slo.be_ttft_s}
    tpot_slo = {LS: slo.ls_tpot_s, BE: slo.be_tpot_s}
    met_ttft, good = pd.Series(False, index=df.index), pd.Series(False, index=df.index)
    has_ttft_slo, has_slo = met_ttft.copy(), good.copy()
    for c in (LS, BE):
        mine = df["cls"] == c
        ttft_ok = done if ttft_slo[c] is None else done & (df["ttft_s"] <= ttft_slo[c])
        tpot_ok = done if tpot_slo[c] is None else done & ~(df["tpot_s"] > tpot_slo[c])
        met_ttft[mine], good[mine] = ttft_ok[mine], (ttft_ok & tpot_ok)[mine]
        has_ttft_slo[mine] = ttft_slo[c] is not None
        has_slo[mine] = ttft_slo[c] is not None or tpot_slo[c] is not None
    gaps = {**gaps, "all": GapStats.merged([gaps[LS], gaps[BE]])}
    columns = ["ttft_s", "tpot_s", "turnaround_s", "preemptions", "recomputes", "swaps"]
    classes = {}
    for name in (LS, BE, "all"):
        mine = pd.Series(True, index=df.index) if name == "all" else df["cls"] == name
        part = df.loc[mine, columns]  # not every column: a million rows are 12 MB each
        classes[name] = {
            "count": int(len(part)),
            "ttft_s": stats(part["ttft_s"]),
            "tpot_s": stats(part["tpot_s"]),
            "itl_s": gaps[name].stats(),
            "turnaround_s": stats(part["turnaround_s"]),
            "slo_attainment": _fraction(met_ttft[mine & has_ttft_slo]),
            "goodput": _fraction(good[mine & has_slo]),
            "preemptions": int(part["preemptions"].sum()),
            "recomputes": int(part["recomputes"].sum()),
            "swaps": int(part["swaps"].sum()),
        }
    span = max(makespan_s, 1e-12)
    finished = df[done]
    output_tokens = float(finished["output_tokens"].sum())
    return {
        "classes": classes,
        "throughput": {
            "jobs_per_s": len(finished) / span,
            "output_tokens_per_s": output_tokens / span,
            "total_tokens_per_s": (output_tokens + float(finished["prompt_tokens"].sum())) / span,
            "goodput_jobs_per_s": (int(good[has_slo].sum()) / span) if has_slo.any() else None,
            "steady_jobs_per_s": steady_jobs_per_s(df),
        },
        "makespan_s": makespan_s,
        "arrived": int(arrived),
        "completed": int(len(finished)),
        "executor": executor,
    }


def steady_jobs_per_s(df: pd.DataFrame) -> float | None:
    """Completions per second between the arrival of request floor(n/10) (in arrival order)
    and the last arrival; see ``summarize``."""
    arrivals = np.sort(df["arrival_s"].to_numpy(dtype=float))
    if len(arrivals) == 0:
        return None
    start, end = arrivals[len(arrivals) // 10], arrivals[-1]
    if end <= start:
        return None
    finish = df["finish_s"]
    return int(((finish > start) & (finish <= end)).sum()) / (end - start)


def _fraction(flags: pd.Series) -> float | None:
    return float(flags.mean()) if len(flags) else None


def outputs(sequences: list[Seq], makespan_s: float, events: int, wall_s: float, slo: Any):
    """(requests table, summary) of a finished run, from either executor."""
    return records_outputs(Records.of(sequences), makespan_s, events, wall_s, slo)


def records_outputs(records: Records, makespan_s: float, events: int, wall_s: float, slo: Any,
                    with_replica: bool = False):  # fmt: skip
    """``outputs`` of requests already folded into ``records``."""
    df = records.frame(with_replica)
    summary = summarize(
        df,
        records.gap_stats(),
        makespan_s=makespan_s,
        arrived=len(records),
        executor={"events": events, "wall_s": wall_s},
        slo=slo,
    )
    return df, summary


def write_outputs(run_dir: str | Path, df: pd.DataFrame, summary: dict,
                  tables: dict[str, pd.DataFrame] | None = None) -> None:  # fmt: skip
    """Write requests.parquet (and any other ``tables``, as ``<name>.parquet``), then
    summary.json last and atomically: a summary exists only for a run that finished, so a
    report never reads a half-written one."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    df.to_parquet(run_dir / "requests.parquet", index=False)
    for name, table in (tables or {}).items():
        table.to_parquet(run_dir / f"{name}.parquet", index=False)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")
