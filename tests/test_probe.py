"""The host-speed probe (profiler.probe): the same step every call, run every ``every_s`` of its
owner's work; the profiler runs it between the shapes of each pass and files its times per
pass; the real engine runs it between iterations, never among the first steps after an idle
gap, without changing the run's clock or schedule; the clocks leave excluded time out."""

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


def test_the_profiler_runs_the_probe_between_shapes_and_files_it_per_pass(runner):
    ticks = itertools.count()  # every reading a second later: each shape is "due"
    probe = SpeedProbe(runner, [3, 1, 4, 1, 5], lambda: float(next(ticks)), every_s=0.5)
    settings = Settings([4, 8], [1, 2], [8], [1, 4, 8], warmup=0, repeats=2, passes=2,
                        wake_idle_ms=(), prefill_pairs=False)  # fmt: skip
    prof = Profiler(runner, settings, torch.device("cpu"), probe)
    prof.grid_pass()
    after_first = len(prof.probe_times)
    prof.grid_pass()
    shapes = settings.num_iterations
    # one after every shape (each took a "second" of the probe's clock), pass by pass
    assert after_first == shapes and len(prof.probe_times) == 2 * shapes
    assert [k for k, _ in prof.probe_times] == [0] * shapes + [1] * shapes
    summary = prof.probe_summary()
    assert summary["count"] == 2 * shapes and summary["every_ms"] == 500
    assert summary["mean_ms"] == 1000 and summary["pass_mean_ms"] == [1000, 1000]
    # and the profile keeps it (the real runs' reference)
    info = build_model("tiny-mixtral")[1]
    profile = build_profile(prof, info, "probe-test", prof.table())
    assert profile.extra["probe"] == summary
    # without a probe: no probe in the profile
    plain = Profiler(runner, settings, torch.device("cpu"))
    plain.grid_pass()
    assert plain.probe_summary() is None
    assert "probe" not in build_profile(plain, info, "plain", plain.table()).extra


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
