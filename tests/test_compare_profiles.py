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


def test_every_op_of_a_profile_against_itself_is_exact():
    """Each op is read on its own axes, as the latency model reads it: attn_prefill_batch
    (batch_size x num_tokens) was read as batch_size x kv_tokens, collapsing its tokens,
    and came out up to 6,960% off against itself; attn_chunk and wake_up likewise."""
    from profiler.schema import OpPoint
    from sim import profiles

    base = profiles.load("a100-mixtral-nf4-hf")
    extra = [OpPoint("attn_chunk", num_tokens=n, kv_tokens=k, median_ms=0.1 + n / 100 + k / 7)
             for n in (16, 64, 256) for k in (128, 512, 2048)]  # fmt: skip
    extra += [OpPoint("wake_up", idle_ms=i, busy_ms=b, median_ms=m)
              for i, b, m in ((0, 0.0, 0.0), (200, 0.0, 4.0), (200, 10.0, 2.0), (1000, 0.0, 9.0),
                              (1000, 10.0, 5.0), (1000, 30.0, 1.0))]  # fmt: skip
    # a prefill's once-per-iteration stages, by tokens and prompt count (sim.latency's
    # PromptCurve: 2 prompts add 0.05 ms, 4 prompts 0.15, past one prompt's grid too)
    for op in ("prepare_prefill", "lm_head_prefill", "attn_prefill_outer"):
        extra += [OpPoint(op, num_tokens=n, median_ms=0.2 + n / 1000) for n in (16, 64, 256)]
        extra += [OpPoint(op, batch_size=k, num_tokens=n, median_ms=0.2 + n / 1000 + e)
                  for k, n, e in ((2, 32, 0.05), (2, 128, 0.05), (4, 256, 0.15))]  # fmt: skip
        extra.append(OpPoint(op, batch_size=4, num_tokens=1024, median_ms=1.5))
    extra += [OpPoint("prepare_decode", batch_size=b, median_ms=0.1) for b in (1, 64)]
    extra += [OpPoint("attn_prefill_next", num_tokens=n, median_ms=0.5) for n in (1, 4096)]
    profile = dataclasses.replace(base, points=base.points + extra)
    result = compare(profile, profile)
    assert {"attn_prefill_batch", "attn_chunk", "wake_up", "attn_decode"} <= set(result["ops"])
    assert result["ops"]["prepare_prefill"]["points"] == 7
    for name, op in result["ops"].items():
        assert op["max_abs_error_pct"] == pytest.approx(0.0, abs=1e-9), name
        assert op["beyond"] == 0


def test_points_beyond_the_reference_grid_are_marked_and_warned_of():
    from sim.compare_profiles import table

    measured = linear_profile()
    clipped = dataclasses.replace(measured, points=[
        p for p in measured.points if p.op != "expert" or p.num_tokens <= 64])  # fmt: skip
    result = compare(measured, clipped)
    expert = result["ops"]["expert"]
    big = [p for p in expert["detail"] if p["num_tokens"] > 64]
    assert big and all(p["beyond"] for p in big)
    assert expert["beyond"] == len(big)
    assert f"extrapolated: expert ({len(big)} of {expert['points']})" in table(result)


def test_profiles_of_other_interference_are_noted():
    """The simulator scales every op by its profile's interference; the comparison is of the
    medians, and says by what further factor the simulator's predictions differ."""
    from sim.compare_profiles import table

    measured = dataclasses.replace(linear_profile(), interference=1.25)
    result = compare(measured, linear_profile())
    assert result["ops"]["expert"]["max_abs_error_pct"] == 0.0  # the medians agree
    assert ("note: the errors are of the op medians; the simulator also scales each op by its "
            "profile's interference (1.25 measured, 1 reference): its predictions from the two "
            "differ by a further factor of 0.8") in table(result)  # fmt: skip
    assert "interference" not in table(compare(measured, measured))


def test_measured_points_of_0_ms_are_left_out_and_said_so():
    """step_overhead's residual is clipped at 0 (run 4's batch 8 on the H200): the point has no
    relative error and was left out of the count without a word."""
    from sim.compare_profiles import table

    measured = linear_profile()
    zeroed = dataclasses.replace(measured, points=[
        dataclasses.replace(p, median_ms=0.0) if p.op == "step_overhead" and p.batch_size == 64
        else p for p in measured.points])  # fmt: skip
    result = compare(zeroed, measured)
    total = sum(p.op == "step_overhead" for p in measured.points)
    assert result["ops"]["step_overhead"]["points"] == total - 1
    assert result["measured_zero"] == {"step_overhead": 1}
    assert "measured points of 0 ms left out (no relative error): step_overhead (1)" in table(
        result
    )
    assert compare(measured, measured)["measured_zero"] == {}
