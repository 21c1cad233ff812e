"""Per-request table and run summary: one schema for the simulator and the real engine.

Names follow ``vllm bench serve`` where one exists: TTFT, TPOT, ITL and E2EL (our
``turnaround_s``, the paper's word); statistics are numpy's (population std, linear
percentiles), as vLLM computes them.
"""

from __future__ import annotations

import json
import math
import os
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
    rows = []
    for s in sorted(sequences, key=lambda s: s.id):
        r = s.request
        first = s.first_token_s if s.first_token_s is not None else math.nan
        finish = s.finish_s if s.finish_s is not None else math.nan
        # a finished request of one token has no gap between tokens: no TPOT, no ITL
        two = s.finish_s is not None and r.output_tokens > 1
        tpot = (finish - first) / (r.output_tokens - 1) if two else math.nan
        itl_max = float(max(s.token_gaps_s)) if two else math.nan
        rows.append(
            (r.id, r.cls, r.source, r.arrival_s, r.prompt_tokens, r.output_tokens, first,
             finish, first - r.arrival_s, finish - r.arrival_s, tpot, itl_max, s.preemptions,
             s.recomputes, s.swaps)
        )  # fmt: skip
    df = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    return df.astype({"id": "int64", "prompt_tokens": "int64", "output_tokens": "int64",
                      "preemptions": "int64", "recomputes": "int64",
                      "swaps": "int64"})  # fmt: skip


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


def token_gaps(sequences: list[Seq]) -> dict[str, np.ndarray]:
    """Every gap between two consecutive tokens of the finished requests, per class."""
    gaps = {}
    for cls in (LS, BE):
        parts = [np.frombuffer(s.token_gaps_s, dtype=np.float32) for s in sequences
                 if s.cls == cls and s.finish_s is not None]  # fmt: skip
        gaps[cls] = np.concatenate(parts) if parts else np.empty(0, dtype=np.float32)
    return gaps


def summarize(
    df: pd.DataFrame,
    gaps: dict[str, np.ndarray],
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
    gaps = {**gaps, "all": np.concatenate([gaps[LS], gaps[BE]])}
    classes = {}
    for name in (LS, BE, "all"):
        mine = pd.Series(True, index=df.index) if name == "all" else df["cls"] == name
        part = df[mine]
        classes[name] = {
            "count": int(len(part)),
            "ttft_s": stats(part["ttft_s"]),
            "tpot_s": stats(part["tpot_s"]),
            "itl_s": stats(gaps[name]),
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
    df = requests_frame(sequences)
    summary = summarize(
        df,
        token_gaps(sequences),
        makespan_s=makespan_s,
        arrived=len(sequences),
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
