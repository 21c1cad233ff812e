"""The compiled executor (``core=compiled``: sim/kernel.py, sim/compiled.py) gives every
request the SimPy executor's results, to the bit.

Exact, not approximate: the loop replays SimPy's stepping (events ordered by time, priority
and the order they were scheduled in), computes each iteration's time by the latency model's
float operations in their order, and hands every routing draw back to the replica's own
``RoutingModel``, so the two executors see the very same floats. Any difference is a bug.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import numpy as np
import pytest
from conftest import linear_profile
from hydra import compose, initialize_config_dir

from sim import compiled
from sim.app import CONF_DIR
from sim.config import UserError
from sim.kernel import pairwise_sum
from sim.metrics import GapStats
from sim.run import RunStopped, simulate
from sim.workloads import stream_workload

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "splitwise_conv.csv"
CONV = ["workload=trace", f"workload.path={TRACE}", "profile=h200-mixtral-bf16",
        "policy=iteration"]  # fmt: skip

CASES = {
    # the conversation trace at its own rate: one replica overloaded, long uncapped outputs
    "conv": [*CONV, "workload.num_requests=500"],
    "conv-tgi-0.3": [*CONV, "workload.num_requests=400", "policy=tgi-0.3"],
    # TGI's token budget binds (joins refused for it) and no batch-size cap
    "conv-token-budget": [*CONV, "workload.num_requests=400",
                          "policy.max_batch_total_tokens=30000", "policy.max_batch_size=null"],
    # a small KV cache: admissions wait for memory, and the gap arena is compacted
    "conv-small-cache": [*CONV, "workload.num_requests=500",
                         "profile.kv_capacity_tokens=40000"],
    # short outputs, many arrivals per completion, the default (nf4) profile; zipf routing
    "paper": ["workload=paper", "workload.num_requests=300", "workload.rate=6",
              "policy=iteration"],
    "paper-zipf": ["workload=paper", "workload.num_requests=200", "workload.rate=4",
                   "policy=iteration", "profile.routing=zipf", "seed=3"],
    # every router on three replicas (ls_first and ls_dedicated read the classes)
    **{f"cluster-{router}": [*CONV, "workload.num_requests=600", "workload.rate=10",
                             "cluster.replicas=3", f"cluster.router={router}"]
       for router in ("round_robin", "least_outstanding", "least_kv", "ls_dedicated",
                      "ls_first")},
    # prefill attention one prompt at a time
    "conv-per-prompt": [*CONV, "workload.num_requests=300",
                        "profile.prefill_attention=per_prompt"],
    # Algorithm 1 and its preemptive forms: LS arrivals suspend BE batches inside iterations
    "qllm": [*CONV, "workload.num_requests=600", "workload.rate=2", "workload.ls_fraction=0.1",
             "policy=qllm"],
    "layer": [*CONV, "workload.num_requests=600", "workload.rate=2",
              "workload.ls_fraction=0.1", "policy=layer"],
    "qllm-router": [*CONV, "workload.num_requests=300", "policy=qllm",
                    "policy.preempt_prefill=false"],
    "alg1": [*CONV, "workload.num_requests=300", "policy=alg1"],
    "qllm-in-flight": [*CONV, "workload.num_requests=300", "policy=qllm",
                       "policy.max_in_flight=32"],
    "qllm-literal": [*CONV, "workload.num_requests=400", "workload.ls_fraction=0.3",
                     "policy=qllm", "policy.fill_be_prefill=false", "policy.refill_be=false"],
    "qllm-paper": ["workload=paper", "workload.num_requests=300", "workload.rate=6",
                   "policy=qllm"],
    "qllm-cluster": [*CONV, "workload.num_requests=600", "workload.rate=9", "policy=qllm",
                     "cluster.replicas=3", "cluster.router=ls_first"],
    # a small KV cache under Algorithm 1: LS prompts wait for memory, no BE prompt goes first
    "qllm-small-cache": ["workload=paper", "workload.num_requests=300", "workload.rate=3",
                         "policy=qllm", "profile.kv_capacity_tokens=4000"],
    "alg1-small-cache": ["workload=paper", "workload.num_requests=300", "workload.rate=3",
                         "policy=alg1", "profile.kv_capacity_tokens=4000"],
}  # fmt: skip


def run(overrides, executor="compiled", **kwargs):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"core={executor}"])
    return simulate(cfg, warn=False, **kwargs)


def without_kind(summary: dict) -> str:
    out = json.loads(json.dumps(summary))
    out["executor"].pop("core")
    out["executor"].pop("wall_s")
    out["executor"].pop("events")  # stepping's count, not fast-forward's (compared below)
    return json.dumps(out, sort_keys=True)


def assert_same(fast, ref, stepping=None):
    assert fast.requests.equals(ref.requests)  # ttft, tpot, itl_max, finish, replica, ...
    assert without_kind(fast.summary) == without_kind(ref.summary)  # itl stats: every gap
    assert fast.timeline.equals(ref.timeline)
    for key in ("makespan_s", "iterations", "preemptions", "peak_kv_used_tokens"):
        assert getattr(fast.result, key) == getattr(ref.result, key), key
    assert fast.extrapolated == ref.extrapolated
    if stepping is not None:  # the loop steps every iteration: stepping's events, one by one
        assert fast.result.events == stepping.result.events


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_gives_every_request_the_simpy_executors_results(case):
    overrides = CASES[case]
    fast = run(overrides)
    assert fast.summary["executor"]["core"] == "compiled"
    stepping = run([*overrides, "fast_forward=false"], "simpy")
    assert_same(fast, run(overrides, "simpy"), stepping)
    assert_same(fast, stepping)
    assert fast.summary["completed"] == len(fast.requests) > 0
    if case in ("qllm", "layer", "qllm-router", "qllm-cluster"):
        assert fast.result.preemptions > 0  # the comparison covers suspended batches


def test_a_resume_that_an_arrival_catches_in_its_switch(tmp_path, monkeypatch):
    """A profile whose context switch takes 3 s: LS work arrives while a suspended batch is
    being restored, and the executor runs it to its next preemptible boundary at once
    (``Simulation._to_next_allowed``) on both executors alike."""
    from dataclasses import replace

    from sim import profiles
    from sim.engine import Simulation

    base = profiles.load("h200-mixtral-bf16")
    points = [replace(p, median_ms=3000.0, p90_ms=3000.0) if p.op == "preempt_switch" else p
              for p in base.points]  # fmt: skip
    path = replace(base, points=points).save(tmp_path / "slow-switch")
    overrides = [*CONV, f"profile.path={path}", "policy=qllm", "workload.num_requests=600",
                 "workload.rate=2", "workload.ls_fraction=0.1"]  # fmt: skip
    calls = []
    original = Simulation._to_next_allowed

    def counted(self, *args):
        calls.append(1)
        return (yield from original(self, *args))

    monkeypatch.setattr(Simulation, "_to_next_allowed", counted)
    fast, stepping = run(overrides), run([*overrides, "fast_forward=false"], "simpy")
    assert calls and fast.result.preemptions > 0
    assert_same(fast, stepping, stepping)


def test_the_cases_cover_what_they_claim():
    """The cases reach the paths they are there for (or their comparison proves nothing)."""
    budget = run(CASES["conv-token-budget"])
    assert budget.result.peak_kv_used_tokens <= 30000
    for case, capacity in (("conv-small-cache", 40000), ("qllm-small-cache", 4000),
                           ("alg1-small-cache", 4000)):  # fmt: skip
        small = run(CASES[case])
        assert small.result.peak_kv_used_tokens > 0.9 * capacity, case  # memory bound them
    per = run(CASES["cluster-ls_dedicated"]).requests
    assert set(per.loc[per["cls"] == "LS", "replica"]) == {0}
    assert set(per.loc[per["cls"] == "BE", "replica"]) == {1, 2}


def test_flushes_and_compactions_in_the_middle_of_a_run(monkeypatch):
    """Finished requests handed over many times, and the gap arena compacted, mid-run: the
    same outputs as one hand-over at the end."""
    overrides = CASES["conv-small-cache"]
    calls = {"compact": 0, "_flush": 0}
    compact, flush = compiled.K.compact, compiled.CompiledCluster._flush

    def counted_compact(*args):
        calls["compact"] += 1
        return compact(*args)

    def counted_flush(self):
        calls["_flush"] += 1
        return flush(self)

    monkeypatch.setattr(compiled, "FLUSH_EVERY", 7)
    monkeypatch.setattr(compiled.K, "compact", counted_compact)
    monkeypatch.setattr(compiled.CompiledCluster, "_flush", counted_flush)
    fast = run(overrides)
    assert calls["compact"] >= 1 and calls["_flush"] > 500 / 7
    assert_same(fast, run(overrides, "simpy"))


@pytest.mark.parametrize(
    "case",
    [
        "conv",
        "conv-token-budget",
        "conv-small-cache",
        "paper",
        "qllm",
        "qllm-literal",
        "qllm-in-flight",
        "qllm-cluster",
    ],
)
def test_decode_runs_change_no_result(case, monkeypatch):
    """The loop's decode runs (``fast_forward``, on by default: an iteration's end that the
    policy would follow with the same batch skips the per-request work and, when nothing
    else comes first, the heap) give what stepping every iteration's work gives, to the
    bit; with room for 3 ends, so the runs are applied in pieces too."""
    seen = []
    result = compiled.CompiledCluster._result

    def kept(self, wall_s):
        out = result(self, wall_s)
        seen.append((self.run_iterations, self.heap_events))
        return out

    monkeypatch.setattr(compiled.CompiledCluster, "_result", kept)
    monkeypatch.setattr(compiled, "RUN_BUFFER", 3)
    runs, steps = run(CASES[case]), run([*CASES[case], "fast_forward=false"])
    (ran, heap), (ran_off, heap_off) = seen
    assert ran > 0.3 * runs.result.iterations and ran_off == 0  # the runs are exercised
    assert heap < heap_off
    assert_same(runs, steps, steps)


@pytest.mark.parametrize("setting", [
    ["policy=iteration"],
    ["policy=iteration", "cluster.replicas=2", "cluster.router=least_outstanding"],
    ["policy=qllm", "workload.ls_fraction=0.2"],
    ["policy=qllm", "workload.ls_fraction=0.2", "cluster.replicas=2",
     "cluster.router=ls_first"],
])  # fmt: skip
def test_events_at_the_same_time_are_ordered_alike(setting, tmp_path):
    """Every stage time and arrival time a multiple of 2**-8 s, so the floats add up
    exactly: iterations end at the very times requests arrive (and at one another's, and
    arrivals come in twos), and the order of events at one time (SimPy's: priority, then
    the order they were scheduled in) decides what the scheduler sees. The loop, its decode
    runs and their shortcut past the heap, must order them as SimPy's stepping does.
    (SimPy's own fast-forward does not, on several replicas: a run's last end is scheduled
    when the run starts, so it comes before an arrival at that very time that stepping
    would take first; README, "fast_forward".)"""
    ms = 1000 * 2.0**-8  # the grid, in the profile's milliseconds (3.90625: a saved profile
    # keeps 6 significant digits)
    path = linear_profile(
        attn_ms=ms,
        router_ms=ms,
        expert_ms=2 * ms,
        expert_per_token_ms=0,
        lm_head_ms=4 * ms,
        overhead_ms=8 * ms,
    ).save(tmp_path / "grid")
    rng = np.random.default_rng(11)
    n = 400
    arrivals = np.cumsum(rng.integers(0, 64, n)) / 128
    trace = tmp_path / "grid.csv"
    prompts, outputs = rng.integers(8, 300, n), rng.integers(2, 30, n)
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{a!r},{p},{d}\n" for a, p, d in zip(arrivals.tolist(), prompts, outputs,
                                               strict=True)))  # fmt: skip
    overrides = ["workload=trace", f"workload.path={trace}", f"profile.path={path}",
                 f"workload.num_requests={n}", *setting]  # fmt: skip
    fast, stepping = run(overrides), run([*overrides, "fast_forward=false"], "simpy")
    assert_same(fast, stepping, stepping)
    ends = set(fast.requests["finish_s"]) | set(fast.requests["first_token_s"])
    assert len(ends & set(arrivals.tolist())) >= 5  # the ties are there


def test_a_streamed_workload_and_a_list_give_the_same_run():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*CASES["conv"], "core=compiled"])
    workload = stream_workload(cfg.workload, seed=cfg.seed)
    shuffled = [workload.request(i) for i in np.random.default_rng(0).permutation(len(workload))]
    a = simulate(cfg, requests=workload, warn=False)
    b = simulate(cfg, requests=shuffled, warn=False)  # sorted by (arrival, id) first
    assert a.requests.equals(b.requests)
    assert a.timeline.equals(b.timeline)


def test_extrapolation_warnings_are_the_same(tmp_path):
    """A profile whose grids end early (4,096 tokens): prompts and contexts of the trace go
    beyond them, on both executors alike, warned of in the same lines."""
    path = linear_profile().save(tmp_path / "small-grid")
    overrides = [*CONV, "workload.num_requests=300", f"profile.path={path}",
                 "cluster.replicas=2", "cluster.router=least_outstanding"]  # fmt: skip
    fast, ref = run(overrides), run(overrides, "simpy")
    assert fast.extrapolated  # the comparison is of something
    assert_same(fast, ref)


def test_a_request_that_cannot_fit_is_refused_alike():
    for extra, key in (
        (["profile.kv_capacity_tokens=3000"], "profile.kv_capacity_tokens"),
        (["policy.max_batch_total_tokens=3000"], "policy.max_batch_total_tokens"),
    ):
        messages = []
        for executor in ("compiled", "simpy"):
            with pytest.raises(UserError, match=key) as e:
                run([*CONV, "workload.num_requests=300", *extra], executor)
            messages.append(str(e.value))
        assert messages[0] == messages[1]  # fmt: skip


@pytest.mark.parametrize("overrides,what", [
    (["policy=priority"], "policy priority"),
    (["policy=vllm", "memory.model=paged"], "policy vllm"),
    (["memory.model=paged"], "memory.model=paged"),
    (["policy=qllm", "policy.merge=true"], "policy.merge=True"),
    (["policy=qllm", "policy.be_max_wait_s=2"], "policy.be_max_wait_s=2"),
])  # fmt: skip
def test_what_it_does_not_run_is_refused_in_one_line(overrides, what):
    with pytest.raises(UserError) as e:
        run([*CONV, "workload.num_requests=20", *overrides])
    message = str(e.value)
    assert message.startswith("core=compiled: does not run") and what in message
    assert "core=simpy" in message and "\n" not in message


def test_boundary_mode_step_is_refused_and_auto_runs_it_on_simpy():
    """Stepping every stage boundary counts an event per stage: the compiled core steps
    iterations, so it would report another count; it refuses rather than mislabel it."""
    with pytest.raises(UserError, match="core=compiled: does not run boundary_mode=step"):
        run([*CONV, "workload.num_requests=20", "boundary_mode=step"])
    auto = run([*CONV, "workload.num_requests=20", "boundary_mode=step"], "auto")
    assert auto.summary["executor"]["core"] == "simpy"


def test_a_run_that_keeps_its_sequences_is_refused():
    with pytest.raises(UserError, match="keeps its sequences"):
        run([*CONV, "workload.num_requests=20"], keep_sequences=True)


def test_an_unknown_executor_is_refused():
    with pytest.raises(UserError, match="core=numba.*simpy, compiled or auto"):
        run([*CONV, "workload.num_requests=20"], "numba")


def test_a_watched_run_stops_for_the_same_reason():
    """qllm-plan's verdict stops a run once it is certain to miss its targets: the compiled
    executor feeds it the same requests in the same order, so the same reason."""
    from sim.plan import Targets, Verdict

    reasons = []
    for executor in ("compiled", "simpy"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*CASES["conv"], f"core={executor}"])
        workload = stream_workload(cfg.workload, seed=cfg.seed)
        verdict = Verdict(Targets(3.0, 0.99, 0.95), cfg.slo, workload.times, workload.is_ls)
        with pytest.raises(RunStopped) as e:
            simulate(cfg, requests=workload, watch=verdict, warn=False)
        reasons.append((str(e.value), verdict.missed, verdict.ls_late))
    assert reasons[0] == reasons[1]


def test_gap_stats_add_many_folds_where_add_folds():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 9, 300)
    lengths[::17] = 0
    gaps = rng.random(int(lengths.sum())).astype(np.float32)
    one, many = GapStats(exact_up_to=100), GapStats(exact_up_to=100)
    start = 0
    for n in lengths.tolist():
        one.add(array("f", gaps[start : start + n].tobytes()))
        start += n
    for part in np.array_split(np.arange(len(lengths)), 7):  # several calls, as flushes are
        lo = int(lengths[: part[0]].sum())
        many.add_many(gaps[lo : lo + int(lengths[part].sum())], lengths[part])
    assert one.stats() == many.stats()
    assert one.count == many.count and np.array_equal(one.hist, many.hist)
    exact_one, exact_many = GapStats(), GapStats()
    exact_one.add(array("f", gaps.tobytes()))
    exact_many.add_many(gaps, np.array([len(gaps)]))
    assert exact_one.stats() == exact_many.stats()


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (129,), (32, 8), (16, 64), (61, 256)])
def test_pairwise_sum_is_numpys_sum(shape):
    rng = np.random.default_rng(sum(shape))
    for scale in (1e-3, 1.0, 1e4):
        a = rng.random(shape) * scale
        assert pairwise_sum(a.ravel(), 0, a.size) == float(a.sum())


def test_randomised_settings_match():
    """A few random TGI settings, rates and seeds on two replicas."""
    rng = np.random.default_rng(7)
    for _ in range(3):
        overrides = [*CONV, "workload.num_requests=250", "cluster.replicas=2",
                     f"cluster.router={rng.choice(['round_robin', 'least_kv'])}",
                     f"workload.rate={float(rng.uniform(2, 12)):.3f}",
                     f"seed={int(rng.integers(100))}",
                     f"policy.max_batch_size={int(rng.integers(4, 48))}",
                     f"policy.max_waiting_tokens={int(rng.integers(1, 30))}",
                     f"policy.waiting_served_ratio={float(rng.uniform(0, 2)):.3f}",
                     f"policy.max_batch_prefill_tokens={int(rng.integers(2048, 8192))}",
                     ]  # fmt: skip
        assert_same(run(overrides), run(overrides, "simpy"))


def test_auto_runs_compiled_where_it_can_and_simpy_elsewhere():
    iteration = run([*CONV, "workload.num_requests=60"], "auto")
    assert iteration.summary["executor"]["core"] == "compiled"
    assert_same(iteration, run([*CONV, "workload.num_requests=60"], "simpy"))
    other = run([*CONV, "workload.num_requests=60", "policy=priority"], "auto")
    assert other.summary["executor"]["core"] == "simpy"
    kept = run([*CONV, "workload.num_requests=60"], "auto", keep_sequences=True)
    assert kept.summary["executor"]["core"] == "simpy" and len(kept.result.sequences) == 60


def test_a_capacity_search_finds_the_same_table_on_either_core(tmp_path, capsys):
    """qllm-plan with core=compiled (iteration and qllm: both on the compiled core) writes
    the table a search on SimPy writes, figure for figure."""
    import pandas as pd

    import sim.plan as plan

    tables = {}
    for core in ("compiled", "simpy"):
        out = tmp_path / core
        args = ["--replicas", "1", "2", "--policies", "iteration", "qllm", "--rate-lo", "0.5",
                "--min-requests", "100", "--horizon-s", "25", "--jobs", "1", "--rel-tol", "0.5",
                "--target-rate", "3", "--out", str(out), *CONV[:-1], f"core={core}"]  # fmt: skip
        assert plan.main(args) == 0
        tables[core] = [pd.read_csv(out / name) for name in ("plan.csv", "target.csv")]
    for a, b in zip(tables["compiled"], tables["simpy"], strict=True):
        pd.testing.assert_frame_equal(a, b)


def test_a_first_compile_is_announced_once(monkeypatch, capsys):
    """No cache for this machine yet: one line says the loop is being compiled (a minute),
    so a first run does not look hung; said once per process, and not with a cache."""
    monkeypatch.setattr(compiled, "_NOTED", [])
    monkeypatch.setattr(compiled.os.path, "exists", lambda path: False)
    compiled._note_first_compile()
    compiled._note_first_compile()
    assert capsys.readouterr().err.count("compiling the loop for this machine") == 1
    monkeypatch.setattr(compiled, "_NOTED", [])
    monkeypatch.setattr(compiled.os.path, "exists", lambda path: True)
    compiled._note_first_compile()
    assert capsys.readouterr().err == ""


def test_a_suspended_batch_on_a_short_expert_grid(tmp_path):
    """An expert grid that ends at 2 tokens, below the routing pools' counts: a suspended
    batch's stage offsets take the pool samples' extrapolated expert times, as the latency
    model's _expert_times gives them."""
    from dataclasses import replace

    base = linear_profile(expert_ms=20.0)
    points = [p for p in base.points if not (p.op == "expert" and p.num_tokens > 2)]
    path = replace(base, points=points).save(tmp_path / "short-experts")
    overrides = [*CONV[:-1], "workload.num_requests=300", f"profile.path={path}",
                 "policy=qllm", "policy.fill_be_prefill=false", "workload.rate=0.5",
                 "workload.ls_fraction=0.1"]  # fmt: skip
    fast, stepping = run(overrides), run([*overrides, "fast_forward=false"], "simpy")
    assert fast.result.preemptions > 0 and fast.extrapolated
    assert_same(fast, stepping, stepping)
