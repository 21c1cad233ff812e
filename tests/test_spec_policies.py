"""Policy rules at their edges (a queue exactly as long as the batch, a budget one token short),
where an off-by-one in a comparison changes the batch. Expected batches follow each policy's
docstring (TGI's router, vLLM's priority policy, the paper's Algorithm 1)."""

from __future__ import annotations

import pytest
from conftest import ids, step

from policies import CapacityError, Phase, Request, Scheduler
from policies.core import Batch, Sequence
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.priority import Priority
from policies.qllm import QLLM


def req(i, cls="BE", prompt=10, out=5, t=None):
    return Request(i, cls, float(i) if t is None else t, prompt, out)


def decoding(policy, *requests, capacity=100_000):
    """A scheduler whose requests have all been prefilled (one per prefill) and now decode."""
    s = Scheduler(policy, kv_capacity_tokens=capacity)
    for r in requests:
        s.arrive(r, 0)
        s.waiting[r.cls].remove(seq := s.waiting[r.cls][-1])
        s.memory.admit(seq)
        seq.generated = 1
        s.ready[r.cls].append(seq)
    return s


# --------------------------------------------------------------------- vocabulary
def test_requests_and_batches_reject_what_cannot_run():
    with pytest.raises(ValueError, match="request 3: class 'XX'"):
        Request(3, "XX", 0.0, 1, 1)
    with pytest.raises(ValueError, match="request 4: prompt and output"):
        Request(4, "LS", 0.0, 0, 1)
    with pytest.raises(ValueError, match="request 5: prompt and output"):
        Request(5, "LS", 0.0, 1, 0)
    Request(6, "BE", 0.0, 1, 1)  # one token each is enough
    with pytest.raises(ValueError, match="^a batch needs at least one sequence$"):
        Batch([], Phase.PREFILL)
    decode = Sequence(req(7), generated=1)
    with pytest.raises(ValueError, match=r"sequences \[7\] are not in phase prefill"):
        Batch([Sequence(req(8)), decode], Phase.PREFILL)


def test_batch_repr_lists_at_most_six_ids():
    six = Batch([Sequence(req(i)) for i in range(6)], Phase.PREFILL)
    assert repr(six) == f"Batch#{six.id}(prefill, n=6, ids=0,1,2,3,4,5)"
    seven = Batch([Sequence(req(i)) for i in range(7)], Phase.PREFILL)
    assert repr(seven) == f"Batch#{seven.id}(prefill, n=7, ids=0,1,2,3,4,5...)"


@pytest.mark.parametrize("policy_cls", [FCFS, IterationFCFS, Priority, LayerPreemptive, QLLM])
def test_batch_limits_are_validated(policy_cls):
    with pytest.raises(ValueError, match="^max_batch_size=0: must be an integer >= 1"):
        policy_cls(max_batch_size=0)
    with pytest.raises(ValueError, match="^max_batch_prefill_tokens must be >= 1$"):
        policy_cls(max_batch_prefill_tokens=0)
    policy_cls(max_batch_size=1, max_batch_prefill_tokens=1)


def test_scheduler_rejects_an_empty_kv_cache():
    with pytest.raises(ValueError, match="^kv_capacity_tokens must be >= 1$"):
        Scheduler(QLLM(), kv_capacity_tokens=0)
    Scheduler(QLLM(), kv_capacity_tokens=1)


# ------------------------------------------------------------------- iteration (TGI)
def test_iteration_defaults_are_tgis_and_settings_are_validated():
    p = IterationFCFS()
    assert (p.max_waiting_tokens, p.waiting_served_ratio) == (20, 1.2)  # TGI's router defaults
    IterationFCFS(max_waiting_tokens=1, waiting_served_ratio=0)  # the smallest allowed
    message = "^max_waiting_tokens must be >= 1 and waiting_served_ratio >= 0$"
    with pytest.raises(ValueError, match=message):
        IterationFCFS(max_waiting_tokens=0)
    with pytest.raises(ValueError, match=message):
        IterationFCFS(waiting_served_ratio=-0.1)


def test_iteration_fills_the_last_free_slot():
    s = decoding(IterationFCFS(max_batch_size=2), req(0, out=9))
    s.arrive(req(1), 0)  # floor(1 x 1.2) = 1 could join, and one slot is free
    assert ids(step(s)) == [1]


def test_iteration_one_running_sequence_still_applies_the_ratio():
    s = decoding(IterationFCFS(waiting_served_ratio=2.5), req(0, out=9))
    s.arrive(req(1), 0)  # 1 waiting < floor(1 x 2.5) = 2: keep decoding
    assert step(s).phase is Phase.DECODE


def test_iteration_admits_in_arrival_order_across_classes():
    s = Scheduler(IterationFCFS(max_batch_size=1), kv_capacity_tokens=10_000)
    s.arrive(req(0, "BE", t=0.0), 0)
    s.arrive(req(1, "LS", t=1.0), 1)
    assert ids(step(s)) == [0]  # class-blind: the older BE request first


# ----------------------------------------------------------------------- priority
def test_priority_fills_the_last_free_slot():
    s = decoding(Priority(max_batch_size=2), req(0, out=9))
    s.arrive(req(1, "LS"), 0)
    assert ids(step(s)) == [1]


# --------------------------------------------------------------------- Algorithm 1
def test_algorithm1_full_ls_decode_batch_goes_before_ls_prefill():
    """Step 1 before step 2: exactly a batch of LS decodes waits, and an LS prefill too."""
    s = decoding(QLLM(max_batch_size=2), req(0, "LS", out=9), req(1, "LS", out=9))
    s.arrive(req(2, "LS"), 0)
    b = step(s)
    assert b.phase is Phase.DECODE and ids(b) == [0, 1]


def test_algorithm1_be_fill_of_an_ls_prefill_keeps_to_the_token_budget():
    """Step 2: the BE fill gets only what the LS prompts leave of the budget, and a BE prompt
    larger than that waits (it is not admitted 'alone': the batch is not empty)."""
    s = Scheduler(QLLM(max_batch_size=4, max_batch_prefill_tokens=100), 100_000)
    s.arrive(req(0, "BE", prompt=50), 0)
    s.arrive(req(1, "LS", prompt=60), 0)
    assert ids(step(s)) == [1]
    s2 = Scheduler(QLLM(max_batch_size=4, max_batch_prefill_tokens=100), 100_000)
    s2.arrive(req(0, "BE", prompt=40), 0)
    s2.arrive(req(1, "LS", prompt=60), 0)
    assert ids(step(s2)) == [1, 0]  # exactly the budget


def test_algorithm1_ls_decode_fill_keeps_to_the_batch_size():
    s = decoding(QLLM(max_batch_size=2), req(0, "LS", out=9), *(req(i, out=9) for i in (1, 2, 3)))
    b = step(s)
    assert b.phase is Phase.DECODE and ids(b) == [0, 1]


def test_algorithm1_refill_stops_when_the_be_decode_batch_is_full():
    s = decoding(QLLM(max_batch_size=2), req(0, out=9), req(1, out=9))
    s.arrive(req(2), 0)
    b = step(s)
    assert b.phase is Phase.DECODE and ids(b) == [0, 1]


def test_algorithm1_refill_fills_the_last_free_slot_by_default():
    s = decoding(QLLM(max_batch_size=2), req(0, out=9))
    s.arrive(req(1), 0)
    b = step(s)  # refill_be is on unless switched off
    assert b.phase is Phase.PREFILL and ids(b) == [1]
    assert LayerPreemptive().refill_be and QLLM().refill_be


# ----------------------------------------------------------------------- scheduler
def test_scheduler_starts_empty_and_charges_nothing_by_default():
    s = Scheduler(QLLM(), kv_capacity_tokens=15)
    assert (s.kv_used_tokens, s.peak_kv_used_tokens, s.iterations, s.preemptions) == (0, 0, 0, 0)
    s.arrive(req(0, prompt=10, out=5), 0)  # needs exactly the capacity: admitted
    with pytest.raises(CapacityError, match="^request 1 needs 16 KV tokens, more than the "
                                            "capacity of 15$"):  # fmt: skip
        s.arrive(req(1, prompt=11, out=5), 0)
    s.next_batch(0)
    s.preempt(0)  # no activation charge unless one is configured
    assert s.kv_used_tokens == 15


def test_scheduler_enforces_the_executor_contract():
    s = Scheduler(QLLM(), kv_capacity_tokens=100)
    with pytest.raises(RuntimeError, match="^no batch is running$"):
        s.preempt(0)
    with pytest.raises(RuntimeError, match="^no batch is running$"):
        s.complete_iteration(0)
    s.arrive(req(0), 0)
    s.next_batch(0)
    with pytest.raises(RuntimeError, match="^next_batch called while a batch is running$"):
        s.next_batch(0)


def test_a_completed_iteration_resets_the_cursor_and_counts_once():
    s = Scheduler(QLLM(), kv_capacity_tokens=100)
    s.arrive(req(0, out=1), 0)
    batch = s.next_batch(0)
    batch.cursor, batch.plan = 9, "stage state"
    finished = s.complete_iteration(1.5)
    assert (batch.cursor, batch.plan) == (0, None)
    assert [q.id for q in finished] == [0] and finished[0].finish_s == 1.5
    assert s.iterations == 1 and s.kv_used_tokens == 0
