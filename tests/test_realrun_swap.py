"""The real engine executes swap preemption: a swapped-out sequence's KV is copied to CPU
memory and back, its next iteration feeds only the token whose KV was not written, and its
tokens still equal ``model.generate``'s greedy tokens."""

from __future__ import annotations

import pytest
import torch
from test_realrun_recompute import f64  # noqa: F401, F811 (the same requests, reference)

from policies.core import BE, Request
from policies.memory import PagedMemory
from policies.qllm import QLLM
from policies.scheduler import Scheduler
from policies.sglang import SGLang
from policies.vllm import VLLM
from profiler.models import build_model
from profiler.ops import KVSequence, ModelRunner
from realrun.clock import VirtualClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts


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
def test_swapped_sequences_generate_exactly_the_greedy_tokens(f64, make, capacity,  # noqa: F811
                                                              monkeypatch):  # fmt: skip
    runner, requests, prompts, reference = f64
    # host room for a few victims only: the others are recomputed
    memory = PagedMemory(capacity, 4, watermark=0.0, preemption="swap", swap_capacity_tokens=60)
    sched = Scheduler(make(), kv_capacity_tokens=capacity, memory=memory)
    moved = []  # sequence ids whose KV went to host
    to_host = KVSequence.to_host

    def recording_to_host(kv):
        assert kv.key.evicted and kv.key.swaps  # only what the scheduler swapped out
        moved.append(kv.key.id)
        to_host(kv)
        assert all(layer.keys is None for layer in kv.cache.layers)  # device storage dropped

    monkeypatch.setattr(KVSequence, "to_host", recording_to_host)
    fed = []  # (tokens fed, tokens cached) of every sequence resuming after a swap
    begin = runner.begin

    def recording_begin(kvs, chunk_tokens=None):
        fed.extend((kv.num_new, kv.num_cached, kv.key.prefilled_tokens) for kv in kvs
                   if kv.key.evicted and kv.key.prefilled_tokens)  # fmt: skip
        assert not any(kv.on_host for kv in kvs)
        return begin(kvs, chunk_tokens)

    monkeypatch.setattr(runner, "begin", recording_begin)
    result = RealEngine(requests, prompts, sched, runner, VirtualClock(1e-3)).run()
    assert len(moved) >= 2 and sched.swaps >= len(moved)
    assert fed and all(n == 1 and cached == kept > 0 for n, cached, kept in fed)
    assert result.tokens == reference
    assert sched.kv_used_tokens == 0 and memory.blocks == {} and memory.host_blocks == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swapped_sequences_generate_exactly_the_greedy_tokens_on_cuda():
    model, _ = build_model({"name": "tiny-mixtral", "config": {"initializer_range": 0.2}},
                           device="cuda", dtype="float64", seed=3)  # fmt: skip
    be = [Request(i, BE, 0.01 * i, 3 + (7 * i) % 37, 6 + i % 7) for i in range(10)]
    requests, prompts = build_prompts(be, 512, max_prompt_tokens=48, seed=0)
    memory = PagedMemory(80, 4, watermark=0.0, preemption="swap", swap_capacity_tokens=1000)
    sched = Scheduler(VLLM(max_num_seqs=8), kv_capacity_tokens=80, memory=memory)
    result = RealEngine(requests, prompts, sched, ModelRunner(model), VirtualClock(1e-3)).run()
    assert sched.swaps >= 2
    for r in requests:
        ids = torch.tensor([prompts[r.id]], device="cuda")
        out = model.generate(ids, do_sample=False, max_new_tokens=r.output_tokens)
        assert result.tokens[r.id] == out[0, r.prompt_tokens :].tolist()
