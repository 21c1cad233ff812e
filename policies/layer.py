"""The paper's Algorithm 1 (GetNextBatch) with preemption at layer granularity.

Four FCFS queues: LS-prefill, LS-decode, BE-prefill, BE-decode. The next batch is, in order:
1. a full batch of LS-decode jobs, if that many wait;
2. LS-prefill jobs, the rest of the batch filled from BE-prefill;
3. LS-decode jobs, the rest filled from BE-decode;
4. a suspended batch, resumed from its cursor (ours: the paper leaves resume order open);
5. BE-decode jobs; 6. BE-prefill jobs.
Ours, on by default (``refill_be``): when fewer than a batch of BE-decode jobs remain and
BE-prefill jobs wait, those are prefilled first so decode batches stay full, as continuous
batching does. Read literally, step 6 admits BE prefills only once no BE decode is left, so
the last long BE sequences decode in ever smaller batches while new BE jobs wait; with
``refill_be=false`` that literal reading is available.
A running batch without LS jobs is preempted at the next boundary (after an attention or
router stage, or at a layer's end) once an LS job waits and its KV reservation, plus the
suspended batch's saved activations, fit in memory; otherwise it keeps running.

Memory: prompt + output tokens reserved on admission; a suspended batch also holds its saved
activations. Nothing is evicted: when memory is short, LS work waits like any other.
"""

from __future__ import annotations

from policies.core import BE, LS, Batch, Granularity
from policies.scheduler import Policy, Scheduler, decode_batch, prefill_batch


class LayerPreemptive(Policy):
    name = "layer"
    granularity = Granularity.LAYER

    def __init__(self, refill_be: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.refill_be = refill_be

    def select(self, s: Scheduler, now: float) -> Batch | None:
        size, budget = self.max_batch_size, self.max_batch_prefill_tokens
        if len(s.ready[LS]) >= size:
            return decode_batch(s.take_ready(LS, size))
        if s.waiting[LS]:
            ls = s.take_prefill(s.waiting[LS], size, budget)
            if ls:
                used = sum(q.request.prompt_tokens for q in ls)
                be = s.take_prefill(
                    s.waiting[BE], size - len(ls), budget - used, alone_if_oversized=False
                )
                return prefill_batch(ls + be)
        if s.ready[LS]:
            ls = s.take_ready(LS, size)
            return decode_batch(ls + s.take_ready(BE, size - len(ls)))
        if s.suspended:
            return s.suspended[0]
        room = size - len(s.ready[BE])
        if room > 0 and (self.refill_be or not s.ready[BE]):
            refill = s.take_prefill(s.waiting[BE], room, budget)
            if refill:
                return prefill_batch(refill)
        return decode_batch(s.take_ready(BE, size))

    def wants_preempt(self, s: Scheduler, running: Batch) -> bool:
        if running.has_ls or not s.waiting[LS]:
            return False
        first = s.waiting[LS][0]
        return s.fits(first.reserved_tokens + s.activation_tokens(running))
