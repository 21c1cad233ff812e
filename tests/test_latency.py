"""The latency model: routing without replacement, prefill attention, extrapolation, the
context-switch term."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from conftest import linear_profile
from hydra import compose, initialize_config_dir

from policies import Request, Scheduler
from policies.core import Batch, Phase, Sequence
from policies.qllm import QLLM
from profiler.schema import OpPoint, Profile, ProfileError
from sim import profiles
from sim.app import CONF_DIR
from sim.config import UserError
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.run import extrapolation_warning, simulate


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


# ------------------------------------------------------------------ prefill attention cost
def with_points(profile: Profile, *points: OpPoint, prefill_attention: str = "per_prompt"):
    return replace(profile, points=[*profile.points, *points], prefill_attention=prefill_attention)


def batch_attention_points() -> list[OpPoint]:
    """attn_prefill_batch(b, n) = 1 ms + 1 us per token, whatever the number of prompts."""
    return [
        OpPoint("attn_prefill_batch", batch_size=b, num_tokens=n, median_ms=1 + n / 1000)
        for b in (1, 8)
        for n in (1, 4096)
    ]


def prefill(*prompt_tokens: int) -> Batch:
    seqs = [Sequence(Request(i, "BE", 0.0, n, 1)) for i, n in enumerate(prompt_tokens)]
    return Batch(seqs, Phase.PREFILL)


def test_batched_prefill_pays_the_attention_stage_once_per_batch():
    """4 prompts of 100 tokens: per prompt 4 x 1 ms (linear_profile's flat attn_prefill);
    batched once on 400 tokens: 1 + 0.4 ms."""
    profile = with_points(linear_profile(), *batch_attention_points(), prefill_attention="batched")
    batch = prefill(100, 100, 100, 100)
    assert LatencyModel(profile).plan(batch).attention_s == pytest.approx(1.4e-3)
    per_prompt = LatencyModel(profile, prefill_attention="per_prompt")
    assert per_prompt.plan(batch).attention_s == pytest.approx(4.0e-3)
    single = prefill(300)  # one prompt: the batched op on (1, 300)
    assert LatencyModel(profile).plan(single).attention_s == pytest.approx(1.3e-3)


def split_attention_points() -> list[OpPoint]:
    """attn_prefill_outer(N) = 0.1 ms + 1 us per token; attn_prefill_next(n) = 0.5 ms + 2 us
    per token (linear_profile's attn_prefill: 1 ms flat)."""
    outer = [OpPoint("attn_prefill_outer", num_tokens=n, median_ms=0.1 + n / 1000)
             for n in (1, 4096)]  # fmt: skip
    later = [OpPoint("attn_prefill_next", num_tokens=n, median_ms=0.5 + n / 500) for n in (1, 4096)]
    return outer + later


def test_a_split_prefill_pays_the_once_per_iteration_part_once_and_later_prompts_warm():
    """Prompts of 100, 200 and 300 tokens: the first's stage (1 ms) without its outer part
    (0.2 ms), the later ones' calls (0.9 + 1.1 ms), the outer part over 600 tokens (0.7 ms);
    one prompt costs its attn_prefill whatever the split says; a profile without the split
    (or batched attention) charges as before."""
    profile = with_points(linear_profile(), *split_attention_points())
    model = LatencyModel(profile)
    three = prefill(100, 200, 300)
    assert model.plan(three).attention_s == pytest.approx((1.0 - 0.2 + 0.9 + 1.1 + 0.7) / 1e3)
    assert model.plan(prefill(300)).attention_s == pytest.approx(1.0e-3)
    assert LatencyModel(linear_profile()).plan(three).attention_s == pytest.approx(3e-3)
    batched = with_points(profile, *batch_attention_points(), prefill_attention="batched")
    assert LatencyModel(batched).plan(three).attention_s == pytest.approx(1.6e-3)


def test_a_split_prefill_charges_its_first_prompt_the_first_call_of_a_batch():
    """attn_prefill_first(n) = 0.95 ms + 1 us per token, where one prompt's call alone
    (attn_prefill - outer) is 1 - 0.2 = 0.8 ms at 100 tokens: prompts of 100, 200 and 300
    tokens cost first(100) = 1.05 ms, the later ones' calls (0.9 + 1.1 ms) and the outer
    part over 600 tokens (0.7 ms); one prompt still costs its attn_prefill."""
    first = [OpPoint("attn_prefill_first", num_tokens=n, median_ms=0.95 + n / 1000)
             for n in (1, 4096)]  # fmt: skip
    profile = with_points(linear_profile(), *split_attention_points(), *first)
    model = LatencyModel(profile)
    three = prefill(100, 200, 300)
    assert model.plan(three).attention_s == pytest.approx((1.05 + 0.9 + 1.1 + 0.7) / 1e3)
    assert model.plan(prefill(300)).attention_s == pytest.approx(1.0e-3)
    # the same prompts in another order: the first is 300 tokens long
    assert model.plan(prefill(300, 100, 200)).attention_s == pytest.approx(
        (1.25 + 0.7 + 0.9 + 0.7) / 1e3
    )


def test_half_a_split_is_refused():
    """One of the two ops alone would be ignored by the latency model: not silently."""
    outer, later = split_attention_points()[:2], split_attention_points()[2:]
    for points in (outer, later):
        with pytest.raises(
            ProfileError, match="needs both attn_prefill_outer and attn_prefill_next"
        ):
            with_points(linear_profile(), *points)
    # the first call without the split would be ignored as well
    first = OpPoint("attn_prefill_first", num_tokens=1, median_ms=1.0)
    with pytest.raises(ProfileError, match="attn_prefill_first needs attn_prefill_outer"):
        with_points(linear_profile(), first)


def prefill_stage_points() -> list[OpPoint]:
    """prepare_decode(B) = 0.1 ms + 0.01 ms per sequence (linear_profile's step_overhead: 3 ms
    flat); prepare_prefill(N) = 0.2 ms + 1 us per token; lm_head_prefill(N) = 0.1 ms + 2 us
    per token (linear_profile's lm_head: 2 ms flat)."""
    return ([OpPoint("prepare_decode", batch_size=b, median_ms=0.1 + b / 100) for b in (1, 64)]
            + [OpPoint("prepare_prefill", num_tokens=n, median_ms=0.2 + n / 1000)
               for n in (1, 4096)]
            + [OpPoint("lm_head_prefill", num_tokens=n, median_ms=0.1 + n / 500)
               for n in (1, 4096)])  # fmt: skip


def test_a_prefill_pays_its_own_prepare_and_lm_head_stages_by_its_tokens():
    """Prompts of 100, 200 and 300 tokens: step_overhead(3) without the decode's prepare(3)
    (3 - 0.13 ms), plus prepare_prefill(600) (0.8 ms); lm_head_prefill(600) (1.3 ms), not
    lm_head(3) (2 ms). A mixed iteration is charged the same by its new tokens (32 + 2 decode
    steps); a decode step is charged as before; a profile without the ops too."""
    staged = LatencyModel(with_points(linear_profile(), *prefill_stage_points()))
    plain = LatencyModel(linear_profile())
    three = prefill(100, 200, 300)
    plan = staged.plan(three)
    assert plan.overhead_s == pytest.approx((3.0 - 0.13 + 0.8) / 1e3)
    assert plan.lm_head_s == pytest.approx(1.3e-3)
    assert plan.total_s - plain.plan(three).total_s == pytest.approx(
        (-0.13 + 0.8 + 1.3 - 2.0) / 1e3, abs=1e-9
    )
    mixed = staged.plan(mixed_with_a_chunk(0))
    assert mixed.overhead_s == pytest.approx((3.0 - 0.13 + 0.234) / 1e3)
    assert mixed.lm_head_s == pytest.approx((0.1 + 34 / 500) / 1e3)
    decode = Batch([decoding(i, 30) for i in range(3)], Phase.DECODE)
    assert staged.plan(decode).overhead_s == plain.plan(decode).overhead_s == 3e-3
    assert staged.plan(decode).lm_head_s == plain.plan(decode).lm_head_s == 2e-3
    assert {"prepare_prefill", "lm_head_prefill"} <= {c.op for c in staged.curves()}
    assert plain.prepare_prefill is None


def prompt_count_points(op: str) -> list[OpPoint]:
    """One prompt: 0.2 ms + 1 us per token at 16..256 tokens; 2 prompts 0.05 ms more at 32 and
    128 (and 0.07 more at 64: the median of the three is 0.05); 4 prompts 0.15 more at 256;
    past the one-prompt grid, 4 prompts of 256 (1024 tokens) at 1.5 ms."""
    ones = [OpPoint(op, num_tokens=n, median_ms=0.2 + n / 1000) for n in (16, 256)]
    pairs = [OpPoint(op, batch_size=2, num_tokens=n, median_ms=0.2 + n / 1000 + extra)
             for n, extra in ((32, 0.05), (64, 0.07), (128, 0.05))]  # fmt: skip
    return [*ones, *pairs, OpPoint(op, batch_size=4, num_tokens=256, median_ms=0.606),
            OpPoint(op, batch_size=4, num_tokens=1024, median_ms=1.5)]  # fmt: skip


def test_a_prefills_once_per_iteration_stages_are_charged_by_their_prompt_count():
    """What k prompts add over one prompt of as many tokens is read where both were measured
    (2 prompts: the median 0.05 ms; 4: 0.15), interpolated in k (3: 0.1) and held per prompt
    past the largest k (8 prompts: 0.35 ms); past the one-prompt grid the k-prompt points
    carry one prompt's curve, less their extra (one prompt of 1024: 1.35 ms). A prefill of
    one prompt pays one prompt's stage, however many the profile's pooled points had."""
    from sim.latency import PromptCurve

    curve = PromptCurve(prompt_count_points("prepare_prefill"))
    assert [curve.extra(k) * 1e3 for k in (1, 2, 3, 4, 8)] == pytest.approx(
        [0.0, 0.05, 0.1, 0.15, 0.35]
    )
    assert curve.scalar(0, 100) == curve.scalar(1, 100) == pytest.approx(0.3e-3)
    assert curve.scalar(2, 100) == pytest.approx(0.35e-3)
    assert curve.scalar(4, 1024) == pytest.approx(1.5e-3)
    assert curve.scalar(0, 1024) == pytest.approx(1.35e-3)
    assert curve.scalar(8, 1024) == pytest.approx(1.7e-3)
    # both reads past what was measured are said, as every curve's extrapolation is
    assert curve.scalar(2, 2048) > curve.scalar(2, 1024)
    assert curve.extrapolations() == [
        "prepare_prefill num_tokens up to 2048 (grid ends at 1024)",
        "prepare_prefill prompts up to 8 (held per prompt past 4)",
    ]
    # k-prompt points past the one-prompt grid with more prompts than any measured within it
    # (16 prompts, where 4 is the most within): read with the extra held per prompt (0.75
    # ms), which the curve's construction does not report as a run's extrapolation
    sixteen = OpPoint("prepare_prefill", batch_size=16, num_tokens=2048, median_ms=2.95)
    wide = PromptCurve([*prompt_count_points("prepare_prefill"), sixteen])
    assert wide.extrapolations() == []
    assert wide.scalar(0, 2048) == pytest.approx(2.2e-3)
    # a profile before 2026-12-05 (every point at batch_size 0, pooled): as before, no extra
    pooled = PromptCurve([replace(p, batch_size=0) for p in prompt_count_points("x")
                          if p.batch_size in (0, 4) and p.num_tokens != 256])  # fmt: skip
    assert pooled.extra(8) == 0.0 and pooled.scalar(8, 1024) == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="no point of one prompt"):
        PromptCurve([OpPoint("prepare_prefill", batch_size=2, num_tokens=8, median_ms=1.0)])


def test_a_prefill_of_several_prompts_pays_what_they_add_to_its_prepare_lm_head_and_outer():
    """The three once-per-iteration ops with prompt-count points: 4 prompts of 64 tokens pay
    0.15 ms more in prepare and in lm_head than one prompt of 256, and every layer's outer
    part 0.15 ms more; one prompt of 256 pays one prompt's stages (0.456 ms each). With
    attn_prefill_first absent, the first prompt's call is one prompt's stage less its outer
    part as one prompt's."""
    base = [p for p in prefill_stage_points()
            if p.op not in ("prepare_prefill", "lm_head_prefill")]  # fmt: skip
    split = [OpPoint("attn_prefill_next", num_tokens=n, median_ms=0.5 + n / 500)
             for n in (1, 4096)]  # fmt: skip
    points = [*base, *split]
    for op in ("prepare_prefill", "lm_head_prefill", "attn_prefill_outer"):
        points += prompt_count_points(op)
    model = LatencyModel(with_points(linear_profile(), *points))
    one, four = model.plan(prefill(256)), model.plan(prefill(64, 64, 64, 64))
    assert one.lm_head_s == pytest.approx(0.456e-3)
    assert four.lm_head_s - one.lm_head_s == pytest.approx(0.15e-3)
    rest = max(model.overhead.scalar(4) - model.prepare_decode.scalar(4), 0.0)
    assert four.overhead_s == pytest.approx(rest + 0.606e-3)
    # a layer's attention stage: the first call (1 - 0.264 ms), 3 later ones (0.628 ms each),
    # the outer part of 4 prompts of 256 tokens in all (0.606 ms)
    assert four.attention_s == pytest.approx((1.0 - 0.264 + 3 * 0.628 + 0.606) / 1e3)


def test_a_prompt_count_of_one_is_refused_for_the_once_per_iteration_ops():
    """batch_size 0 is one prompt: a point at 1 would be a second key for the same shape,
    of which the latency model would keep one silently."""
    with pytest.raises(
        ProfileError,
        match=r"prepare_prefill\(batch_size=1, num_tokens=8\): "
        "a prefill's batch_size is its prompt count",
    ):
        with_points(
            linear_profile(),
            *prefill_stage_points(),
            OpPoint("prepare_prefill", batch_size=1, num_tokens=8, median_ms=1.0),
        )
    # and k prompts' points alone: what they add is read against one prompt's, which is missing
    only_pairs = [p for p in prefill_stage_points() if p.op != "lm_head_prefill"]
    only_pairs += [OpPoint("lm_head_prefill", batch_size=2, num_tokens=n, median_ms=1.0)
                   for n in (8, 64)]  # fmt: skip
    with pytest.raises(
        ProfileError,
        match=r"lm_head_prefill has no point of one prompt "
        r"\(batch_size 0\), only of \[2\] prompts",
    ):
        with_points(linear_profile(), *only_pairs)


def test_a_prefills_prepare_never_makes_the_rest_of_its_overhead_negative():
    """step_overhead below the decode's prepare at some batch size (they are medians of
    different samples): the rest is 0, not a negative time."""
    points = [p for p in prefill_stage_points() if p.op != "prepare_decode"]
    points += [OpPoint("prepare_decode", batch_size=b, median_ms=4.0) for b in (1, 64)]
    plan = LatencyModel(with_points(linear_profile(), *points)).plan(prefill(100))
    assert plan.overhead_s == pytest.approx(0.3e-3)


@pytest.mark.parametrize("left_out", ["prepare_decode", "prepare_prefill", "lm_head_prefill"])
def test_two_of_a_prefills_three_stage_ops_are_refused(left_out):
    """Without one of them the latency model would ignore the other two: not silently."""
    points = [p for p in prefill_stage_points() if p.op != left_out]
    with pytest.raises(ProfileError, match=f"without {left_out}: a prefill's own prepare"):
        with_points(linear_profile(), *points)


def test_builtin_profiles_model_an_engine_that_batches_prefill_attention():
    """The nf4 profile's stage is host bound (~0.82 ms flat per call): 10 prompts of 100
    tokens cost ~10 calls per prompt, ~1 call batched."""
    profile = profiles.load("a100-mixtral-nf4-hf")
    assert profile.prefill_attention == "batched"
    batch = prefill(*[100] * 10)
    batched = LatencyModel(profile).plan(batch).attention_s
    per_prompt = LatencyModel(profile, prefill_attention="per_prompt").plan(batch).attention_s
    one = LatencyModel(profile).plan(prefill(100)).attention_s
    assert per_prompt == pytest.approx(10 * one)
    assert batched < 1.5 * one


def test_a_profile_without_the_field_runs_prefill_per_prompt(tmp_path):
    """Profiles measured on realrun's runner (one attention call per prompt) omit it."""
    directory = linear_profile().save(tmp_path / "p")
    meta = json.loads((directory / "profile.json").read_text())
    del meta["prefill_attention"]
    (directory / "profile.json").write_text(json.dumps(meta))
    assert Profile.load(directory).prefill_attention == "per_prompt"


def test_batched_mode_needs_the_batched_op(tmp_path):
    directory = linear_profile().save(tmp_path / "p")
    with pytest.raises(UserError, match=r"profile\.prefill_attention=batched: .*per_prompt"):
        simulate(app_cfg(f"profile.path={directory}", "profile.prefill_attention=batched"))
    with pytest.raises(UserError, match=r"profile\.prefill_attention=both"):
        simulate(app_cfg("profile.prefill_attention=both"))


# --------------------------------------------------------------------------- extrapolation
def app_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["workload.num_requests=6", *overrides])


def test_extrapolating_beyond_a_grid_warns_once_per_run(tmp_path, capsys):
    base = linear_profile()
    short = [p for p in base.points if not (p.op == "attn_prefill" and p.num_tokens > 2)]
    short.append(OpPoint("attn_prefill", num_tokens=1024, median_ms=1.0))
    directory = replace(base, points=short).save(tmp_path / "p")
    overrides = [
        f"profile.path={directory}",
        "workload=synthetic",
        "workload.rate=50",
        "workload.prompt.max=4096",
    ]
    simulate(app_cfg(*overrides, "workload.prompt.tokens=2000", "workload.output.tokens=4"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "attn_prefill num_tokens up to 2000 (grid ends at 1024)" in err[0]
    simulate(app_cfg(*overrides, "workload.prompt.tokens=1000", "workload.output.tokens=4"))
    assert capsys.readouterr().err == ""
    # a caller of many runs (qllm-validate) asks for none and merges them: the largest input
    quiet = simulate(app_cfg(*overrides, "workload.prompt.tokens=3000",
                             "workload.output.tokens=4"), warn=False)  # fmt: skip
    assert capsys.readouterr().err == ""
    lines = [*quiet.extrapolated, "attn_prefill num_tokens up to 2000 (grid ends at "
             "1024)", "expert num_tokens up to 241 (grid ends at 224)"]  # fmt: skip
    assert extrapolation_warning("p", lines) == (
        "warning: profile p: extrapolated beyond the grid (the last segment's slope, never "
        "downwards; held where a curve has one point): attn_prefill num_tokens up to 3000 "
        "(grid ends at 1024); expert num_tokens up to 241 (grid ends at 224)"
    )


def test_a_2d_grid_warns_of_its_largest_input_not_its_last_rows():
    """attn_decode read at a context of 9,000 by a small batch, then 5,000 by a large one:
    the warning named the last row's 5,000 (each row notes what it was read at)."""
    pts = [p for p in linear_profile().points if p.op != "attn_decode"]
    pts += [OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=1.0 + kv / 4096)
            for b in (1, 8, 64) for kv in (0, 4096)]  # fmt: skip
    lm = LatencyModel(replace(linear_profile(), points=pts))
    lm.attn_decode(2, 9000)
    lm.attn_decode(32, 5000)
    assert lm.extrapolations() == ["attn_decode kv_tokens up to 9000 (grid ends at 4096)"]


def test_a_2d_grid_of_one_row_warns_when_read_past_it():
    """attn_decode measured at batch 1 only (grid.decode_batch=[1]) was read at that row for
    every batch size, and nothing warned; a grid of two rows did warn."""
    pts = [p for p in linear_profile().points if p.op != "attn_decode"]
    pts += [OpPoint("attn_decode", batch_size=1, kv_tokens=kv, median_ms=1.0 + kv / 4096)
            for kv in (0, 4096)]  # fmt: skip
    lm = LatencyModel(replace(linear_profile(), points=pts))
    assert lm.attn_decode(1, 2048) == pytest.approx(1.5e-3)
    assert lm.extrapolations() == []  # on the row
    assert lm.attn_decode(32, 2048) == pytest.approx(1.5e-3)  # held: no second row to slope
    assert lm.extrapolations() == ["attn_decode batch_size up to 32 (grid ends at 1)"]


def test_step_overhead_points_past_the_engine_host_grid_are_used():
    """engine_host fitted up to batch 16, step_overhead measured up to 64: the sum stopped at
    16, step_overhead's measured points past it were dropped, and a batch of 32 warned that
    step_overhead was extrapolated. engine_host is a fitted line: read along it."""
    base = linear_profile()
    assert max(p.batch_size for p in base.op_points("step_overhead")) == 64
    host = [OpPoint("engine_host", batch_size=b, median_ms=0.1 + 0.01 * b) for b in (1, 16)]
    lm = LatencyModel(with_points(base, *host))
    alone = LatencyModel(base)
    for b in (8, 32, 64):  # the host line at b, on top of step_overhead's own points
        assert lm.overhead.scalar(b) == pytest.approx(alone.overhead.scalar(b)
                                                      + (0.1 + 0.01 * b) / 1e3)  # fmt: skip
    assert lm.extrapolations() == []


def test_engine_host_points_beyond_the_overhead_grid_do_not_hide_its_extrapolation():
    """engine_host measured up to batch 256, step_overhead up to 64: their sum was filed at 256
    with step_overhead extrapolated there, and a batch of 200 warned of nothing."""
    host = [OpPoint("engine_host", batch_size=b, median_ms=0.1) for b in (1, 256)]
    lm = LatencyModel(with_points(linear_profile(), *host))
    assert lm.overhead.scalar(64) == pytest.approx(3.1e-3)
    assert lm.overhead.scalar(200) == pytest.approx(3.1e-3)
    assert lm.extrapolations() == ["step_overhead batch_size up to 200 (grid ends at 64)"]


@pytest.mark.parametrize("name", ["a100x2-mixtral-fp16", "a100-mixtral-nf4-hf"])
def test_builtin_grids_cover_the_conversation_trace(name):
    """The longest conversation prompt (14,050 tokens) and its context stay inside the grids."""
    lm = LatencyModel(profiles.load(name))
    lm.plan(prefill(14_050))
    seq = Sequence(Request(0, "BE", 0.0, 14_050, 2000), generated=1999)
    lm.plan(Batch([seq] * 64, Phase.DECODE))
    assert lm.extrapolations() == []


# ----------------------------------------------------------------------- context switches
SWITCH = [OpPoint("preempt_switch", num_tokens=n, median_ms=5 + (n - 1) / 1000) for n in (1, 4096)]


def _preempted_be(profile: Profile, mode: str):
    """A 64-token BE prefill from t=0; an LS request arrives 40% into it and preempts it."""
    m = profile.model
    probe = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0))
    be = Request(0, "BE", 0.0, prompt_tokens=64, output_tokens=1)
    t_ls = 0.4 * probe.plan(prefill(64)).total_s
    ls = Request(1, "LS", t_ls, prompt_tokens=16, output_tokens=1)
    latency = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0))
    sched = Scheduler(QLLM(), kv_capacity_tokens=10**6, activation_tokens_per_token=0.125)
    result = Simulation([be, ls], sched, latency, mode=mode, record_trace=True).run()
    return result, latency


@pytest.mark.parametrize("mode", ["lookup", "step"])
def test_a_resumed_batch_pays_the_switch_cost_once(mode):
    """64 new tokens: 5 ms + 63 us, paid when the BE prefill resumes after the LS prefill."""
    profile = linear_profile(num_layers=4, attn_ms=4, expert_ms=2, overhead_ms=1)
    free, _ = _preempted_be(profile, mode)
    paid, latency = _preempted_be(with_points(profile, *SWITCH), mode)
    assert latency.switch_s(prefill(64)) == pytest.approx(5.063e-3)
    assert free.preemptions == paid.preemptions == 1
    segments = [[(t0, t1, kind) for t0, t1, _, kind, _ in r.trace] for r in (free, paid)]
    assert [kind for _, _, kind in segments[1]] == ["preempted", "prefill", "prefill"]
    assert segments[1][:2] == segments[0][:2]  # identical up to the resume
    be_free = next(s for s in free.sequences if s.id == 0).finish_s
    be_paid = next(s for s in paid.sequences if s.id == 0).finish_s
    assert be_paid - be_free == pytest.approx(5.063e-3, abs=1e-12)


def test_without_the_op_preemption_is_free():
    assert LatencyModel(linear_profile()).switch_s(prefill(64)) == 0.0
    profile = profiles.load("a100-mixtral-nf4-hf")
    # 64 tokens x 24,576 bytes, copied out and back (read + write each) at ~1.4 TB/s: ~4 us,
    # plus 2 kernel overheads and 200 us of host time
    assert LatencyModel(profile).switch_s(prefill(64)) == pytest.approx(222e-6, rel=0.05)


def test_large_token_counts_sum_pool_samples_with_the_exact_spread():
    """200 tokens (3 x 64 + 8): each expert's count has mean 200 x 2/8 = 50 and, a token
    including a given expert with probability 1/4, variance 200 x 1/4 x 3/4 = 37.5 (drawing
    400 assignments with replacement would give 400 x 1/8 x 7/8 = 43.75)."""
    r = RoutingModel(32, 8, 2, seed=7)
    counts = np.stack([r.summed(200) for _ in range(2000)])
    assert np.all(counts.sum(axis=-1) == 400)
    assert counts.mean() == pytest.approx(50, abs=0.1)
    assert counts.var() == pytest.approx(37.5, rel=0.05)


# attn_chunk (chunk tokens, cached prefix): 1 ms + 1 us per chunk token + 10 us per prefix token
CHUNK = [OpPoint("attn_chunk", num_tokens=n, kv_tokens=kv, median_ms=1 + n / 1e3 + kv / 1e2)
         for n in (1, 64) for kv in (0, 1000)]  # fmt: skip


def mixed_with_a_chunk(prefix_tokens: int) -> Batch:
    """Two decodes (contexts 9 and 19) and a 32-token chunk over ``prefix_tokens`` cached."""
    decodes = [Sequence(Request(i, "LS", 0.0, 10 * i - 1, 4), generated=1) for i in (1, 2)]
    chunk = Sequence(Request(3, "BE", 0.0, 200, 4), prefilled_tokens=prefix_tokens,
                     chunk_tokens=32)  # fmt: skip
    return Batch([*decodes, chunk], Phase.MIXED)


def test_a_mixed_batch_costs_its_chunk_over_the_cached_prefix():
    """With attn_chunk: the chunk of 32 over 100 cached costs 1 + 0.032 + 1 ms, plus the two
    decodes' batched attention (linear_profile: 1 ms); without it, or over no prefix, the chunk
    costs as a prefill of 32 tokens (linear_profile: 1 ms)."""
    chunked = LatencyModel(with_points(linear_profile(), *CHUNK))
    assert chunked.plan(mixed_with_a_chunk(100)).attention_s == pytest.approx(3.032e-3)
    assert chunked.plan(mixed_with_a_chunk(0)).attention_s == pytest.approx(2.0e-3)
    without = LatencyModel(linear_profile())
    assert without.plan(mixed_with_a_chunk(100)).attention_s == pytest.approx(2.0e-3)
    assert "attn_chunk" in {c.op for c in chunked.curves()}


def decoding(i: int, context: int) -> Sequence:
    """A sequence in decode with ``context`` tokens cached."""
    seq = Sequence(Request(i, "BE", 0.0, context, 10))
    seq.generated = 1
    return seq


def test_interference_scales_every_iteration_op_but_not_the_wake_up():
    """A profile whose iterations ran 10% slower on average than their shapes' medians
    (``Profile.interference``) predicts 1.1x every plan, prefill and decode alike; the wake-up
    (an excess over warm steps) is not scaled."""
    wake = [OpPoint("wake_up", idle_ms=0), OpPoint("wake_up", median_ms=20.0, idle_ms=100)]
    base = with_points(linear_profile(), *wake)
    slow = replace(base, interference=1.1)
    for phase, seqs in (("prefill", [Sequence(Request(0, "LS", 0.0, 40, 5))]),
                        ("decode", [decoding(i, 30 + i) for i in range(3)])):  # fmt: skip
        batch = Batch(seqs, Phase(phase))
        plans = [LatencyModel(p, RoutingModel(p.model.num_layers, p.model.num_experts,
                                                p.model.top_k, seed=0)).plan(batch)
                 for p in (base, slow)]  # fmt: skip
        assert plans[1].total_s == pytest.approx(1.1 * plans[0].total_s)
    assert LatencyModel(slow).wake_s(0.2) == LatencyModel(base).wake_s(0.2) == 0.020


def test_the_engines_host_time_is_charged_once_per_iteration_by_batch_size(tmp_path):
    """``engine_host`` (the real engine's time between iterations) adds to every plan's
    overhead, interpolated by batch size, decode runs included; saved and loaded with the
    profile; absent, nothing changes."""
    host = [OpPoint("engine_host", batch_size=1, median_ms=0.1, p90_ms=0.1),
            OpPoint("engine_host", batch_size=33, median_ms=0.9, p90_ms=0.9)]  # fmt: skip
    base = linear_profile()
    timed = with_points(base, *host)
    timed.save(tmp_path / "p")
    loaded = Profile.load(tmp_path / "p")
    assert loaded.op_points("engine_host") == host
    for size, extra_ms in ((1, 0.1), (17, 0.5), (33, 0.9), (49, 1.3)):  # 49: the slope on
        batch = Batch([decoding(i, 30) for i in range(size)], Phase.DECODE)
        plans = [LatencyModel(p, RoutingModel(p.model.num_layers, p.model.num_experts,
                                                p.model.top_k, seed=0)).plan(batch)
                 for p in (base, loaded)]  # fmt: skip
        assert plans[1].overhead_s - plans[0].overhead_s == pytest.approx(extra_ms / 1e3)
        assert plans[1].total_s - plans[0].total_s == pytest.approx(extra_ms / 1e3)
    # a fast-forwarded run's later iterations carry it too
    batch = Batch([decoding(i, 30) for i in range(17)], Phase.DECODE)
    runs = []
    for p in (base, loaded):
        model = LatencyModel(p, RoutingModel(p.model.num_layers, p.model.num_experts,
                                             p.model.top_k, seed=0))  # fmt: skip
        batch.plan = model.plan(batch)
        runs.append(model.decode_run(batch, 5).totals_s)
    assert runs[1] - runs[0] == pytest.approx(np.full(5, 0.5e-3))
