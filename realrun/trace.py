"""A Chrome trace of a real run (Trace Event Format, opens in Perfetto or chrome://tracing).

Process "engine": thread "batches" has one complete ("X") event per executed segment of a
batch (from its start or resume to its end, preemption or merge), thread "stages" one per stage that
did work (empty expert queues are left out). Process "requests": one thread per request with
an event from arrival to finish and, nested in it, one from arrival to the first token. Times
are microseconds of the engine's clock.
"""

from __future__ import annotations

import json
from pathlib import Path

from policies.core import Batch
from policies.core import Sequence as Seq
from profiler.ops import StageRef

ENGINE, REQUESTS = 0, 1
BATCHES, STAGES = 0, 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


class ChromeTrace:
    def __init__(self, stages: bool = True) -> None:
        self.stages = stages
        self.events: list[dict] = [
            _meta("process_name", ENGINE, 0, "engine"),
            _meta("thread_name", ENGINE, BATCHES, "batches"),
            _meta("thread_name", ENGINE, STAGES, "stages"),
            _meta("process_name", REQUESTS, 0, "requests"),
        ]

    def _complete(self, name, cat, pid, tid, start_s, end_s, args) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "args": args}
        self.events.append({**event, "ts": _us(start_s), "dur": _us(end_s - start_s)})

    def stage(self, ref: StageRef, batch: Batch, start_s: float, end_s: float, tokens: int) -> None:
        if ref.stage == "expert":
            name = f"expert L{ref.layer}.E{ref.expert}"
        elif ref.layer >= 0:
            name = f"{ref.stage} L{ref.layer}"
        else:
            name = ref.stage
        self._complete(name, ref.stage, ENGINE, STAGES, start_s, end_s,
                       {"batch": batch.id, "index": ref.index, "tokens": tokens})  # fmt: skip

    def segment(self, batch: Batch, start_s: float, end_s: float, preempted: bool,
                merged: bool = False) -> None:  # fmt: skip
        outcome = "preempted" if preempted else "merged" if merged else "done"
        ids = [s.id for s in batch.sequences]
        self._complete(f"{batch.phase.value} #{batch.id} ({outcome})", batch.phase.value, ENGINE,
                       BATCHES, start_s, end_s, {"requests": ids, "size": batch.size,
                                                 "ls": batch.has_ls})  # fmt: skip

    def request(self, seq: Seq) -> None:
        r = seq.request
        args = {"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "preemptions": seq.preemptions}  # fmt: skip
        self.events.append(_meta("thread_name", REQUESTS, r.id, f"{r.cls} #{r.id}"))
        self._complete(f"{r.cls} #{r.id}", r.cls, REQUESTS, r.id, r.arrival_s, seq.finish_s, args)
        self._complete("ttft", "ttft", REQUESTS, r.id, r.arrival_s, seq.first_token_s, {})

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        return path


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
