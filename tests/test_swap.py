"""Swap preemption under paged memory: KV to host memory and back, its copy time, its fallback."""

from __future__ import annotations

import pytest
from conftest import linear_profile
from hydra import compose, initialize_config_dir

from policies import Phase, Request, Scheduler
from policies.memory import PagedMemory, build_memory
from policies.priority import Priority
from policies.vllm import VLLM
from sim.app import CONF_DIR
from sim.config import UserError
from sim.latency import LatencyModel, RoutingModel
from sim.run import simulate


def req(i, cls="BE", prompt=4, out=6, t=0.0):
    return Request(i, cls, t, prompt, out)


def swapping(capacity=12, swap_tokens=8, block=4):
    return PagedMemory(capacity, block, watermark=0.0, preemption="swap",
                       swap_capacity_tokens=swap_tokens)  # fmt: skip


def two_growing(mem, policy=None):
    """Two sequences of 4-token prompts on 3 blocks of 4: the second to need a third block at
    the first decode (token 5 of each) is preempted."""
    s = Scheduler(policy or Priority(max_batch_size=4), kv_capacity_tokens=12, memory=mem)
    a, b = s.arrive(req(0), 0), s.arrive(req(1, t=0.1), 0)
    batch = s.next_batch(0)
    assert [q.id for q in batch.sequences] == [0, 1] and batch.swap_tokens == 0
    s.complete_iteration(0)
    return s, a, b


def test_a_sequence_that_cannot_grow_is_swapped_out_and_back_in():
    mem = swapping()
    s, a, b = two_growing(mem)
    batch = s.next_batch(0)  # a grows into block 3; b cannot: its written KV (4 tokens) leaves
    assert batch.sequences == [a] and batch.swap_tokens == 4  # this iteration pays the copy
    s.complete_iteration(0)
    assert (b.swaps, b.recomputes, s.swaps, s.recomputes) == (1, 0, 1, 0)
    assert mem.host_blocks == {1: 1} and mem.host_used_tokens == 4 and mem.blocks == {0: 2}
    assert list(s.waiting["BE"]) == [b] and b.phase is Phase.PREFILL
    assert (b.context_tokens, b.new_tokens) == (4, 1)  # only the unwritten token is fed
    while a.finish_s is None:
        assert s.next_batch(0).swap_tokens == 0
        s.complete_iteration(0)
    batch = s.next_batch(0)  # room again: b is admitted, its block copied back first
    assert batch.sequences == [b] and batch.new_tokens == 1 and batch.swap_tokens == 4
    assert mem.host_blocks == {} and mem.host_used_tokens == 0 and mem.blocks == {1: 2}
    s.complete_iteration(0)
    assert b.generated == 2 and not b.evicted and b.phase is Phase.DECODE
    assert b.context_tokens == 5
    while s.in_system:
        s.next_batch(0)
        s.complete_iteration(0)
    assert b.generated == 6 and s.kv_used_tokens == 0 and mem.blocks == {}
    assert len(b.token_gaps_s) == 5  # every token recorded once


def test_a_full_swap_space_falls_back_to_recompute():
    mem = swapping(swap_tokens=3)  # less than one block
    s, a, b = two_growing(mem)
    assert s.next_batch(0).swap_tokens == 0
    s.complete_iteration(0)
    assert (b.swaps, b.recomputes) == (0, 1) and mem.host_blocks == {}
    assert (b.context_tokens, b.new_tokens) == (0, 5)  # prompt + generated recomputed
    while s.in_system:
        s.next_batch(0)
        s.complete_iteration(0)
    assert (a.generated, b.generated) == (6, 6) and s.kv_used_tokens == 0


def test_a_prefill_not_begun_is_recomputed_not_swapped():
    """A sequence admitted but not yet run has no KV written: nothing to copy."""
    mem = swapping(capacity=16, swap_tokens=100)
    s = Scheduler(Priority(max_batch_size=4), kv_capacity_tokens=16, memory=mem)
    seq = s.arrive(req(0), 0)
    s.take_prefill([seq], 1, 100)
    s.evict(seq)
    assert (seq.swaps, seq.recomputes, mem.transfer_tokens) == (0, 1, 0)


def test_vllm_counts_a_swap_as_a_preemption_and_admits_nothing_in_that_step():
    s, a, b = two_growing(swapping(), VLLM(4, 64, scheduling_policy="priority"))
    s.arrive(req(2, "LS", prompt=1, out=1, t=0.2), 0)  # its one block would fit
    assert s.next_batch(0).sequences == [a] and b.swaps == 1  # the decode step preempts b
    s.complete_iteration(0)
    # V1: the step that preempted admitted none; the next one may
    assert [q.id for q in s.next_batch(0).sequences] == [0, 2]


def test_the_copy_time_is_charged_at_the_profiles_swap_bandwidth():
    profile = linear_profile(num_layers=2, num_experts=4)
    latency = LatencyModel(profile, RoutingModel(2, 4, 2))
    s, a, b = two_growing(swapping())
    batch = s.next_batch(0)
    with_copy = latency.plan(batch).overhead_s
    batch.swap_tokens = 0
    copy_s = 4 * profile.memory.kv_bytes_per_token / profile.memory.swap_bytes_per_s
    assert with_copy - latency.plan(batch).overhead_s == pytest.approx(copy_s, rel=1e-9)
    assert copy_s > 0


def test_swap_needs_paged_memory_and_a_known_mode():
    with pytest.raises(ValueError, match="^preemption=swap: needs memory.model=paged"):
        build_memory("reserve", 100, preemption="swap")
    with pytest.raises(ValueError, match="^preemption=move: must be one of recompute, swap"):
        build_memory("paged", 100, preemption="move")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = [
            "policy=vllm",
            "workload=synthetic",
            "workload.num_requests=60",
            "workload.rate=50",
            "workload.output.tokens=200",
            "profile.kv_capacity_tokens=2000",
        ]
        return compose("config", overrides=[*base, *overrides])


def test_simulate_swaps_under_memory_pressure_and_loses_nothing():
    out = simulate(_cfg("memory.model=paged", "memory.preemption=swap"))
    every = out.summary["classes"]["all"]
    assert out.summary["completed"] == 60 and every["swaps"] > 0
    assert (out.requests["swaps"] > 0).sum() > 1
    none = simulate(_cfg("memory.model=paged", "memory.preemption=swap",
                         "memory.swap_space_gib=0"))  # fmt: skip
    assert none.summary["classes"]["all"]["swaps"] == 0
    assert none.summary["classes"]["all"]["recomputes"] > 0


def test_swap_under_reserve_is_one_line():
    with pytest.raises(UserError, match=r"^memory.preemption=swap: swap needs memory.model=paged"):
        simulate(_cfg("memory.preemption=swap"))
    with pytest.raises(UserError, match=r"^memory.preemption=move: must be recompute or swap"):
        simulate(_cfg("memory.preemption=move"))
    with pytest.raises(UserError, match=r"^memory.swap_space_gib=-1.0: must be >= 0"):
        simulate(_cfg("memory.model=paged", "memory.preemption=swap", "memory.swap_space_gib=-1"))
