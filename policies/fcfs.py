"""Request-level FCFS: static batches that run to completion (FasterTransformer style).

The oldest waiting requests form a batch (up to ``max_batch_size`` and the prefill token
budget); the batch is prefilled, then decodes until every sequence in it has finished. Nothing
joins a running batch. Memory: a request whose KV reservation does not fit waits for the next
batch; the batch forms from the requests before it (no overtaking). Under paged memory a
member preempted by recompute (the latest arrival, whatever its class) leaves the batch and
joins the next one.
"""

from __future__ import annotations

import math

from policies.core import Batch, Granularity, Sequence
from policies.scheduler import (
    Policy,
    Scheduler,
    decode_batch,
    latest_arrival_victim,
    prefill_batch,
)


class FCFS(Policy):
    name = "fcfs"
    granularity = Granularity.REQUEST
    decode_run_grows = True  # the static batch decodes whatever the memory

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.members: set[int] = set()  # ids of the running static batch

    def select(self, s: Scheduler, now: float) -> Batch | None:
        ready = [q for c in s.ready for q in s.ready[c] if q.id in self.members]
        if ready:
            for seq in ready:
                s.ready[seq.cls].remove(seq)
            return decode_batch(sorted(ready, key=lambda q: q.id))
        seqs = s.take_prefill(s.waiting_fifo(), self.max_batch_size, self.max_batch_prefill_tokens)
        self.members = {q.id for q in seqs}
        return prefill_batch(seqs)

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        self.members -= {q.id for q in batch.sequences if q.done}

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        return math.inf  # the static batch decodes until a member finishes

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        return math.inf  # nothing joins a running static batch

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        return latest_arrival_victim(s, batch)  # class-blind, as its batches
