"""gpu/faults.py, the GPU check's diagnostic of the real engine's page faults (QLLM_CHECK_STEPS
with ``faults``): on the CPU with tiny-mixtral, each fault is charged once, each variant runs
under its own environment, and the validation's variant is chosen as its rule says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.faults import choose

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform != "linux", reason="RUSAGE_THREAD, /proc/self")
def test_each_variant_charges_its_segments_faults_to_stages_under_its_own_env(tmp_path):
    out = tmp_path / "faults.json"
    done = subprocess.run([sys.executable, "-m", "gpu.faults", "--json", str(out), "--env", "",
                           "--env", "PYTHONMALLOC=malloc", "threads=1", "workload.num_requests=4",
                           "workload.prompt.tokens=16", "workload.prompt.max=32",
                           "workload.output.tokens=4", "workload.output.max=6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    default, malloc = json.loads(out.read_text())["variants"]
    assert default["env"] == {} and malloc["env"] == {"PYTHONMALLOC": "malloc"}
    for result in (default, malloc):
        segs = result["segments"]
        assert segs and result["retains_memory"]
        # every stage's faults are some segment's: the two ledgers agree to the fault
        assert sum(s["stage_faults"] for s in segs) == sum(
            st["faults"] for st in result["stages"].values()
        )
        assert {"prepare", "attention", "router", "expert", "lm_head"} <= set(result["stages"])
        for s in segs:  # a segment's faults include those of its stages
            assert 0 <= s["stage_faults"] <= s["faults"] and s["ms"] > 0 and s["rss_kib"] > 0
        assert result["summary"]["segments"] == len(segs)
    # the variant's variable reached its process: CPython's own arenas are bypassed there
    assert default["segments"][0]["arenas_total"] > 0
    assert all(s["arenas_total"] is None for s in malloc["segments"])
    assert done.stdout.count("env=") == 2


def test_an_argument_that_is_no_override_is_refused():
    done = subprocess.run([sys.executable, "-m", "gpu.faults", "workload"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "not a qllm-realrun override: workload" in done.stderr


def variant(env: dict, faults: float) -> dict:
    return {"env": env, "summary": {"faults_per_segment": faults}}


def test_the_validation_runs_under_the_variant_that_removed_most_of_the_faults():
    default = variant({}, 200.0)
    fix = variant({"PYTHONMALLOC": "malloc"}, 3.0)
    other = variant({"MALLOC_ARENA_MAX": "1"}, 180.0)
    assert choose([default, other, fix]) is fix
    assert choose([default, other]) is None  # 180 of 200: not a quarter
    assert choose([variant({}, 10.0), fix]) is None  # the default hardly faulted
    assert choose([default]) is None
    # a variant only this script understands is not one the validation can run as
    assert choose([default, variant({"GPU_FAULTS_CUDNN_SDPA": "1"}, 3.0)]) is None


def test_a_cuda_runner_turns_cudnn_attention_off_and_a_cpu_one_leaves_it():
    """The setting is process-wide and a CPU build of torch holds it too, so the choice is
    testable here (whether the H200's faults go with it was measured there: run 6)."""
    import torch

    from profiler.ops import no_per_shape_attention_plans

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert not no_per_shape_attention_plans(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert no_per_shape_attention_plans(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not no_per_shape_attention_plans(torch.device("cuda"))  # already off
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_every_runner_asks_for_no_per_shape_attention_plans_on_its_own_device(monkeypatch):
    """The wiring: a ``ModelRunner`` passes its device to the switch when it is built (the
    switch acts on CUDA only, above; here the CPU's device reaches it)."""
    import profiler.ops as ops
    from profiler.models import build_model

    seen = []
    monkeypatch.setattr(ops, "no_per_shape_attention_plans", lambda device: seen.append(device))
    runner = ops.ModelRunner(build_model("tiny-mixtral")[0])
    assert seen == [runner.device]
