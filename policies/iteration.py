"""Iteration-level FCFS with continuous batching, as HF TGI's router does it.

Follows TGI's ``batching_task`` for a model without prefill chunking: router/src/infer.rs in
v1.4.5 and v2.0.1, backends/v3/src/backend.rs in v3.3.7 (the last release); the rules below are
the same in all three:

- All sequences that have a token decode together in one running batch. Waiting requests join
  only through a prefill iteration that pauses decoding.
- TGI's counter ``waiting_tokens`` is set to 1 by every prefill and grows by 1 with every
  decode step. Before each decode step the router tries a join: any number of waiting requests
  may join once ``waiting_tokens >= max_waiting_tokens`` (with the default 20: after 19 decode
  steps), otherwise only when at least floor(running x ``waiting_served_ratio``) requests fit.
- After a join the merged batch decodes once before the next try (TGI's loop decodes right
  after a join); after a prefill into an empty batch the router tries a join at once.
- A prefill holds at most ``max_batch_prefill_tokens`` prompt tokens; the batch holds at most
  ``max_batch_size`` sequences (null: no cap, TGI's default) and reserves at most
  ``max_batch_total_tokens`` KV tokens, prompt + output of every member (null: only the KV
  cache's capacity bounds it, as when TGI infers the figure from free memory).

``waiting_served_ratio`` defaults to 1.2, TGI's default up to v2.0.1; TGI v2.0.2 (pull request
#1820, April 2024) lowered it to 0.3: ``conf/policy/iteration.yaml`` is the former,
``conf/policy/tgi-0.3.yaml`` the latter. TGI v3 ignores both join rules for models that
support prefill chunking; that reading is not modelled. Scheduling is class-blind (FIFO by
arrival).

Memory: each joining request reserves prompt + output tokens; requests that do not fit wait,
in order, until running ones finish. Under ``memory.model=paged`` (not TGI's) a sequence that
cannot grow preempts the latest arrival by recompute, whatever its class.
"""

from __future__ import annotations

import math

from policies.core import Batch, Granularity, Phase, Sequence
from policies.scheduler import (
    ARRIVAL_ORDER,
    CapacityError,
    Policy,
    Scheduler,
    cap,
    decode_batch,
    latest_arrival_victim,
    prefill_batch,
)


class IterationFCFS(Policy):
    name = "iteration"
    granularity = Granularity.ITERATION

    def __init__(
        self,
        max_waiting_tokens: int = 20,
        waiting_served_ratio: float = 1.2,
        max_batch_total_tokens: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if max_waiting_tokens < 1 or waiting_served_ratio < 0:
            raise ValueError("max_waiting_tokens must be >= 1 and waiting_served_ratio >= 0")
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = waiting_served_ratio
        self.max_batch_total_tokens = cap("max_batch_total_tokens", max_batch_total_tokens)
        self.waiting_tokens = 1  # TGI's counter: 1 after a prefill, +1 per decode step
        self.decode_next = False  # a join was just prefilled: the merged batch decodes first

    def select(self, s: Scheduler, now: float) -> Batch | None:
        running = [q for c in s.ready for q in s.ready[c]]
        if (s.waiting["LS"] or s.waiting["BE"]) and not (running and self.decode_next):
            joined = self._join(s, running)
            if joined is not None:
                self.decode_next = bool(running)
                return joined
        self.decode_next = False
        seqs = s.take_ready("LS", len(running)) + s.take_ready("BE", len(running))
        seqs.sort(key=ARRIVAL_ORDER)
        return decode_batch(seqs)

    def _join(self, s: Scheduler, running: list) -> Batch | None:
        """TGI's ``queue.next_batch(min_size, max_size, prefill budget, token budget)``."""
        room = self.max_batch_size - len(running)
        if room <= 0:
            return None
        if not running or self.waiting_tokens >= self.max_waiting_tokens:
            min_size = 1
        else:
            min_size = max(1, math.floor(len(running) * self.waiting_served_ratio))
        budget = self._budget(running)
        args = (room, self.max_batch_prefill_tokens)
        admitted = s.take_prefill(s.waiting_fifo(), *args, dry_run=True, max_reserved_tokens=budget)
        if not running and not admitted:
            head = next(s.waiting_fifo())
            if head.reserved_tokens > self.max_batch_total_tokens:  # TGI refuses it on arrival
                raise CapacityError(
                    f"request {head.id} needs {head.reserved_tokens} KV tokens, more than "
                    f"the batch may hold",
                    key=f"policy.max_batch_total_tokens={self.max_batch_total_tokens}",
                )
        if len(admitted) < min_size:
            return None
        s.take(admitted)  # what take_prefill would take now: nothing changed since the dry run
        return prefill_batch(admitted)

    def _budget(self, running: list) -> float:
        """KV tokens the joining requests may reserve: what ``max_batch_total_tokens`` leaves
        to the running batch's reservations (not summed when there is no cap: asked at every
        arrival during a run)."""
        if self.max_batch_total_tokens == math.inf:
            return math.inf
        return self.max_batch_total_tokens - sum(q.reserved_tokens for q in running)

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        self.waiting_tokens = 1 if batch.phase is Phase.PREFILL else self.waiting_tokens + 1

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """Decoding changes only ``waiting_tokens``: a join that admits some waiting requests,
        too few for ``waiting_served_ratio``, happens once it reaches ``max_waiting_tokens``."""
        room = self.max_batch_size - batch.size
        if room <= 0 or not (s.waiting["LS"] or s.waiting["BE"]):
            return math.inf
        budget = self._budget(batch.sequences)
        admitted = s.take_prefill(s.waiting_fifo(), room, self.max_batch_prefill_tokens,
                                  dry_run=True, max_reserved_tokens=budget)  # fmt: skip
        if not admitted:
            return math.inf
        if len(admitted) >= max(1, math.floor(batch.size * self.waiting_served_ratio)):
            return 1  # the next select joins
        # after i decodes waiting_tokens is i higher; the select that sees max_waiting_tokens joins
        return max(1, self.max_waiting_tokens - self.waiting_tokens)

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq) -> float:
        """``decode_run`` reads the waiting queue as it is, and the counter as it was when the
        run began (``on_decodes`` has not yet applied the run)."""
        return self.decode_run(s, batch)

    def on_decodes(self, s: Scheduler, batch: Batch, ends_s) -> None:
        self.waiting_tokens += len(ends_s)

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        return latest_arrival_victim(s, batch)  # class-blind, as its admission
