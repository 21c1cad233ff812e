"""SGLang's scheduler with priority scheduling and priority preemption, without chunked prefill.

Reproduces, as read in SGLang's main branch of 2025 (the v0.5 series):

- ``Scheduler.get_next_batch_to_run`` (python/sglang/srt/managers/scheduler.py): prefill
  first; a new prefill batch is formed whenever a waiting request can be admitted, otherwise
  the running requests decode.
- ``SchedulePolicy`` with priority scheduling (python/sglang/srt/managers/schedule_policy.py):
  the waiting queue in priority order (``ls_priority`` for LS, ``be_priority`` for BE; larger
  is more important, SGLang's default sign), arrival order within a priority.
- ``PrefillAdder.preempt_to_schedule`` (same file), as ``get_new_batch_prefill`` calls it: a
  waiting request that finds no free slot (``max_batch_size``, SGLang's
  max_running_requests) preempts running requests whose priority is lower than its own by
  more than ``priority_scheduling_preemption_threshold`` (strictly, as SGLang compares),
  lowest priority then latest arrival first, until it has a slot and its KV fits; when those
  are not enough nothing is preempted and admission stops. A request that has a slot but no
  KV room stops admission (SGLang's ``NO_TOKEN``) and preempts nobody. Preempted requests
  free their KV and are requeued (recomputed later).
- ``ScheduleBatch.retract_decode`` (python/sglang/srt/managers/schedule_batch.py): when the
  running requests cannot all grow, requests are retracted, fewest generated tokens first and
  then longest prompt, until the others fit; they are requeued and recomputed.

Not modelled: chunked prefill, the radix (prefix) cache, and SGLang's admission budget
(``PrefillAdder``: a new request is charged its prompt plus its ``max_new_tokens``, and the
running requests their remaining outputs times ``new_token_ratio``, which starts at 0.7 and
decays per decode step; ``retract_decode_steps`` of headroom). Here admission charges the
prompt's KV only (under ``paged``: its blocks, the watermark kept free), so this policy
admits more readily than SGLang and retracts more often under memory pressure. Preempted and
retracted requests go back to the front of their queue (SGLang re-queues them behind the
requests waiting, by a new entry time). Retraction here is class-blind, as in SGLang. Memory
is the configured model (``memory.model``; SGLang's own is ``paged``).
"""

from __future__ import annotations

import math

from policies.core import BE, LS, Batch, Granularity, Sequence
from policies.scheduler import Policy, Scheduler, decode_batch, prefill_batch


class SGLang(Policy):
    name = "sglang"
    granularity = Granularity.ITERATION
    decode_run_grows = True  # see decode_run

    def __init__(
        self,
        enable_priority_preemption: bool = True,
        priority_scheduling_preemption_threshold: int = 10,
        ls_priority: int = 100,
        be_priority: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        threshold = priority_scheduling_preemption_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"priority_scheduling_preemption_threshold={threshold}: must be an integer >= 0"
            )
        self.enable_priority_preemption = enable_priority_preemption
        self.threshold = threshold
        self.priority = {LS: ls_priority, BE: be_priority}

    def select(self, s: Scheduler, now: float) -> Batch | None:
        running = len(s.ready[LS]) + len(s.ready[BE])
        taken: list[Sequence] = []
        tokens = 0
        for seq in self._waiting(s):
            if taken and tokens + seq.new_tokens > self.max_batch_prefill_tokens:
                break
            if running + len(taken) >= self.max_batch_size:  # no slot: preempt for one
                if not self._preempt_for(s, seq):
                    break
                running = len(s.ready[LS]) + len(s.ready[BE])  # the preempted left
            elif not s.fits(s.memory.admit_tokens(seq)):
                break  # no KV room (SGLang's NO_TOKEN): admission stops, nothing is preempted
            admitted = s.take_prefill([seq], 1, seq.new_tokens)
            if not admitted:
                break
            taken += admitted
            tokens += seq.new_tokens
        if taken:
            return prefill_batch(taken)
        n = len(s.ready[LS]) + len(s.ready[BE])
        return decode_batch(s.take_ready(LS, n) + s.take_ready(BE, n))

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """Admission of the head of the queue (and preemption for it) failed on queues and
        priorities that decoding does not change, and on memory that it only fills: the
        head's shortfall less what the running requests it may preempt hold grows by the
        blocks the others take."""
        return math.inf

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """Only the head of the queue is tried: an arrival behind it changes nothing."""
        return 1 if self._head(s) is seq else math.inf

    def _head(self, s: Scheduler) -> Sequence | None:
        """``_waiting(s)[0]``, without the snapshot."""
        if self.priority[LS] == self.priority[BE]:
            return next(s.waiting_fifo(), None)
        first, second = (LS, BE) if self.priority[LS] > self.priority[BE] else (BE, LS)
        queue = s.waiting[first] or s.waiting[second]
        return queue[0] if queue else None

    def _waiting(self, s: Scheduler) -> list[Sequence]:
        """The waiting queue in priority order, arrival order within a priority (a snapshot:
        admission changes the queues)."""
        if self.priority[LS] == self.priority[BE]:  # one priority: arrival order across classes
            return list(s.waiting_fifo())
        first, second = (LS, BE) if self.priority[LS] > self.priority[BE] else (BE, LS)
        return list(s.waiting[first]) + list(s.waiting[second])

    def _preempt_for(self, s: Scheduler, seq: Sequence) -> bool:
        """SGLang's ``preempt_to_schedule``, asked when the batch is full: free a slot and
        enough KV for ``seq`` from running requests of sufficiently lower priority, or
        preempt none. A victim is credited the KV it holds (SGLang credits its reserved
        remaining tokens)."""
        if not self.enable_priority_preemption:
            return False
        mine = self.priority[seq.cls]
        running = [q for q in s.evictable() if mine - self.priority[q.cls] > self.threshold]
        running.sort(key=lambda q: (self.priority[q.cls], -q.request.arrival_s, -q.id))
        short = s.kv_used_tokens + s.memory.admit_tokens(seq) - s.memory.admission_limit_tokens
        chosen: list[Sequence] = []
        for q in running:
            if short <= 0 and chosen:
                break
            chosen.append(q)
            short -= s.memory.held_tokens(q)
        if not chosen or short > 0:
            return False
        for q in chosen:
            s.evict_ready(q)
        return True

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        """``retract_decode``: fewest generated tokens, then the longest prompt."""
        return min(s.evictable(batch), key=lambda q: (q.generated, -q.request.prompt_tokens))
