"""The host-speed probe (profiler.probe): the same step every call, run every ``every_s`` of its
owner's work; the profiler runs it around every shape of each pass, files its times per pass
and each shape's samples divided by the probe around them; the real engine runs it between
iterations, never among the first steps after an idle gap, without changing the run's clock
or schedule; the clocks leave excluded time out."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from conftest import greedy_setup
from test_realrun import STAGE_S, mixed_requests, policy

from policies.core import BE, LS, Request
from policies.scheduler import Scheduler
from profiler.measure import Profiler, Settings, build_profile
from profiler.models import build_model
from profiler.ops import ModelRunner
from profiler.probe import PROBE_AFTER_IDLE, PROBE_WARM_STEPS, SpeedProbe, probe_speed
from realrun.clock import CpuClock, VirtualClock, WallClock
from realrun.engine import RealEngine


@pytest.fixture(scope="module")
def runner():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRunner(build_model("tiny-mixtral")[0])
    torch.set_num_threads(threads)


def test_the_probe_runs_the_same_step_every_every_s_of_work(runner):
    ticks = itertools.count()  # a clock on which each probe takes one second
    probe = SpeedProbe(runner, [5, 9, 2, 7], lambda: float(next(ticks)), every_s=0.05)
    seq = probe.seq
    before = (list(seq.token_ids), seq.num_cached)
    assert before[1] == 4 and len(before[0]) == 5  # the ids cached, the prefill's token to feed
    assert probe.maybe() is None  # no work yet
    probe.work(0.03)
    assert not probe.due and probe.maybe() is None
    probe.work(0.03)  # 0.06 of work: due
    assert probe.due and probe.maybe() == 1.0
    assert not probe.due and probe.times == [1.0]  # what it owed is paid
    steps = []
    run = runner.run
    runner.run = lambda state, *a: steps.append(state.sequences) or run(state, *a)
    try:
        assert probe() == 1.0 and len(probe.times) == 2  # run at once, whatever is owed
    finally:
        del runner.run
    # its step untimed (its weights and cache back in), then timed
    assert len(steps) == 1 + PROBE_WARM_STEPS and all(s == [seq] for s in steps)
    assert (list(seq.token_ids), seq.num_cached) == before  # rewound: the same step each time
    with pytest.raises(ValueError, match="every_s"):
        SpeedProbe(runner, [1, 2], time.perf_counter, every_s=0)


def test_probe_speed_is_the_mean_probe_over_the_reference():
    assert probe_speed([0.002, 0.004], 0.002) == pytest.approx(1.5)
    assert probe_speed([], 0.002) is None and probe_speed([0.002], None) is None


def test_the_profiler_runs_the_probe_around_every_shape_and_files_it_per_pass(runner):
    ticks = itertools.count()  # every reading a second later: each probe takes a second
    probe = SpeedProbe(runner, [3, 1, 4, 1, 5], lambda: float(next(ticks)), every_s=0.5)
    settings = Settings([4, 8], [1, 2], [8], [1, 4, 8], warmup=0, repeats=2, passes=2,
                        wake_idle_ms=(), prefill_pairs=False)  # fmt: skip
    prof = Profiler(runner, settings, torch.device("cpu"), probe)
    prof.grid_pass()
    after_first = len(prof.probe_times)
    prof.grid_pass()
    shapes = settings.num_iterations
    # one at each pass's start and one after every shape, pass by pass
    assert after_first == shapes + 1 and len(prof.probe_times) == 2 * (shapes + 1)
    assert [k for k, _ in prof.probe_times] == [0] * (shapes + 1) + [1] * (shapes + 1)
    summary = prof.probe_summary()
    assert summary["count"] == 2 * (shapes + 1) and summary["normalized"] is True
    assert summary["mean_ms"] == 1000 and summary["pass_mean_ms"] == [1000, 1000]
    # and the profile keeps it (the real runs' reference)
    info = build_model("tiny-mixtral")[1]
    profile = build_profile(prof, info, "probe-test", prof.table())
    assert profile.extra["probe"] == summary
    assert "divided by the host-speed probe" in profile.calibration
    # without a probe: no probe in the profile, its samples in ms
    plain = Profiler(runner, settings, torch.device("cpu"))
    plain.grid_pass()
    assert plain.probe_summary() is None and not plain.normalize and plain.unit_ms == 1.0
    profile = build_profile(plain, info, "plain", plain.table())
    assert "probe" not in profile.extra and "host-speed probe" not in profile.calibration


class ScheduleProbe:
    """A probe whose every call reads ``probe_ms`` times the host's speed (``host["speed"]``)."""

    def __init__(self, host: dict, probe_ms: float = 2.0) -> None:
        self.host, self.probe_ms = host, probe_ms

    def __call__(self) -> float:
        return self.probe_ms * self.host["speed"] / 1e3

    def identity(self) -> dict:
        return {"kv": 64, "warm_steps": 1, "ids_sha256": "0" * 16}


def slowed_clock(prof: Profiler, host: dict, stage_ms: float) -> None:
    """Every stage of the profiler's timed iterations takes ``stage_ms`` times the host's
    speed (the real iteration runs: its stages are the model's)."""
    iteration = prof.clock.iteration

    def timed(runner, seqs):
        _, stages = iteration(runner, seqs)
        for st in stages:
            st.ms = stage_ms * host["speed"]
            st.calls = st.calls and [stage_ms * host["speed"] / len(st.calls)] * len(st.calls)
        return sum(st.ms for st in stages), stages

    prof.clock.iteration = timed


def test_a_visit_is_filed_in_probe_steps_and_read_back_in_ms(runner):
    host = {"speed": 1.0}
    settings = Settings([4], [1], [8], [1], warmup=0, repeats=3, passes=3, wake_idle_ms=(),
                        prefill_pairs=False)  # fmt: skip
    prof = Profiler(runner, settings, torch.device("cpu"), ScheduleProbe(host))
    slowed_clock(prof, host, stage_ms=0.5)
    prof.samples[("lm_head", 1, 0, 0)].append(7.0)  # filed before: left as it is
    before = prof._probe()  # 2 ms
    host["speed"] = 3.0  # the visit runs 3x slower, and the probe after it reads so
    after = prof._visit(lambda: prof.decode(1, 8, repeats=3), before)
    assert after == pytest.approx(6e-3)
    unit = 1e3 * (before + after) / 2  # 4 ms per probe step around the visit
    assert prof.samples[("lm_head", 1, 0, 0)] == [7.0] + [pytest.approx(1.5 / unit)] * 3
    attention = prof.samples[("attn_decode", 1, 0, 8)]  # a stage per layer, per repeat
    assert len(attention) == 3 * runner.num_layers
    assert attention == [pytest.approx(1.5 / unit)] * len(attention)
    assert all(t == pytest.approx(1.5 / unit) for _, t in prof.expert_samples)
    (shape,) = prof.totals
    stages = len(prof.clock.iteration(runner, prof.prompts([8]))[1])
    assert prof.totals[shape] == [pytest.approx(1.5 * stages / unit)] * 3
    assert prof.totals_unit[shape] == [unit] * 3  # what pass_speeds multiplies back
    # read back in ms at the profile's mean probe (2 and 6 ms: 4 ms a probe step)
    assert prof.unit_ms == pytest.approx(4.0)
    assert prof.totals_ms()[shape] == [pytest.approx(1.5 * stages)] * 3
    (point,) = [p for p in prof.table() if p.op == "attn_decode"]
    assert point.median_ms == pytest.approx(1.5) and point.p90_ms == pytest.approx(1.5)
    # not normalized: the same visit filed as timed
    raw = Profiler(runner, settings, torch.device("cpu"), ScheduleProbe(host), normalize=False)
    slowed_clock(raw, host, stage_ms=0.5)
    raw._visit(lambda: raw.decode(1, 8, repeats=3), raw._probe())
    assert raw.samples[("attn_decode", 1, 0, 8)] == [pytest.approx(1.5)] * len(attention)
    assert raw.unit_ms == 1.0 and raw.probe_summary()["normalized"] is False


def test_a_profile_normalized_by_its_probe_holds_every_shape_at_its_mean_speed(runner):
    """The host ran 1x, 1x, then 4x slower pass by pass: normalized, every shape is read at
    the mean probe's speed (2x); as timed, at the median pass's (1x). The passes' speeds
    (``pass_speeds``) stay those timed, and the self-check compares like with like."""
    # 6 repeats: a pair of the jittered prefill (8 tokens: 7 and 9) in every pass
    settings = Settings([4, 8], [1, 2], [8], [1, 4, 8], warmup=0, repeats=6, passes=3,
                        wake_idle_ms=(), prefill_pairs=False)  # fmt: skip
    info = build_model("tiny-mixtral")[1]
    tables = {}
    for normalize in (True, False):
        host = {"speed": 1.0}
        prof = Profiler(runner, settings, torch.device("cpu"), ScheduleProbe(host),
                        normalize=normalize)  # fmt: skip
        slowed_clock(prof, host, stage_ms=0.5)
        for speed in (1.0, 1.0, 4.0):
            host["speed"] = speed
            prof.grid_pass()
        tables[normalize] = {(p.op, p.batch_size, p.num_tokens, p.kv_tokens): p.median_ms
                             for p in prof.table()}  # fmt: skip
        assert prof.pass_speeds() == pytest.approx([1.0, 1.0, 4.0])  # over the median pass
        profile = build_profile(prof, info, "drift", prof.table())
        check = profile.extra["self_check"]["shapes"]
        assert all(abs(r["error_pct"]) < 60 for r in check)  # the same units on both sides
    assert tables[True][("attn_decode", 2, 0, 8)] == pytest.approx(1.0)  # 0.5 ms x 2
    assert tables[False][("attn_decode", 2, 0, 8)] == pytest.approx(0.5)
    assert tables[True][("lm_head", 1, 0, 0)] == pytest.approx(1.0)


class StubProbe:
    """Counts the engine's work and, when due, records how many segments the engine had run
    since its last idle gap; each probe takes 1 ms of the engine's clock."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self.owed, self.at = every_s, 0.0, []
        self.engine: RealEngine | None = None
        self.worked = 0.0

    def work(self, seconds: float) -> None:
        self.owed += seconds
        self.worked += seconds

    @property
    def due(self) -> bool:
        return self.owed >= self.every_s

    def maybe(self):
        if not self.due:
            return None
        self.owed = 0.0
        self.at.append((self.engine._busy_segments, self.engine.clock.now()))
        self.engine.clock.t += 1e-3
        return 1e-3


class ExcludingClock(VirtualClock):
    """A virtual clock on which the probe's time passes, unless the engine excludes it."""

    def exclude(self, seconds: float) -> None:
        self.t -= seconds


def test_the_engine_probes_between_iterations_off_its_clock():
    runner, requests, prompts, reference = greedy_setup(mixed_requests(), max_prompt_tokens=64)
    # a gap: two late requests after the engine has gone idle (a prefill, then 7 decode steps)
    late = [Request(100, LS, 30.0, 5, 8), Request(101, BE, 30.0, 6, 8)]
    requests = requests + late
    prompts = {**prompts, 100: [7] * 5, 101: [9] * 6}

    def run(probe):
        sched = Scheduler(policy("qllm"), kv_capacity_tokens=100_000)
        engine = RealEngine(requests, prompts, sched, runner, ExcludingClock(STAGE_S), probe=probe)
        if probe is not None:
            probe.engine = engine
        return engine.run()

    plain = run(None)
    every_s = 2 * runner.num_stages * STAGE_S  # due every two iterations' work
    probe = StubProbe(every_s)
    probed = run(probe)
    # the same run: tokens, and every request's times and preemptions (the probe's time is
    # not the run's: the engine excludes it from its clock)
    assert probed.tokens == plain.tokens
    assert all(probed.tokens[i] == tokens for i, tokens in reference.items())

    def times(result):
        return [(s.id, s.first_token_s, s.finish_s, s.preemptions) for s in result.sequences]

    assert times(probed) == times(plain)
    assert plain.probes == [] and probed.probes == [1e-3] * len(probe.at)
    # about one per every_s of the run's work, never among the first segments after a gap:
    # after the gap, the probe (owed since before it) waits for the PROBE_AFTER_IDLE-th
    assert probe.worked == pytest.approx(plain.stages * STAGE_S)
    assert 0.5 * probe.worked / every_s <= len(probe.at) <= probe.worked / every_s + 1e-9
    assert min(busy for busy, _ in probe.at) >= PROBE_AFTER_IDLE
    after_gap = [busy for busy, now in probe.at if now > 30.0]
    assert after_gap and after_gap[0] == PROBE_AFTER_IDLE


@pytest.mark.parametrize("clock_kind", [WallClock, CpuClock])
def test_excluded_time_leaves_the_clock(clock_kind):
    clock = clock_kind()
    clock.start()
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # busy: both clocks move
        pass
    before = clock.now()
    clock.exclude(0.03)
    after = clock.now()
    assert before - 0.03 <= after < before - 0.02
    virtual = VirtualClock(1e-3)
    virtual.tick()
    virtual.exclude(5.0)  # only stages take virtual time
    assert virtual.now() == pytest.approx(1e-3)


def test_a_profile_is_the_reference_only_for_runs_of_its_own_probe(runner, capsys):
    from types import SimpleNamespace

    from realrun.validate import probe_reference

    probe = SpeedProbe(runner, [2, 7, 1, 8], time.perf_counter)
    ours = {"mean_ms": 3.0, "count": 9, **probe.identity()}
    assert probe_reference(SimpleNamespace(extra={"probe": ours}), probe) == pytest.approx(3e-3)
    assert capsys.readouterr().err == ""
    assert probe_reference(SimpleNamespace(extra={"probe": ours}), None) is None  # virtual clock
    # another token (another seed or model), another warm-up: its times are no reference
    other = SpeedProbe(runner, [2, 7, 1, 9], time.perf_counter).identity()
    for theirs in ({**ours, "ids_sha256": other["ids_sha256"]}, {**ours, "warm_steps": 0}):
        profile = SimpleNamespace(extra={"probe": theirs})
        assert probe_reference(profile, probe, "results/p") is None
        err = capsys.readouterr().err
        assert err.startswith("warning: profile.path=results/p timed another host-speed probe")
        assert err.count("\n") == 1 and "no host-normalized figures" in err
    # one that does not say what it ran (the curated profiles of 2026-12-03 12:54)
    unnamed = {"mean_ms": 3.0, "count": 9}
    assert probe_reference(SimpleNamespace(extra={"probe": unnamed}), probe, "results/v") is None
    assert "does not say what it ran" in capsys.readouterr().err
    # none at all (qllm-profile's profiles)
    assert probe_reference(SimpleNamespace(extra={}), probe, "results/q") is None
    assert "has no host-speed probe" in capsys.readouterr().err
