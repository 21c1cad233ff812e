"""KV memory models: reserve and paged, recompute preemption, reliability under memory pressure."""

from __future__ import annotations

import pytest
from conftest import linear_profile, step
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies import Phase, Request, Scheduler, Sequence
from policies.alg1 import Algorithm1
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.memory import PagedMemory, ReserveMemory, build_memory
from policies.priority import Priority
from policies.qllm import QLLM
from policies.scheduler import CapacityError
from policies.sglang import SGLang
from policies.vllm import VLLM
from sim.app import CONF_DIR
from sim.config import UserError
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.run import simulate


def req(i, cls="BE", prompt=10, out=5, t=0.0):
    return Request(i, cls, t, prompt, out)


def paged(capacity, block=4, watermark=0.0):
    return PagedMemory(capacity, block_size_tokens=block, watermark=watermark)


def test_paged_blocks_follow_the_tokens_written():
    mem = paged(64, block=16)
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=64, memory=mem)
    s.arrive(req(0, prompt=20, out=30), 0)
    step(s)  # prefill writes 20 tokens: 2 blocks
    assert s.kv_used_tokens == 32
    for _ in range(12):  # the decode of generated token g makes the KV prompt + g long: 32
        step(s)
    assert s.kv_used_tokens == 32
    step(s)  # the 33rd KV token needs a third block
    assert s.kv_used_tokens == 48 and mem.blocks == {0: 3}
    while s.in_system:
        step(s)
    assert s.kv_used_tokens == 0 and mem.blocks == {}


def test_reserve_charges_prompt_plus_output_on_admission():
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=100)
    assert isinstance(s.memory, ReserveMemory)
    s.arrive(req(0, prompt=20, out=30), 0)
    step(s)
    assert s.kv_used_tokens == 50


def test_paged_watermark_holds_back_admission_but_not_growth():
    mem = paged(100, block=10, watermark=0.2)  # 10 blocks, 2 kept free at admission
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=100, memory=mem)
    s.arrive(req(0, prompt=40, out=30), 0)
    s.arrive(req(1, prompt=30, out=30), 0)
    assert [q.id for q in step(s).sequences] == [0, 1] and s.kv_used_tokens == 70
    for _ in range(10):  # KV 50 and 40 tokens long: 9 blocks, into the watermark
        step(s)
    assert s.kv_used_tokens == 90 and s.recomputes == 0
    s.arrive(req(2, prompt=1, out=1), 0)
    assert s.next_batch(0).phase is Phase.DECODE  # one more block would pass the watermark


def test_a_request_that_can_never_fit_is_refused_on_arrival_naming_it():
    s = Scheduler(Priority(), kv_capacity_tokens=100, memory=paged(100, block=10, watermark=0.1))
    # its KV is at most prompt + output - 1 tokens long (the last token's is never written):
    # 9 blocks, and a recompute readmits them past the 1 watermark block
    s.arrive(req(0, prompt=50, out=41), 0)
    with pytest.raises(CapacityError, match="request 1 needs"):
        s.arrive(req(1, prompt=50, out=42), 0)


def test_a_request_whose_kv_fills_the_cache_exactly_runs_to_its_end():
    """16 + 17 tokens write at most 32 KV tokens: 2 blocks of 16, the whole cache (it was
    refused as needing 48)."""
    s = Scheduler(Priority(), kv_capacity_tokens=32, memory=paged(32, block=16))
    seq = s.arrive(req(0, prompt=16, out=17), 0)
    while s.in_system:
        step(s)
    assert seq.generated == 17 and s.peak_kv_used_tokens == 32 and s.recomputes == 0


def test_a_request_that_can_never_fit_is_one_line_through_simulate():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["policy=vllm", "memory.model=paged",
                                           "profile.kv_capacity_tokens=200", "workload=synthetic",
                                           "workload.num_requests=50"])  # fmt: skip
        with pytest.raises(UserError, match=r"^profile.kv_capacity_tokens: request \d+ needs"):
            simulate(cfg)
        cfg.memory.block_size_tokens = 2000
        with pytest.raises(UserError, match=r"^memory.block_size_tokens=2000: must be in"):
            simulate(cfg)


def test_bad_memory_model_is_named():
    with pytest.raises(ValueError, match="^model=swap: must be one of reserve, paged"):
        build_memory("swap", 100)


def test_a_sequence_that_cannot_grow_is_preempted_by_recompute_and_resumes():
    """Two sequences share 3 blocks of 4 tokens; the second to need a block is preempted: its
    blocks are freed, it waits at the front of its queue with its tokens kept, and its next
    prefill recomputes prompt + generated tokens."""
    mem = paged(12, block=4)
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=12, memory=mem)
    a, b = s.arrive(req(0, prompt=4, out=6), 0), s.arrive(req(1, prompt=4, out=6, t=0.1), 0)
    assert [q.id for q in step(s).sequences] == [0, 1]  # prefill: 1 block each
    step(s)  # decode writes token 5 of each: a gets block 2, b cannot and is preempted
    assert (a.generated, b.generated) == (2, 1)
    assert b.recomputes == 1 and b.evicted and b.phase is Phase.PREFILL
    assert list(s.waiting["BE"]) == [b] and mem.blocks == {0: 2}
    assert b.new_tokens == 5 and b.context_tokens == 0  # prompt + the generated token
    while a.generated < a.request.output_tokens:
        assert step(s).sequences == [a]
    batch = s.next_batch(0)  # a finished: b is re-admitted and recomputes 5 tokens
    assert batch.phase is Phase.PREFILL and batch.sequences == [b] and batch.new_tokens == 5
    s.complete_iteration(0)
    assert b.generated == 2 and not b.evicted and b.context_tokens == 5
    while s.in_system:
        step(s)
    assert b.generated == 6 and s.kv_used_tokens == 0 and mem.blocks == {}
    assert s.recomputes == 1 and b.preemptions == 0  # suspensions are counted apart


@pytest.mark.parametrize(
    ("policy", "evicted"),
    [
        (IterationFCFS, 1),
        (FCFS, 1),
        (Priority, 0),
        (lambda max_batch_size: VLLM(max_batch_size, scheduling_policy="priority"), 0),
        (lambda max_batch_size: VLLM(max_batch_size), 1),
    ],  # fmt: skip
    ids=["iteration", "fcfs", "priority", "vllm-priority", "vllm-fcfs"],
)
def test_a_class_blind_policy_preempts_the_latest_arrival_whatever_its_class(policy, evicted):
    """A BE request (arrived first) and an LS one share 3 blocks; when they cannot both grow,
    the class-blind policies (fcfs, iteration, vllm's fcfs) preempt the latest arrival, the LS
    one, as their FIFO order says; the priority-aware ones preempt the BE one. Under the class-aware
    rule that fcfs and iteration took until 2026-12-05 the BE one went in every case."""
    s = Scheduler(policy(max_batch_size=4), kv_capacity_tokens=12, memory=paged(12, block=4))
    seqs = [s.arrive(req(0, "BE", prompt=4, out=6), 0),
            s.arrive(req(1, "LS", prompt=4, out=6, t=0.1), 0.1)]  # fmt: skip
    while not any(q.recomputes for q in seqs):
        step(s)
    assert [q.recomputes for q in seqs] == [int(i == evicted) for i in range(2)]
    while s.in_system:
        step(s)
    assert all(q.generated == 6 for q in seqs) and s.kv_used_tokens == 0


def test_recompute_prefill_is_costed_as_prompt_plus_generated_tokens():
    latency = LatencyModel(linear_profile(num_layers=2, num_experts=4), RoutingModel(2, 4, 2))
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=12, memory=paged(12, block=4))
    b = s.arrive(req(1, prompt=4, out=6), 0)
    step(s)
    step(s)
    s.ready["BE"].remove(b)
    s.evict(b)
    batch = s.next_batch(0)
    assert batch.phase is Phase.PREFILL and batch.new_tokens == 6  # 4 prompt + 2 generated
    assert latency.plan(batch).expert_tokens.sum() == 6 * 2 * 2  # tokens x top_k x layers


# ------------------------------------------------------------------------------ reliability
def _policies():
    return {
        "fcfs": lambda b, t: FCFS(max_batch_size=b, max_batch_prefill_tokens=t),
        "iteration": lambda b, t: IterationFCFS(max_batch_size=b, max_batch_prefill_tokens=t),
        "priority": lambda b, t: Priority(max_batch_size=b, max_batch_prefill_tokens=t),
        "alg1": lambda b, t: Algorithm1(max_batch_size=b, max_batch_prefill_tokens=t),
        "layer": lambda b, t: LayerPreemptive(max_batch_size=b, max_batch_prefill_tokens=t),
        "qllm": lambda b, t: QLLM(max_batch_size=b, max_batch_prefill_tokens=t),
        "qllm-evict": lambda b, t: QLLM(
            max_batch_size=b, max_batch_prefill_tokens=t, evict_be_for_ls=True
        ),
        "vllm-fcfs": lambda b, t: VLLM(max_num_seqs=b, max_num_batched_tokens=t),
        "vllm-priority": lambda b, t: VLLM(b, t, scheduling_policy="priority"),
        "vllm-chunked": lambda b, t: VLLM(b, t, enable_chunked_prefill=True),
        "vllm-chunked-priority": lambda b, t: VLLM(b, t, "priority", enable_chunked_prefill=True),
        "sglang": lambda b, t: SGLang(max_batch_size=b, max_batch_prefill_tokens=t),
    }


POLICIES = _policies()

request_lists = st.lists(
    st.tuples(
        st.floats(0, 3, allow_nan=False),
        st.sampled_from(["LS", "BE"]),
        st.integers(1, 120),
        st.integers(1, 40),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=request_lists,
    policy=st.sampled_from(sorted(POLICIES)),
    model=st.sampled_from(["reserve", "paged", "swap"]),
    swap=st.integers(0, 300),  # host tokens for swap: none to plenty
    batch=st.integers(1, 8),
    capacity=st.integers(170, 1200),
    block=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 300),
)
@example(  # the one running request finishes in the step that preempted the other
    rows=[(0.0, "LS", 37, 34), (0.0, "LS", 39, 33), (0.0625, "LS", 1, 30)],
    policy="vllm-fcfs", model="paged", swap=0, batch=3, capacity=170, block=1, budget=1,
)  # fmt: skip
@example(  # host space for some victims only (3 swapped, 2 recomputed, suspended BE among them)
    rows=[(0.0, "BE", 60, 40)] * 4 + [(0.1, "LS", 30, 40)] * 2,
    policy="qllm-evict", model="swap", swap=128, batch=6, capacity=400, block=16, budget=64,
)  # fmt: skip
@example(  # chunked prefill: 1 swapped, 1 recomputed
    rows=[(0.0, "BE", 60, 40)] * 4 + [(0.1, "LS", 30, 40)] * 2,
    policy="vllm-chunked-priority", model="swap", swap=80, batch=6, capacity=400, block=16,
    budget=64,
)  # fmt: skip
def test_every_arrived_request_completes_under_memory_pressure(
    rows, policy, model, swap, batch, capacity, block, budget
):
    """Every policy x memory model (paged preempting by recompute or by swap): no request
    lost, no stall, KV used back to 0, no block leaked on device or host, capacity never
    exceeded, every token produced once."""
    requests = [Request(i, c, t, p, o) for i, (t, c, p, o) in enumerate(sorted(rows))]
    if model == "swap":
        memory = build_memory("paged", capacity, block, 0.05, "swap", swap)
    else:
        memory = build_memory(model, capacity, block, watermark=0.05)
    sched = Scheduler(POLICIES[policy](batch, budget), capacity, 0.125, memory=memory)
    fits = [r for r in requests if memory.max_tokens(Sequence(r)) <= memory.capacity_tokens]
    prof = linear_profile(num_layers=2, num_experts=4)
    result = Simulation(fits, sched, LatencyModel(prof, RoutingModel(2, 4, 2, seed=0))).run()
    assert len(result.sequences) == len(fits)
    for seq in result.sequences:
        assert seq.generated == seq.request.output_tokens and seq.finish_s is not None
        assert not seq.evicted and len(seq.token_gaps_s) == seq.generated - 1
    assert sched.kv_used_tokens == 0 and sched.in_system == 0
    assert getattr(memory, "blocks", {}) == {} and getattr(memory, "host_blocks", {}) == {}
    assert getattr(memory, "host_used_tokens", 0) == 0
    assert result.peak_kv_used_tokens <= memory.capacity_tokens
