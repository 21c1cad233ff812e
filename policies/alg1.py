"""The paper's Algorithm 1 (GetNextBatch) decided between iterations only: the ablation ``alg1``.

Four FCFS queues: LS-prefill, LS-decode, BE-prefill, BE-decode. The next batch is, in order:
1. a full batch of LS-decode jobs, if that many wait;
2. LS-prefill jobs, the rest of the batch filled from BE-prefill (``fill_be_prefill``);
3. LS-decode jobs, the rest filled from BE-decode;
4. a suspended batch, resumed from its cursor (ours: the paper leaves resume order open);
5. BE-decode jobs; 6. BE-prefill jobs.
When memory is short, LS work keeps its place: while an LS prompt waits for KV memory, no BE
prompt is admitted (step 6 is closed, and step 2 fills a batch with BE prompts only if the
LS prompts left waiting fit); BE decodes and suspended batches run on and free it.
This class never preempts: ``layer`` and ``qllm`` (policies/layer.py, policies/qllm.py) add
preemption inside an iteration on top of this very selection, so ``alg1`` against them
separates what the queue order buys from what preemption buys.

Options (each a Hydra key ``policy.<name>``):

- ``refill_be`` (ours, default true): when fewer than a batch of BE-decode jobs remain and
  BE-prefill jobs wait, those are prefilled first so decode batches stay full, as continuous
  batching does. Read literally, step 6 admits BE prefills only once no BE decode is left;
  false gives that reading.
- ``fill_be_prefill`` (default true, step 2 as the paper reads): an LS prefill batch is filled
  with waiting BE prompts up to the batch size and the prefill token budget; false prefills LS
  prompts alone (BE prompts are then admitted only by steps 5-6 or the starvation guard).
- ``max_in_flight`` (default null: no cap): the most admitted, unfinished sequences (running,
  decode-ready and suspended together). Algorithm 1's batch size bounds one iteration only, so
  without it an LS prefill filled with BE prompts can admit hundreds of sequences; with
  ``max_in_flight = max_batch_size`` a batch size of 32 means what it means for ``iteration``
  and ``priority``. A prefill (of either class) waits for a free slot.
- ``be_max_wait_s`` (default null: off): starvation guard. A BE job that has waited longer
  than this, for its first token (since arrival) or for its next token (since its last one),
  is served as LS would be until its next token: it joins the LS queues (FIFO by how long it
  has waited) and a batch holding it is not preempted for an LS arrival; a suspended batch
  holding one is resumed before LS-decode work (after steps 1-2). It bounds a BE job's wait by
  the limit plus what an LS job would wait at that moment, not absolutely: Algorithm 1 itself
  lets LS prefills (step 2) delay every decode.

- ``evict_be_for_ls`` (ours, default false): when the first waiting LS job does not fit in
  KV memory, BE work is preempted by recompute to make room (``Scheduler.evict``): decode-ready
  BE jobs, latest arrival first, then suspended BE batches (their KV, their saved activations
  and the work of their unfinished iteration), oldest first; only if that frees enough.

Memory: the configured model (``reserve``: prompt + output tokens on admission); a suspended
batch also holds its saved activations. Unless ``evict_be_for_ls`` is set, nothing is evicted
for LS work: when memory is short, an LS job waits for BE work already admitted to finish
(not for BE work admitted after it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection

from policies.core import BE, LS, Batch, Granularity, Sequence
from policies.scheduler import Policy, Scheduler, cap, decode_batch, prefill_batch


class Algorithm1(Policy):
    name = "alg1"
    granularity = Granularity.ITERATION

    def __init__(
        self,
        refill_be: bool = True,
        fill_be_prefill: bool = True,
        max_in_flight: int | None = None,
        be_max_wait_s: float | None = None,
        evict_be_for_ls: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if be_max_wait_s is not None and not (
            isinstance(be_max_wait_s, (int, float)) and be_max_wait_s >= 0
        ):
            raise ValueError(f"be_max_wait_s={be_max_wait_s}: must be >= 0 seconds, or null (off)")
        self.refill_be = refill_be
        self.fill_be_prefill = fill_be_prefill
        self.max_in_flight = cap("max_in_flight", max_in_flight)
        self.be_max_wait_s = be_max_wait_s
        self.evict_be_for_ls = evict_be_for_ls
        self.promoted: set[int] = set()  # overdue BE ids served as LS until their next token

    # ------------------------------------------------------------------------------ selection
    def select(self, s: Scheduler, now: float) -> Batch | None:
        size, budget = self.max_batch_size, self.max_batch_prefill_tokens
        slots = self.max_in_flight - self.in_flight(s)
        ls_waiting, ls_ready = self._ls_queues(s, now)
        if len(ls_ready) >= size:
            return self._decode(s, list(itertools.islice(ls_ready, size)), size)
        if ls_waiting and slots > 0:
            if self.evict_be_for_ls and s.waiting[LS]:
                # room for the first real LS request and the overdue BE ones queued before
                # it (admitted in order); never for overdue BE work alone, which evicting
                # other BE work would only trade for its own kind, each victim soon overdue
                # in turn (2,042 recomputes for 150 requests, most of them that)
                self._evict_be(s, self._ls_need(s, ls_waiting))
            ls = s.take_prefill(ls_waiting, min(size, slots), budget)
            if ls:
                self._promote(ls)
                room = min(size, slots) - len(ls)
                # the rest filled with BE prompts, unless an LS prompt is left waiting for KV
                # memory (a smaller BE prompt would take the room it waits for)
                # (take_prefill took a prefix: out of the queue itself, or of the guard's copy)
                rest = ls_waiting if ls_waiting is s.waiting[LS] else ls_waiting[len(ls) :]
                left = next(iter(rest), None)
                blocked = left is not None and not s.fits(s.memory.admit_tokens(left))
                if self.fill_be_prefill and room > 0 and not blocked:
                    used = sum(q.new_tokens for q in ls)
                    fill = s.waiting[BE]
                    ls += s.take_prefill(fill, room, budget - used, alone_if_oversized=False)
                return prefill_batch(ls)
        overdue = [b for b in s.suspended if self._overdue(b.sequences, now)]
        if overdue:
            self._promote(overdue[0].sequences)
            return overdue[0]
        if ls_ready:
            return self._decode(s, list(ls_ready), size)
        if s.suspended:
            return s.suspended[0]
        # 6. BE prompts, none while an LS prompt waits (step 2 admitted nothing: its KV does
        # not fit, and a smaller BE prompt would take the room it waits for). Algorithm 1
        # itself goes no further than step 2 while LS-prefill is non-empty; decodes and
        # resumes still run here, and free memory.
        room = min(size - len(s.ready[BE]), slots)
        if not ls_waiting and room > 0 and (self.refill_be or not s.ready[BE]):
            refill = s.take_prefill(s.waiting[BE], room, budget)
            if refill:
                return prefill_batch(refill)
        return decode_batch(s.take_ready(BE, size))

    def in_flight(self, s: Scheduler) -> int:
        """Admitted, unfinished sequences: running, decode-ready and suspended."""
        n = sum(len(q) for q in s.ready.values()) + sum(b.size for b in s.suspended)
        return n + (s.running.size if s.running is not None else 0)

    def _ls_queues(self, s: Scheduler, now: float) -> tuple[Collection[Sequence], ...]:
        """The LS-prefill and LS-decode queues, with overdue BE jobs merged in (longest
        waiting first) when the starvation guard is on. Every BE job is looked at: an evicted
        one goes back to the front of its queue, waiting since its last token, so the overdue
        ones are not a prefix of it."""
        if self.be_max_wait_s is None:
            return s.waiting[LS], s.ready[LS]
        since, limit = self._waiting_since, self.be_max_wait_s
        late_waiting = sorted((q for q in s.waiting[BE] if now - since(q) > limit), key=since)
        late_ready = sorted((q for q in s.ready[BE] if now - since(q) > limit), key=since)
        waiting = heapq.merge(s.waiting[LS], late_waiting, key=since)
        ready = heapq.merge(s.ready[LS], late_ready, key=since)
        return list(waiting), list(ready)

    def _ls_need(self, s: Scheduler, ls_waiting: Collection[Sequence]) -> int:
        """The KV the first real LS job needs to be admitted: its own charge and that of the
        overdue BE jobs queued before it (admitted in order; 0 when none waits)."""
        need = 0
        for q in ls_waiting:
            need += s.memory.admit_tokens(q)
            if q.cls == LS:
                return need
        return 0

    def _decode(self, s: Scheduler, first: list[Sequence], size: float) -> Batch | None:
        """A decode batch of ``first`` (heads of the decode queues), filled from BE-decode."""
        for q in first:
            s.ready[q.cls].remove(q)
        self._promote(first)
        return decode_batch(first + s.take_ready(BE, size - len(first)))

    # ----------------------------------------------------------------- evict BE for LS
    def _be_victims(self, s: Scheduler) -> list:
        """BE work whose KV may go: decode-ready BE jobs, latest arrival first, then suspended
        batches without LS work, oldest first; none served as LS (starvation guard)."""
        ready = [q for q in s.ready[BE] if q.id not in self.promoted]
        ready.sort(key=lambda q: (q.request.arrival_s, q.id), reverse=True)
        return ready + [b for b in s.suspended if not self.protected(b)]

    def evictable_be_tokens(self, s: Scheduler) -> int:
        return sum(s.held_tokens(v) for v in self._be_victims(s))

    def make_room(self, s: Scheduler, tokens: int, now: float) -> None:
        """A batch suspended for an LS job: evict BE work for the batch's saved activations
        and the LS job's admission together, before the activations are charged."""
        if self.evict_be_for_ls and s.waiting[LS]:
            self._evict_be(s, tokens + self._ls_need(s, self._ls_queues(s, now)[0]))

    def _evict_be(self, s: Scheduler, tokens: int) -> None:
        """Free BE KV until an admission charge of ``tokens`` fits, if evicting can make it."""
        if s.fits(tokens) or not s.fits(tokens - self.evictable_be_tokens(s)):
            return
        for v in self._be_victims(s):
            if s.fits(tokens):
                return
            if isinstance(v, Batch):
                s.evict_suspended(v)
            else:
                s.evict_ready(v)

    # ------------------------------------------------------------------- starvation guard
    def _waiting_since(self, q: Sequence) -> float:
        return q.last_token_s if q.last_token_s is not None else q.request.arrival_s

    def _overdue(self, seqs: list[Sequence], now: float) -> bool:
        limit = self.be_max_wait_s
        return limit is not None and any(now - self._waiting_since(q) > limit for q in seqs)

    def _promote(self, seqs: list[Sequence]) -> None:
        if self.be_max_wait_s is not None:
            self.promoted.update(q.id for q in seqs if not q.is_ls)

    def protected(self, batch: Batch) -> bool:
        """Whether the batch holds LS work (or BE work served as LS)."""
        return batch.has_ls or any(q.id in self.promoted for q in batch.sequences)

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """Selection reads queues and memory only, which decoding does not change, unless the
        starvation guard is on (it reads the clock)."""
        return math.inf if self.be_max_wait_s is None else 1

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """Only steps 2 and 6 read the prefill queues, and each admits in queue order: an
        arrival changes the selection only if it would be admitted there (a prompt queued
        before it was not, so then it is not either). Step 1 comes before both, and step 4
        before step 6 when the batch holds LS jobs; step 6 admits nothing while an LS prompt
        waits."""
        size, budget = self.max_batch_size, self.max_batch_prefill_tokens
        ls = sum(q.is_ls for q in batch.sequences)  # the LS-decode queue after this iteration
        if ls >= size:
            return math.inf
        slots = self.max_in_flight - self.in_flight(s)
        if seq.is_ls:
            queue = s.waiting[LS]
            if self.evict_be_for_ls and queue[0] is seq:  # a new head may evict BE work
                return 1
            room = min(size, slots)
        else:
            # step 6 is not reached, skipped (BE decodes wait) or closed (an LS prompt waits)
            if ls or not self.refill_be or s.waiting[LS]:
                return math.inf
            queue, room = s.waiting[BE], min(size - batch.size, slots)
        if room > 0 and s.take_prefill(queue, room, budget, dry_run=True):
            return 1
        return math.inf

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        if self.promoted:  # a promotion lasts until the sequence's next token
            self.promoted.difference_update(q.id for q in batch.sequences)
