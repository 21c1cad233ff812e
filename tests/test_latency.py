"""The latency model: routing without replacement, prefill attention, extrapolation, the
context-switch term."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.latency import RoutingModel


# ------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("mode", ["uniform", "zipf"])
def test_one_token_activates_exactly_top_k_experts_in_every_layer(mode):
    r = RoutingModel(32, 8, 2, mode=mode, seed=1)
    counts = r.draw(1, size=500)
    assert counts.shape == (500, 32, 8)
    assert np.all(np.count_nonzero(counts, axis=-1) == 2)
    assert counts.max() == 1


@pytest.mark.parametrize("tokens", [1, 3, 64, 4096])
def test_counts_sum_to_tokens_times_top_k_and_never_exceed_tokens(tokens):
    r = RoutingModel(32, 8, 2, mode="zipf", seed=2)
    counts = r.draw(tokens, size=20)
    assert np.all(counts.sum(axis=-1) == tokens * 2)
    assert counts.max() <= tokens


def test_mean_active_experts_at_4_tokens_matches_the_closed_form():
    """Uniform load, 8 experts, top-2: one token leaves a given expert out with probability
    C(7,2)/C(8,2) = 3/4, so E[active] = 8 * (1 - (3/4)^4) = 5.46875 (drawing the 8
    assignments with replacement gives 8 * (1 - (7/8)^8) = 5.25)."""
    expected = 8 * (1 - (math.comb(7, 2) / math.comb(8, 2)) ** 4)
    assert expected == pytest.approx(5.46875)
    r = RoutingModel(32, 8, 2, seed=3)
    active = np.count_nonzero(r.draw(4, size=2000), axis=-1)  # 64,000 layer draws
    assert active.mean() == pytest.approx(expected, abs=0.01)  # standard error ~0.003


def test_skewed_load_is_each_experts_share_of_assignments():
    r = RoutingModel(4, 8, 2, mode="zipf", skew=1.0, seed=4)
    counts = r.draw(1000, size=100)
    share = counts.sum(axis=0) / (100 * 1000 * 2)
    np.testing.assert_allclose(share, r.load, atol=0.002)


def test_gumbel_path_for_large_expert_sets():
    """64 experts, top-8 has too many subsets to enumerate: per-token Gumbel-top-k."""
    r = RoutingModel(3, 64, 8, seed=5)
    assert r.subset_p is None
    counts = r.draw(1, size=200)
    assert np.all(np.count_nonzero(counts, axis=-1) == 8)
    counts = r.draw(50, size=40)
    assert np.all(counts.sum(axis=-1) == 400) and counts.max() <= 50
    share = counts.sum(axis=(0, 1)) / counts.sum()
    np.testing.assert_allclose(share, 1 / 64, atol=0.004)


def test_too_few_loaded_experts_is_an_error():
    load = [[1.0, 0, 0, 0]]
    with pytest.raises(ValueError, match="top_k=2"):
        RoutingModel(1, 4, 2, mode="profile", expert_load=load)


def test_decode_pools_are_exact_samples_too():
    """The nested pools (n tokens = n - 1 tokens + one more) keep the distribution."""
    r = RoutingModel(32, 8, 2, seed=6, pool_size=2000)
    assert np.all(np.count_nonzero(r.pool(1), axis=-1) == 2)
    four = r.pool(4)
    assert np.all(four.sum(axis=-1) == 8) and four.max() <= 4
    assert np.count_nonzero(four, axis=-1).mean() == pytest.approx(5.46875, abs=0.01)
    assert np.all((four - r.pool(3)).sum(axis=-1) == 2)  # one more token in every layer
