"""QLLM: Algorithm 1 with per-expert queues, so a batch may also be preempted after any expert.

Selection, options, preemption rule and memory behaviour are those of ``layer`` (see
policies/layer.py); only the granularity is finer: an LS arrival waits for the end of the
expert in progress instead of the end of the layer stage. With ``preempt_prefill=false`` (the
authors' public code) it checks only after each router, as ``layer`` then does.
"""

from __future__ import annotations

from policies.core import Granularity
from policies.layer import LayerPreemptive


class QLLM(LayerPreemptive):
    name = "qllm"
    granularity = Granularity.EXPERT
