"""vLLM V1's scheduler, with or without chunked prefill.

Reproduces ``Scheduler.schedule`` of vLLM V1 (vllm/v1/core/sched/scheduler.py, as in the
v0.9-v0.11 releases):

- One engine step is one iteration (one scheduler output, one forward pass): first the
  running requests (one decode token each), then the waiting ones, in queue order, while
  ``max_num_seqs`` running requests, the step's token budget ``max_num_batched_tokens``
  (minus the running decodes) and the KV cache allow; the first waiting request that does not
  fit stops admission (no overtaking). The running requests' blocks come first: admission
  leaves room for the blocks they write in the step, and a step whose running requests cannot
  all grow (they preempt) admits none. A waiting request never displaces a running one: once
  ``max_num_seqs`` requests run, an LS arrival waits for one to finish (vLLM issue #40004).
- ``scheduling_policy``: ``fcfs`` (one waiting queue in arrival order) or ``priority`` (a heap
  on (priority, arrival): LS requests, priority 0, before BE, priority 1).
- When a running request cannot get a KV block for its next token, a victim is preempted by
  recompute (``Scheduler.evict``): under ``priority`` the running request with the lowest
  priority and the latest arrival, under ``fcfs`` the last one admitted (``running.pop()``).
  A step that preempted admits no waiting request. Preempted requests go back to the front of
  the waiting queue, the latest preempted first (under ``priority``: of their class's queue,
  where vLLM re-inserts them in its heap by arrival; the two agree when they arrived before the
  requests waiting there).
  V1 only recomputes; ``memory.preemption=swap`` gives V0's swap preemption instead (a
  swapped-out request is swapped back in when it is admitted again, before new prompts).

- ``enable_chunked_prefill`` (vLLM's default is true; ours false): the running requests come
  first, in admission order, each taking one decode token, or the next chunk of its prompt (as
  much as the budget leaves) when its prefill is unfinished; then waiting requests, each taking
  a chunk of what is left. A prompt is thus split over several iterations, and its first token
  comes with its last chunk. False: whole prompts only, so a prompt longer than what the budget
  leaves stops admission (V1's ``num_new_tokens > token_budget``); the step is a decode, a
  prefill or a mixed iteration of both. V1 refuses a ``max_num_batched_tokens`` below the
  model's length when chunking is off; here a longer prompt runs alone when nothing else
  does, so that it cannot block its queue for ever.

Not modelled: prefix caching, speculative decoding, ``long_prefill_token_threshold``; under
``priority``, a running request that preempts itself does not stop the others' turn (V1 stops
scheduling running requests there). A chunk's attention over its cached prefix costs the
profile's ``attn_chunk`` (a prefill of its own tokens in a profile without it). Growth
preemptions are decided after a step is chosen (when its batch is charged); admission leaves
room for them beforehand, as above.
Memory is the configured model (``memory.model``; vLLM's own is ``paged``). The real engine
runs both forms.
"""

from __future__ import annotations

import heapq
import itertools
import math

from policies.core import BE, LS, Batch, Granularity, Phase, Request, Sequence
from policies.scheduler import Policy, Scheduler, priority_victim_key

SCHEDULING_POLICIES = ("fcfs", "priority")


class VLLM(Policy):
    name = "vllm"
    granularity = Granularity.ITERATION
    decode_run_grows = True  # admission alone reads memory

    def __init__(
        self,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        scheduling_policy: str = "fcfs",
        enable_chunked_prefill: bool = False,
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={scheduling_policy}: must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        for key, value in (("max_num_seqs", max_num_seqs),
                           ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value}: must be an integer >= 1")
        super().__init__(
            max_batch_size=max_num_seqs, max_batch_prefill_tokens=max_num_batched_tokens
        )
        self.priority = scheduling_policy == "priority"
        self.enable_chunked_prefill = enable_chunked_prefill

    def select(self, s: Scheduler, now: float) -> Batch | None:
        """One engine step, one iteration: the running requests, then waiting ones (V1 puts
        both in one scheduler output, one forward pass, chunked prefill or not)."""
        # preempted in this step (by growing its running requests: a select again after
        # every one of them was preempted), not in the step before, which V1 forgets
        preempted = s.kv_preemptions != s.step_kv_preemptions
        chunked = self.enable_chunked_prefill
        budget = self.max_batch_prefill_tokens
        running = sorted([*s.ready[LS], *s.ready[BE], *s.prefilling], key=_admission)
        seqs = []
        for q in running:
            if budget <= 0:
                break
            if q.phase is Phase.PREFILL:  # a chunked prefill under way (chunked mode only)
                q.chunk_tokens = min(q.prefill_left_tokens, budget)
                s.prefilling.remove(q)
            else:
                s.ready[q.cls].remove(q)
            seqs.append(q)
            budget -= q.new_tokens
        # V1 allocates the running requests' blocks first and admits no waiting request in a
        # step that preempted: admission leaves room for what the running write in this step,
        # and none is tried when they cannot all grow (the scheduler then preempts for them).
        # When that preempted every one of them, this is the select again, with none left
        # running: the waiting are admitted in this same step (V1 would run a step without
        # them first; here no step runs without a batch, and the engine would wait idle)
        slots = self.max_batch_size - len(running)
        waiting = len(s.waiting[LS]) + len(s.waiting[BE])
        growth = math.inf  # nothing to admit
        if slots > 0 and waiting and not (preempted and running):
            growth = sum(s.memory.grow_tokens(q) for q in seqs) if s.memory.grows else 0
        if growth <= s.memory.capacity_tokens - s.kv_used_tokens:
            # the head of the queue, copied (admission takes from it): no more than can join
            for q in list(itertools.islice(self._waiting(s), int(min(slots, waiting)))):
                if budget <= 0 or slots <= 0:
                    break
                if chunked:
                    q.chunk_tokens = min(q.prefill_left_tokens, budget)
                elif q.prefill_left_tokens > budget and (seqs or running):
                    break  # a whole prompt only; one longer than the whole budget runs alone
                tokens = q.new_tokens
                if not s.fits(s.memory.admit_tokens(q) + growth) or not s.take_prefill(
                    [q], 1, tokens
                ):
                    q.chunk_tokens = 0
                    break
                seqs.append(q)
                budget -= tokens
                slots -= 1
        if not seqs:
            return None
        if chunked:
            return Batch(seqs, Phase.MIXED)
        prefills = sum(q.phase is Phase.PREFILL for q in seqs)
        if prefills == 0:
            return Batch(seqs, Phase.DECODE)
        return Batch(seqs, Phase.PREFILL if prefills == len(seqs) else Phase.MIXED)

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """After a decode the next step tries admission: the decodes go on while it fails (on
        queues that decoding does not change and memory that it only fills)."""
        if self.enable_chunked_prefill:
            return 1
        room = self.max_batch_size - batch.size
        if room > 0 and (s.waiting[LS] or s.waiting[BE]):
            budget = self.max_batch_prefill_tokens - batch.size
            if s.take_prefill(self._waiting(s), room, budget, dry_run=True,
                              alone_if_oversized=False):  # fmt: skip
                return 1
        return math.inf

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """Admission stops at the first waiting request that does not fit: only an arrival at
        the head of the queue that fits now may be admitted before the run's end (memory
        only fills during it; ``decode_run`` found the old head unfit, or none)."""
        room = self.max_batch_size - batch.size
        if room <= 0 or next(iter(self._waiting(s))) is not seq:
            return math.inf
        budget = self.max_batch_prefill_tokens - batch.size
        fits = s.take_prefill([seq], room, budget, dry_run=True, alone_if_oversized=False)
        return 1 if fits else math.inf

    def arrival_ends_run(self, s: Scheduler, batch: Batch, request: Request) -> bool:
        """With room in the batch, a request that heads the waiting queue on arrival is
        admitted at the next step if its prompt's KV fits (memory only fills during a run:
        if it does not fit now, it will not then)."""
        if self.enable_chunked_prefill or batch.size >= self.max_batch_size:
            return False
        ahead = (
            s.waiting[LS] if self.priority and request.cls == LS else s.waiting[LS] or s.waiting[BE]
        )
        return not ahead and s.fits(s.memory.admit_tokens(Sequence(request)))

    def _waiting(self, s: Scheduler):
        if self.priority:
            return _class_order(s)
        # one queue by arrival; preempted requests were put back at its front
        return heapq.merge(s.waiting[LS], s.waiting[BE], key=_fcfs_key)

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        if self.priority:
            return max(s.evictable(batch), key=priority_victim_key)
        return max(s.evictable(batch), key=lambda q: q.admission)


def _class_order(s: Scheduler):
    yield from s.waiting[LS]
    yield from s.waiting[BE]


def _admission(q: Sequence) -> int:
    return q.admission


def _fcfs_key(q: Sequence) -> tuple:
    """fcfs's queue order: preempted requests first, the latest preempted first (V1's
    ``prepend_request`` puts each at the queue's front: a stack; until 2026-12-05 they were
    ordered by arrival, which differed where a request re-admitted last, early by arrival,
    was preempted before one admitted ahead of it), then the others by arrival."""
    return (not q.evicted, -q.eviction, q.request.arrival_s, q.id)
