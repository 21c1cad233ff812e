"""qllm-plan stops a run once it is certain to miss the targets (``sim.plan.Verdict``): the
bounds are sound (a stopped run's whole figures miss too), and a search gives the same answers
as one that runs every run to its end."""

from __future__ import annotations

import csv
import random
from types import SimpleNamespace

import numpy as np
import pytest
import simpy

import sim.plan as plan
from policies.core import BE, LS, Request, Sequence
from sim.metrics import outputs


def finished(i, cls, arrival, ttft, duration, out):
    s = Sequence(Request(id=i, cls=cls, arrival_s=arrival, prompt_tokens=4, output_tokens=out))
    s.first_token_s = arrival + ttft
    s.finish_s = s.first_token_s + (duration if out > 1 else 0.0)  # one token: done at it
    s.generated = out
    s.token_gaps_s.extend([duration / (out - 1)] * (out - 1) if out > 1 else [])
    return s


def whole_run(seqs, slo):
    """A whole run's figures, as ``evaluate`` computes them."""
    df, summary = outputs(seqs, max(s.finish_s for s in seqs), 0, 0.0, slo)
    ratio = plan.keeps_up(df["arrival_s"].to_numpy(), df["finish_s"].to_numpy())
    return {"ls_ttft_p99_s": summary["classes"]["LS"]["ttft_s"]["p99"],
            "goodput": summary["classes"]["all"]["goodput"], "keeps_up": ratio}  # fmt: skip


def test_a_stopped_run_misses_its_targets_by_the_bound_it_names():
    """Random runs, each request's finish shown to the verdict in time order (as a simulation
    does): wherever it stops, the whole run's figure is beyond the bound it names, and the
    run misses the targets; it stops in a good share of the runs (the test would catch a
    verdict that never stops, too)."""
    rng = random.Random(7)
    stops = {"ls_ttft_p99_s": 0, "goodput": 0, "keeps_up": 0}
    for case in range(600):
        n = rng.randint(2, 80)
        times = np.sort(np.array([rng.uniform(0, 20) for _ in range(n)]))
        if case % 7 == 0:  # ties, as a trace has
            times = np.round(times)
        classes = [LS if rng.random() < 0.5 else BE for _ in range(n)]
        seqs = [finished(i, classes[i], float(times[i]), rng.expovariate(1.0),
                         rng.expovariate(0.5), rng.randint(1, 5)) for i in range(n)]  # fmt: skip
        slo = SimpleNamespace(ls_ttft_s=rng.choice([None, 0.5, 2.0]),
                              be_ttft_s=rng.choice([None, 3.0]),
                              ls_tpot_s=rng.choice([None, 0.4]), be_tpot_s=None)  # fmt: skip
        targets = plan.Targets(rng.uniform(0.2, 4.0), rng.uniform(0.5, 1.0), rng.uniform(0.5, 1.0))
        verdict = plan.Verdict(targets, slo, times, np.array([c == LS for c in classes]))
        stop = verdict.start(simpy.Environment())
        for s in sorted(seqs, key=lambda s: s.finish_s):
            verdict.finished(s)
            if stop.triggered:
                break
        if verdict.reason is None:
            continue
        key, bound = plan.parse_stopped(verdict.reason)
        stops[key] += 1
        whole = whole_run(seqs, slo)
        if key == "ls_ttft_p99_s":
            assert whole[key] > bound >= targets.ls_ttft_p99_s, (case, verdict.reason, whole)
        elif key == "goodput":
            assert whole[key] <= bound < targets.goodput, (case, verdict.reason, whole)
        else:
            assert whole[key] == bound < targets.keeps_up, (case, verdict.reason, whole)
        if whole["goodput"] is not None:  # None: ``evaluate`` refuses the run before it starts
            assert not targets.met({**whole, "stopped": ""})
        assert targets.missed_by(verdict.reason)
    assert min(stops.values()) >= 20, stops


def test_ls_p99_stops_at_the_count_that_makes_it_certain():
    """101 LS requests: numpy's linear p99 is the value of rank 99 (h = 0.99 x 100), above
    the target once 2 are late; the verdict waits for a spare third (the rounding of h)."""
    times = np.arange(101, dtype=float)
    slo = SimpleNamespace(ls_ttft_s=None, be_ttft_s=None, ls_tpot_s=None, be_tpot_s=None)
    verdict = plan.Verdict(plan.Targets(1.0, 0.0, 0.0), slo, times, np.ones(101, bool))
    stop = verdict.start(simpy.Environment())
    late = [finished(i, LS, float(i), 5.0, 0.0, 1) for i in range(3)]
    verdict.finished(late[0])
    verdict.finished(late[1])
    assert not stop.triggered
    verdict.finished(late[2])
    assert stop.triggered and verdict.reason == "ls_ttft_p99_s>1.0"
    # one more late is no more than the target plus the margin: never counted
    verdict = plan.Verdict(plan.Targets(1.0, 0.0, 0.0), slo, times, np.ones(101, bool))
    stop = verdict.start(simpy.Environment())
    for i in range(5):
        verdict.finished(finished(i, LS, float(i), 1.0 + 1e-12, 0.0, 1))
    assert not stop.triggered


def test_missed_by_reuses_a_stopped_run_only_for_targets_it_misses_too():
    strict = plan.Targets(1.0, 0.99, 0.95)
    assert strict.missed_by("ls_ttft_p99_s>1.0")
    assert not plan.Targets(2.0, 0.99, 0.95).missed_by("ls_ttft_p99_s>1.0")
    assert plan.Targets(0.5, 0.99, 0.95).missed_by("ls_ttft_p99_s>1.0")
    assert strict.missed_by("goodput<=0.98") and not plan.Targets(1.0, 0.98, 0.95).missed_by(
        "goodput<=0.98"
    )
    assert strict.missed_by("keeps_up=0.9") and not plan.Targets(1.0, 0.99, 0.9).missed_by(
        "keeps_up=0.9"
    )
    for bad in ("keeps_up<0.9", "goodput>0.5", "nonsense", "ls_ttft_p99_s>x"):
        with pytest.raises(ValueError):
            plan.parse_stopped(bad)


SEARCH = ["--replicas", "1", "2", "--policies", "iteration", "qllm", "--min-requests", "150",
          "--horizon-s", "40", "--jobs", "1", "--rel-tol", "0.1", "--rate-lo", "0.5",
          "--ls-ttft-p99-s", "1.0", "--goodput", "0.9", "--target-rate", "2",
          "workload=synthetic", "workload.output.tokens=16", "workload.prompt.tokens=64",
          "slo.ls_ttft_s=1.5"]  # fmt: skip


def read(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_search_that_stops_runs_answers_as_one_that_runs_them_all(tmp_path, capsys):
    """The same search with and without --full-runs: the same plan.csv and target.csv, every
    run judged alike; the stopped runs (there are some) keep no figures but the bound."""
    assert plan.main([*SEARCH, "--out", str(tmp_path / "stop")]) == 0
    said = capsys.readouterr().out
    assert plan.main([*SEARCH, "--full-runs", "--out", str(tmp_path / "full")]) == 0
    assert "stopped once certain" not in capsys.readouterr().out
    for name in ("plan.csv", "target.csv"):
        assert read(tmp_path / "stop" / name) == read(tmp_path / "full" / name), name
    stop, full = (read(tmp_path / d / "evaluations.csv") for d in ("stop", "full"))

    def key(r):
        return r["policy"], r["router"], r["replicas"], r["rate"], r["seed"]

    assert {key(r): r["ok"] for r in stop} == {key(r): r["ok"] for r in full}
    stopped = [r for r in stop if r["stopped"]]
    assert stopped and not any(r["stopped"] for r in full)
    assert f"{len(stopped)} of the runs made stopped once certain to miss the targets" in said
    figures = {key(r): r for r in full}
    for r in stopped:
        assert r["ok"] == "False" and r["ls_ttft_p99_s"] == r["goodput"] == ""
        name, bound = plan.parse_stopped(r["stopped"])
        whole = float(figures[key(r)][name])
        assert {"ls_ttft_p99_s": whole > bound, "goodput": whole <= bound,
                "keeps_up": whole == bound == float(r["keeps_up"])}[name], (r, whole)  # fmt: skip


def test_a_resumed_search_reruns_a_stopped_run_its_targets_cannot_judge(tmp_path, capsys):
    """Runs stopped under a strict LS target are re-run under a looser one (their bound says
    nothing of it), and the answers are those of a fresh search with the looser target."""
    out = tmp_path / "resumed"
    assert plan.main([*SEARCH, "--out", str(out)]) == 0
    ls_stops = [r for r in read(out / "evaluations.csv") if r["stopped"].startswith("ls_")]
    assert ls_stops
    loose = [*SEARCH[: SEARCH.index("--ls-ttft-p99-s")], "--ls-ttft-p99-s", "60",
             *SEARCH[SEARCH.index("--ls-ttft-p99-s") + 2 :]]  # fmt: skip
    capsys.readouterr()
    assert plan.main([*loose, "--out", str(out)]) == 0
    made = capsys.readouterr().out
    assert " 0 runs made" not in made, made
    assert plan.main([*loose, "--full-runs", "--out", str(tmp_path / "fresh")]) == 0
    for name in ("plan.csv", "target.csv"):
        assert read(out / name) == read(tmp_path / "fresh" / name), name


def test_a_stopped_run_still_refuses_a_request_no_replica_can_hold(tmp_path):
    """The whole run would fail on its last request, too large for the KV cache; a run stopped
    long before it arrives fails on it as well, instead of counting as a missed target."""
    from sim.config import UserError

    trace = tmp_path / "trace.csv"
    rows = [f"{i * 0.01},64,16" for i in range(300)] + ["100.0,64,10000000"]
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "\n".join(rows))
    task = ("qllm", "least_outstanding", 1, 20.0, 0, 301,
            ("workload=trace", f"workload.path={trace}", "workload.ls_fraction=1",
             "workload.max_output_tokens=null"))  # fmt: skip
    with pytest.raises(UserError, match="KV tokens, more than the capacity"):
        plan.evaluate(task)
    with pytest.raises(UserError, match="KV tokens, more than the capacity"):
        plan.evaluate(task, targets=plan.Targets(1e-6, 0.5, 0.5))
