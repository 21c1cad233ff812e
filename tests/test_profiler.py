"""qllm-profile: every tiny model profiles on the CPU, the console script writes a loadable
profile, user errors are one line, the full Mixtral shape is refused without the memory."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from profiler import app, models
from profiler.measure import run
from profiler.models import PRESETS, ModelError, build_model
from profiler.ops import ModelRunner
from profiler.schema import OPS, OPTIONAL_OPS, Profile

TINY = sorted(name for name in PRESETS if name.startswith("tiny-"))
# A very small grid: two prefill shapes, two decode shapes, one run each.
SMALL = [
    "grid.prefill_tokens=[4,16]",
    "grid.decode_batch=[1,3]",
    "grid.decode_kv=[8]",
    "grid.expert_tokens=[1,4,16]",
    "warmup=0",
    "repeats=1",
    "routing.prompts=2",
    "routing.prompt_tokens=8",
    "progress=false",
]  # fmt: skip


def profile_in_process(tmp_path: Path, *overrides: str) -> tuple[Profile, Path]:
    cfg = app.compose_config([*SMALL, f"output.dir={tmp_path}", *overrides])
    return run(cfg, progress=False)


@pytest.mark.parametrize("model", TINY)
def test_every_tiny_model_profiles_on_the_cpu(tmp_path, model):
    profile, directory = profile_in_process(tmp_path, f"model={model}", "device=cpu")
    assert directory == tmp_path / f"{model}-cpu"
    loaded = Profile.load(directory)
    assert {p.op for p in loaded.points} == set(OPS) - OPTIONAL_OPS
    assert loaded.model == profile.model and loaded.model.name == model
    assert loaded.dtype == "float32" and loaded.torch_version == torch.__version__
    assert all(p.median_ms > 0 for p in loaded.points if p.op != "step_overhead")
    assert len(loaded.expert_load) == loaded.model.num_layers
    for row in loaded.expert_load:
        assert len(row) == loaded.model.num_experts
        assert math.isclose(sum(row), 1.0, rel_tol=1e-9)
    assert loaded.memory.kv_bytes_per_token > 0


def test_console_script_writes_a_loadable_profile(tmp_path):
    script = Path(sys.executable).parent / "qllm-profile"
    if not script.exists():
        pytest.skip("qllm-profile is not installed in this venv: run `make venv`")
    # warm-up and repeats here: the profile must be sane enough to drive the simulator
    grid = [o for o in SMALL if not o.startswith(("warmup=", "repeats="))] + [
        "warmup=2",
        "repeats=5",
    ]
    done = subprocess.run(
        [str(script), *grid, f"output.dir={tmp_path}", "output.name=cli", "device=cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "profile cli:" in done.stdout
    profile = Profile.load(tmp_path / "cli")
    assert profile.source == "measured" and profile.model.name == "tiny-mixtral"
    # the measured profile drives the simulator
    run_dir = tmp_path / "sim"
    sim = subprocess.run(
        [sys.executable, "-m", "sim", f"profile.path={tmp_path / 'cli'}", "workload=synthetic",
         "workload.num_requests=20", "workload.rate=50", "policy=qllm",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] == 20
    # tiny-mixtral iterations take milliseconds, not the A100 profile's hundreds
    assert summary["makespan_s"] < 20


def user_error(capsys, monkeypatch, *argv: str) -> str:
    """Run the app in-process; returns its one-line error after checking the exit code."""
    monkeypatch.setattr(sys, "argv", ["qllm-profile", *SMALL, *argv])
    with pytest.raises(SystemExit) as exit_info:
        app.cli()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("qllm-profile: error: ")
    return err


def test_user_errors_are_one_line(capsys, monkeypatch, tmp_path):
    out = f"output.dir={tmp_path}"
    assert "unknown model" in user_error(capsys, monkeypatch, "model=tiny-gpt", out)
    assert "not a directory" in user_error(capsys, monkeypatch, "model.path=/no/such/dir", out)
    assert "grid.decode_batch" in user_error(capsys, monkeypatch, "grid.decode_batch=[0]", out)
    assert "dtype" in user_error(capsys, monkeypatch, "dtype=float8", out)
    if not torch.cuda.is_available():
        assert "CUDA" in user_error(capsys, monkeypatch, "device=cuda", out)
    assert not any(tmp_path.iterdir())


def test_full_mixtral_is_refused_without_the_memory(monkeypatch):
    # The free-memory figure is set, so the test means the same on any machine, a big GPU too.
    # Mixtral-8x7B: 46.7e9 parameters x 2 bytes (bf16) x 1.15 margin = 100 GiB.
    free = {"bytes": 40 * 2**30}
    monkeypatch.setattr(models, "available_bytes", lambda device: free["bytes"])
    with pytest.raises(ModelError, match=r"needs about 100 GiB on cpu .*only 40 GiB free"):
        build_model("mixtral-8x7b", device="cpu", dtype="bfloat16")
    free["bytes"] = 101 * 2**30  # enough: checked without building (that would take 100 GiB)
    mixtral = getattr(transformers, models.PRESETS["mixtral-8x7b"][0])(
        **models.PRESETS["mixtral-8x7b"][1]
    )
    models._check_memory("mixtral-8x7b", mixtral, torch.device("cpu"), torch.bfloat16)
    free["bytes"] = 99 * 2**30
    with pytest.raises(ModelError, match="only 99 GiB free"):
        models._check_memory("mixtral-8x7b", mixtral, torch.device("cpu"), torch.bfloat16)


def test_a_local_checkpoint_loads_offline(tmp_path):
    model, _ = build_model({"name": "tiny-qwen3-moe", "config": {"num_hidden_layers": 2}})
    model.save_pretrained(tmp_path / "ckpt")
    loaded, info = build_model({"name": "tiny-mixtral", "path": str(tmp_path / "ckpt")})
    assert info.source == str(tmp_path / "ckpt") and info.name == "ckpt"
    assert info.shape.num_layers == 2 and info.shape.head_dim == 32
    prompt = [[5, 7, 11, 13]]
    assert ModelRunner(loaded).generate(prompt, 3) == ModelRunner(model).generate(prompt, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiler_runs_on_cuda(tmp_path):
    profile, directory = profile_in_process(tmp_path, "device=cuda")
    loaded = Profile.load(directory)
    assert {p.op for p in loaded.points} == set(OPS) - OPTIONAL_OPS
    assert loaded.dtype == "bfloat16" and loaded.extra["device_type"] == "cuda"
    shutil.rmtree(directory)
