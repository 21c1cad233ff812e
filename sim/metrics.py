"""Per-request table and run summary: one schema for the simulator and the real engine."""

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
    "tbt_mean_s",
    "preemptions",
]


def requests_frame(sequences: list[Seq]) -> pd.DataFrame:
    rows = []
    for s in sorted(sequences, key=lambda s: s.id):
        r = s.request
        first = s.first_token_s if s.first_token_s is not None else math.nan
        finish = s.finish_s if s.finish_s is not None else math.nan
        tbt = (finish - first) / (r.output_tokens - 1) if r.output_tokens > 1 else math.nan
        rows.append(
            (r.id, r.cls, r.source, r.arrival_s, r.prompt_tokens, r.output_tokens, first,
             finish, first - r.arrival_s, finish - r.arrival_s, tbt, s.preemptions)
        )  # fmt: skip
    df = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    return df.astype({"id": "int64", "prompt_tokens": "int64", "output_tokens": "int64",
                      "preemptions": "int64"})  # fmt: skip


def _stats(values: pd.Series) -> dict:
    v = values.dropna().to_numpy(dtype=float)
    if len(v) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(
    df: pd.DataFrame,
    makespan_s: float,
    arrived: int,
    executor: dict,
    ls_ttft_slo_s: float = 3.0,
    be_ttft_slo_s: float | None = None,
) -> dict:
    """The run summary (see README, "Outputs"). SLO attainment is the fraction of a class's
    arrived requests whose TTFT met the class's SLO (a request that never produced a token
    missed it); a class without an SLO counts as met."""
    done = df[df["finish_s"].notna()]
    slo = {LS: ls_ttft_slo_s, BE: be_ttft_slo_s}
    classes = {}
    for name, part in ((LS, df[df.cls == LS]), (BE, df[df.cls == BE]), ("all", df)):
        if name == "all":
            met = sum(_met(df[df.cls == c], slo[c]) for c in (LS, BE))
        else:
            met = _met(part, slo[name])
        classes[name] = {
            "count": int(len(part)),
            "ttft_s": _stats(part["ttft_s"]),
            "turnaround_s": _stats(part["turnaround_s"]),
            "tbt_s": _stats(part["tbt_mean_s"]),
            "slo_attainment": (met / len(part)) if len(part) else None,
        }
    span = max(makespan_s, 1e-12)
    return {
        "classes": classes,
        "throughput": {
            "jobs_per_s": len(done) / span,
            "tokens_per_s": float(done["output_tokens"].sum()) / span,
        },
        "makespan_s": makespan_s,
        "arrived": int(arrived),
        "completed": int(len(done)),
        "executor": executor,
    }


def outputs(sequences: list[Seq], makespan_s: float, events: int, wall_s: float, slo: Any):
    """(requests table, summary) of a finished run, from either executor."""
    df = requests_frame(sequences)
    summary = summarize(
        df,
        makespan_s=makespan_s,
        arrived=len(sequences),
        executor={"events": events, "wall_s": wall_s},
        ls_ttft_slo_s=slo.ls_ttft_s,
        be_ttft_slo_s=slo.be_ttft_s,
    )
    return df, summary


def _met(part: pd.DataFrame, slo_s: float | None) -> int:
    if slo_s is None:
        return len(part)
    return int((part["ttft_s"] <= slo_s).sum())


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
