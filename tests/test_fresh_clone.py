"""What a fresh clone anywhere needs: the reference data ships inside the repository with its
licences, nothing reads a path outside the clone (a `../shared` that exists only on the
development machine), and no command's default output overwrites a tracked file."""

from __future__ import annotations

import re
import subprocess
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
SOURCES = ("policies", "sim", "profiler", "realrun", "conf", "tests", "benchmarks", "notebooks")


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
    pattern = re.compile(r"\.\./shared|shared/data")
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
