"""Preemption in the real engine, checked against figures worked out by hand.

A tiny Mixtral cut to 2 layers x 4 experts has the stage layout of tests/test_spec_preemption.py:
14 stages an iteration (prepare, then per layer attention, router, experts 0-3, then lm_head).
Boundary c is "c stages done". Preemptible: ``layer`` 1, 2, 3, 7, 8, 9, 13 (never between two
experts); ``qllm`` every inner boundary 1..13. With a virtual clock every stage takes 1 ms, so an
iteration started at t runs boundary c at t + c ms.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import linear_profile
from test_spec_preemption import LAYER_BOUNDARIES, CheckingScheduler

from policies.core import BE, LS, Request
from policies.layer import LayerPreemptive
from policies.qllm import QLLM
from profiler.models import build_model
from profiler.ops import ModelRunner
from profiler.schema import OpPoint
from realrun.clock import VirtualClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.validate import predict_segment, shape_batch
from sim.latency import LatencyModel

MS = 1e-3
STAGES = 14


class CountingRunner(ModelRunner):
    """Records every stage it executes as (iteration state, stage index)."""

    def __init__(self, model):
        super().__init__(model)
        self.executed = []  # keeps the states alive, so their ids stay unique

    def step(self, state):
        self.executed.append((state, state.cursor))
        return super().step(state)

    def stages_by_iteration(self):
        out = defaultdict(list)
        for state, cursor in self.executed:
            out[id(state)].append(cursor)
        return list(out.values())


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m, _ = build_model({"name": "tiny-mixtral",
                        "config": {"num_hidden_layers": 2, "num_local_experts": 4}})  # fmt: skip
    yield m
    torch.set_num_threads(threads)


def run(model, requests, policy):
    requests, prompts = build_prompts(requests, 512, max_prompt_tokens=64, seed=0)
    runner = CountingRunner(model)
    assert runner.num_stages == STAGES
    sched = CheckingScheduler(policy, kv_capacity_tokens=100_000, activation_tokens_per_token=1.0)
    result = RealEngine(requests, prompts, sched, runner, VirtualClock(MS)).run()
    sched.check_drained()
    # Each stage of each iteration ran exactly once, in order, across preemptions.
    iterations = runner.stages_by_iteration()
    assert len(iterations) == result.iterations
    assert all(stages == list(range(STAGES)) for stages in iterations)
    return result, sched


# (LS arrival ms, where qllm suspends the BE prefill, where layer does); None: no boundary left
ARRIVALS = [
    (0.5, 1, 1),
    (1.5, 2, 2),  # in layer 0's attention
    (4.5, 5, 7),  # in expert 1 of layer 0: qllm after it, layer at the end of layer 0
    (6.5, 7, 7),  # in the last expert of layer 0
    (9.5, 10, 13),  # in expert 0 of layer 1: layer waits for the end of the last layer
    (13.5, None, None),  # in lm_head
]


@pytest.mark.parametrize("arrival_ms, qllm_at, layer_at", ARRIVALS)
@pytest.mark.parametrize("name", ["qllm", "layer"])
def test_real_engine_suspends_at_the_hand_worked_boundary(model, name, arrival_ms, qllm_at,
                                                          layer_at):  # fmt: skip
    """BE prefill (2 tokens out) from 0 ms; an LS request (1 token) arrives mid-iteration. The
    BE batch stops at the boundary of the table, the LS prefill runs 14 ms, the BE prefill ends
    at 28 ms whatever the stop (nothing lost or repeated) and its decode at 42 ms."""
    policy, at = (QLLM(), qllm_at) if name == "qllm" else (LayerPreemptive(), layer_at)
    be = Request(0, BE, 0.0, prompt_tokens=8, output_tokens=2)
    ls = Request(1, LS, arrival_ms * MS, prompt_tokens=4, output_tokens=1)
    result, sched = run(model, [be, ls], policy)
    be_seq, ls_seq = sorted(result.sequences, key=lambda s: s.id)
    if at is None:
        assert sched.cursors == []
        assert ls_seq.first_token_s == pytest.approx(28 * MS)
        assert be_seq.first_token_s == pytest.approx(14 * MS)
        return
    assert sched.cursors == [at]
    assert ls_seq.first_token_s == pytest.approx((at + STAGES) * MS)
    assert be_seq.first_token_s == pytest.approx(28 * MS)
    assert be_seq.finish_s == pytest.approx(42 * MS)


def mixed_requests() -> list[Request]:
    """12 BE jobs first; 10 one-token LS jobs arrive one by one while BE batches run (an LS job
    done with its prefill leaves the next LS arrival a BE-only batch to preempt)."""
    be = [Request(i, BE, 0.001 * i, 3 + (7 * i) % 37, 6 + i % 7) for i in range(12)]
    ls = [Request(12 + j, LS, 0.02 + 0.0313 * j, 2 + (5 * j) % 23, 1) for j in range(10)]
    return be + ls


@pytest.mark.parametrize("name", ["qllm", "layer"])
def test_real_engine_stops_only_where_the_named_policy_may(model, name):
    """Many arrivals: ``layer`` never stops between experts, ``qllm`` does; no LS batch is
    preempted and KV accounting holds (CheckingScheduler); every stage runs once (run)."""
    policy = QLLM(max_batch_size=6) if name == "qllm" else LayerPreemptive(max_batch_size=6)
    result, sched = run(model, mixed_requests(), policy)
    assert len(sched.cursors) >= 5, sched.cursors
    if name == "layer":
        assert set(sched.cursors) <= set(LAYER_BOUNDARIES)
    else:
        assert set(sched.cursors) - set(LAYER_BOUNDARIES), sched.cursors


def test_segments_record_each_executed_stretch_with_its_shape_and_idle_time(model):
    """The hand-worked qllm case (LS arrives at 4.5 ms, the BE prefill stops at boundary 5)
    plus a BE request arriving at 100 ms on an idle engine: one segment per executed stretch,
    with the batch shape at planning time, and the idle time only before the late one."""
    be = Request(0, BE, 0.0, prompt_tokens=8, output_tokens=2)
    ls = Request(1, LS, 4.5 * MS, prompt_tokens=4, output_tokens=1)
    late = Request(2, BE, 100 * MS, prompt_tokens=5, output_tokens=1)
    result, _ = run(model, [be, ls, late], QLLM())
    got = [(s.phase, s.shape, s.start_cursor, s.end_cursor, round(s.start_s / MS, 6),
            round(s.end_s / MS, 6), round(s.idle_s / MS, 6), s.preempted)
           for s in result.segments]  # fmt: skip
    assert got == [
        ("prefill", [("prefill", 8, 0)], 0, 5, 0, 5, 0, True),
        ("prefill", [("prefill", 4, 0)], 0, 14, 5, 19, 0, False),
        ("prefill", [("prefill", 8, 0)], 5, 14, 19, 28, 0, False),  # resumed
        ("decode", [("decode", 1, 8)], 0, 14, 28, 42, 0, False),
        ("prefill", [("prefill", 5, 0)], 0, 14, 100, 114, 58, False),
    ]
    assert sum(s.end_cursor - s.start_cursor for s in result.segments) == result.stages


def test_a_segments_prediction_is_the_plans_time_over_its_stretch(model):
    """Against a profile whose stages all take fixed times (overhead 3, attention 1, router
    0.2, every expert 0.5, lm_head 2 ms): the prediction of a stretch is the plan's time
    between its cursors, plus the profile's wake-up after its idle time."""

    base = linear_profile(num_layers=2, num_experts=4, expert_per_token_ms=0.0)
    extra = [OpPoint("expert", num_tokens=0, median_ms=0.5), OpPoint("wake_up", idle_ms=0),
             OpPoint("wake_up", median_ms=6.0, idle_ms=100)]  # fmt: skip
    latency = LatencyModel(replace(base, points=base.points + extra))
    be = Request(0, BE, 0.0, prompt_tokens=8, output_tokens=2)
    ls = Request(1, LS, 4.5 * MS, prompt_tokens=4, output_tokens=1)
    late = Request(2, BE, 100 * MS, prompt_tokens=5, output_tokens=1)
    result, _ = run(model, [be, ls, late], QLLM())
    predicted = [round(predict_segment(latency, s)[0] / MS, 9) for s in result.segments]
    whole = 3 + 2 * (1 + 0.2 + 4 * 0.5) + 2  # 11.4 ms
    assert predicted == [5.2, whole, round(whole - 5.2, 9), whole, whole + 6.0 * 58 / 100]
    batch = shape_batch("decode", [("decode", 1, 8), ("decode", 1, 30)])
    assert [(s.new_tokens, s.context_tokens) for s in batch.sequences] == [(1, 8), (1, 30)]
