"""vLLM's and SGLang's admission rules at their limits, worked out by hand from the documented
rules (policies/vllm.py, policies/sglang.py): the step's token budget less the running decodes,
free slots, no overtaking, and the priority order. Written to kill mutants that the broader
tests let survive (README, "Mutation testing")."""

from __future__ import annotations

from conftest import ids, step

from policies import Phase, Request, Scheduler
from policies.sglang import SGLang
from policies.vllm import VLLM


def req(i, cls="BE", prompt=4, out=10, t=0.0):
    return Request(i, cls, t, prompt, out)


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
    batch = step(s, 1)  # a step: the running requests decode first...
    assert batch.phase is Phase.DECODE and ids(batch) == [0, 1]
    batch = step(s, 1)  # ... then the admitted prefill
    assert batch.phase is Phase.PREFILL and ids(batch) == [2]
    assert ids(step(s, 1)) == [0, 1, 2]


def test_vllm_admits_only_into_free_slots():
    s = Scheduler(VLLM(max_num_seqs=3), kv_capacity_tokens=10_000)
    s.arrive(req(0), 0)
    s.arrive(req(1), 0)
    step(s)
    for i in (2, 3):
        s.arrive(req(i, t=1), 1)
    step(s, 1)  # decode
    assert ids(step(s, 1)) == [2]  # one slot left
    assert ids(step(s, 1)) == [0, 1, 2]


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
