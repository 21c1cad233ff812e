"""Iteration-level FCFS with continuous batching, as HF TGI's router does it.

All sequences that have a token decode together in one running batch. Waiting requests join
only through a prefill iteration that pauses decoding, and TGI's router allows one only when
(a) at least floor(batch size x ``waiting_served_ratio``) requests could join, or
(b) ``max_waiting_tokens`` decode steps have passed since the last join, or the batch is empty.
A prefill holds at most ``max_batch_prefill_tokens`` prompt tokens and the batch at most
``max_batch_size`` sequences. Scheduling is class-blind (FIFO by arrival).

Memory: each joining request reserves prompt + output tokens (TGI's max_batch_total_tokens
check); requests that do not fit wait, in order, until running ones finish.
"""

from __future__ import annotations

import math

from policies.core import Batch, Granularity
from policies.scheduler import Policy, Scheduler, decode_batch, prefill_batch


class IterationFCFS(Policy):
    name = "iteration"
    granularity = Granularity.ITERATION

    def __init__(
        self, max_waiting_tokens: int = 20, waiting_served_ratio: float = 1.2, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if max_waiting_tokens < 1 or waiting_served_ratio < 0:
            raise ValueError("max_waiting_tokens must be >= 1 and waiting_served_ratio >= 0")
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = waiting_served_ratio
        self.steps_since_join = 0

    def select(self, s: Scheduler, now: float) -> Batch | None:
        running = sum(len(q) for q in s.ready.values())
        room = self.max_batch_size - running
        if room > 0 and (s.waiting["LS"] or s.waiting["BE"]):
            if running == 0 or self.steps_since_join >= self.max_waiting_tokens:
                min_size = 1
            else:
                min_size = max(1, math.floor(running * self.waiting_served_ratio))
            budget = self.max_batch_prefill_tokens
            if len(s.take_prefill(s.waiting_fifo(), room, budget, dry_run=True)) >= min_size:
                self.steps_since_join = 0
                return prefill_batch(s.take_prefill(s.waiting_fifo(), room, budget))
        seqs = sorted(s.take_ready("LS", running) + s.take_ready("BE", running), key=_age)
        return decode_batch(seqs)

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        if batch.phase.value == "decode":
            self.steps_since_join += 1


def _age(seq) -> tuple[float, int]:
    return (seq.request.arrival_s, seq.id)
