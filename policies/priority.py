"""Priority scheduling decided only between iterations, like vLLM's ``priority`` policy.

Waiting requests are admitted LS first, then BE, each FIFO, whenever the running batch has
room (prefill-first continuous batching). Nothing is preempted mid-iteration, and a full batch
is not broken up for an LS arrival: the LS request waits for a slot (vLLM's known limitation
when ``max_num_seqs`` is reached, issue #40004).

Of vLLM it models the priority order of admission and that limitation; under ``paged`` memory
also V1's victim rule (lowest priority, latest arrival, by recompute; ``Policy.victim``). It
does not model V1's step (running requests before waiting ones under one token budget, no
admission in a step that preempted) or chunked prefill: ``vllm`` (policies/vllm.py) does.

Memory: the configured model; under ``reserve`` prompt + output tokens are reserved on
admission and what does not fit waits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from policies.core import BE, LS, Batch, Granularity, Sequence
from policies.scheduler import Policy, Scheduler, decode_batch, prefill_batch


class Priority(Policy):
    name = "priority"
    granularity = Granularity.ITERATION
    decode_run_grows = True  # admission alone reads memory

    def select(self, s: Scheduler, now: float) -> Batch | None:
        running = sum(len(q) for q in s.ready.values())
        room = self.max_batch_size - running
        if room > 0:
            candidates = _waiting(s)
            seqs = s.take_prefill(candidates, room, self.max_batch_prefill_tokens)
            if seqs:
                return prefill_batch(seqs)
        return decode_batch(s.take_ready(LS, running) + s.take_ready(BE, running))

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        return math.inf  # admission failed on queues decoding does not change, memory it fills

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """Admission stops at the first waiting request that does not fit: only an arrival at
        the head (LS first) that fits now may be admitted before the run's end."""
        room = self.max_batch_size - batch.size
        if room <= 0 or next(_waiting(s)) is not seq:
            return math.inf
        taken = s.take_prefill([seq], room, self.max_batch_prefill_tokens, dry_run=True)
        return 1 if taken else math.inf


def _waiting(s: Scheduler) -> Iterator[Sequence]:
    return itertools.chain(s.waiting[LS], s.waiting[BE])
