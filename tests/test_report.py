"""Sweeps, qllm-report, the paper comparison, resume, notebooks and launcher configs."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from nbclient import NotebookClient

from sim import reproduce
from sim.app import CONF_DIR
from sim.report import CLASSES, FIGURES, cli, load_sweep
from sim.reproduce import compare, slo_max_rate

ROOT = Path(__file__).resolve().parents[1]
POLICIES, RATES, SEEDS = ("iteration", "qllm"), (2.0, 4.0), (0, 1)


def qllm_sim(*args):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=180)  # fmt: skip


def sweep_args(sweep_dir: Path) -> list[str]:
    return ["-m", f"policy={','.join(POLICIES)}", f"workload.rate={','.join(map(str, RATES))}",
            f"seed={','.join(map(str, SEEDS))}", "workload.num_requests=24",
            "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A tiny multirun, run in parallel by the joblib launcher: 2 policies x 2 rates x 2 seeds."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    r = qllm_sim(*sweep_args(sweep_dir))
    assert r.returncode == 0, r.stderr
    return sweep_dir


@pytest.fixture(scope="module")
def paper_results(tmp_path_factory) -> Path:
    """sim.reproduce on a tiny grid (two experiments, two rates, one seed, 30 jobs)."""
    out = tmp_path_factory.mktemp("paper")
    code = reproduce.main(["--out", str(out), "--rates", "1", "4", "--seeds", "0",
                           "--num-requests", "30", "--experiments", "paper", "uncapped",
                           "--jobs", "1"])  # fmt: skip
    assert code == 0
    return out


def test_sweep_runs_every_combination(sweep):
    assert len(list(sweep.glob("*/summary.json"))) == len(POLICIES) * len(RATES) * len(SEEDS)


def test_report_writes_a_tidy_table_and_the_figures(sweep, tmp_path, capsys):
    cli([str(sweep), "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "table.csv")
    assert len(table) == len(POLICIES) * len(RATES) * len(SEEDS) * len(CLASSES)
    keys = set(zip(table.policy, table.rate, table.seed, table.cls, strict=True))
    assert keys == set(itertools.product(POLICIES, RATES, SEEDS, CLASSES))
    for column in ("ttft_mean_s", "ttft_p99_s", "turnaround_mean_s", "slo_attainment",
                   "ttft_max_s", "jobs_per_s", "tokens_per_s", "count"):  # fmt: skip
        assert table[column].notna().all(), column
    # the row of one run and class carries that run's summary.json figures
    row = table[(table.policy == "qllm") & (table.rate == 4.0) & (table.seed == 1)
                & (table.cls == "LS")].iloc[0]  # fmt: skip
    summary = json.loads((sweep / row.run_dir / "summary.json").read_text())
    assert row.ttft_mean_s == pytest.approx(summary["classes"]["LS"]["ttft_s"]["mean"])
    assert row.jobs_per_s == pytest.approx(summary["throughput"]["jobs_per_s"])
    requests = pd.read_parquet(sweep / row.run_dir / "requests.parquet")
    assert row.ttft_max_s == pytest.approx(requests.loc[requests.cls == "LS", "ttft_s"].max())
    for name in FIGURES.values():
        assert (tmp_path / name).stat().st_size > 10_000, name
    assert "qllm" in capsys.readouterr().out


def test_report_leaves_out_runs_without_a_summary(sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    crashed = next(copy.glob("policy=qllm*"))
    (crashed / "summary.json").unlink()
    table, requests = load_sweep(copy)
    assert table["run_dir"].nunique() == len(POLICIES) * len(RATES) * len(SEEDS) - 1
    assert crashed.name not in set(table["run_dir"]) | set(requests["run_dir"])


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_report_on_a_missing_or_empty_dir_is_one_line(tmp_path, capsys, make):
    with pytest.raises(SystemExit) as exit_:
        cli([str(make(tmp_path))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qllm-report: error: ")


def test_rerun_of_an_interrupted_sweep_runs_only_the_unfinished_run(sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    before = {p.parent.name: p.stat().st_mtime_ns for p in copy.glob("*/summary.json")}
    lost = sorted(before)[3]
    (copy / lost / "summary.json").unlink()
    r = qllm_sim(*sweep_args(copy))
    assert r.returncode == 0, r.stderr
    after = {p.parent.name: p.stat().st_mtime_ns for p in copy.glob("*/summary.json")}
    assert set(after) == set(before)
    assert [name for name in after if after[name] != before[name]] == [lost]
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("skipping finished run")]
    assert len(skipped) == len(before) - 1 and not any(ln.endswith(lost) for ln in skipped)


def _table(ttft: dict, *, ls_turn=None, be_turn=None, jobs=None, attain=None) -> pd.DataFrame:
    """A hand-made tidy table: per policy, one value per rate (the same for both seeds)."""
    rows = []
    for policy, values in ttft.items():
        for i, (rate, value) in enumerate(values.items()):
            for seed in (0, 1):
                common = {"experiment": "paper", "policy": policy, "rate": rate, "seed": seed}
                rows.append(
                    {
                        **common,
                        "cls": "LS",
                        "ttft_mean_s": value,
                        "turnaround_mean_s": (ls_turn or ttft)[policy][rate],
                        "slo_attainment": (attain or {}).get(policy, [1.0] * 9)[i],
                    }
                )
                rows.append(
                    {
                        **common,
                        "cls": "BE",
                        "ttft_mean_s": 1.0,
                        "turnaround_mean_s": (be_turn or ttft)[policy][rate],
                    }
                )
                rows.append({**common, "cls": "all", "jobs_per_s": (jobs or {}).get(
                    policy, {}).get(rate, 1.0)})  # fmt: skip
    return pd.DataFrame(rows)


def test_comparison_keys_on_a_hand_made_table():
    ttft = {"iteration": {1.0: 6.0, 2.0: 8.0, 3.0: 10.0}, "qllm": {1.0: 0.1, 2.0: 0.2, 3.0: 4.0}}
    ls_turn = {"iteration": {1.0: 20, 2.0: 30, 3.0: 40}, "qllm": {1.0: 10, 2.0: 10, 3.0: 20}}
    be_turn = {"iteration": {1.0: 10, 2.0: 10, 3.0: 10}, "qllm": {1.0: 12, 2.0: 15, 3.0: 30}}
    jobs = {"iteration": {1.0: 1.0, 2.0: 2.0, 3.0: 2.0}, "qllm": {1.0: 1.0, 2.0: 2.0, 3.0: 2.2}}
    c = compare(_table(ttft, ls_turn=ls_turn, be_turn=be_turn, jobs=jobs,
                       attain={"qllm": [1.0, 0.85, 0.9], "iteration": [0.0] * 3}))  # fmt: skip
    assert c["ls_ttft_reduction_avg"] == pytest.approx((60 + 40 + 2.5) / 3)
    assert c["ls_ttft_reduction_max"] == pytest.approx(60)
    assert c["slo_max_rate_qllm"] == 2.0  # 4 s at rate 3 misses the 3 s SLO
    assert c["slo_max_rate_baseline"] is None  # missed at every rate
    assert c["slo_max_rate_qllm_attainment90"] == 1.0  # 85% at rate 2 breaks the run
    assert c["ls_turnaround_reduction_max"] == pytest.approx(3.0)
    assert c["be_turnaround_ratio_avg"] == pytest.approx((1.2 + 1.5 + 3.0) / 3)
    assert c["be_turnaround_ratio_max"] == pytest.approx(3.0)
    assert c["throughput_ratio_avg"] == pytest.approx((1 + 1 + 1.1) / 3)
    assert set(c["per_rate"]) == {"1", "2", "3"}


def test_slo_max_rate_is_the_end_of_the_first_run_of_met_rates():
    assert slo_max_rate(pd.Series({1.0: True, 2.0: False, 3.0: True})) == 1.0
    assert slo_max_rate(pd.Series({3.0: True, 1.0: True, 2.0: True})) == 3.0
    assert slo_max_rate(pd.Series({1.0: False, 2.0: True})) is None


def test_reproduce_writes_the_paper_directory(paper_results):
    c = json.loads((paper_results / "comparison.json").read_text())
    for key in reproduce.PAPER:
        assert key in c
    assert c["ls_ttft_reduction_avg"] > 1 and "uncapped" in c["sensitivity"]
    table = pd.read_csv(paper_results / "table.csv")
    assert set(table["experiment"]) == {"paper", "uncapped"}
    assert set(table.loc[table.experiment == "paper", "policy"]) == set(reproduce.GRANULARITIES)
    # the README reports this run's figure, recomputed here from table.csv (one seed)
    ls = table[(table.experiment == "paper") & (table.cls == "LS")]
    ttft = ls.pivot(index="rate", columns="policy", values="ttft_mean_s")
    measured = (ttft["iteration"] / ttft["qllm"]).mean()
    assert c["ls_ttft_reduction_avg"] == pytest.approx(measured)
    readme = (paper_results / "README.md").read_text()
    row = next(line for line in readme.splitlines()
               if line.startswith("| LS TTFT reduction, average over rates |"))  # fmt: skip
    assert row.split("|")[3].strip() == reproduce.fmt_x(measured)
    for name in [*FIGURES.values(), "granularity.png", "sensitivity.png"]:
        assert (paper_results / name).is_file(), name


@pytest.mark.parametrize("name, results", [("slo_curves", "sweep"),
                                           ("paper_reproduction", "paper_results")])  # fmt: skip
def test_notebook_executes(name, results, request, monkeypatch):
    monkeypatch.setenv("QLLM_RESULTS", str(request.getfixturevalue(results)))
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    # the python3 kernel that ipykernel provides runs in this interpreter: no kernelspec to install
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()  # fmt: skip
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert any(o.output_type == "display_data" for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("launcher, target, key", [
    ("joblib", "JoblibLauncher", "n_jobs"),
    ("slurm", "SlurmLauncher", "timeout_min"),
])  # fmt: skip
def test_launcher_config_composes_with_the_app(launcher, target, key):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"],
                      return_hydra_config=True)  # fmt: skip
    assert cfg.hydra.launcher._target_.endswith(target)
    assert key in cfg.hydra.launcher
    assert cfg.policy.name == "qllm"  # the app's own config is untouched


def test_ray_launcher_config_composes_when_the_plugin_is_installed():
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=ray_cluster"],
                      return_hydra_config=True)  # fmt: skip
    assert cfg.hydra.launcher._target_.endswith("RayLauncher")
