"""vLLM's and SGLang's admission rules at their limits, worked out by hand from the documented
rules (policies/vllm.py, policies/sglang.py): the step's token budget less the running decodes,
free slots, no overtaking, and the priority order. Written to kill mutants that the broader
tests let survive (README, "Mutation testing")."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest
from conftest import ids, step

from policies import Phase, Request, Scheduler
from policies.memory import PagedMemory
from policies.priority import Priority
from policies.qllm import QLLM
from policies.sglang import SGLang
from policies.vllm import VLLM


def req(i, cls="BE", prompt=4, out=10, t=0.0):
    return Request(i, cls, t, prompt, out)


def ids_of(seqs):
    return [q.id for q in seqs]


# ------------------------------------------------------------------------------------- vllm
def test_vllm_admits_within_the_budget_left_by_the_running_decodes_without_overtaking():
    """Budget 10, two requests running: 8 prompt tokens may join. Prompts 5, 4, 1 wait: 5 fits,
    5 + 4 does not, and the 1-token prompt behind may not overtake."""
    s = Scheduler(VLLM(max_num_seqs=4, max_num_batched_tokens=10), kv_capacity_tokens=10_000)
    s.arrive(req(0), 0)
    s.arrive(req(1), 0)
    assert ids(step(s)) == [0, 1]
    for i, prompt in ((2, 5), (3, 4), (4, 1)):
        s.arrive(req(i, prompt=prompt, t=1), 1)
    batch = s.next_batch(1)  # one step, one iteration: the running requests' decodes, a prefill
    assert batch.phase is Phase.MIXED and ids(batch) == [0, 1, 2]
    assert [q.new_tokens for q in batch.sequences] == [1, 1, 5]  # the whole prompt: 5 + 4 > 8
    s.complete_iteration(1)
    assert ids(step(s, 1)) == [0, 1, 2, 3]  # 4 tokens now fit: 3 decodes + 4 <= 10


def test_vllm_admits_only_into_free_slots():
    s = Scheduler(VLLM(max_num_seqs=3), kv_capacity_tokens=10_000)
    s.arrive(req(0), 0)
    s.arrive(req(1), 0)
    step(s)
    for i in (2, 3):
        s.arrive(req(i, t=1), 1)
    assert ids(step(s, 1)) == [0, 1, 2]  # one slot left: two decodes and one prefill
    assert ids(step(s, 1)) == [0, 1, 2] and [q.id for q in s.waiting["BE"]] == [3]


def test_chunked_vllm_admits_only_into_free_slots():
    s = Scheduler(VLLM(max_num_seqs=2, max_num_batched_tokens=100, enable_chunked_prefill=True),
                  kv_capacity_tokens=10_000)  # fmt: skip
    s.arrive(req(0), 0)
    step(s)
    for i in (1, 2, 3):
        s.arrive(req(i, t=0.1 * i), 0.1 * i)
    batch = s.next_batch(1)  # request 0's decode token and request 1's whole prompt
    assert [(q.id, q.new_tokens) for q in batch.sequences] == [(0, 1), (1, 4)]
    assert [q.id for q in s.waiting["BE"]] == [2, 3]


def test_chunked_vllm_stops_at_the_first_waiting_request_that_does_not_fit():
    """KV 30 reserved: request 0 holds 14; request 1 needs 30 and waits, its chunk not set;
    request 2 (4 tokens) would fit but may not overtake it."""
    s = Scheduler(VLLM(max_num_batched_tokens=100, enable_chunked_prefill=True),
                  kv_capacity_tokens=30)  # fmt: skip
    s.arrive(req(0, prompt=4, out=10), 0)
    step(s)
    big = s.arrive(req(1, prompt=20, out=10, t=0.1), 0.1)
    s.arrive(req(2, prompt=2, out=2, t=0.2), 0.2)
    batch = step(s, 1)
    assert ids(batch) == [0] and big.chunk_tokens == 0 and big.new_tokens == 20
    assert [q.id for q in s.waiting["BE"]] == [1, 2]


# ----------------------------------------------------------------------------------- sglang
def test_sglang_prefill_budget_admits_an_oversized_prompt_alone():
    s = Scheduler(SGLang(max_batch_prefill_tokens=10), kv_capacity_tokens=10_000)
    for i in range(3):
        s.arrive(req(i, t=0.1 * i), 0)
    s.arrive(req(3, prompt=15, t=1), 1)
    assert [ids(step(s)) for _ in range(3)] == [[0, 1], [2], [3]]  # prefill first, each time


def test_sglang_a_full_batch_of_equal_priority_leaves_the_rest_waiting():
    s = Scheduler(SGLang(max_batch_size=2), kv_capacity_tokens=10_000)
    for i in range(3):
        s.arrive(req(i, t=0.1 * i), 0)
    assert ids(step(s)) == [0, 1]
    batch = step(s)
    assert batch.phase is Phase.DECODE and ids(batch) == [0, 1] and s.recomputes == 0


def test_sglang_the_larger_priority_goes_first():
    s = Scheduler(SGLang(ls_priority=0, be_priority=100), kv_capacity_tokens=10_000)
    s.arrive(req(0, "LS"), 0)
    s.arrive(req(1, t=0.1), 0.1)
    assert ids(step(s)) == [1, 0]
    s = Scheduler(SGLang(), kv_capacity_tokens=10_000)
    s.arrive(req(0), 0)
    s.arrive(req(1, "LS", t=0.1), 0.1)
    assert ids(step(s)) == [1, 0]


# -------------------------------------------------------------------------------- scheduler
def test_a_dropped_suspended_batch_frees_its_kv_and_activations_and_requeues_in_order():
    """Reservations 8 + 9 tokens; 11 tokens in flight x 0.125 = 1.375, charged as 2."""
    s = Scheduler(QLLM(max_batch_size=4), kv_capacity_tokens=1000,
                  activation_tokens_per_token=0.125)  # fmt: skip
    s.arrive(req(0, prompt=5, out=3), 0)
    s.arrive(req(1, prompt=6, out=3, t=0.1), 0)
    batch = s.next_batch(0)
    assert ids(batch) == [0, 1] and s.kv_used_tokens == 17
    assert s.activation_tokens(batch) == 2 and s.held_tokens(batch) == 17  # nothing suspended
    s.preempt(0.5)
    assert s.kv_used_tokens == s.held_tokens(batch) == 19 and s.in_system == 2
    assert s.held_tokens(batch.sequences[1]) == 9
    s.evict_suspended(batch)
    assert s.kv_used_tokens == 0 and s.suspended == [] and s.recomputes == 2
    assert [q.id for q in s.waiting["BE"]] == [0, 1]  # back at the front, in their order
    assert all(q.evicted and q.recomputes == 1 for q in batch.sequences)


def test_waiting_fifo_merges_the_classes_by_arrival_then_id():
    s = Scheduler(QLLM(), kv_capacity_tokens=1000)
    for i, cls, t in ((0, "BE", 0.1), (1, "LS", 0.1), (2, "LS", 0.2), (3, "BE", 0.3)):
        s.arrive(req(i, cls, t=t), t)
    assert [q.id for q in s.waiting_fifo()] == [0, 1, 2, 3]  # a tie goes to the lower id
    assert [q.id for q in s.waiting_fifo(["BE"])] == [0, 3]


def test_waiting_fifo_of_both_classes_is_heapq_merge_on_random_queues():
    """The two-queue merge on the hot path yields what heapq.merge yields, ties (equal
    arrival times) included, read whole or in part."""
    rng = random.Random(7)
    for trial in range(200):
        s = Scheduler(QLLM(), kv_capacity_tokens=10**9)
        t = 0.0
        for i in range(rng.randint(1, 30)):
            t += rng.choice((0.0, 0.0, 0.5, 1.0))  # many equal arrival times
            s.arrive(req(i, rng.choice(("LS", "BE")), t=t), t)
        want = [q.id for q in heapq.merge(s.waiting["LS"], s.waiting["BE"],
                                          key=lambda q: (q.request.arrival_s, q.id))]  # fmt: skip
        assert [q.id for q in s.waiting_fifo()] == want, trial
        k = rng.randint(0, len(want))
        assert [q.id for q in itertools.islice(s.waiting_fifo(), k)] == want[:k]


def test_take_ready_takes_from_the_front_all_or_some():
    s = Scheduler(QLLM(), kv_capacity_tokens=1000)
    for i in range(5):
        s.arrive(req(i), 0)
        s.ready["BE"].append(s.waiting["BE"].pop())
    assert ids_of(s.take_ready("BE", 2)) == [0, 1] and ids_of(s.ready["BE"]) == [2, 3, 4]
    assert ids_of(s.take_ready("BE", 3)) == [2, 3, 4] and not s.ready["BE"]
    s.ready["BE"].extend(s.waiting["BE"])
    assert s.take_ready("BE", 0) == [] and s.take_ready("LS", 4) == []


def test_take_prefill_dry_run_and_reservation_cap():
    s = Scheduler(QLLM(), kv_capacity_tokens=1000)
    for i in range(4):
        s.arrive(req(i, prompt=4, out=6), 0)  # 10 reserved each
    dry = s.take_prefill(s.waiting["BE"], 8, 100, dry_run=True)
    assert ids_of(dry) == [0, 1, 2, 3] and len(s.waiting["BE"]) == 4 and s.kv_used_tokens == 0
    capped = s.take_prefill(s.waiting["BE"], 8, 100, max_reserved_tokens=30)
    assert ids_of(capped) == [0, 1, 2] and s.kv_used_tokens == 30
    assert [q.admission for q in capped] == [0, 1, 2]
    assert s.take_prefill(s.waiting["BE"], 0, 100) == []  # no slot
    assert s.take_prefill(s.waiting["BE"], 1, 3, alone_if_oversized=False) == []


@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_a_batch_size_must_be_a_positive_integer_or_null(value):
    with pytest.raises(ValueError, match=f"^max_batch_size={value}: must be an integer >= 1, "
                                         "or null for no cap$"):  # fmt: skip
        Priority(max_batch_size=value)


def test_a_null_batch_size_is_no_cap_and_the_defaults_are_32_and_4096():
    assert Priority(max_batch_size=None).max_batch_size == math.inf
    assert (Priority().max_batch_size, Priority().max_batch_prefill_tokens) == (32, 4096)


def test_sglang_equal_priorities_admit_in_arrival_order_across_classes():
    """SGLang orders its waiting queue by priority, then arrival: with LS and BE at the same
    priority an earlier BE prompt goes first (a one-slot batch admits it, not the LS one)."""
    s = Scheduler(SGLang(max_batch_size=1, ls_priority=5, be_priority=5), kv_capacity_tokens=100)
    s.arrive(req(0, t=0.0), 0)
    s.arrive(req(1, "LS", t=0.1), 0.1)
    assert ids(step(s)) == [0]


def test_sglang_fills_the_prefill_budget_exactly():
    s = Scheduler(SGLang(max_batch_prefill_tokens=10), kv_capacity_tokens=10_000)
    s.arrive(req(0, prompt=4), 0)
    s.arrive(req(1, prompt=6), 0)
    s.arrive(req(2, prompt=1), 0)
    assert ids(step(s)) == [0, 1]  # 10 tokens: the budget, not over it


def test_sglang_ls_arrivals_preempt_one_be_each_for_their_slots():
    """Two BE requests fill both slots; two LS arrivals each need a slot: both BE requests are
    preempted (the later arrival first), and both LS prompts run together. Each re-queues
    behind the requests already waiting (SGLang's _add_request_to_queue), so 1 before 0."""
    s = Scheduler(SGLang(max_batch_size=2), kv_capacity_tokens=10_000)
    be = [s.arrive(req(0, out=20), 0), s.arrive(req(1, out=20), 0)]
    step(s)
    s.arrive(req(2, "LS", t=0.5), 0.5)
    s.arrive(req(3, "LS", t=0.5), 0.5)
    assert ids(step(s)) == [2, 3]
    assert [q.recomputes for q in be] == [1, 1] and s.recomputes == 2
    assert [q.id for q in s.waiting["BE"]] == [1, 0]


def test_sglang_requeues_a_preempted_request_behind_those_waiting_by_entry_time():
    """With one priority for both classes the queue is in entry order across classes: BE 0,
    retracted at 1.0 (evicted by hand, as ``Scheduler._grow`` does with ``victim``'s choice),
    goes behind LS 1 and LS 2, which arrived at 0.1 and 0.5, and ahead of LS 3, arriving at
    1.5 (by arrival alone it would lead)."""
    policy = SGLang(max_batch_size=1, ls_priority=5, be_priority=5)
    s = Scheduler(policy, kv_capacity_tokens=100)
    be = s.arrive(req(0, out=20), 0)
    s.arrive(req(1, "LS", out=20, t=0.1), 0.1)
    assert ids(step(s, 0.1)) == [0]
    s.arrive(req(2, "LS", t=0.5), 0.5)
    assert ids(step(s, 1.0)) == [0]  # full: decode; the selection at 1.0
    policy._requeued(be)  # what victim() notes of the request it retracts
    s.evict_ready(be)
    s.arrive(req(3, "LS", t=1.5), 1.5)
    assert ids_of(policy._waiting(s)) == [1, 2, 0, 3]
    assert policy._head(s).id == 1


def test_sglang_preempts_the_higher_id_among_equal_arrivals():
    s = Scheduler(SGLang(max_batch_size=2), kv_capacity_tokens=10_000)
    be = [s.arrive(req(0, out=20), 0), s.arrive(req(1, out=20), 0)]
    step(s)
    s.arrive(req(2, "LS", t=0.5), 0.5)
    assert ids(step(s)) == [2] and [q.recomputes for q in be] == [0, 1]


def _sglang_two_be_holding_20_of_30(ls_first=False, slots=2):
    """Reserve memory of 30: two BE requests hold 10 each (or an LS one and a BE one), in a
    batch of ``slots`` (2: full, so that an LS arrival preempts for a slot)."""
    s = Scheduler(SGLang(max_batch_size=slots), kv_capacity_tokens=30)
    first = s.arrive(req(0, "LS" if ls_first else "BE", prompt=4, out=6), 0)
    second = s.arrive(req(1, prompt=4, out=6, t=0.1), 0.1)
    step(s)
    return s, first, second


@pytest.mark.parametrize(
    ("need", "ls_first", "admitted", "recomputes", "slots"),
    [
        (11, False, True, 1, 2),  # a full batch, 1 token short: the latest BE goes, only it
        (20, False, True, 1, 2),  # exactly one BE's 10: it is enough
        (21, False, True, 2, 2),  # 1 more than one BE frees: both go
        (21, True, False, 0, 2),  # only one BE to preempt, 1 token short: none goes
        (20, True, True, 1, 2),
        (11, False, False, 0, 3),  # a free slot: no KV room stops admission, nobody preempted
    ],
)
def test_sglang_preempts_for_kv_only_what_makes_the_ls_request_fit(
    need, ls_first, admitted, recomputes, slots
):
    s, first, second = _sglang_two_be_holding_20_of_30(ls_first, slots)
    ls = s.arrive(req(2, "LS", prompt=need - 6, out=6, t=1), 1)
    batch = s.next_batch(1)
    assert (ls in batch.sequences) is admitted
    assert s.recomputes == recomputes
    if recomputes == 1:
        assert second.recomputes == 1  # the later arrival


def test_chunked_vllm_fills_the_token_budget_to_the_token_and_never_passes_it():
    """Budget 3, prompts 1, 1, 5, 2 (3 tokens out each): the first steps are the two short
    prompts and 1 token of the long one, then decodes with the chunks that fit beside them."""
    s = Scheduler(VLLM(max_num_batched_tokens=3, enable_chunked_prefill=True),
                  kv_capacity_tokens=10_000)  # fmt: skip
    for i, prompt in enumerate([1, 1, 5, 2]):
        s.arrive(req(i, prompt=prompt, out=3), 0)
    steps = []
    while s.in_system:
        batch = s.next_batch(0)
        steps.append([(q.id, q.new_tokens) for q in batch.sequences])
        s.complete_iteration(0)
    assert steps == [
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],
        [(0, 1), (1, 1), (2, 1)],
        [(2, 2), (3, 1)],
        [(2, 1), (3, 1)],
        [(2, 1), (3, 1)],
        [(3, 1)],
    ]


def test_chunked_vllm_fills_every_free_slot():
    s = Scheduler(VLLM(max_num_seqs=3, enable_chunked_prefill=True), kv_capacity_tokens=10_000)
    for i in range(4):
        s.arrive(req(i, prompt=1), 0)
    assert ids(s.next_batch(0)) == [0, 1, 2]


def test_chunked_vllm_admits_nothing_in_the_step_that_preempted():
    """As the one-phase form (test_engines): two BE requests outgrow 6 blocks of 4 and the later
    one is preempted; an LS prompt that fits once it is waits for the step after."""
    s = Scheduler(VLLM(scheduling_policy="priority", enable_chunked_prefill=True),
                  kv_capacity_tokens=24, memory=PagedMemory(24, 4, watermark=0.0))  # fmt: skip
    s.arrive(req(0, out=12), 0)
    s.arrive(req(1, out=12, t=0.1), 0)
    step(s)
    while sum(s.memory.grow_tokens(q) for q in s.ready["BE"]) <= 24 - s.kv_used_tokens:
        step(s)
    s.arrive(req(2, "LS", prompt=1, out=1, t=1), 1)
    assert ids(step(s, 1)) == [0] and s.recomputes == 1
    assert ids(s.next_batch(1)) == [0, 2]


def test_vllm_fcfs_puts_a_preempted_request_before_every_waiting_one():
    """Under fcfs the preempted request goes back to the front of the one waiting queue, ahead
    of an LS request that arrived while it ran; the LS prompt (one block, which is free) may not
    overtake it while it waits for its 3 blocks."""
    s = Scheduler(VLLM(max_num_seqs=2), kv_capacity_tokens=24, memory=PagedMemory(24, 4, 0.0))
    s.arrive(req(0, out=12), 0)
    s.arrive(req(1, out=12, t=0.1), 0.1)
    step(s)
    s.arrive(req(2, "LS", prompt=1, out=2, t=0.2), 0.2)
    while s.recomputes == 0:
        step(s)
    steps = []
    for _ in range(3):
        batch = step(s, 1)
        steps.append((batch.phase, ids(batch)))
    assert steps == [(Phase.DECODE, [0]), (Phase.DECODE, [0]), (Phase.PREFILL, [1, 2])]


def test_vllm_defaults_and_option_names():
    vllm = VLLM()
    assert (vllm.max_batch_size, vllm.max_batch_prefill_tokens) == (256, 8192)
    with pytest.raises(ValueError, match="^max_num_seqs=0: must be an integer >= 1$"):
        VLLM(max_num_seqs=0)
    with pytest.raises(ValueError, match="^max_num_seqs=True: must be an integer >= 1$"):
        VLLM(max_num_seqs=True)


@pytest.mark.parametrize(("ls_priority", "preempts"), [(10, False), (11, True)])
def test_sglang_default_threshold_10_and_be_priority_0(ls_priority, preempts):
    """LS must outrank BE (priority 0 by default) by more than 10 (the default threshold)."""
    s = Scheduler(SGLang(max_batch_size=1, ls_priority=ls_priority), kv_capacity_tokens=100)
    s.arrive(req(0, out=20), 0)
    step(s)
    s.arrive(req(1, "LS", t=0.5), 0.5)
    assert (ids(step(s)) == [1]) is preempts and s.recomputes == int(preempts)


@pytest.mark.parametrize("threshold", [-1, True, 2.5])
def test_sglang_threshold_must_be_an_integer_of_at_least_0(threshold):
    key = "priority_scheduling_preemption_threshold"
    with pytest.raises(ValueError, match=f"^{key}={threshold}: must be an integer >= 0$"):
        SGLang(priority_scheduling_preemption_threshold=threshold)


def test_sglang_threshold_0_preempts_for_any_higher_priority():
    policy = SGLang(max_batch_size=1, ls_priority=1, priority_scheduling_preemption_threshold=0)
    s = Scheduler(policy, kv_capacity_tokens=100)
    s.arrive(req(0, out=20), 0)
    step(s)
    s.arrive(req(1, "LS", t=0.5), 0.5)
    assert ids(step(s)) == [1]


def test_every_recompute_of_a_sequence_is_counted():
    s = Scheduler(QLLM(), kv_capacity_tokens=100)
    seq = s.arrive(req(0, prompt=4, out=10), 0)
    for n in (1, 2):
        step(s)  # a (re-)prefill
        s.ready["BE"].remove(seq)
        s.evict(seq)
        assert seq.recomputes == s.recomputes == n and s.kv_used_tokens == 0
    assert ids(step(s)) == [0] and seq.generated == 3  # kept its 2 tokens, made a third
