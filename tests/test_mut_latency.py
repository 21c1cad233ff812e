"""The latency model's less travelled paths, pinned by values worked out by hand: a grid of
more than two batch sizes, the extrapolation report, Gumbel-top-k routing of large expert sets,
unpooled routing, and the costing of mixed (chunked-prefill) batches. Written to kill mutants
that the broader tests let survive (README, "Mutation testing")."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from conftest import linear_profile

from policies.core import Batch, Phase, Request, Sequence
from profiler.schema import OpPoint
from sim.latency import Curve1D, Curve2D, LatencyModel, RoutingModel

MS = 1e-3


def three_row_grid() -> Curve2D:
    """t(b, kv) = b^2 + kv / 100 ms at b in {1, 2, 4}, kv in {0, 100}: the two segments along
    b have different slopes (3 ms per sequence, then 6)."""
    return Curve2D([OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=b * b + kv / 100)
                    for b in (1, 2, 4) for kv in (0, 100)])  # fmt: skip


def test_curve2d_interpolates_within_the_right_pair_of_batch_rows():
    grid = three_row_grid()
    assert grid(1.5, 0) == pytest.approx(2.5 * MS)  # between rows 1 (1 ms) and 2 (4 ms)
    assert grid(3, 0) == pytest.approx(10 * MS)  # between rows 2 (4 ms) and 4 (16 ms)
    assert grid(3, 50) == pytest.approx(10.5 * MS)
    assert grid(2, 100) == pytest.approx(5 * MS)  # on a row
    assert grid(6, 0) == pytest.approx(28 * MS)  # above: the last segment's slope, 6 ms
    assert grid(0, 0) == pytest.approx(1 * MS)  # below: the first row


def test_curve2d_reports_one_kv_line_and_the_batch_size_it_went_past():
    grid = three_row_grid()
    assert grid.extrapolations() == []
    grid(3, 300)  # both rows around b = 3 extrapolate in kv
    assert grid.extrapolations() == ["attn_decode kv_tokens up to 300 (grid ends at 100)"]
    grid(9, 50)
    assert grid.extrapolations() == [
        "attn_decode kv_tokens up to 300 (grid ends at 100)",
        "attn_decode batch_size up to 9 (grid ends at 4)",
    ]
    grid(7, 50)  # a smaller excursion does not lower the reported largest
    assert grid.extrapolations()[-1] == "attn_decode batch_size up to 9 (grid ends at 4)"


# ------------------------------------------------------------- Gumbel-top-k (large expert sets)
def skewed_gumbel(seed: int = 0) -> RoutingModel:
    """80 experts, top-2 (6,320 ordered pairs: past the exact path), two heavy experts."""
    load = [[1000.0, 1000.0] + [1.0] * 78] * 2
    return RoutingModel(2, 80, 2, mode="profile", expert_load=load, seed=seed)


def test_gumbel_top_k_follows_the_load():
    """Plackett-Luce with weights 1000, 1000 and 78 x 1: a token picks expert 0 with probability
    1000/2078 + (1000/2078)(1000/1078) + (78/2078)(~0.93) ~ 0.96, likewise expert 1."""
    r = skewed_gumbel()
    assert r.subset_p is None
    counts = r.draw(100, size=20)
    assert np.all(counts.sum(axis=-1) == 200) and counts.max() <= 100
    heavy = counts[..., :2].mean(axis=(0, 1)) / 100
    np.testing.assert_allclose(heavy, 0.95, atol=0.03)


def test_gumbel_draw_without_size_is_one_sample_of_the_layers():
    r = skewed_gumbel(seed=3)
    one = r.draw(1)
    assert one.shape == (2, 80)
    assert np.all(one.sum(axis=-1) == 2) and one.max() == 1
    # an unbatched draw is the batched draw of size 1, from the same random stream
    assert np.array_equal(skewed_gumbel(seed=7).draw(5), skewed_gumbel(seed=7).draw(5, size=1)[0])


def test_unpooled_routing_draws_every_prefill_fresh():
    """pool_size=0: no pools are kept; a 100-token prefill's counts still sum to 100 x top_k."""
    r = RoutingModel(3, 8, 2, seed=1, pool_size=0)
    counts = r.summed(100)
    assert counts.shape == (3, 8)
    assert np.all(counts.sum(axis=-1) == 200) and counts.max() <= 100


def test_unpooled_routing_plans_decodes_and_prefills_through_the_latency_model():
    latency = LatencyModel(linear_profile(num_layers=2, num_experts=4, top_k=2),
                           RoutingModel(2, 4, 2, seed=0, pool_size=0))  # fmt: skip
    decode = Batch([Sequence(Request(i, "BE", 0, 5, 9), generated=1) for i in range(3)],
                   Phase.DECODE)  # fmt: skip
    prefill = Batch([Sequence(Request(9, "BE", 0, 150, 9))], Phase.PREFILL)
    for batch, tokens in ((decode, 3), (prefill, 150)):
        counts = latency.plan(batch).expert_tokens
        assert counts.shape == (2, 4)
        assert np.all(counts.sum(axis=-1) == 2 * tokens) and counts.max() <= tokens


def test_a_mixed_batch_costs_chunks_as_prefills_and_decodes_on_the_longest_context():
    """attn_prefill(n) = n / 10 ms, attn_decode(b, kv) = b + kv / 100 ms: a 40-token chunk of a
    prompt (4 ms) with decodes of contexts 100 and 250 (2 + 2.5 ms) costs 8.5 ms; chunks alone
    cost their sum."""
    base = linear_profile(num_layers=1, num_experts=2, top_k=1)
    points = [p for p in base.points if p.op not in ("attn_prefill", "attn_decode")]
    points += [OpPoint("attn_prefill", num_tokens=n, median_ms=n / 10) for n in (1, 1000)]
    points += [OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=b + kv / 100)
               for b in (1, 8) for kv in (0, 1000)]  # fmt: skip
    latency = LatencyModel(dataclasses.replace(base, points=points), RoutingModel(1, 2, 1))
    chunk = Sequence(Request(0, "BE", 0, 300, 5), prefilled_tokens=100, chunk_tokens=40)
    decodes = [Sequence(Request(1, "BE", 0, 100, 5), generated=1),
               Sequence(Request(2, "LS", 0, 240, 5), generated=11)]  # fmt: skip
    assert latency.attention_s(Batch([chunk, *decodes], Phase.MIXED)) == pytest.approx(8.5 * MS)
    other = Sequence(Request(3, "BE", 0, 20, 5))  # a whole 20-token prompt: 2 ms
    assert latency.attention_s(Batch([chunk, other], Phase.MIXED)) == pytest.approx(6 * MS)


def test_curve1d_vectorised_matches_the_scalar_path_with_a_clamped_last_slope():
    """Points (1, 1), (3, 5), (5, 6), (7, 5) ms: the last segment falls, so extrapolation is
    flat at 5 ms; inputs between the points interpolate whatever the array's largest value."""
    points = [(1, 1.0), (3, 5.0), (5, 6.0), (7, 5.0)]
    curve = Curve1D([OpPoint("expert", num_tokens=n, median_ms=t) for n, t in points], "num_tokens")
    xs = np.array([0, 2, 4, 6, 7, 9])
    expected_ms = [1.0, 3.0, 5.5, 5.5, 5.0, 5.0]
    np.testing.assert_allclose(curve(xs), np.array(expected_ms) * MS)
    assert [curve.scalar(x) for x in xs] == pytest.approx(np.array(expected_ms) * MS)


def test_curve1d_reports_only_inputs_past_the_last_point():
    curve = Curve1D([OpPoint("router", num_tokens=n, median_ms=n) for n in (1, 8)], "num_tokens")
    curve(np.array([1, 8]))
    curve.scalar(8)
    assert curve.extrapolations() == []
    curve(np.array([2, 12]))
    assert curve.scalar(10) == pytest.approx(10 * MS)  # two points: their slope, 1 ms a token
    assert curve.extrapolations() == ["router num_tokens up to 12 (grid ends at 8)"]


def test_gumbel_pools_hold_exact_samples_of_n_tokens():
    """Decode pools of a large expert set: each pool sample of n tokens has n x top_k picks per
    layer, one token at most once per expert, and pool n is pool n - 1 plus one token."""
    r = skewed_gumbel(seed=2)
    one = r.pool(1)
    assert one.shape == (r.pool_size, 2, 80)
    assert np.all(one.sum(axis=-1) == 2) and one.max() == 1
    three = r.pool(3)
    assert three.shape == (r.pool_size, 2, 80) and np.all(three.sum(axis=-1) == 6)
    assert np.all((three - r.pool(2)).sum(axis=-1) == 2)
    assert three[..., :2].mean() > 2.5  # the heavy experts: ~0.96 x 3 tokens each


def test_an_idle_expert_costs_the_profiles_zero_token_point():
    """With an expert point at 0 tokens (0.3 ms), an expert that got no token still costs it;
    the affine points above are 0.5 ms + 0.01 ms per token."""
    base = linear_profile(num_layers=1, num_experts=4, top_k=1)
    points = [*base.points, OpPoint("expert", num_tokens=0, median_ms=0.3)]
    latency = LatencyModel(dataclasses.replace(base, points=points), RoutingModel(1, 4, 1))
    plan = latency.plan(Batch([Sequence(Request(0, "BE", 0, 5, 9), generated=1)], Phase.DECODE))
    expected_ms = np.where(plan.expert_tokens[0] > 0, 0.51, 0.3)
    np.testing.assert_allclose(plan.experts_s[0], expected_ms * MS)
    assert sorted(plan.expert_tokens[0].tolist()) == [0, 0, 0, 1]


def test_an_unknown_prefill_attention_mode_is_refused_listing_the_modes():
    with pytest.raises(ValueError, match=r"^must be one of \['per_prompt', 'batched'\]$"):
        LatencyModel(linear_profile(), prefill_attention="sometimes")


@pytest.mark.parametrize("rest", [1e-20, 1e-12])
def test_a_load_held_almost_wholly_by_one_expert_still_routes_by_the_load(rest):
    """Load [1, r, r], top-2: every token picks expert 0 and then 1 or 2 with even odds. With r
    below float rounding of 1 + r, "the weight left after expert 0" must not round to 0 (which
    gave the near-unloaded experts every token, and expert 0 none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no numpy overflow or division warning on the way
        r = RoutingModel(1, 3, 2, mode="profile", expert_load=[[1.0, rest, rest]], seed=0)
        counts = r.draw(1000)
    assert counts[0, 0] == 1000
    assert counts[0, 1] == pytest.approx(500, abs=60) and counts[0, 1] + counts[0, 2] == 1000


def test_an_extreme_zipf_skew_picks_the_two_heaviest_experts():
    """skew 60: rank 2 has 2^-60 of rank 1's load, rank 3 (2/3)^60 ~ 3e-11 of rank 2's."""
    r = RoutingModel(2, 8, 2, mode="zipf", skew=60.0, seed=0)
    counts = r.draw(100)
    for layer, load in zip(counts, r.load, strict=True):
        assert sorted(layer[np.argsort(load)[-2:]].tolist()) == [100, 100]
        assert layer.sum() == 200


def test_a_load_that_cannot_be_met_keeps_the_load_as_plackett_luce_weights():
    """Load [3, 1, 1, 1] / 6, top-2: expert 0's share 1/2 would need it in every token's pair,
    which the fit cannot reach without the others' shares, so the load stays the weights.
    P({0, e}) = (1/2)(1/3) + (1/6)(3/5) = 4/15 for e = 1..3, so expert 0 is picked by 4/5 of
    the tokens and each other expert by 2/5."""
    r = RoutingModel(1, 4, 2, mode="profile", expert_load=[[3.0, 1.0, 1.0, 1.0]], seed=0)
    counts = r.draw(100_000)[0]
    np.testing.assert_allclose(counts / 100_000, [0.8, 0.4, 0.4, 0.4], atol=0.006)


def test_each_layer_is_fitted_on_its_own():
    """A layer whose load cannot be met does not stop the fit of a layer whose load can: the
    second layer's shares of assignments still match its load [4, 3, 2, 1] / 10."""
    load = [[3.0, 1.0, 1.0, 1.0], [4.0, 3.0, 2.0, 1.0]]
    r = RoutingModel(2, 4, 2, mode="profile", expert_load=load, seed=0)
    counts = r.draw(100_000)
    np.testing.assert_allclose(counts[0] / 100_000, [0.8, 0.4, 0.4, 0.4], atol=0.006)
    np.testing.assert_allclose(counts[1] / 200_000, [0.4, 0.3, 0.2, 0.1], atol=0.003)


def test_an_expert_the_profile_never_saw_gets_no_token_and_no_numpy_warning():
    """A measured load with an unused expert (common in a short profiling run) is fitted
    quietly: [3, 3, 2, 0] / 8, top-2, gives shares of assignments 3/8, 3/8, 1/4, 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = RoutingModel(1, 4, 2, mode="profile", expert_load=[[3.0, 3.0, 2.0, 0.0]], seed=0)
        counts = r.draw(100_000)[0]
    assert counts[3] == 0
    np.testing.assert_allclose(counts / 200_000, [0.375, 0.375, 0.25, 0.0], atol=0.003)


def test_zipf_skew_defaults_to_one():
    r = RoutingModel(3, 4, 2, mode="zipf", seed=0)
    harmonic = 1 / np.arange(1, 5)
    for layer in r.load:
        np.testing.assert_allclose(np.sort(layer)[::-1], harmonic / harmonic.sum())
