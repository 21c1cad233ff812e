"""The latency model against values worked out by hand from its documented rules: piecewise-
linear curves (clamped below, extrapolated upwards only), the stage layout of a plan, routing
load shapes, and which op each stage's time comes from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import linear_profile

from policies.core import Batch, Granularity, Phase, Request, Sequence
from profiler.schema import OpPoint
from sim.latency import Curve1D, Curve2D, LatencyModel, Plan, RoutingModel

MS = 1e-3


def test_curve1d_interpolates_clamps_below_and_extrapolates_with_the_last_slope():
    curve = Curve1D([OpPoint("expert", num_tokens=n, median_ms=t)
                     for n, t in ((1, 1.0), (3, 5.0), (5, 6.0))], "num_tokens")  # fmt: skip
    expected_ms = {0: 1.0, 1: 1.0, 2: 3.0, 3: 5.0, 4: 5.5, 5: 6.0, 7: 7.0}
    for x, ms in expected_ms.items():
        assert curve.scalar(x) == pytest.approx(ms * MS), x
        assert curve.scalar(x) == pytest.approx(ms * MS), x  # memoised: the same again
    xs = np.array(list(expected_ms))
    np.testing.assert_allclose(curve(xs), np.array(list(expected_ms.values())) * MS)
    one = Curve1D([OpPoint("lm_head", batch_size=4, median_ms=2.0)], "batch_size")
    assert one.scalar(1) == one.scalar(99) == pytest.approx(2 * MS)  # one point: constant


def test_curve2d_is_bilinear_on_the_grid_and_clamped_or_extrapolated_off_it():
    # t(b, kv) = b + kv / 100 (ms) at b in {1, 3}, kv in {0, 100}
    grid = Curve2D([OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=b + kv / 100)
                    for b in (1, 3) for kv in (0, 100)])  # fmt: skip
    assert grid(2, 50) == pytest.approx(2.5 * MS)
    assert grid(1, 100) == pytest.approx(2 * MS)
    assert grid(0.5, 50) == pytest.approx(1.5 * MS)  # below the grid: the first row
    assert grid(5, 50) == pytest.approx(5.5 * MS)  # above: the rows' slope, 1 ms per sequence
    row = Curve2D([OpPoint("attn_decode", batch_size=2, kv_tokens=kv, median_ms=kv / 10)
                   for kv in (0, 10)])  # fmt: skip
    assert row(7, 5) == pytest.approx(0.5 * MS)  # one batch size: kv interpolation only


def test_plan_layout_offsets_and_locations():
    """2 layers x 4 experts: overhead 1, attention 4, router 1, experts 1..4 ms in layer 0 and
    0 (no token), 2, 0, 2 ms in layer 1, lm_head 3 ms."""
    plan = Plan(overhead_s=1 * MS, attention_s=4 * MS, router_s=1 * MS,
                experts_s=np.array([[1, 2, 3, 4], [0, 2, 0, 2]]) * MS, lm_head_s=3 * MS,
                expert_tokens=np.array([[1, 1, 1, 1], [0, 1, 0, 1]]))  # fmt: skip
    assert (plan.num_layers, plan.stages_per_layer, plan.num_stages) == (2, 6, 14)
    assert plan.total_s == pytest.approx(1e-3 * (1 + 2 * 5 + 10 + 4 + 3))
    boundary_ms = [0, 1, 5, 6, 7, 9, 12, 16, 20, 21, 21, 23, 23, 25, 28]
    np.testing.assert_allclose(plan.offsets, np.array(boundary_ms) * MS, atol=1e-12)
    assert [plan.offset(b) for b in (0, 5, 14)] == pytest.approx([0, 9 * MS, 28 * MS])
    assert plan.locate(0) == (-1, 0, 0)  # the step overhead
    assert plan.locate(1) == (0, 0, 0)  # layer 0 attention
    assert plan.locate(2) == (0, 1, 0)  # layer 0 router
    assert plan.locate(3) == (0, 2, 0)  # layer 0 expert 0
    assert plan.locate(6) == (0, 2, 3)  # layer 0 expert 3
    assert plan.locate(8) == (1, 1, 0)  # layer 1 router
    assert plan.locate(12) == (1, 2, 3)
    # the first preemptible boundary at or after the time
    assert plan.next_boundary(8 * MS, Granularity.EXPERT) == 5
    assert plan.next_boundary(9 * MS, Granularity.EXPERT) == 5
    assert plan.next_boundary(8 * MS, Granularity.LAYER) == 7
    assert plan.next_boundary(21.5 * MS, Granularity.EXPERT) == 11  # zero-length stages
    assert plan.next_boundary(21.5 * MS, Granularity.LAYER) == 13
    assert plan.next_boundary(26 * MS, Granularity.EXPERT) is None  # in lm_head
    assert plan.next_boundary(0.5 * MS, Granularity.ITERATION) is None
    assert plan.preemptible(Granularity.LAYER) == [1, 2, 3, 7, 8, 9, 13]


def test_routing_load_shapes():
    uniform = RoutingModel(2, 4, 2)
    np.testing.assert_allclose(uniform.load, np.full((2, 4), 0.25))
    zipf = RoutingModel(3, 4, 2, mode="zipf", skew=2.0, seed=1)
    ranks = 1 / np.arange(1, 5) ** 2.0
    for layer in zipf.load:  # each layer: 1 / rank^2, normalised, in its own order
        np.testing.assert_allclose(np.sort(layer)[::-1], ranks / ranks.sum())
    measured = RoutingModel(1, 2, 1, mode="profile", expert_load=[[3.0, 1.0]])
    np.testing.assert_allclose(measured.load, [[0.75, 0.25]])
    with pytest.raises(ValueError, match="^routing mode 'profile' needs a profile with exp"):
        RoutingModel(1, 2, 1, mode="profile")
    with pytest.raises(ValueError, match="^unknown routing mode 'round-robin'$"):
        RoutingModel(1, 2, 1, mode="round-robin")


def test_routing_draws_top_k_assignments_per_token_capped_at_the_token_count():
    routing = RoutingModel(3, 4, 2, seed=0)
    counts = routing.draw(5)
    assert counts.shape == (3, 4)
    assert (counts <= 5).all() and (counts.sum(axis=1) <= 10).all()
    many = routing.draw(1000, size=50)
    assert many.shape == (50, 3, 4)
    assert many.sum(axis=2).mean() == pytest.approx(2000, rel=0.01)  # caps are rare
    one_expert = RoutingModel(2, 1, 1).draw(7)
    assert one_expert.tolist() == [[7], [7]]
    assert routing.pooled(64) and not routing.pooled(65)
    assert not RoutingModel(1, 2, 1, pool_size=0).pooled(1)
    assert all(0 <= routing.pick() < routing.pool_size for _ in range(200))


def test_stage_times_come_from_their_ops():
    """Prefill attention: the sum over sequences of attn_prefill(prompt); decode attention:
    attn_decode(batch size, the longest context); router by tokens; lm_head and overhead by
    batch size; an expert with no token costs nothing."""
    base = linear_profile(num_layers=1, num_experts=2, top_k=1)
    points = [p for p in base.points if p.op not in ("attn_prefill", "attn_decode", "router",
                                                     "lm_head", "step_overhead")]  # fmt: skip
    points += [OpPoint("attn_prefill", num_tokens=n, median_ms=n / 10) for n in (1, 1000)]
    points += [OpPoint("router", num_tokens=n, median_ms=n / 100) for n in (1, 1000)]
    points += [OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=b + kv / 100)
               for b in (1, 8) for kv in (0, 1000)]  # fmt: skip
    points += [OpPoint("lm_head", batch_size=b, median_ms=b / 2) for b in (1, 8)]
    points += [OpPoint("step_overhead", batch_size=b, median_ms=b * 3) for b in (1, 8)]
    profile = dataclasses.replace(base, points=points)
    latency = LatencyModel(profile, RoutingModel(1, 2, 1, seed=0))
    prefill = Batch([Sequence(Request(0, "BE", 0, 10, 5)), Sequence(Request(1, "LS", 0, 30, 5))],
                    Phase.PREFILL)  # fmt: skip
    plan = latency.plan(prefill)
    assert plan.attention_s == pytest.approx(4 * MS)  # (10 + 30) / 10 ms
    assert plan.router_s == pytest.approx(0.4 * MS)  # 40 tokens / 100
    assert plan.lm_head_s == pytest.approx(1 * MS) and plan.overhead_s == pytest.approx(6 * MS)
    assert plan.expert_tokens.sum() == 40  # top-1: every token once
    expected = [0.0 if n == 0 else latency.expert.scalar(n) for n in plan.expert_tokens[0]]
    np.testing.assert_allclose(plan.experts_s[0], expected)
    a, b = (
        Sequence(Request(2, "BE", 0, 100, 5), generated=1),
        Sequence(Request(3, "BE", 0, 300, 5), generated=3),
    )  # contexts 100 and 302
    decode = latency.plan(Batch([a, b], Phase.DECODE))
    assert decode.attention_s == pytest.approx((2 + 3.02) * MS)
    assert decode.router_s == pytest.approx(0.02 * MS)
    one = latency.plan(Batch([Sequence(Request(4, "BE", 0, 1, 5), generated=1)], Phase.DECODE))
    assert sorted(one.expert_tokens[0].tolist()) == [0, 1]
    assert min(one.experts_s[0]) == 0.0 and max(one.experts_s[0]) > 0
