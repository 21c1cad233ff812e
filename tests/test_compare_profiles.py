"""sim.compare_profiles: a reference's error at the measured profile's points, per op."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import linear_profile

from sim.compare_profiles import compare


def test_a_reference_twice_as_slow_is_100_percent_off_at_every_point():
    measured = linear_profile()
    doubled = dataclasses.replace(measured, points=[
        dataclasses.replace(p, median_ms=2 * p.median_ms) for p in measured.points])  # fmt: skip
    result = compare(measured, doubled)
    assert set(result["ops"]) == {"attn_prefill", "attn_decode", "router", "expert", "lm_head",
                                  "step_overhead"}  # fmt: skip
    for op in result["ops"].values():
        assert op["max_abs_error_pct"] == pytest.approx(100.0)
        assert all(p["error_pct"] == pytest.approx(100.0) for p in op["detail"])
    assert compare(measured, measured)["ops"]["expert"]["max_abs_error_pct"] == 0.0


def test_reference_points_between_the_measured_ones_are_interpolated():
    measured = linear_profile(expert_ms=0.5, expert_per_token_ms=0.01)
    # Only the grid's ends: the reference interpolates linearly in between, exact for an affine op.
    sparse = dataclasses.replace(measured, points=[
        p for p in measured.points if p.op != "expert" or p.num_tokens in (1, 4096)])  # fmt: skip
    expert = compare(measured, sparse)["ops"]["expert"]
    assert expert["points"] == 3 and expert["max_abs_error_pct"] == pytest.approx(0.0, abs=1e-9)
