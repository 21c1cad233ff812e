"""SGLang's scheduler with priority scheduling, priority preemption and its admission budget
(``new_token_ratio``), without chunked prefill.

Reproduces, as read in SGLang v0.5.6 (python/sglang/srt/...; compared with v0.5.3 and a 2026
snapshot of the main branch, differences noted):

- ``Scheduler.get_next_batch_to_run`` (managers/scheduler.py): prefill first; a new prefill
  batch is formed whenever a waiting request can be admitted, otherwise the running requests
  decode.
- ``SchedulePolicy._sort_by_priority_and_fcfs`` (managers/schedule_policy.py), schedule policy
  ``fcfs`` (the default) with priority scheduling: the waiting queue in priority order
  (``ls_priority`` for LS, ``be_priority`` for BE; larger is more important, SGLang's default
  sign), then by the time a request entered the queue.
- ``PrefillAdder``'s token budget (same file; ``add_one_req``, ``_update_prefill_budget``,
  ``budget_state``, ``_get_running_request_total_token_offset``): each running request is
  charged min(max_new_tokens - generated, ``clip_max_new_tokens_estimation``) x
  ``new_token_ratio`` tokens it may still write; a waiting request is refused, and admission
  stops (``NO_TOKEN``), when its prompt (prompt + generated, for a recomputed request) plus
  min(max_new_tokens - generated, clip) (v0.5.3: max_new_tokens whole) is at least the free
  KV less those charges and less what the requests admitted before it in the round were
  charged (each: its prompt rounded up to whole blocks plus min(max_new_tokens, clip));
  admission also stops once that remainder, or the free KV less the admitted prompts, is
  <= 0. Requests carry no max_new_tokens here:
  SGLang's ``bench_serving`` sends ``max_new_tokens`` equal to the dataset's output length
  (with ``ignore_eos``), so a request's ``output_tokens`` is its max_new_tokens.
- ``new_token_ratio`` (``Scheduler.__init__`` and ``update_running_batch``, managers/
  scheduler.py; defaults from environ.py, SGLANG_*): it starts at min(``init_new_token_ratio``
  (0.7) x ``schedule_conservativeness`` (1.0), 1); each decode step that retracts nothing
  lowers it by (initial - floor) / ``new_token_ratio_decay_steps`` (600), down to the floor
  min(initial x ``min_new_token_ratio_factor`` (0.14), 1) = 0.098 by default (SGLang
  subtracts a step at a time; here k decodes after the ratio was set it is max(set value -
  k x step, floor), so that k decodes applied at once give what k single ones give); a step
  that retracts sets it to ``ScheduleBatch.retract_decode``'s estimate
  (managers/schedule_batch.py) over the requests left running, min(1, (generated +
  ``retract_decode_steps`` (20) x their number) / (their max_new_tokens + 1)) (v0.5.3: no
  + 1), and it goes back to its initial value when the server is idle (``event_loop_normal``
  calls ``self_check_during_idle``, managers/scheduler_runtime_checker_mixin.py, when there is
  no batch to run: here, when ``select`` returns none).
- ``PrefillAdder.preempt_to_schedule`` (schedule_policy.py), as ``get_new_batch_prefill`` calls
  it: a waiting request that finds no free slot (``max_batch_size``, SGLang's
  max_running_requests) preempts running requests whose priority is lower than its own by
  more than ``priority_scheduling_preemption_threshold`` (strictly, as SGLang compares),
  lowest priority then latest entry to the waiting queue first, until its prompt plus
  min(max_new_tokens, clip) fits the budget, each victim credited its budget charge
  (remaining x ratio, not the KV it holds); when those are not enough nothing is preempted
  and admission stops. (v0.5.6 reads the prompt length before it is set, so counts 0 for it;
  main counts it, as here.) The admission test above follows and may still refuse the
  request. A request that has a slot but no budget or KV room stops admission and preempts
  nobody. Preempted requests free their KV and are recomputed later.
- ``ScheduleBatch.retract_decode``: when the running requests cannot all grow, requests are
  retracted, fewest generated tokens first and then longest prompt, until the others fit.
- ``Scheduler._add_request_to_queue``: preempted and retracted requests are re-queued with a
  new entry time, so they wait behind the requests of their priority already waiting (ahead
  of lower priorities): here at the back of their class's queue (``requeue_front`` False).

Under ``memory.model=paged`` (SGLang's own) the free KV is what admission may fill (the
configured watermark kept free; ``memory.watermark=0`` is SGLang's pool) and a page is a
block. Under ``reserve`` a request already reserves prompt + output on admission and never
runs out, so the budget would count outputs twice: admission is the reservation alone and a
victim is credited the KV it holds. ``clip_max_new_tokens_estimation=0`` charges prompts only
(admission as before the budget was modelled, but a priority preemption then frees budget
only where the prompt fits the free KV without the victims' blocks). A request that would
run alone is admitted whenever its KV fits, budget or not (SGLang would wait forever for a
request whose prompt + max_new_tokens reaches the free KV of an empty server).

Not modelled: chunked prefill, the radix (prefix) cache (nothing is evictable), and
``add_one_req_ignore_eos`` (the rule SGLang uses for ignore_eos requests when the radix cache
is disabled). Retraction here is class-blind, as in SGLang. Memory is the configured model
(``memory.model``; SGLang's own is ``paged``).

Options (SGLang's names; the SGLANG_* environment variables lower-cased, without the prefix):
``schedule_conservativeness``, ``init_new_token_ratio``, ``min_new_token_ratio_factor``,
``new_token_ratio_decay_steps``, ``retract_decode_steps``, ``clip_max_new_tokens_estimation``,
with the defaults above.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable

from policies.core import BE, LS, Batch, Granularity, Sequence
from policies.scheduler import Policy, Scheduler, decode_batch, prefill_batch


class SGLang(Policy):
    name = "sglang"
    granularity = Granularity.ITERATION
    decode_run_grows = True  # see decode_run
    requeue_front = False  # SGLang's _add_request_to_queue: behind those already waiting

    def __init__(
        self,
        enable_priority_preemption: bool = True,
        priority_scheduling_preemption_threshold: int = 10,
        ls_priority: int = 100,
        be_priority: int = 0,
        schedule_conservativeness: float = 1.0,
        init_new_token_ratio: float = 0.7,
        min_new_token_ratio_factor: float = 0.14,
        new_token_ratio_decay_steps: int = 600,
        retract_decode_steps: int = 20,
        clip_max_new_tokens_estimation: int = 4096,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        _integer("priority_scheduling_preemption_threshold",
                 priority_scheduling_preemption_threshold, 0)  # fmt: skip
        _integer("new_token_ratio_decay_steps", new_token_ratio_decay_steps, 1)
        _integer("retract_decode_steps", retract_decode_steps, 0)
        _integer("clip_max_new_tokens_estimation", clip_max_new_tokens_estimation, 0)
        for key, value in (("schedule_conservativeness", schedule_conservativeness),
                           ("init_new_token_ratio", init_new_token_ratio),
                           ("min_new_token_ratio_factor", min_new_token_ratio_factor)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{key}={value}: must be a number >= 0")
        self.enable_priority_preemption = enable_priority_preemption
        self.threshold = priority_scheduling_preemption_threshold
        self.priority = {LS: ls_priority, BE: be_priority}
        self.init_ratio = min(init_new_token_ratio * schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * min_new_token_ratio_factor, 1.0)
        self.ratio_step = (self.init_ratio - self.min_ratio) / new_token_ratio_decay_steps
        self.retract_decode_steps = retract_decode_steps
        self.clip = clip_max_new_tokens_estimation
        # new_token_ratio: its value when last set (start, idle, retraction) and the decode
        # steps since, so that k steps applied at once (on_decodes) give what k single ones do
        self._ratio_base = self.init_ratio
        self._decays = 0
        self._now = 0.0  # the time of the last selection (a retraction follows it)
        self._entries: dict[int, tuple] = {}  # re-queued sequence id -> its entry key
        self._requeues = itertools.count()

    # ----------------------------------------------------------------------- new_token_ratio
    @property
    def new_token_ratio(self) -> float:
        return self._ratio_after(self._decays)

    def _ratio_after(self, decays: int) -> float:
        if decays == 0:
            return self._ratio_base
        return max(self._ratio_base - decays * self.ratio_step, self.min_ratio)

    def _set_ratio(self, ratio: float) -> None:
        self._ratio_base, self._decays = ratio, 0

    def _offset(self, running: Iterable[Sequence], ratio: float, ahead: int = 0) -> float:
        """``_get_running_request_total_token_offset`` summed over the running requests,
        ``ahead`` decode steps from now."""
        clip = self.clip
        return sum([min(q.request.output_tokens - q.generated - ahead, clip) * ratio
                    for q in running])  # fmt: skip

    def _need(self, seq: Sequence) -> int:
        """``add_one_req``'s total_tokens: the prompt to compute and the output to come."""
        return seq.new_tokens + min(max(seq.request.output_tokens - seq.generated, 0), self.clip)

    # ------------------------------------------------------------------------------ selection
    def select(self, s: Scheduler, now: float) -> Batch | None:
        self._now = now
        ready = [*s.ready[LS], *s.ready[BE]]
        budget = None
        if s.memory.grows:  # PrefillAdder's budget, under paged memory only (module docstring)
            budget = _Budget(s.memory.admission_limit_tokens - s.kv_used_tokens,
                             self._offset(ready, self.new_token_ratio))  # fmt: skip
        alone = not ready  # nothing runs: the first admission skips the budget
        taken: list[Sequence] = []
        tokens = 0
        for seq in self._waiting(s):
            if taken and tokens + seq.new_tokens > self.max_batch_prefill_tokens:
                break
            if len(s.ready[LS]) + len(s.ready[BE]) + len(taken) >= self.max_batch_size:
                if not self._preempt_for(s, seq, budget):  # no slot: preempt for one
                    break
            elif not s.fits(s.memory.admit_tokens(seq)):
                break  # no KV room (SGLang's NO_TOKEN): admission stops, nothing is preempted
            if budget is not None and not (alone and not taken) and self._need(seq) >= budget.left:
                break  # over the budget: NO_TOKEN
            admitted = s.take_prefill([seq], 1, seq.new_tokens)
            if not admitted:
                break
            taken += admitted
            tokens += seq.new_tokens
            if budget is not None and not budget.charge(
                _blocks(s, seq.new_tokens), min(seq.request.output_tokens, self.clip)
            ):
                break  # budget_state: NO_TOKEN
        if taken:
            return prefill_batch(taken)
        n = len(s.ready[LS]) + len(s.ready[BE])
        if not n:
            self._set_ratio(self.init_ratio)  # idle: self_check_during_idle
            return None
        self._decays += 1  # update_running_batch; a retraction sets the ratio instead (victim)
        return decode_batch(s.take_ready(LS, n) + s.take_ready(BE, n))

    def _entry(self, q: Sequence) -> tuple:
        """When ``q`` last entered the waiting queue (its arrival, or its latest re-queue)."""
        return self._entries.get(q.id) or (q.request.arrival_s, 0, q.id)

    def _requeued(self, q: Sequence) -> None:
        self._entries[q.id] = (self._now, 1, next(self._requeues))

    def _head(self, s: Scheduler) -> Sequence | None:
        """``_waiting(s)[0]``, without the snapshot."""
        if self.priority[LS] == self.priority[BE]:
            heads = [queue[0] for queue in s.waiting.values() if queue]
            return min(heads, key=self._entry, default=None)
        first, second = (LS, BE) if self.priority[LS] > self.priority[BE] else (BE, LS)
        queue = s.waiting[first] or s.waiting[second]
        return queue[0] if queue else None

    def _waiting(self, s: Scheduler) -> list[Sequence]:
        """The waiting queue in priority order, entry order within a priority (a snapshot:
        admission changes the queues). Each class's queue is in entry order: re-queued
        requests were put at its back."""
        if self.priority[LS] == self.priority[BE]:  # one priority: entry order across classes
            return list(heapq.merge(s.waiting[LS], s.waiting[BE], key=self._entry))
        first, second = (LS, BE) if self.priority[LS] > self.priority[BE] else (BE, LS)
        return list(s.waiting[first]) + list(s.waiting[second])

    def _victims(self, running: Iterable[Sequence], seq: Sequence) -> list[Sequence]:
        """The running requests ``seq`` may preempt, in SGLang's order: lowest priority, then
        latest entry first."""
        mine = self.priority[seq.cls]
        running = [q for q in running if mine - self.priority[q.cls] > self.threshold]
        running.sort(key=self._entry, reverse=True)
        running.sort(key=lambda q: self.priority[q.cls])
        return running

    def _preempt_for(self, s: Scheduler, seq: Sequence, budget: _Budget | None) -> bool:
        """SGLang's ``preempt_to_schedule``, asked when the batch is full: free a slot and
        budget for ``seq`` from running requests of sufficiently lower priority, or preempt
        none. Under the budget a victim is credited its budget charge; without it (reserve),
        the KV it holds."""
        if not self.enable_priority_preemption:
            return False
        if budget is None:
            short = s.kv_used_tokens + s.memory.admit_tokens(seq) - s.memory.admission_limit_tokens
        else:
            ratio = self.new_token_ratio
            short = seq.new_tokens + min(seq.request.output_tokens, self.clip) - budget.left
        chosen: list[Sequence] = []
        for q in self._victims(s.evictable(), seq):
            if short <= 0 and chosen:
                break
            chosen.append(q)
            short -= s.memory.held_tokens(q) if budget is None else self._offset([q], ratio)
        if not chosen or short > 0:
            return False
        for q in chosen:
            if budget is not None:
                budget.release(s.memory.held_tokens(q), self._offset([q], ratio))
            self._requeued(q)
            s.evict_ready(q)
        return True

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        """``retract_decode``: fewest generated tokens, then the longest prompt; the ratio
        becomes its estimate over the requests left (none left: as when idle)."""
        chosen = min(s.evictable(batch), key=lambda q: (q.generated, -q.request.prompt_tokens))
        self._requeued(chosen)
        left = [q for q in batch.sequences if q is not chosen]
        if not left:
            self._set_ratio(self.init_ratio)
            return chosen
        generated = sum(q.generated for q in left)
        max_new = sum(q.request.output_tokens for q in left)
        self._set_ratio(min(1.0, (generated + self.retract_decode_steps * len(left)) /
                            (max_new + 1)))  # fmt: skip
        return chosen

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        """A finished sequence's re-queue entry is dropped: on a long run the entries would
        otherwise grow with every request ever retracted or preempted."""
        if self._entries:
            for q in batch.sequences:
                if q.finish_s is not None:
                    self._entries.pop(q.id, None)

    # ---------------------------------------------------------------------------- fast-forward
    def on_decodes(self, s: Scheduler, batch: Batch, ends_s) -> None:
        self._decays += len(ends_s)  # the selections of the decodes applied at once

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """Admission of the head of the queue (and preemption for it) failed on queues and
        priorities that decoding does not change, and on memory that it only fills; but the
        budget the running requests leave grows as their outputs shorten and the ratio
        decays: the run lasts until the first selection at which the head could pass."""
        if not s.memory.grows:
            return math.inf
        head = self._head(s)
        return math.inf if head is None else self._runs_before(s, batch, head)

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """Only the head of the queue is tried: an arrival behind it changes nothing."""
        if self._head(s) is not seq:
            return math.inf
        return self._runs_before(s, batch, seq) if s.memory.grows else 1

    def _runs_before(self, s: Scheduler, batch: Batch, head: Sequence) -> float:
        """Selections of ``batch`` from this one on (whose ratio has decayed ``_decays`` times,
        at least once), before the first at which ``head`` could pass the budget, or the
        preemption test when the batch is full; inf: none before a sequence finishes. At the
        i-th selection of the run the running requests are i - 1 decodes further and the ratio
        i - 2 decays lower; the free KV is at most today's (memory only fills during a run),
        so a test that fails on today's free KV fails then. Both tests only loosen as i grows:
        the first i that passes is found by bisection."""
        free = s.memory.admission_limit_tokens - s.kv_used_tokens
        running = batch.sequences
        if len(running) < self.max_batch_size:
            need = self._need(head)

            def passes(i: int) -> bool:  # the very sum and comparison select makes
                ratio = self._ratio_after(self._decays + i - 2)
                return need < free - self._offset(running, ratio, i - 1)
        else:
            if not self.enable_priority_preemption:
                return math.inf
            victims = {q.id for q in self._victims(running, head)}
            kept = [q for q in running if q.id not in victims]
            if len(kept) == len(running):
                return math.inf
            need = head.new_tokens + min(head.request.output_tokens, self.clip)

            def passes(i: int) -> bool:  # every victim preempted; 1 token of slack for the
                # order select subtracts its credits in
                ratio = self._ratio_after(self._decays + i - 2)
                return need - free + self._offset(kept, ratio, i - 1) <= 1

        last = min(q.request.output_tokens - q.generated for q in running)  # a run's longest
        if last < 2 or not passes(last):
            return math.inf
        lo, hi = 1, last  # passes(hi); not passes(lo) (the first selection refused the head)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if passes(mid) else (mid, hi)
        return hi - 1


class _Budget:
    """One admission round's ``PrefillAdder`` budget, in tokens: the free KV (``free``), what
    is charged against it (``charged``: the running requests' offsets, then each admitted
    request's prompt and output) and the admitted prompts alone (``prompts``)."""

    __slots__ = ("free", "charged", "prompts")

    def __init__(self, free: int, offset: float) -> None:
        self.free, self.charged, self.prompts = free, offset, 0

    @property
    def left(self) -> float:
        """``rem_total_tokens``."""
        return self.free - self.charged

    def charge(self, prompt: int, output: int) -> bool:
        """``_update_prefill_budget``; False: ``budget_state`` says NO_TOKEN."""
        self.charged += prompt + output
        self.prompts += prompt
        return self.left > 0 and self.free - self.prompts > 0

    def release(self, held: int, offset: float) -> None:
        """A preempted running request: its KV is freed, its offset no longer charged."""
        self.free += held
        self.charged -= offset


def _blocks(s: Scheduler, tokens: int) -> int:
    """``ceil_paged_tokens``: tokens rounded up to whole blocks."""
    block = s.memory.block_size_tokens
    return -(-tokens // block) * block


def _integer(key: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{key}={value}: must be an integer >= {least}")
