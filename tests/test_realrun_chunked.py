"""The real engine executes chunked prefill: prompts split over several mixed iterations, each
chunk attending to its cached prefix, decode steps in the same iterations, and every request
still gets exactly ``model.generate``'s greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy_setup

from policies.core import BE, LS, Request
from policies.memory import PagedMemory
from policies.scheduler import Scheduler
from policies.vllm import VLLM
from profiler.models import build_model
from profiler.ops import ModelRunner
from realrun.clock import VirtualClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.validate import shape_batch

BUDGET_TOKENS = 16  # max_num_batched_tokens: most prompts below take several iterations


def workload() -> tuple[list[Request], dict[int, list[int]]]:
    """Prompts up to 48 tokens, LS arrivals while BE requests decode."""
    be = [Request(i, BE, 0.01 * i, 9 + (13 * i) % 40, 4 + i % 5) for i in range(8)]
    ls = [Request(8 + j, LS, 0.05 + 0.04 * j, 2 + (11 * j) % 37, 1 + j % 3) for j in range(6)]
    return build_prompts(be + ls, 512, max_prompt_tokens=48, seed=0)


@pytest.fixture(scope="module")
def f64():
    """float64 tiny-mixtral with large random weights (greedy tokens depend on the whole
    context), the workload and its greedy reference tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield greedy_setup(*workload())
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "scheduling_policy, paged",
    [("fcfs", False), ("priority", False), ("priority", True)],
    ids=["fcfs", "priority", "priority-paged"],
)
def test_chunked_prefill_generates_exactly_the_greedy_tokens(f64, scheduling_policy, paged):
    runner, requests, prompts, reference = f64
    policy = VLLM(max_num_seqs=8, max_num_batched_tokens=BUDGET_TOKENS,
                  scheduling_policy=scheduling_policy, enable_chunked_prefill=True)  # fmt: skip
    memory = PagedMemory(100, block_size_tokens=4, watermark=0.0) if paged else None
    sched = Scheduler(policy, kv_capacity_tokens=100 if paged else 100_000, memory=memory)
    batches = []  # per iteration: (tokens fed, tokens cached before, prompt tokens) per sequence
    recomputed = []  # (tokens fed, tokens cached before) of sequences re-prefilling after eviction
    begin = runner.begin

    def recording_begin(kvs, chunk_tokens=None):
        state = begin(kvs, chunk_tokens)
        batches.append([(n, kv.num_cached, kv.num_prompt)
                        for kv, n in zip(kvs, state.feed, strict=True)])  # fmt: skip
        recomputed.extend((n, kv.num_cached) for kv, n in zip(kvs, state.feed, strict=True)
                          if kv.key.evicted)  # fmt: skip
        return state

    runner.begin = recording_begin
    try:
        result = RealEngine(requests, prompts, sched, runner, VirtualClock(1e-3)).run()
    finally:
        del runner.begin
    assert result.tokens == reference
    assert all(s.done for s in result.sequences)
    # The run covers what it claims: prompt chunks over a cached prefix, chunks that leave the
    # prompt unfinished, and iterations holding decode steps and prompt chunks together.
    fed = [seq for b in batches for seq in b]
    assert sum(0 < cached < prompt for _, cached, prompt in fed) >= 5
    assert sum(cached + n < prompt for n, cached, prompt in fed) >= 5
    mixed = [b for b in batches if any(c >= p for _, c, p in b) and any(c < p for _, c, p in b)]
    assert len(mixed) >= 5
    assert max(sum(n for n, *_ in b) for b in batches) <= BUDGET_TOKENS
    if paged:  # recomputations chunked too: later chunks keep the recomputed prefix
        assert sched.recomputes >= 1 and sched.kv_used_tokens == 0
        assert any(cached == 0 for _, cached in recomputed)
        assert any(cached > 0 for _, cached in recomputed)
    # qllm-validate rebuilds each recorded iteration, chunks with their cached prefix
    for seg in result.segments:
        rebuilt = shape_batch(seg.phase, seg.shape).sequences
        assert [(q.phase.value, q.new_tokens, q.context_tokens) for q in rebuilt] == seg.shape


def test_the_cli_runs_vllm_with_chunked_prefill(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "realrun", f"hydra.run.dir={tmp_path}", "progress=false",
         "clock=virtual", "workload=synthetic", "workload.num_requests=5", "workload.rate=50",
         "workload.prompt.tokens=40", "workload.output.tokens=3", "policy=vllm",
         "policy.enable_chunked_prefill=true", "policy.max_num_batched_tokens=16"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 5
    # 5 prompts of 40 tokens under a 16-token budget take at least 200 / 16 iterations, of
    # tiny-mixtral's 42 stages each (one-phase batches would need as few as 3)
    assert summary["executor"]["events"] >= 13 * 42


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_prefill_exact_tokens_on_cuda():
    model, _ = build_model({"name": "tiny-mixtral", "config": {"initializer_range": 0.2}},
                           device="cuda", dtype="float64", seed=3)  # fmt: skip
    requests, prompts = workload()
    policy = VLLM(max_num_seqs=8, max_num_batched_tokens=BUDGET_TOKENS,
                  scheduling_policy="priority", enable_chunked_prefill=True)  # fmt: skip
    sched = Scheduler(policy, kv_capacity_tokens=100_000)
    result = RealEngine(requests, prompts, sched, ModelRunner(model), VirtualClock(1e-3)).run()
    for r in requests:
        ref = model.generate(
            torch.tensor([prompts[r.id]], device="cuda"),
            do_sample=False,
            max_new_tokens=r.output_tokens,
        )[0, r.prompt_tokens :].tolist()
        assert result.tokens[r.id] == ref
