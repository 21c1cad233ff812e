"""gpu/modes.py, the diagnostic the GPU check runs before its validation (QLLM_CHECK_STEPS with
``modes``): on the CPU, with tiny-mixtral, what it writes is what its phases timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform != "linux", reason="page faults via resource, /proc/stat")
def test_each_phase_times_its_steps_with_their_faults_and_the_cpu_probe(tmp_path):
    out = tmp_path / "modes.json"
    done = subprocess.run([sys.executable, "-m", "gpu.modes", "--steps", "6", "--grow", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert [p["phase"] for p in phases] == ["rewound", "growing", "growing-retained"]
    every_ms = []
    for p in phases:
        ms, faults, cpu = p["series_ms"], p["series_faults"], p["series_cpu_probe_ms"]
        assert len(ms) == len(faults) == len(cpu) == 6
        assert all(isinstance(f, int) and f >= 0 for f in faults)
        assert all(x > 0 for x in ms) and all(x > 0 for x in cpu)
        assert p["p10_ms"] <= p["median_ms"] <= p["p90_ms"]
        assert p["faults_mean"] == pytest.approx(sum(faults) / 6)
        every_ms += ms
    # "slow" is against the p10 of every phase's steps together
    fast = result["fast_p10_ms"]
    assert min(every_ms) <= fast <= max(every_ms)
    for p in phases:
        assert p["slow_share"] == pytest.approx(sum(x > 1.25 * fast for x in p["series_ms"]) / 6)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_every_runner_keeps_freed_memory_unless_told_not_to():
    """By default (on every device since the H200's runs page-faulted 70-318 times an
    iteration, results/gpu/h200/run3; only the CPU's is tested here); retain_memory=False is
    gpu/modes.py's, which times the default allocator first."""
    from profiler.models import build_model
    from profiler.ops import ModelRunner

    model = build_model("tiny-mixtral")[0]
    assert ModelRunner(model).retains_memory
    assert not ModelRunner(model, retain_memory=False).retains_memory
