"""The real engine executes recompute preemption: after its KV is freed, a sequence re-prefills
prompt + generated tokens and still produces exactly ``model.generate``'s greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_setup

from policies.core import BE, LS, Request
from policies.memory import PagedMemory
from policies.qllm import QLLM
from policies.scheduler import Scheduler
from policies.sglang import SGLang
from policies.vllm import VLLM
from realrun.clock import VirtualClock
from realrun.engine import RealEngine


@pytest.fixture(scope="module")
def f64():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    be = [Request(i, BE, 0.01 * i, 3 + (7 * i) % 37, 6 + i % 7) for i in range(10)]
    ls = [Request(10 + j, LS, 0.1 + 0.07 * j, 2 + (5 * j) % 23, 1 + j % 3) for j in range(8)]
    yield greedy_setup(be + ls, max_prompt_tokens=48)
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "make, capacity",
    [
        # vLLM grows its running requests before it admits: a smaller cache to preempt in
        (lambda: VLLM(max_num_seqs=8, scheduling_policy="priority"), 100),
        # SGLang's budget on prompts only (clip 0), so that the cache runs out and it retracts
        (lambda: SGLang(max_batch_size=6, clip_max_new_tokens_estimation=0), 100),
        (lambda: QLLM(max_batch_size=6, evict_be_for_ls=True), 120),
    ],
    ids=["vllm", "sglang", "qllm-evict"],
)
def test_recomputed_sequences_generate_exactly_the_greedy_tokens(f64, make, capacity):
    runner, requests, prompts, reference = f64
    memory = PagedMemory(capacity, block_size_tokens=4, watermark=0.0)
    sched = Scheduler(make(), kv_capacity_tokens=capacity, memory=memory)
    refed = []  # (tokens fed, prompt + generated) of every recomputing sequence
    begin = runner.begin

    def recording_begin(kvs, chunk_tokens=None):
        refed.extend((kv.num_new, kv.key.new_tokens) for kv in kvs if kv.key.evicted)
        return begin(kvs, chunk_tokens)

    runner.begin = recording_begin
    try:
        result = RealEngine(requests, prompts, sched, runner, VirtualClock(1e-3)).run()
    finally:
        del runner.begin
    assert len(refed) >= 2  # the comparison covers recomputed sequences
    assert all(fed == expected > 1 for fed, expected in refed)  # the whole context, again
    assert result.tokens == reference
    assert sched.kv_used_tokens == 0 and memory.blocks == {}
