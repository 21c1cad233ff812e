"""The paper's Algorithm 1 with preemption inside an iteration, at layer granularity.

Selection, options and memory behaviour are those of ``alg1`` (policies/alg1.py). A running
batch without LS jobs is preempted at the next boundary (after an attention or router stage,
or at a layer's end) once an LS job waits, it can be admitted (``max_in_flight``; with
``be_max_wait_s``, after the overdue BE jobs queued before it, which select admits first),
and its KV reservation (with theirs), plus the suspended batch's saved activations, fit in
memory (with ``evict_be_for_ls``: once BE KV outside the running batch is counted as free,
and evicted when the batch is suspended); otherwise it keeps running. The executors ask only
when a request arrives.

Short of KV memory, a suspended batch keeps its KV (and its activations) and resumes only once
no LS decode is left (``alg1``'s steps 3-4), so the LS jobs that follow share what it leaves:
without ``evict_be_for_ls`` their TTFT can be far worse than under ``alg1`` (README, Policies).

Option ``preempt_prefill`` (default true, Algorithm 1 as the paper reads it: any batch without
LS jobs may be preempted, prefills included). False follows the authors' public code
(``QueueAwareMoEWrapper``): only decode batches are preempted, only when the whole batch is BE,
and only after a layer's router, before any of its experts runs (granularity ``router``);
prefills pass straight through.
"""

from __future__ import annotations

from policies.alg1 import Algorithm1
from policies.core import LS, Batch, Granularity, Phase
from policies.scheduler import Scheduler


class LayerPreemptive(Algorithm1):
    name = "layer"
    granularity = Granularity.LAYER

    def __init__(self, preempt_prefill: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.preempt_prefill = preempt_prefill
        if not preempt_prefill:
            self.granularity = Granularity.ROUTER

    def wants_preempt(self, s: Scheduler, running: Batch, now: float) -> bool:
        if self.protected(running) or not s.waiting[LS]:
            return False
        if not self.preempt_prefill and running.phase is Phase.PREFILL:
            return False
        # what select would admit first: the first LS job, after the overdue BE jobs queued
        # before it (starvation guard), within the batch size and the free slots; else a
        # preemption would only resume the same batch (at every boundary, over and over)
        ls_waiting = self._ls_queues(s, now)[0]
        ahead = 1 if ls_waiting is s.waiting[LS] \
            else next(k for k, q in enumerate(ls_waiting, 1) if q.cls == LS)  # fmt: skip
        if ahead > self.max_batch_size or self.in_flight(s) + ahead > self.max_in_flight:
            return False
        need = self._ls_need(s, ls_waiting) + s.activation_tokens(running)
        if self.evict_be_for_ls:  # BE KV outside the running batch may make room
            need -= self.evictable_be_tokens(s)
        return s.fits(need)
