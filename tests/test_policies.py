"""Policy decisions on hand-built scheduler states (no executor involved)."""

from __future__ import annotations

import pytest
from conftest import ids, step

from policies import Phase, Request, Scheduler
from policies.alg1 import Algorithm1
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.priority import Priority
from policies.qllm import QLLM


def req(i, cls="BE", t=None, prompt=10, out=5):
    return Request(i, cls, float(i) if t is None else t, prompt, out)


def test_fcfs_runs_a_static_batch_to_completion_before_admitting():
    s = Scheduler(FCFS(max_batch_size=2), kv_capacity_tokens=10_000)
    s.arrive(req(0, out=3), 0)
    s.arrive(req(1, out=1), 0)
    s.arrive(req(2), 0)
    assert ids(step(s)) == [0, 1]  # prefill; request 1 finishes with its first token
    s.arrive(req(3), 0)
    b = step(s)
    assert b.phase is Phase.DECODE and ids(b) == [0]  # nobody joins the running batch
    assert ids(step(s)) == [0]
    b = step(s)
    assert b.phase is Phase.PREFILL and ids(b) == [2, 3]


def test_iteration_join_rules_follow_tgi_router():
    pol = IterationFCFS(max_batch_size=32, max_waiting_tokens=3, waiting_served_ratio=1.2)
    s = Scheduler(pol, kv_capacity_tokens=100_000)
    for i in range(5):
        s.arrive(req(i, out=50), 0)
    assert len(step(s).sequences) == 5  # empty batch: everyone waiting joins
    s.arrive(req(5, out=50), 0)
    # 1 waiting < floor(5 * 1.2) = 6: keep decoding
    assert step(s).phase is Phase.DECODE
    for i in range(6, 11):
        s.arrive(req(i, out=50), 0)
    b = step(s)  # 6 waiting >= 6: the join is a prefill of all of them
    assert b.phase is Phase.PREFILL and ids(b) == [5, 6, 7, 8, 9, 10]
    s.arrive(req(11, out=50), 0)
    phases = [step(s).phase for _ in range(4)]
    # 1 waiting < floor(11 * 1.2): joins only once TGI's counter (1 after the prefill, +1 per
    # decode) reaches max_waiting_tokens = 3, i.e. after 2 decode steps
    assert phases == [Phase.DECODE] * 2 + [Phase.PREFILL, Phase.DECODE]


def test_iteration_prefill_respects_token_budget_and_batch_size():
    s = Scheduler(IterationFCFS(max_batch_size=3, max_batch_prefill_tokens=25), 100_000)
    for i in range(5):
        s.arrive(req(i, prompt=10), 0)
    assert ids(step(s)) == [0, 1]  # 30 tokens would exceed 25
    # with a budget for all five, the batch-size limit of 3 stops the prefill
    s3 = Scheduler(IterationFCFS(max_batch_size=3, max_batch_prefill_tokens=1000), 100_000)
    for i in range(7):
        s3.arrive(req(i, prompt=10), 0)
    assert ids(step(s3)) == [0, 1, 2]
    b = step(s3)  # the batch is full: the other four wait while it decodes
    assert b.phase is Phase.DECODE and ids(b) == [0, 1, 2]
    # oversized prompt alone is admitted, so it cannot block the queue forever
    s2 = Scheduler(IterationFCFS(max_batch_prefill_tokens=25), 100_000)
    s2.arrive(req(0, prompt=100), 0)
    assert ids(step(s2)) == [0]


def test_priority_admits_ls_first_but_never_preempts():
    s = Scheduler(Priority(max_batch_size=2), kv_capacity_tokens=10_000)
    s.arrive(req(0, "BE", out=9), 0)
    s.arrive(req(1, "BE", out=9), 0)
    s.arrive(req(2, "LS"), 0)
    assert ids(step(s)) == [2, 0]
    s.arrive(req(3, "LS"), 0)
    assert not s.preemptible
    b = step(s)  # full batch: the LS request waits for a slot (vLLM's limitation)
    assert b.phase is Phase.DECODE and ids(b) == [2, 0]


@pytest.mark.parametrize("policy_cls", [Algorithm1, LayerPreemptive, QLLM])
def test_algorithm1_batch_order(policy_cls):
    s = Scheduler(policy_cls(max_batch_size=3), kv_capacity_tokens=10_000)
    for i, c in enumerate(["BE", "BE", "BE", "LS"]):
        s.arrive(req(i, c, out=4), 0)
    # 2. LS-prefill, filled from BE-prefill
    assert ids(step(s)) == [3, 0, 1]
    # 3. LS-decode, filled from BE-decode
    b = step(s)
    assert b.phase is Phase.DECODE and ids(b) == [3, 0, 1]
    s.arrive(req(4, "LS"), 0)
    assert ids(step(s)) == [4, 2]  # a new LS prefill goes before any decode
    # 1. a full batch of LS decodes when that many wait
    s2 = Scheduler(policy_cls(max_batch_size=2), kv_capacity_tokens=10_000)
    for i in range(3):
        s2.arrive(req(i, "LS", out=4), 0)
    s2.arrive(req(3, "BE", out=4), 0)
    step(s2)
    step(s2)
    b = s2.next_batch(0)
    assert b.phase is Phase.DECODE and [q.cls for q in b.sequences] == ["LS", "LS"]


def test_algorithm1_preempts_be_only_batches_and_resumes_them_from_the_cursor():
    s = Scheduler(
        QLLM(max_batch_size=4), kv_capacity_tokens=10_000, activation_tokens_per_token=0.5
    )
    s.arrive(req(0, "BE", prompt=40, out=3), 0)
    be = s.next_batch(0)
    assert not s.should_preempt(0)
    s.arrive(req(1, "LS", prompt=8, out=2), 1)
    assert s.should_preempt(1)
    be.cursor = 17
    be.plan = "saved state"
    used = s.kv_used_tokens
    s.preempt(2)
    assert s.kv_used_tokens == used + 20  # 40 tokens in flight x 0.5 held while suspended
    ls = s.next_batch(2)
    assert ids(ls) == [1] and not s.should_preempt(2)  # LS batches are never preempted
    s.complete_iteration(3)
    assert ids(step(s)) == [1]  # LS decode comes before the suspended BE batch
    resumed = s.next_batch(4)
    assert resumed is be and be.cursor == 17 and be.plan == "saved state"
    assert s.kv_used_tokens == 43  # LS finished, activations released: BE's 40 + 3 reserved
    assert be.sequences[0].preemptions == 1


def test_algorithm1_does_not_preempt_when_ls_cannot_fit_in_memory():
    s = Scheduler(QLLM(), kv_capacity_tokens=100, activation_tokens_per_token=0.5)
    s.arrive(req(0, "BE", prompt=50, out=10), 0)
    s.next_batch(0)
    s.arrive(req(1, "LS", prompt=30, out=5), 1)  # 35 + 25 held activations > 40 free
    assert not s.should_preempt(1)


@pytest.mark.parametrize("refill", [True, False])
def test_algorithm1_refills_be_decode_batches_only_when_asked(refill):
    s = Scheduler(QLLM(max_batch_size=4, refill_be=refill), kv_capacity_tokens=10_000)
    s.arrive(req(0, "BE", out=9), 0)
    step(s)  # BE 0 prefilled, now a lone BE decode
    s.arrive(req(1, "BE", out=9), 0)
    b = s.next_batch(0)
    if refill:  # continuous batching: the waiting BE job joins before decoding goes on
        assert b.phase is Phase.PREFILL and ids(b) == [1]
    else:  # the paper's step 6 read literally: BE prefill only once no BE decode is left
        assert b.phase is Phase.DECODE and ids(b) == [0]
