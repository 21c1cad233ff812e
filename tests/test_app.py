"""qllm-sim end to end: config validation, outputs, determinism, clear errors."""

from __future__ import annotations

import json
import os
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
STATS = {"mean", "p50", "p90", "p99"}


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
    assert list(df.columns) == REQUEST_COLUMNS
    assert len(df) == 60 and df["finish_s"].notna().all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == {"classes", "throughput", "makespan_s", "arrived", "completed",
                            "executor"}  # fmt: skip
    assert set(summary["classes"]) == {"LS", "BE", "all"}
    for part in summary["classes"].values():
        assert set(part) == {"count", "ttft_s", "turnaround_s", "tbt_s", "slo_attainment"}
        assert set(part["ttft_s"]) == STATS == set(part["turnaround_s"]) == set(part["tbt_s"])
    assert set(summary["throughput"]) == {"jobs_per_s", "tokens_per_s"}
    assert set(summary["executor"]) == {"events", "wall_s"}
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


def test_bad_enum_is_rejected_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="workload.arrival=sometimes") as info:
        cfg("workload.arrival=sometimes")
    cause = info.value.__cause__
    assert isinstance(cause, ValidationError)
    assert "expected one of [poisson, gamma, trace]" in str(cause)
