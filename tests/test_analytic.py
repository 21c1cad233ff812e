"""The analytic roofline model, its A100 calibration and the built-in profiles it generates."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from policies.core import Batch, Phase, Request, Sequence
from profiler import analytic
from profiler.schema import Profile
from sim.latency import LatencyModel, RoutingModel

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "data" / "a100-measured" / "llama3-8b-shape-mlp.csv"  # shipped in the repository
BUILTIN = ROOT / "sim" / "profiles"
NAMES = ("a100-mixtral-fp16", "h100-mixtral-bf16", "h200-mixtral-bf16", "a100-mixtral-nf4-hf")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "profiler.analytic", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def decode_batch(size: int, context: int = 300) -> Batch:
    seqs = [Sequence(Request(i, "LS", 0.0, context, 100), generated=1) for i in range(size)]
    return Batch(seqs, Phase.DECODE)


def load(name: str) -> Profile:
    return Profile.load(BUILTIN / name)


def mean_decode_s(profile: Profile, size: int, plans: int = 50) -> float:
    m = profile.model
    lm = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=7))
    batch = decode_batch(size)
    return float(np.mean([lm.plan(batch).total_s for _ in range(plans)]))


# ------------------------------------------------------------------------ A100 calibration
def test_check_expert_within_10_percent_of_measured_a100():
    r = run_cli("--check", str(CSV))
    assert r.returncode == 0, r.stderr
    # without a file, --check reads the shipped measurements (the README's command)
    assert run_cli("--check").stdout == r.stdout
    lines = r.stdout.strip().splitlines()
    ops = {re.match(r"op=(\S+)", line).group(1): line for line in lines[:-1]}
    assert set(ops) == {"expert", "attn_pre_proj", "attn_post_proj"}
    expert = float(re.search(r"max_error_pct=([\d.]+)", ops["expert"]).group(1))
    assert expert <= 10.0, ops["expert"]
    assert re.fullmatch(r"max_error_pct=[\d.]+", lines[-1])
    worst = float(lines[-1].split("=")[1])
    assert worst >= expert


def test_check_missing_csv_exits_2_with_one_line(tmp_path):
    r = run_cli("--check", str(tmp_path / "nope.csv"))
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "nope.csv" in r.stderr


def test_check_malformed_csv_exits_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("num_tokens,foo\n1,2\n")
    r = run_cli("--check", str(bad))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "missing columns" in r.stderr


# ---------------------------------------------------------------------- built-in profiles
def test_builtin_profiles_equal_what_write_produces_now(tmp_path):
    r = run_cli("--write", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in NAMES:
        assert Profile.load(BUILTIN / name).name == name
        fresh = Profile.load(tmp_path / name)
        assert fresh.source == ("calibrated" if "nf4" in name else "analytic")
        for f in ("ops.csv", "profile.json"):
            committed = (BUILTIN / name / f).read_text()
            assert committed == (tmp_path / name / f).read_text(), (
                f"sim/profiles/{name}/{f} is stale: run `python -m profiler.analytic --write`"
            )
        assert (BUILTIN / name / "ops.csv").stat().st_size < 16_000


def test_module_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import profiler.analytic"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------- the paper's A100 setting
def test_nf4_decode_iteration_within_paper_range_and_increasing():
    """Every planned decode iteration at batch 1..32 (context 300) takes 300-400 ms, and the
    mean over 200 plans grows with the batch (the same routing seed for every batch size, so
    the means differ by the batch, not by the draws)."""
    profile = load("a100-mixtral-nf4-hf")
    m = profile.model
    means = []
    for size in range(1, 33):
        lm = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=3))
        batch = decode_batch(size)
        times = [lm.plan(batch).total_s for _ in range(200)]
        assert 0.30 <= min(times) and max(times) <= 0.40, (size, min(times), max(times))
        means.append(np.mean(times))
    assert np.all(np.diff(means) > 0), np.round(means, 4)
    assert means[0] < 0.32 and means[-1] > 0.38


def test_nf4_prefill_grows_with_tokens():
    profile = load("a100-mixtral-nf4-hf")
    lm = LatencyModel(profile)
    times = []
    for n in (16, 128, 1024, 4096):
        batch = Batch([Sequence(Request(0, "LS", 0.0, n, 10))], Phase.PREFILL)
        times.append(np.mean([lm.plan(batch).total_s for _ in range(5)]))
    assert np.all(np.diff(times) > 0)
    assert 0.45 <= times[2] <= 1.5


def test_nf4_memory_from_the_paper():
    mem = load("a100-mixtral-nf4-hf").memory
    assert mem.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert mem.kv_capacity_tokens == int((80e9 * 0.9 - 22.9e9) // mem.kv_bytes_per_token)


# -------------------------------------------------------------------------- roofline sanity
def test_expert_at_one_token_is_memory_bound():
    hw, m = analytic.A100, analytic.MIXTRAL_8X7B
    lm = analytic.LayerModel(m, hw)
    weights = 3 * m.hidden_size * m.intermediate_size * analytic.FP16_BYTES
    ideal = weights / (hw.mem_bw * hw.gemm.memory)
    assert ideal <= float(lm.expert_ffn(1)) <= 1.1 * ideal
    assert 0.2e-3 < float(lm.expert_ffn(1)) < 0.3e-3  # 352 MB at ~1.5 TB/s
    flops = 2 * 4096 * weights / analytic.FP16_BYTES
    compute = flops / (hw.peak_flops * hw.gemm.compute)
    assert compute <= float(lm.expert_ffn(4096)) <= 1.15 * compute  # compute bound


def test_newer_gpus_decode_faster():
    a100, h100, h200 = (mean_decode_s(load(n), 16, plans=10) for n in NAMES[:3])
    assert h200 < h100 < a100
    kv = [load(n).memory.kv_capacity_tokens for n in NAMES[:3]]
    assert kv[0] == kv[1] == analytic.MIN_KV_TOKENS < kv[2]  # 93 GB of fp16 weights
