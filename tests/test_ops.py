"""The stepped runner: token-exact against ``model.generate``, with sequences joining and
leaving batches, per-sequence KV of different lengths, and a batch suspended mid-layer while
another batch runs."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from policies.core import Stage
from profiler.models import build_model
from profiler.ops import KVCacheError, ModelRunner, RunnerError, cache_keyword
from sim.latency import Plan

NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3"])
def f64(request):
    """A model in float64 (argmax ties cannot differ by rounding) with larger random weights,
    so the greedy tokens depend on the whole context rather than repeat one token."""
    model, info = build_model({"name": request.param, "config": {"initializer_range": 0.2}},
                              dtype="float64", seed=3)  # fmt: skip
    return model, ModelRunner(model)


def reference(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def test_greedy_tokens_equal_generate_across_joins_and_a_suspension(f64):
    model, runner = f64
    a, b, c, d = (runner.new_sequence(p) for p in prompts(5, 11, 3, 8))
    runner.run(runner.begin([a, b]))  # a two-sequence prefill of different lengths
    runner.run(runner.begin([a, b]))
    runner.run(runner.begin([c]))  # c joins: decode KV lengths now differ
    # A decode batch stops after expert 3 of a middle layer, keeping its state ...
    middle = runner.num_layers // 2
    suspended = runner.begin([a, b, c])
    runner.run(suspended, until=runner.flat_index(middle, Stage.EXPERT, 3) + 1)
    assert suspended.held_bytes() > 0 and not suspended.done
    # ... while another batch runs a whole iteration (d's prefill) ...
    runner.run(runner.begin([d]))
    # ... then resumes exactly where it stopped.
    assert runner.next_stage(suspended).expert == 4
    runner.run(suspended)
    while min(len(s.generated) for s in (a, b, c, d)) < NEW_TOKENS:
        unfinished = [s for s in (a, b, c, d) if len(s.generated) < NEW_TOKENS]
        runner.run(runner.begin(unfinished))  # finished sequences leave the batch
    for s in (a, b, c, d):
        assert s.generated == reference(model, s.token_ids[: s.num_prompt])


def test_step_by_step_equals_run_and_truncate_rewinds(f64):
    model, runner = f64
    (p,) = prompts(7, seed=1)
    stepped = runner.new_sequence(p)
    state = runner.begin([stepped])
    refs = []
    while not state.done:
        refs.append(runner.step(state))
    assert [r.index for r in refs] == list(range(runner.num_stages))
    first = stepped.generated[0]
    assert first == runner.generate([p], 1)[0][0]
    stepped.truncate(len(p), 0)  # rewind the prefill: the same token again
    runner.run(runner.begin([stepped]))
    assert stepped.generated == [first]


def test_stage_layout_matches_the_latency_plan():
    model, _ = build_model("tiny-mixtral")
    runner = ModelRunner(model)
    plan = Plan(0.0, 0.0, 0.0, np.zeros((runner.num_layers, runner.num_experts)), 0.0,
                np.zeros((runner.num_layers, runner.num_experts), dtype=int))  # fmt: skip
    assert runner.num_stages == plan.num_stages
    refs = runner.stage_list()
    assert (refs[0].stage, refs[-1].stage) == ("prepare", "lm_head")
    stage = {"attention": Stage.ATTENTION, "router": Stage.ROUTER, "expert": Stage.EXPERT}
    for ref in refs[1:-1]:
        expected = (ref.layer, int(stage[ref.stage]), max(ref.expert, 0))
        assert plan.locate(ref.index) == expected
        assert runner.flat_index(ref.layer, stage[ref.stage], max(ref.expert, 0)) == ref.index


def test_runner_rejects_an_empty_batch():
    model, _ = build_model("tiny-olmoe")
    with pytest.raises(RunnerError):
        ModelRunner(model).begin([])


def test_the_cache_argument_is_named_as_the_installed_transformers_names_it():
    def old(hidden_states, attention_mask, past_key_values=None, **kwargs): ...

    def new(hidden_states, attention_mask, cache=None, **kwargs): ...

    def neither(hidden_states, **kwargs): ...

    assert (cache_keyword(old), cache_keyword(new)) == ("past_key_values", "cache")
    with pytest.raises(RunnerError, match="neither"):
        cache_keyword(neither)


@pytest.mark.parametrize("decode", [False, True])
def test_an_attention_that_writes_no_kv_fails_the_iteration(decode):
    """transformers 5.17 drops an unknown cache keyword into **kwargs: no KV written. Forcing a
    name the attention ignores must fail at the iteration's end, in prefill and in decode."""
    model, _ = build_model("tiny-mixtral")
    runner = ModelRunner(model)
    seq = runner.new_sequence([1, 2, 3])
    if decode:
        runner.run(runner.begin([seq]))
    runner._attn_cache_kw = "ignored_by_attention"
    with pytest.raises(KVCacheError, match="holds 0 tokens|holds 3 tokens"):
        runner.run(runner.begin([seq]))


def test_one_token_prompts_take_the_batched_path_and_equal_generate(f64):
    """A batch of one-token prompts feeds one token each: its first iteration is a decode
    step over empty caches, whose padded buffers take their shape from the new keys."""
    model, runner = f64
    seqs = [runner.new_sequence(p) for p in prompts(1, 1, 1, seed=2)]
    for _ in range(NEW_TOKENS):
        runner.run(runner.begin(seqs))
    for s in seqs:
        assert s.generated == reference(model, s.token_ids[:1])


def test_prefill_chunks_over_a_cached_prefix_mixed_with_decodes_equal_generate(f64):
    """Prompts fed in chunks (each attending to its cached prefix), in iterations that also
    hold decode steps and a one-token prompt; a chunk that leaves its prompt unfinished yields
    no token. A mixed iteration suspended mid-layer resumes while another batch ran between."""
    model, runner = f64
    a, b, c, d, e = (runner.new_sequence(p) for p in prompts(13, 7, 20, 1, 6, seed=4))
    first = runner.run(runner.begin([a, b], [5, 0]))
    assert first.next_tokens[0] is None and (a.num_cached, a.generated) == (5, [])
    mixed = runner.begin([b, a, c, d], [0, 4, 6, 0])  # b, d: one token each
    runner.run(mixed, until=runner.flat_index(runner.num_layers // 2, Stage.EXPERT, 1))
    runner.run(runner.begin([e]))
    runner.run(runner.begin([e]))  # e decodes: the runner's padded KV is now e's
    runner.run(mixed)
    assert mixed.next_tokens[1:3] == [None, None]
    assert (a.num_cached, c.num_cached) == (9, 6)
    last = runner.run(runner.begin([a, b, c, d], [0, 0, 1, 0]))  # a's last chunk; c: 1 token
    assert [t is None for t in last.next_tokens] == [False, False, True, False]
    while min(len(s.generated) for s in (a, b, c, d)) < NEW_TOKENS:
        runner.run(runner.begin([s for s in (a, b, c, d) if len(s.generated) < NEW_TOKENS]))
    for s in (a, b, c, d):
        assert s.generated == reference(model, s.token_ids[: s.num_prompt])
    assert e.generated == reference(model, e.token_ids[: e.num_prompt], 2)


def test_a_chunk_must_fit_the_uncached_tokens():
    model, _ = build_model("tiny-mixtral")
    runner = ModelRunner(model)
    seq = runner.new_sequence([1, 2, 3])
    with pytest.raises(RunnerError, match="chunk"):
        runner.begin([seq], [4])
    with pytest.raises(RunnerError, match="one entry per sequence"):
        runner.begin([seq], [1, 1])


class OpLog(TorchDispatchMode):
    """The aten ops run inside the ``with`` block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# Ops whose CUDA kernels read a value back to the host (a device sync) before they return.
SYNCING_OPS = {"bincount", "nonzero", "_local_scalar_dense", "item", "unique", "_unique2",
               "masked_select", "is_nonzero", "repeat_interleave"}  # fmt: skip


def tiny_runner() -> ModelRunner:
    model, _ = build_model("tiny-mixtral")
    return ModelRunner(model)


def test_router_reads_the_device_once(monkeypatch):
    runner = tiny_runner()
    state = runner.begin([runner.new_sequence(p) for p in prompts(5, 9)])
    runner.run(state, until=runner.flat_index(0, Stage.ROUTER))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    with OpLog() as log:
        runner.step(state)
    assert reads == [(runner.num_experts + 1,)]  # the queue bounds, nothing else
    assert not SYNCING_OPS & set(log.ops)
    assert sum(state.routing.counts) == 14 * runner.top_k


def decode_attention_ops(runner: ModelRunner, batch: int) -> list[str]:
    """The ops of layer 1's attention in the second decode step of ``batch`` sequences."""
    seqs = [runner.new_sequence(p) for p in prompts(*range(3, 3 + batch))]
    runner.run(runner.begin(seqs))  # prefill
    runner.run(runner.begin(seqs))  # first decode step: binds the padded KV
    state = runner.begin(seqs)
    runner.run(state, until=runner.flat_index(1, Stage.ATTENTION))
    with OpLog() as log:
        runner.step(state)
    runner.run(state)
    return log.ops


def test_decode_attention_copies_no_kv_per_sequence():
    """The batch's new keys and values go into its padded buffer in one op each, and
    attention reads a view of it: the ops do not grow with the batch."""
    runner = tiny_runner()
    small, large = decode_attention_ops(runner, 2), decode_attention_ops(runner, 6)
    assert sorted(small) == sorted(large)
    assert small.count("index_copy_") == 2  # keys, values


def test_a_finished_batch_frees_its_padded_kv_without_the_garbage_collector():
    """No reference cycle between sequences and their batch's padded KV: on a GPU, buffers
    left to the cyclic collector pile up between its runs."""
    runner = tiny_runner()
    gc.collect()
    gc.disable()
    try:
        seqs = [runner.new_sequence(p) for p in prompts(4, 6)]
        for _ in range(3):  # prefill, two decode steps on one padded KV
            runner.run(runner.begin(seqs))
        padded = runner._padded
        assert padded() is not None and padded().holds(seqs, 9)
        del seqs
        assert padded() is None
    finally:
        gc.enable()


def test_a_decode_step_binds_a_new_padded_kv_only_for_a_new_batch(f64):
    """``IterationState.bound`` (what the validation charges as ``attn_decode_bind``): the
    first decode step of a batch binds; the next step of the same sequences reuses the buffer,
    also after another batch's prefill; a new member or a new order binds anew."""
    _, runner = f64
    a, b, c = (runner.new_sequence(p) for p in prompts(5, 11, 3))
    runner.run(runner.begin([a, b]))  # their prefill

    def binds(seqs) -> bool:
        return runner.run(runner.begin(seqs)).bound

    assert binds([a, b]) and not binds([a, b])
    runner.run(runner.begin([c]))  # a prefill: it leaves the decode batch's buffer
    assert not binds([a, b])
    assert binds([a, b, c]) and not binds([a, b, c])
    assert binds([b, a, c]) and not binds([b, a, c])
    assert binds([b, c]) and not binds([b, c])  # a leaves
