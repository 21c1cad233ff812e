"""What a fresh clone anywhere needs: the reference data ships inside the repository with its
licences, nothing reads a path outside the clone (a sibling `shared` folder that exists only on the
development machine), and no command's default output overwrites a tracked file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import realrun.app  # noqa: F401  (registers the realrun schema with Hydra)
import realrun.validate  # noqa: F401  (registers the validate schema)
from sim.app import CONF_DIR
from sim.config import Arrival, WorkloadConfig, WorkloadKind
from sim.workloads import build_workload

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
MAX_FILE_BYTES = 2 * 2**20  # keeps a clone small; a larger file would be gzipped or subset
# Where the project's own text lives; .venv, results and caches are not the project's.
SOURCES = (
    "policies",
    "sim",
    "profiler",
    "realrun",
    "conf",
    "tests",
    "benchmarks",
    "notebooks",
    "docs",
)


def test_every_data_file_is_small_and_has_its_licence_beside_it():
    files = list(DATA.rglob("*.csv"))
    assert {p.relative_to(DATA).as_posix() for p in files} == {
        "a100-measured/llama3-8b-shape-mlp.csv",
        "traces/splitwise_code.csv",
        "traces/splitwise_conv.csv",
    }
    readme = (DATA / "README.md").read_text()
    for path in files:
        assert path.stat().st_size < MAX_FILE_BYTES, path
        assert any(path.parent.glob("LICENSE-*")), f"no licence beside {path}"
        assert path.name in readme, f"data/README.md does not describe {path.name}"
    assert "CC-BY-4.0" in readme and "Splitwise" in readme  # the traces' attribution


def test_both_azure_traces_load_whole():
    for name, rows in (("splitwise_code", 8_819), ("splitwise_conv", 19_366)):
        path = str(DATA / "traces" / f"{name}.csv")
        config = WorkloadConfig(kind=WorkloadKind.trace, arrival=Arrival.trace, rate=None,
                                num_requests=rows, path=path)  # fmt: skip
        requests = build_workload(config, seed=0)
        assert len(requests) == rows
        # the full hour, not a subset repeated (a short trace is cycled to num_requests)
        assert 3000 < requests[-1].arrival_s < 3700
        assert len({r.arrival_s for r in requests}) > 0.99 * rows
        assert np.mean([r.prompt_tokens for r in requests]) > 100


def test_nothing_reads_outside_the_clone():
    # built from parts, so that this file does not itself hold the pattern it looks for
    outside = "shared"
    pattern = re.compile(r"\.\./" + outside + "|" + outside + "/data")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in [*SOURCES, "README.md", "Makefile", "pyproject.toml"]
        for path in ([ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*"))
        if path.is_file() and path.suffix in {"", ".py", ".md", ".yaml", ".ipynb", ".toml"}
        and path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]  # fmt: skip
    assert not offenders


def tracked(path: str) -> list[str]:
    done = subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout.split()


def default_output(config: str, key: str) -> str:
    """Where a command writes by default: its config's key, up to the first interpolation
    (a date or time, different on every run)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config, return_hydra_config=True)
    value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    if value is None:  # an interpolation only Hydra's runtime resolves: read it raw
        value = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            value = value[part]
    return str(value).split("${")[0]


@pytest.mark.parametrize("config, key", [
    ("validate", "out_dir"),  # qllm-validate (`make validate` writes the curated folder)
    ("profiler", "output.dir"),  # qllm-profile
    ("config", "hydra.run.dir"),  # qllm-sim
    ("config", "hydra.sweep.dir"),  # qllm-sim -m
    ("realrun", "hydra.run.dir"),  # qllm-realrun
    ("realrun", "hydra.sweep.dir"),  # qllm-realrun -m
])  # fmt: skip
def test_default_outputs_overwrite_no_tracked_file(config, key):
    out = default_output(config, key)
    assert out.startswith("results/") and out.rstrip("/") != "results", out
    assert tracked(out) == [], f"{config}.yaml {key}={out} holds tracked files"


def test_curated_results_are_tracked():
    # the check above means something only if git sees the curated folders
    assert tracked("results/validation") and tracked("results/paper")


def test_in_ci_a_skip_fails_unless_the_test_needs_a_gpu(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_runs(): pass\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_on_gpu(): pass\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_known_bug(): assert False\n"
        "@pytest.mark.skipif(True, reason='data not found')\n"
        "def test_needs_data(): pass\n"
        "def test_needs_plugin(): pytest.importorskip('no_such_plugin')\n"
    )
    (tmp_path / "test_module_skip.py").write_text(
        "import pytest\npytest.importorskip('no_such_plugin')\ndef test_x(): pass\n"
    )

    def pytest_run(ci: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CI": ci}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
             "--continue-on-collection-errors", "--rootdir", str(tmp_path),
             "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    ci = pytest_run("true")
    assert ci.returncode == 1, ci.stdout
    failed = {line.split()[1].split("::")[-1] for line in ci.stdout.splitlines()
              if line.startswith(("FAILED", "ERROR"))}  # fmt: skip
    assert failed == {"test_needs_data", "test_needs_plugin", "test_module_skip.py"}, ci.stdout
    assert "only tests marked gpu may skip" in ci.stdout
    assert "1 passed" in ci.stdout and "1 skipped" in ci.stdout and "1 xfailed" in ci.stdout
    local = pytest_run("")  # outside CI a skip stays a skip
    assert local.returncode == 0, local.stdout
