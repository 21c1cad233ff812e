"""QLLM: Algorithm 1 with per-expert queues, so a batch may also be preempted after any expert.

Selection, options, preemption rule and memory behaviour are those of ``layer`` (see
policies/layer.py); only the granularity is finer: an LS arrival waits for the end of the
expert in progress instead of the end of the layer stage. With ``preempt_prefill=false`` (the
authors' public code) it checks only after each router, as ``layer`` then does.

Option ``merge`` (default false): the paper's merge, "preempted LS work can be merged with a
suspended BE batch when both reach the same layer". A batch holding LS work (or BE work served
as LS) that starts or resumes behind a suspended batch, and has room for it under
``max_batch_size``, runs to the suspended batch's cursor and merges with it there; the merged
batch finishes the iteration as one (the oldest such suspended batch first; another merge may
follow further on). The suspended batch thus catches up while the LS work runs, rather than
waiting for it to finish. The paper does not say whether the batch size cap binds a merged
batch; here it does, as it binds every other batch.
"""

from __future__ import annotations

from policies.core import Batch, Granularity
from policies.layer import LayerPreemptive
from policies.scheduler import Scheduler


class QLLM(LayerPreemptive):
    name = "qllm"
    granularity = Granularity.EXPERT

    def __init__(self, merge: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(merge, bool):
            raise ValueError(f"merge={merge}: must be true or false")
        self.merge = merge

    def merge_partner(self, s: Scheduler, running: Batch) -> Batch | None:
        if not self.merge or not self.protected(running):
            return None
        room = self.max_batch_size - running.size
        for batch in s.suspended:
            if batch.cursor > running.cursor and batch.size <= room:
                return batch
        return None
