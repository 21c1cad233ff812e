"""qllm-profile: every tiny model profiles on the CPU, the console script writes a loadable
profile, user errors are one line, the full Mixtral shape is refused without the memory."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import linear_profile

from policies.core import BE, Batch, Phase, Request, Sequence
from profiler import app, measure, models
from profiler.measure import Profiler, Settings, StageClock, run
from profiler.models import PRESETS, ModelError, build_model
from profiler.ops import ModelRunner
from profiler.schema import OPS, OPTIONAL_OPS, OpPoint, Profile, spread
from realrun.run import warm_up
from sim import profiles
from sim.latency import LatencyModel

TINY = sorted(name for name in PRESETS if name.startswith("tiny-"))
# A very small grid: two prefill shapes, two decode shapes, one run each.
SMALL = [
    "grid.prefill_tokens=[4,16]",
    "grid.decode_batch=[1,3]",
    "grid.decode_kv=[8]",
    "grid.expert_tokens=[1,4,16]",
    "grid.chunk_kv=[8]",
    "grid.prefill_batch_tokens=[16,32]",  # 16-token prompts: 2 of them (16: the plain prefill)
    "warmup=0",
    "decode_warmup=0",
    "repeats=1",
    "routing.prompts=2",
    "routing.prompt_tokens=8",
    "wake.idle_ms=[]",
    "progress=false",
]  # fmt: skip


def profile_in_process(tmp_path: Path, *overrides: str) -> tuple[Profile, Path]:
    cfg = app.compose_config([*SMALL, f"output.dir={tmp_path}", *overrides])
    return run(cfg, progress=False)


# The ops a default profile has, on any device (the CUDA test's list, apart from this one, had
# fallen two changes behind the profiler, unseen without a GPU)
PROFILED_OPS = set(OPS) - OPTIONAL_OPS | {
    "attn_chunk",
    "attn_decode_bind",
    "attn_prefill_outer",
    "attn_prefill_first",
    "attn_prefill_next",
    "prepare_decode",
    "prepare_prefill",
    "lm_head_prefill",
}


@pytest.mark.parametrize("model", TINY)
def test_every_tiny_model_profiles_on_the_cpu(tmp_path, model):
    profile, directory = profile_in_process(tmp_path, f"model={model}", "device=cpu")
    assert directory == tmp_path / f"{model}-cpu"
    loaded = Profile.load(directory)
    assert {p.op for p in loaded.points} == PROFILED_OPS
    assert loaded.model == profile.model and loaded.model.name == model
    assert loaded.dtype == "float32" and loaded.torch_version == torch.__version__
    assert all(p.median_ms > 0 for p in loaded.points if p.op != "step_overhead")
    assert len(loaded.expert_load) == loaded.model.num_layers
    for row in loaded.expert_load:
        assert len(row) == loaded.model.num_experts
        assert math.isclose(sum(row), 1.0, rel_tol=1e-9)
    assert loaded.memory.kv_bytes_per_token > 0
    # the self-check: the latency model against every timed prefill and decode shape
    check = loaded.extra["self_check"]
    shapes = {(r["phase"], r["batch_size"], r["tokens"], r["kv_tokens"]) for r in check["shapes"]}
    # (2 prompts of 8: the batch's prompt count at the longest prompt's 16 tokens)
    assert shapes == {("prefill", 1, 4, 0), ("prefill", 1, 16, 0), ("prefill", 2, 8, 0),
                      ("prefill", 2, 16, 0), ("prefill", 2, 32, 0), ("decode", 1, 1, 8),
                      ("decode", 3, 3, 8)}  # fmt: skip
    # the batched prefill and the pair of 16: the router at their 32 tokens; their attention
    # stage split: the part outside the calls over all 32 tokens, the first prompt's call and
    # the second's
    assert 32 in {p.num_tokens for p in loaded.op_points("router")}
    assert 32 not in {p.num_tokens for p in loaded.op_points("attn_prefill")}
    # the once-per-iteration stages by prompt count (0: one prompt)
    for op in ("attn_prefill_outer", "prepare_prefill", "lm_head_prefill"):
        assert {p.key() for p in loaded.op_points(op)} == {(0, 4), (0, 16), (2, 8), (2, 16),
                                                           (2, 32)}  # fmt: skip
    assert {p.num_tokens for p in loaded.op_points("attn_prefill_first")} == {4, 8, 16}
    assert {p.num_tokens for p in loaded.op_points("attn_prefill_next")} == {4, 8, 16}
    assert all(math.isfinite(r["error_pct"]) for r in check["shapes"])


def test_console_script_writes_a_loadable_profile(tmp_path):
    script = Path(sys.executable).parent / "qllm-profile"
    if not script.exists():
        pytest.skip("qllm-profile is not installed in this venv: run `make venv`")
    # warm-up and repeats here: the profile must be sane enough to drive the simulator
    grid = [o for o in SMALL if not o.startswith(("warmup=", "decode_warmup=", "repeats="))] + [
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
    # what ran, as it ran (it said "each after 2 warm-up" of decode shapes run after 3)
    assert "each after 2 warm-up iterations (3 untimed steps before a decode shape's; a " \
        "prefill of n tokens timed in pairs" in profile.calibration  # fmt: skip
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
    assert "grid.chunk_kv" in user_error(capsys, monkeypatch, "grid.chunk_kv=[0]", out)
    assert "dtype" in user_error(capsys, monkeypatch, "dtype=float8", out)
    if not torch.cuda.is_available():
        assert "CUDA" in user_error(capsys, monkeypatch, "device=cuda", out)
    # tracebacks until 2026-12-04
    assert "routing=None: must be a mapping" in user_error(capsys, monkeypatch, "routing=null", out)
    assert "output.dir=None: must be" in user_error(capsys, monkeypatch, "output.dir=null")
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_without_weights_is_one_line(tmp_path):
    model, _ = build_model({"name": "tiny-qwen3-moe", "config": {"num_hidden_layers": 2}})
    model.config.save_pretrained(tmp_path / "ckpt")  # a config and no weights: a traceback
    with pytest.raises(ModelError, match=r"^model.path=.*ckpt: no loadable weights \("):
        build_model({"name": "tiny-mixtral", "path": str(tmp_path / "ckpt")})


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
    assert {p.op for p in loaded.points} == PROFILED_OPS
    assert loaded.dtype == "bfloat16" and loaded.extra["device_type"] == "cuda"
    shutil.rmtree(directory)


def test_the_profiler_uses_one_thread_by_default(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert app.compose_config().threads == 1
        profile, _ = profile_in_process(tmp_path)
        assert profile.extra["threads"] == torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def points_from(times_ms: list[float]) -> list[OpPoint]:
    """The profiler's aggregation fed fake timings: a decode attention point with these
    repeats, tight router and lm_head points, and expert samples of very different sizes."""
    prof = Profiler(ModelRunner(build_model("tiny-mixtral")[0]), Settings([1], [1], [1], [4]),
                    torch.device("cpu"))  # fmt: skip
    prof.samples[("attn_decode", 8, 0, 512)] = times_ms
    prof.samples[("router", 0, 8, 0)] = [0.2] * 36 + [0.21] * 4
    prof.samples[("lm_head", 8, 0, 0)] = [0.5] * 40
    prof.expert_samples = [(n, 0.01 * n) for n in range(1, 40)]  # one bin, 40x apart
    return prof.table()


def test_scattered_repeats_flag_the_profile_and_tight_ones_do_not(tmp_path):
    tight = spread(points_from([1.0 + 0.01 * (i % 7) for i in range(40)]))
    assert not tight.noisy and tight.worst_factor < 1.1
    busy = spread(points_from([1.0] * 35 + [30.0] * 5))  # one repeat in eight 30x slower
    assert busy.noisy and busy.worst == "attn_decode(batch_size=8, kv_tokens=512)"
    assert busy.worst_factor == pytest.approx(30.0)
    assert tight.median_factor < 1.1 and busy.median_factor < 1.1  # one bad point suffices


def saved_profile(tmp_path: Path, attn_p90_ms: float) -> Path:
    """conftest's hand-made profile, as if measured, with one decode attention point's p90
    replaced."""
    profile = linear_profile()
    profile.source = "measured"
    attn = next(p for p in profile.points if p.op == "attn_decode")
    profile.points[profile.points.index(attn)] = replace(attn, p90_ms=attn_p90_ms)
    return profile.save(tmp_path / f"p90-{attn_p90_ms}")


def test_profile_json_records_the_spread_and_the_simulator_warns_once(tmp_path, capsys):
    noisy, tight = saved_profile(tmp_path, 30.0), saved_profile(tmp_path, 1.2)
    meta = json.loads((noisy / "profile.json").read_text())
    assert meta["spread"]["noisy"] and meta["spread"]["worst_factor"] == 30.0
    assert not json.loads((tight / "profile.json").read_text())["spread"]["noisy"]
    profiles.load("", str(tight))
    assert capsys.readouterr().err == ""
    for _ in range(2):  # a sweep loads it once per run: one warning
        profiles.load("", str(noisy))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: profile test-linear looks measured on a busy machine")
    assert "attn_decode(batch_size=1, kv_tokens=0) has a p90 30.0x its median" in line


def test_qllm_profile_warns_in_one_line_about_a_noisy_profile(capsys, monkeypatch, tmp_path):
    noisy = Profile.load(saved_profile(tmp_path, 30.0))
    monkeypatch.setattr(measure, "run", lambda cfg, progress: (noisy, tmp_path))
    monkeypatch.setattr(sys, "argv", ["qllm-profile", *SMALL, f"output.dir={tmp_path}"])
    app.cli()
    out, err = capsys.readouterr()
    assert out.startswith("profile test-linear:")
    assert len(err.splitlines()) == 1 and err.startswith("warning: profile test-linear")


def test_a_measured_profile_under_a_built_in_name_is_refused_or_named(
    capsys, monkeypatch, tmp_path
):
    """profile=<name> reads the built-in first: qllm-profile refuses to write a measured
    profile there under a built-in's name (before building the model), and a simulation
    that finds one there anyway says which it reads."""
    import shutil

    monkeypatch.chdir(tmp_path)
    built = []
    monkeypatch.setattr(measure, "build_model", lambda *a, **k: built.append(1))
    err = user_error(capsys, monkeypatch, "output.name=h200-mixtral-bf16")
    assert "output.name=h200-mixtral-bf16: a built-in profile has this name" in err
    assert built == [] and not (tmp_path / "results" / "profiles").exists()
    # written there by hand (or by an older qllm-profile): the lookup names the shadowing
    measured = tmp_path / profiles.MEASURED_DIR / "h200-mixtral-bf16"
    shutil.copytree(profiles.BUILTIN_DIR / "h200-mixtral-bf16", measured)
    monkeypatch.setattr(profiles, "_warned_shadow", set())
    assert profiles.directory("h200-mixtral-bf16") == profiles.BUILTIN_DIR / "h200-mixtral-bf16"
    profiles.directory("h200-mixtral-bf16")
    (line,) = capsys.readouterr().err.splitlines()  # once
    assert line.startswith("warning: profile.name=h200-mixtral-bf16 is the built-in profile")
    assert "profile.path=results/profiles/h200-mixtral-bf16 reads it" in line


def test_bad_thread_counts_are_one_line_errors(capsys, monkeypatch, tmp_path):
    for bad in ("0", "abc", "-2"):
        err = user_error(capsys, monkeypatch, f"threads={bad}", f"output.dir={tmp_path}")
        assert f"threads={bad}:" in err and "integer >= 1" in err
    # the process clock sums every thread's CPU time: with two, a stage's figure was CPU
    # seconds, not its latency, without a word (until 2026-12-05)
    err = user_error(capsys, monkeypatch, "threads=2", "clock=process", f"output.dir={tmp_path}")
    assert "clock=process with 2 torch threads" in err and "threads=1" in err
    assert not any(tmp_path.iterdir())


class FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA; counts how many are made."""

    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        FakeEvent.made += 1
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


def test_stage_clock_reuses_its_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.made = 0
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    clock = StageClock(torch.device("cuda"))
    seq = runner.new_sequence([1, 2, 3])
    for _ in range(3):
        total_ms, stages = clock.iteration(runner, [seq])
        seq.truncate(3, 0)
        assert len(stages) == runner.num_stages and total_ms > 0
        # a prefill's attention stages: the call of its one prompt timed
        calls = [st.calls for st in stages if st.ref.stage == "attention"]
        assert len(calls) == runner.num_layers and all(len(c) == 1 for c in calls)
    # one per boundary, and two around each attention call, for all iterations
    assert FakeEvent.made == runner.num_stages + 1 + 2 * runner.num_layers


def test_warm_ups_reach_the_largest_batch_and_prompt(monkeypatch):
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    shapes = []  # (sequences, tokens fed) of every iteration begun
    begin = runner.begin
    monkeypatch.setattr(runner, "begin", lambda seqs: shapes.append(
        (len(seqs), sum(s.num_new for s in seqs))) or begin(seqs))  # fmt: skip
    warm_up(runner, prompt_tokens=40, batch_size=6)
    assert (1, 40) in shapes and (6, 6) in shapes  # the longest prefill; a decode of 6
    shapes.clear()
    settings = Settings([4, 24], [1, 5], [8], [1], warmup=1, repeats=1, wake_idle_ms=())
    Profiler(runner, settings, torch.device("cpu")).points(progress=False)
    assert shapes[:3] == [(1, 24), (5, 40), (5, 5)]  # before any shape of the grid


def test_each_repeat_feeds_new_tokens_over_the_same_cache():
    """A real step feeds a token never fed before (other experts than the last step's): the
    repeats of a shape feed new random tokens each time, over the same cached context, so
    that the profile does not time experts kept hot by the same token re-fed."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4], [1], [8], [1], warmup=1, repeats=6, wake_idle_ms=())
    profiler = Profiler(runner, settings, torch.device("cpu"))
    seqs = profiler.prompts([9, 5])
    runner.run(runner.begin(seqs))  # the prefill: one token each to feed
    cached = [list(s.token_ids[: s.num_cached]) for s in seqs]
    fed = []
    begin = runner.begin
    runner.begin = lambda batch: fed.append(tuple(s.token_ids[-1] for s in batch)) or begin(batch)
    runs = profiler.repeat(seqs)
    assert len(runs) == 6 and len(fed) == 7
    assert len(set(fed)) == 7  # a new pair of tokens every time
    assert [s.token_ids[: s.num_cached] for s in seqs] == cached
    assert [(len(s.token_ids), s.num_cached) for s in seqs] == [(10, 9), (6, 5)]


@pytest.mark.parametrize("decode_warmup", [0, 2])
def test_a_decode_shape_is_timed_decode_warmup_steps_after_its_prefill(decode_warmup):
    """A decode shape's sequences are prefilled right before its steps, and the steps right
    after a prefill run slower than a run's steps in a row: on a clock where every stage of
    the first 2 decode steps after a prefill takes 5 s (1 s otherwise), the shape's timed steps
    come after ``decode_warmup`` untimed ones: all at 1 s with 2, the first two at 5 s with 0."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4], [1], [8], [1], warmup=0, decode_warmup=decode_warmup, repeats=3,
                        passes=1, wake_idle_ms=(), prefill_pairs=False)  # fmt: skip
    profiler = Profiler(runner, settings, torch.device("cpu"))
    state = {"now": 0.0, "since_prefill": 0}
    begin = runner.begin

    def timed_begin(seqs, *args):
        prefill = any(s.num_new > 1 for s in seqs)
        state["since_prefill"] = 0 if prefill else state["since_prefill"] + 1
        return begin(seqs, *args)

    def clock():
        state["now"] += 5.0 if 1 <= state["since_prefill"] <= 2 else 1.0
        return state["now"]

    runner.begin = timed_begin
    profiler.clock.clock = clock
    profiler.clock._call_mark = lambda: state["now"]
    profiler.points(progress=False)
    slow = [1, 1, 1] if decode_warmup == 2 else [5, 5, 1]  # each timed step's slowdown
    attention = profiler.samples[("attn_decode", 1, 0, 8)]  # one a layer, a step's in turn
    assert attention == [1000.0 * k for k in slow for _ in range(runner.num_layers)]
    assert profiler.totals[(1, 1, 8, 1)] == [1000.0 * k * runner.num_stages for k in slow]
    with pytest.raises(measure.SettingsError, match="decode_warmup=-1"):
        Settings([4], [1], [8], [1], decode_warmup=-1).validate()


def test_repeats_are_split_over_the_passes():
    settings = Settings([4], [1], [8], [1], repeats=10, passes=3, wake_idle_ms=())
    assert [settings.pass_repeats(k) for k in range(3)] == [4, 3, 3]
    assert Settings([4], [1], [8], [1], repeats=2, passes=5).passes == 2  # a repeat a pass
    with pytest.raises(measure.SettingsError, match="passes=0"):
        Settings([4], [1], [8], [1], passes=0).validate()


@pytest.mark.parametrize("passes", [1, 3])
def test_a_slow_stretch_of_the_machine_hits_a_few_samples_of_a_shape(passes):
    """On a clock of its own, every stage takes 1 s, and 3 s during a slow stretch of the
    machine that starts with the first timed prefill of 16 tokens and lasts 9 iterations: all
    9 repeats of that shape in one pass (its median triples), a third of them in 3 passes (the
    median holds), as a shared machine's slow stretches of seconds hit a profile."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4, 16], [1], [8], [1], warmup=0, repeats=9, passes=passes,
                        wake_idle_ms=())  # fmt: skip
    profiler = Profiler(runner, settings, torch.device("cpu"))
    state = {"now": 0.0, "started": False, "slow_left": 0, "slow": False}
    begin = runner.begin

    def timed_begin(seqs, *args):
        # a prefill of 16 tokens is timed at 14 and 18 (16 -+ 16 // PREFILL_JITTER)
        if not state["started"] and len(seqs) == 1 and seqs[0].num_new in (14, 18):
            state["started"], state["slow_left"] = True, 9
        state["slow"] = state["slow_left"] > 0
        state["slow_left"] -= state["slow"]
        return begin(seqs, *args)

    def clock():
        state["now"] += 3.0 if state["slow"] else 1.0
        return state["now"]

    runner.begin = timed_begin
    profiler.clock.clock = clock
    profiler.clock._call_mark = lambda: state["now"]  # reads around the calls take no time
    points = profiler.points(progress=False)
    assert profiler.passes_done == passes
    prefill = {p.num_tokens: p.median_ms for p in points if p.op == "attn_prefill"}
    assert prefill[4] == pytest.approx(1000.0)
    assert prefill[16] == pytest.approx(3000.0 if passes == 1 else 1000.0)
    # 9 repeats of a jittered prefill: 5 pairs (in 3 passes: 2, 2 and 1)
    assert len(profiler.folded()[("attn_prefill", 0, 16, 0)]) == 10 * runner.num_layers


def test_a_prefill_of_several_prompts_files_its_first_call_apart_from_the_later_ones():
    """A pair's attention stage of 5 ms a layer, its calls 2.5 and 1.5 ms: outer 1 ms, the
    first call (attn_prefill_first) 2.5 ms and the later one (attn_prefill_next) 1.5 ms, each
    at its prompt's grid length; a batch of 3 calls (2.5, 1.5, 2.5 ms) files the mean of the
    later two; a single prompt's call files neither."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4, 16], [1], [8], [1], warmup=0, repeats=2, wake_idle_ms=())
    prof = Profiler(runner, settings, torch.device("cpu"))

    def attention(layer: int, ms: float, calls: list[float]) -> measure.StageTime:
        return measure.StageTime(measure.StageRef(layer, "attention", layer, -1), 0, ms, calls)

    pair = [attention(layer, 5.0, [2.5, 1.5]) for layer in range(2)]
    prof.record([(10.0, pair)], num_tokens=32, prompts=2)
    assert prof.samples[("attn_prefill_first", 0, 16, 0)] == [2.5, 2.5]
    assert prof.samples[("attn_prefill_next", 0, 16, 0)] == [1.5, 1.5]
    assert prof.samples[("attn_prefill_outer", 2, 32, 0)] == [1.0, 1.0]
    prof.record([(10.0, [attention(0, 7.5, [2.5, 1.5, 2.5])])], num_tokens=48, prompts=3)
    assert prof.samples[("attn_prefill_outer", 3, 48, 0)] == [1.0]
    assert prof.samples[("attn_prefill_first", 0, 16, 0)] == [2.5] * 3
    assert prof.samples[("attn_prefill_next", 0, 16, 0)] == [1.5, 1.5, 2.0]
    prof.record([(10.0, [attention(0, 3.0, [2.0])])], num_tokens=4)
    assert ("attn_prefill_first", 0, 4, 0) not in prof.samples
    assert prof.samples[("attn_prefill_outer", 0, 4, 0)] == [1.0]  # one prompt's: 0
    assert prof.samples[("attn_prefill", 0, 4, 0)] == [3.0]


def test_a_prefill_is_timed_on_new_prompts_a_little_shorter_and_longer_and_folded_onto_n():
    """A prefill shape of 16 tokens runs as a real run's prefills do: new sequences every time
    (never rewound), alternately 14 and 18 tokens (16 -+ 16 // PREFILL_JITTER), the timed ones
    in pairs; on a clock where a stage takes 0.1 s a token, the profile's point at 16 is the
    midpoint of the two sides (1.6 s), its samples keep each side's spread, and a shape timed
    on one side only keeps its samples at the length it ran."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4, 16], [1], [8], [1], warmup=1, repeats=3, passes=1,
                        wake_idle_ms=())  # fmt: skip
    profiler = Profiler(runner, settings, torch.device("cpu"))
    state = {"now": 0.0, "tokens": 1}
    begun, begin = [], runner.begin

    def timed_begin(seqs, *args):
        state["tokens"] = sum(s.num_new for s in seqs)
        begun.append((seqs[0], seqs[0].num_cached, seqs[0].num_new))  # held: ids stay apart
        return begin(seqs, *args)

    def clock():
        state["now"] += 100.0 * state["tokens"]  # ms, read as seconds x 1e3
        return state["now"] / 1e3

    runner.begin = timed_begin
    profiler.clock.clock = clock
    profiler.clock._call_mark = lambda: state["now"] / 1e3
    begun.clear()
    profiler.prefill(16)
    # 1 warm-up (18) then 3 repeats rounded up to 2 pairs: 14, 18, 14, 18; new sequences
    assert [(cached, new) for _, cached, new in begun] == [(0, 18), (0, 14), (0, 18), (0, 14),
                                                           (0, 18)]  # fmt: skip
    assert len({id(seq) for seq, _, _ in begun}) == 5
    layers = runner.num_layers
    assert profiler.jittered[("attn_prefill", 0, 16, 0, -2)] == [pytest.approx(1400.0)] * 2 * layers
    assert profiler.jittered[("attn_prefill", 0, 16, 0, 2)] == [pytest.approx(1800.0)] * 2 * layers
    assert not profiler.samples.get(("attn_prefill", 0, 16, 0))
    assert profiler.folded()[("attn_prefill", 0, 16, 0)] == [pytest.approx(1600.0)] * 4 * layers
    assert profiler.totals.keys() == {(0, 14, 0, 1), (0, 18, 0, 1)}  # self_check: as they ran
    profiler.prefill(4)  # too short to jitter (4 // 8 = 0): 3 repeats at 4 tokens
    assert [new for _, _, new in begun[5:]] == [4] * 4
    points = {p.num_tokens: p.median_ms for p in profiler.table() if p.op == "attn_prefill"}
    assert points == {4: pytest.approx(400.0), 16: pytest.approx(1600.0)}
    # one side alone (a pass's pair cut short): no midpoint, its samples where they ran
    del profiler.jittered[("attn_prefill", 0, 16, 0, 2)]
    folded = profiler.folded()
    assert ("attn_prefill", 0, 16, 0) not in folded
    assert folded[("attn_prefill", 0, 14, 0)] == [pytest.approx(1400.0)] * 2 * layers


def test_a_jittered_prefill_is_timed_in_whole_pairs_spread_over_the_passes():
    settings = Settings([4], [1], [8], [1], repeats=18, passes=12, wake_idle_ms=())
    assert [settings.pass_prefill_repeats(k) for k in range(12)] == [2] * 9 + [0] * 3
    settings = Settings([4], [1], [8], [1], repeats=3, passes=3, wake_idle_ms=())
    assert [settings.pass_prefill_repeats(k) for k in range(3)] == [2, 2, 0]
    settings = Settings([4], [1], [8], [1], repeats=1, passes=1, wake_idle_ms=())
    assert settings.pass_prefill_repeats(0) == 1  # one repeat: not jittered (Profiler.prefill)


def test_wake_up_is_the_extra_time_of_the_first_steps_after_an_idle_gap(monkeypatch):
    """On a clock of its own (deterministic): a device whose iteration takes 1 ms, and 40 ms
    more on the first and 10 ms more on the second once it sat idle 50 ms or more. Each window
    after a gap is a run's work after one: a prefill of a new prompt of wake.prompt_tokens,
    decode steps of it (rewound, a new token each), then a prefill of another prompt. The
    profiler
    measures, at 150 ms of idle time, 50 ms left after no work, 10 ms after the prefill's
    (1 ms), none after a step more; none at 2 ms of idle time; 0 at 0."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    clock = {"now": 0.0, "last": 0.0, "cold": []}
    run_steps = runner.run
    begun = []  # (sequence, tokens fed, cached) of every iteration begun
    begin = runner.begin
    fed = []  # the last token of every iteration begun
    monkeypatch.setattr(runner, "begin", lambda seqs: begun.append(
        (seqs[0], seqs[0].num_new, seqs[0].num_cached)) or fed.append(seqs[0].token_ids[-1])
        or begin(seqs))  # fmt: skip

    def run(state):
        out = run_steps(state)
        if clock["now"] - clock["last"] >= 0.05:
            clock["cold"] = [0.04, 0.01]
        clock["now"] += 0.001 + (clock["cold"].pop(0) if clock["cold"] else 0.0)
        clock["last"] = clock["now"]
        return out

    def sleep(seconds):
        clock["now"] += seconds

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(measure, "wait_idle", lambda seconds, wait: sleep(seconds))
    settings = Settings([4], [1], [8], [1], wake_idle_ms=(2, 150), wake_repeats=3,
                        wake_prompt_tokens=12)  # fmt: skip
    profiler = Profiler(runner, settings, torch.device("cpu"))
    profiler.clock.clock = lambda: clock["now"]  # the profile's CPU clock, wall or process
    rows = defaultdict(list)
    for p in profiler.wake_points():
        assert p.op == "wake_up"
        rows[p.idle_ms].append((p.busy_ms, p.median_ms, p.p90_ms))
    assert sorted(rows) == [0, 2, 150] and rows[0] == [(0, 0, 0)]
    # 1 ms steps: the window's 100 ms is more steps than the most (64); a point at each kept k
    steps = measure.wake_steps(1.0)
    assert steps == measure.WAKE_STEPS_RANGE[1] == 64
    window = begun[-(steps + 2) :]  # the last window: a prefill, its steps, another prefill
    first, last = window[0][0], window[-1][0]
    decode = [(1, 12)] * steps  # one token over the prompt, rewound after each step
    assert [(n, c) for _, n, c in window] == [(12, 0), *decode, (12, 0)]
    assert all(seq is first for seq, _, _ in window[:-1]) and last is not first
    assert len(set(fed[-(steps + 1) : -1])) > steps // 2  # a new random token each step
    kept = [*measure.WAKE_POINTS, steps + 1]  # the prefill, then the steps
    assert [b for b, _, _ in rows[150]] == pytest.approx(kept)
    n = len(kept)
    assert [m for _, m, _ in rows[150]] == pytest.approx([50, 10] + [0] * (n - 2), abs=1e-6)
    assert [p for _, _, p in rows[150]] == pytest.approx([50, 10] + [0] * (n - 2), abs=1e-6)
    assert [m for _, m, _ in rows[2]] == pytest.approx([0] * n, abs=1e-6)
    assert measure.wake_steps(10.0) == 10 and measure.wake_steps(50.0) == 4


def test_a_window_that_runs_slower_as_a_whole_is_drift_not_a_wake_up(monkeypatch):
    """1 ms steps, 1 ms slower for the 5 steps after 50 ms or more of idle time; and the
    machine drifts: each window after a gap runs at its own speed (1.0, 1.3, 0.8 ms per step in
    turn). The wake-up is the 5 ms of those steps at every idle time (a reference from the
    window before the gap, the last version's, read 17.8 ms here)."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    clock = {"now": 0.0, "last": 0.0, "slow": 0, "step": 0.001, "sleeps": 0}
    speeds = [0.001, 0.0013, 0.0008]
    run_steps = runner.run

    def run(state):
        out = run_steps(state)
        if clock["now"] - clock["last"] >= 0.05:
            clock["slow"] = 5
        clock["now"] += clock["step"] + (0.001 if clock["slow"] > 0 else 0.0)
        clock["slow"] -= 1
        clock["last"] = clock["now"]
        return out

    def sleep(seconds):
        clock["now"] += seconds
        clock["step"] = speeds[clock["sleeps"] % len(speeds)]
        clock["sleeps"] += 1

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(measure, "wait_idle", lambda seconds, wait: sleep(seconds))
    settings = Settings([4], [1], [8], [1], wake_idle_ms=(100, 150), wake_repeats=3)
    profiler = Profiler(runner, settings, torch.device("cpu"))
    profiler.clock.clock = lambda: clock["now"]
    curves = defaultdict(dict)
    for p in profiler.wake_points():
        curves[p.idle_ms][round(p.busy_ms, 6)] = p.median_ms
    assert curves[0] == {0: 0.0}
    for idle_ms in (100, 150):  # busy: the median warm step (1 ms) times the steps before
        assert curves[idle_ms][0] == pytest.approx(5.0)
        assert curves[idle_ms][3] == pytest.approx(2.0)
        assert curves[idle_ms][8] == pytest.approx(0.0, abs=1e-9)
        # the raw samples are kept (profile.json: extra.wake_samples): the curve again
        samples = np.array(profiler.wake_samples[idle_ms])  # [prefill, steps, prefill] rows
        assert samples.shape == (3, measure.wake_steps(1.0) + 2)
        again = {round(p.busy_ms, 6): p.median_ms for p in
                 measure.wake_curve(idle_ms, samples[:, 1:-1], samples[:, [0, -1]])}  # fmt: skip
        assert again == pytest.approx(curves[idle_ms])


def test_a_slow_down_ends_at_the_first_step_that_is_not_slower():
    """Per step (the first four bins are single steps), the median excess over the repeats
    (over the median of the window's second half); the first step whose median is not
    positive ends the slow-down, so a later positive step (noise, 0.4 ms at step 4) is not
    counted; p90 from the repeats' own sums."""
    rows = np.array([[3.0, 1.5, 1.0, 1.4, 1.0, 1.0, 1.0, 1.0],
                     [2.0, 1.5, 0.9, 1.4, 1.0, 1.0, 1.0, 1.0],
                     [5.0, 1.5, 1.0, 1.4, 1.0, 1.0, 1.0, 1.0]])  # fmt: skip
    points = measure.wake_curve(50, rows)
    assert [p.busy_ms for p in points] == [0, 1, 2, 3, 4, 6, 8]
    assert [p.median_ms for p in points] == pytest.approx([2.5, 0.5, 0, 0, 0, 0, 0])
    assert points[0].p90_ms == pytest.approx(np.percentile([2.5, 1.5, 4.5], 90))
    assert all(p.op == "wake_up" and p.idle_ms == 50 for p in points)
    # a first step no slower than the warm ones: no wake-up at all
    flat = measure.wake_curve(50, np.ones((3, 8)) + np.array([0, 0.5, 0, 0, 0, 0, 0, 0]))
    assert [p.median_ms for p in flat] == [0.0] * 7


def test_the_wake_ups_repeats_are_spread_over_the_passes(monkeypatch):
    """Measured after the last pass only, the wake-up was that stretch's of the machine (one
    run read 17-25 ms after 1 s of idle time where the real runs showed about 1): its repeats
    run in the passes, spread as evenly as they allow, and ``wake_points`` runs only those
    left (all of them before any pass)."""
    settings = Settings([4], [1], [8], [1], repeats=18, passes=12, wake_repeats=9)
    assert [settings.pass_wake_repeats(k) for k in range(12)] == [0, 1, 1, 1] * 3
    for repeats, passes in ((9, 2), (5, 5), (20, 3), (1, 4)):
        settings = Settings([4], [1], [8], [1], repeats=20, passes=passes, wake_repeats=repeats)
        assert sum(settings.pass_wake_repeats(k) for k in range(passes)) == repeats
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    settings = Settings([4], [1], [8], [1], warmup=0, repeats=3, passes=3, wake_idle_ms=(1, 2),
                        wake_repeats=2, prefill_pairs=False)  # fmt: skip
    profilers = [Profiler(runner, settings, torch.device("cpu"))]
    slept = []  # (pass, idle ms) of every gap

    def sleep(seconds):
        slept.append((profilers[-1].passes_done, round(seconds * 1e3)))

    monkeypatch.setattr(measure, "wait_idle", lambda seconds, wait: sleep(seconds))
    points = profilers[-1].points(progress=False)
    assert slept == [(1, 1), (1, 2), (2, 1), (2, 2)]  # none in pass 0, none after the passes
    assert {k: len(v) for k, v in profilers[-1].wake_samples.items()} == {1: 2, 2: 2}
    assert {p.idle_ms for p in points if p.op == "wake_up"} == {0, 1, 2}
    profilers.append(Profiler(runner, settings, torch.device("cpu")))  # no pass: all of them now
    slept.clear()
    profilers[-1].wake_points()
    assert slept == [(0, 1), (0, 2)] * 2
    # a validation stopped by its time budget after two passes: the repeats they ran, no more
    profilers.append(Profiler(runner, settings, torch.device("cpu")))
    slept.clear()
    profilers[-1].grid_pass()
    profilers[-1].grid_pass()
    points = profilers[-1].wake_points(top_up=False)
    assert slept == [(1, 1), (1, 2)]
    assert {k: len(v) for k, v in profilers[-1].wake_samples.items()} == {1: 1, 2: 1}
    assert {p.idle_ms for p in points} == {0, 1, 2}
    # ... and stopped before any repeat ran: all of them (a profile needs its wake-up)
    profilers.append(Profiler(runner, settings, torch.device("cpu")))
    slept.clear()
    profilers[-1].grid_pass()
    profilers[-1].wake_points(top_up=False)
    assert slept == [(1, 1), (1, 2)] * 2


def test_a_window_that_starts_with_a_prefill_reads_its_excess_over_its_warm_repeat():
    """A window after the gap starts with a prefill (10 ms warm: the same prefill at the
    window's end), 12-14 ms after the gap, then 1 ms decode steps, the first 0.5 ms slower:
    3.5 ms left after no work, 0.5 after the prefill's 10 ms, none after a step more; busy
    counts the prefill's warm time, then the steps'."""
    steps = np.ones((3, 8))
    steps[:, 0] += 0.5
    first = np.array([[12.0, 10.0], [13.0, 10.0], [14.0, 10.2]])
    points = measure.wake_curve(50, steps, first)
    assert [p.busy_ms for p in points] == pytest.approx([0, 10, 11, 12, 13, 15, 17, 18])
    assert [p.median_ms for p in points] == pytest.approx([3.5, 0.5, 0, 0, 0, 0, 0, 0])
    assert points[0].p90_ms == pytest.approx(np.percentile([2.5, 3.5, 4.3], 90))
    # a prefill no slower than its warm repeat: no wake-up, whatever the steps show after it
    flat = measure.wake_curve(50, steps, np.array([[10.0, 10.0]] * 3))
    assert [p.median_ms for p in flat] == [0.0] * 8


def test_a_long_small_tail_is_kept_in_bins_where_one_step_is_within_the_noise():
    """1 ms steps, alternately 0.2 ms slower and faster (the noise: its floor is 0.2 ms); after
    the gap the first step 2 ms slower, the next three 0.5 ms, then twelve 0.15 ms: below the
    noise step by step (the estimator before cut the wake-up at step 5, 3.65 ms), above it in
    bins of 4 and 8 steps (0.2 / sqrt 4 and 0.2 / sqrt 8): the whole 5.1 ms."""
    noise = 0.2 * (-1.0) ** np.arange(40)
    noise[0] = 0.0
    tail = np.zeros(40)
    tail[0], tail[1:4], tail[4:16] = 2.0, 0.5, 0.15
    rows = np.tile(1.0 + noise + tail, (9, 1))
    points = {p.busy_ms: p for p in measure.wake_curve(200, rows)}
    # the three 0.5 ms steps read 0.3, 0.7, 0.3 with the noise
    assert points[0].median_ms == pytest.approx(2.0 + 1.3 + 12 * 0.15)
    assert points[4].median_ms == pytest.approx(12 * 0.15)  # after the first four steps
    assert points[16].median_ms == pytest.approx(0.0, abs=1e-9)
    assert all(p.p90_ms == pytest.approx(p.median_ms) for p in points.values())  # rows alike


def test_interference_is_the_mean_time_over_the_median_of_its_shape():
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    profiler = Profiler(runner, Settings([4], [1], [8], [1]), torch.device("cpu"))
    assert profiler.interference() == 1.0  # nothing timed yet
    profiler.totals[(0, 4, 0, 1)] += [1.0, 1.0, 1.0, 3.0]  # one slow repeat of four: ratio 3
    profiler.totals[(1, 1, 8, 1)] += [2.0, 2.0, 2.0, 2.0]
    assert profiler.interference() == pytest.approx(10 / 8)
    # a stall (40x its shape's median) counts as STALL_RATIO: not a 4.9% slower profile
    profiler.totals[(0, 4, 0, 1)][3] = 40.0
    assert measure.STALL_RATIO == 3.0 and profiler.interference() == pytest.approx(10 / 8)


def test_each_pass_of_the_grid_has_its_own_speed_against_the_whole_profile():
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    profiler = Profiler(runner, Settings([4], [1], [8], [1]), torch.device("cpu"))
    assert profiler.pass_speeds() == []
    # two passes of two repeats: the second ran one shape twice as slow
    profiler.totals[(0, 4, 0, 1)] += [1.0, 1.0, 2.0, 2.0]  # median 1.5
    profiler.totals_pass[(0, 4, 0, 1)] += [0, 0, 1, 1]
    profiler.totals[(1, 1, 8, 1)] += [3.0, 3.0, 3.0, 3.0]
    profiler.totals_pass[(1, 1, 8, 1)] += [0, 0, 1, 1]
    for key in profiler.totals:  # as timed (no probe: not in probe steps)
        profiler.totals_unit[key] += [1.0] * 4
    assert profiler.pass_speeds() == pytest.approx([(2 / 3 + 1) / 2, (4 / 3 + 1) / 2])
    assert np.mean(profiler.pass_speeds()) == pytest.approx(profiler.interference())


def test_a_profiles_interference_round_trips_and_old_files_read_none(tmp_path):
    base = profiles.load("a100-mixtral-nf4-hf")
    assert base.interference == 1.0
    saved = replace(base, interference=1.08).save(tmp_path / "p")
    assert Profile.load(saved).interference == 1.08
    meta = json.loads((saved / "profile.json").read_text())
    del meta["interference"]  # a profile saved before the field
    (saved / "profile.json").write_text(json.dumps(meta))
    assert Profile.load(saved).interference == 1.0
    with pytest.raises(ValueError, match="interference=0"):
        replace(base, interference=0.0)


def append_row(saved: Path, row: str) -> None:
    """A row added to a saved profile's ops.csv by hand, its row count in profile.json raised
    to match (else the count refuses it first)."""
    with (saved / "ops.csv").open("a") as f:
        f.write(row + "\n")
    meta = json.loads((saved / "profile.json").read_text())
    (saved / "profile.json").write_text(json.dumps({**meta, "points": meta["points"] + 1}))


@pytest.mark.parametrize("row, message", [
    ("expert,0,1,0,9.0,9.0,0,0", "two points of expert(num_tokens=1)"),
    ("expert,4,1,0,9.0,9.0,0,0", "expert is keyed by num_tokens only, but a point sets "
                                 "batch_size=4"),
])  # fmt: skip
def test_a_duplicated_or_mis_keyed_ops_row_is_refused(tmp_path, row, message):
    """The latency model keeps the last point of a key: an appended copy of the expert rows
    at 10x their cost loaded without a word and tripled LS TTFT."""
    saved = profiles.load("a100-mixtral-nf4-hf").save(tmp_path / "p")
    append_row(saved, row)
    with pytest.raises(ValueError, match=re.escape(message)):
        Profile.load(saved)


@pytest.mark.parametrize("row, message", [
    ("lm_head,999,0,0,1.0,nan,0,0", "lm_head at (999,) has p90_ms=nan"),
    ("lm_head,999,0,0,1.0,-1,0,0", "lm_head at (999,) has p90_ms=-1.0"),
    ("expert,0,-8,0,1.0,1.0,0,0", "expert has num_tokens=-8"),
    ("expert,0,99999,0,1.0,1.0", "malformed row"),  # a row cut short: idle_ms, busy_ms
    ("expert,0,99999,0,1.0,1.0,0,0,7", "malformed row"),
])  # fmt: skip
def test_a_row_with_a_bad_p90_key_or_field_count_is_refused(tmp_path, row, message):
    """A NaN p90 loaded and hid a 5x-noisy point from the spread warning (NaN sorts
    anywhere); a negative key, or a row cut short (read as idle_ms = busy_ms = 0) or with a
    field too many, loaded as well."""
    saved = profiles.load("a100-mixtral-nf4-hf").save(tmp_path / "p")
    append_row(saved, row)
    with pytest.raises(ValueError, match=re.escape(message)):
        Profile.load(saved)


def test_a_profile_cut_short_is_refused(tmp_path):
    """ops.csv is sorted by op, so a file cut at a row's end lost its wake_up rows first and
    loaded as a profile without a wake-up (0 ms after 1 s of idle time where it read 0.82),
    and one cut inside its last number loaded that number's prefix (busy_ms 128.576 as 12)."""
    base = profiles.load("a100-mixtral-nf4-hf")
    wake = [
        OpPoint("wake_up", idle_ms=0),
        OpPoint("wake_up", median_ms=0.8, p90_ms=1.0, idle_ms=1000),
        OpPoint("wake_up", median_ms=0.2, p90_ms=0.3, idle_ms=1000, busy_ms=128.576),
    ]
    saved = replace(base, points=base.points + wake).save(tmp_path / "p")
    assert sorted(p.name for p in saved.iterdir()) == ["ops.csv", "profile.json"]  # no .part
    whole = (saved / "ops.csv").read_bytes()
    assert Profile.load(saved).op_points("wake_up") == wake
    (saved / "ops.csv").write_bytes(b"".join(whole.splitlines(keepends=True)[:-2]))
    with pytest.raises(ValueError, match="points where profile.json says"):
        Profile.load(saved)
    (saved / "ops.csv").write_bytes(whole[: whole.rindex(b"128.576") + 2])  # "...,12"
    with pytest.raises(ValueError, match="its last row has no line end"):
        Profile.load(saved)


@pytest.mark.parametrize("row, message", [
    ("wake_up,0,0,0,40,40,,", "malformed row"),  # read as idle_ms = busy_ms = 0 before
    ("wake_up,0,0,0,40,40,0,0", "wake_up at idle_ms=0 has median_ms=40"),
])  # fmt: skip
def test_an_empty_key_field_or_a_wake_up_after_no_idle_time_is_refused(tmp_path, row, message):
    """An empty idle_ms read as 0: with its 40 ms, every batch after a gap of 1 ms was charged
    about 40 ms of wake-up (idle_ms = 0 is 0 by definition, and the profiler writes it so)."""
    saved = profiles.load("a100-mixtral-nf4-hf").save(tmp_path / "p")
    append_row(saved, row)
    with pytest.raises(ValueError, match=re.escape(message)):
        Profile.load(saved)


def test_a_nan_p90_no_longer_hides_a_noisy_point():
    noisy = [OpPoint("lm_head", batch_size=b, median_ms=1.0, p90_ms=p)
             for b, p in [(1, 5.0), (2, math.nan), *((b, 1.2) for b in range(3, 9))]]  # fmt: skip
    with pytest.raises(ValueError, match="p90_ms=nan"):
        replace(profiles.load("a100-mixtral-nf4-hf"), points=noisy)
    assert spread([p for p in noisy if not math.isnan(p.p90_ms)]).noisy


def test_a_profile_json_key_nothing_reads_is_refused(tmp_path):
    """A misspelt key (``interferance``, ``prefill_atention``) loaded as the default without a
    word; model and memory keys were already checked."""
    saved = profiles.load("a100-mixtral-nf4-hf").save(tmp_path / "p")
    meta = json.loads((saved / "profile.json").read_text())
    (saved / "profile.json").write_text(json.dumps({**meta, "prefill_atention": "batched"}))
    with pytest.raises(ValueError, match="unknown key 'prefill_atention'"):
        Profile.load(saved)
    meta["routing"]["expert_loads"] = meta["routing"].pop("expert_load")
    (saved / "profile.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown key 'routing.expert_loads'"):
        Profile.load(saved)


@pytest.mark.parametrize("memory", [{"kv_bytes_per_token": -2048},
                                    {"activation_bytes_per_token": -1}])  # fmt: skip
def test_negative_memory_figures_are_refused(memory):
    """A negative kv_bytes_per_token loaded and made every swap take negative time (and 0
    raised a ZeroDivisionError in the scheduler)."""
    base = profiles.load("a100-mixtral-nf4-hf")
    with pytest.raises(ValueError, match="kv_bytes_per_token must be >= 1"):
        replace(base, memory=replace(base.memory, **memory))


@pytest.mark.parametrize("value", [0.0, 25.0, float("nan")])
def test_a_swap_rate_in_the_wrong_unit_is_refused(value):
    """swap_bytes_per_s is in bytes per second: 25 (meant as GB/s) loaded and made a swap a
    billion times too slow."""
    base = profiles.load("a100-mixtral-nf4-hf")
    with pytest.raises(ValueError, match="below 1 MB/s; it is in bytes per second"):
        replace(base, memory=replace(base.memory, swap_bytes_per_s=value))
    assert replace(base, memory=replace(base.memory, swap_bytes_per_s=25e9))


def test_a_saved_profile_is_version_3_and_versions_1_and_2_still_load(tmp_path):
    """A saved profile is version 3 and round-trips its wake_up points, busy times included;
    a version-2 file (no busy_ms column) and a version-1 file (no idle_ms either) read those
    columns as 0."""
    base = profiles.load("a100-mixtral-nf4-hf")
    assert base.op_points("wake_up") == []
    wake = [OpPoint("wake_up", idle_ms=0), OpPoint("wake_up", median_ms=3.5, p90_ms=4.0,
                                                   idle_ms=200),
            OpPoint("wake_up", median_ms=0.5, p90_ms=1.0, idle_ms=200, busy_ms=2.25)]  # fmt: skip
    saved = replace(base, points=base.points + wake).save(tmp_path / "p")
    assert json.loads((saved / "profile.json").read_text())["schema_version"] == 3
    assert Profile.load(saved).op_points("wake_up") == wake
    lines = (saved / "ops.csv").read_text().splitlines()
    assert lines[0].endswith(",idle_ms,busy_ms")
    meta = json.loads((saved / "profile.json").read_text())
    for version, keep in ((2, -1), (1, -2)):
        old = tmp_path / f"v{version}"
        shutil.copytree(saved, old)
        older = {k: v for k, v in meta.items() if k != "points"}  # no row count then
        (old / "profile.json").write_text(json.dumps({**older, "schema_version": version}))
        rows = [line for line in lines if "2.25" not in line]  # a point only version 3 has
        if version == 1:  # no wake_up either: keyed by idle_ms, its points would be one
            rows = [line for line in rows if not line.startswith("wake_up,")]
        (old / "ops.csv").write_text("\n".join(",".join(r.split(",")[:keep]) for r in rows))
        points = Profile.load(old).points
        assert all(p.busy_ms == 0 for p in points)
        assert [p.idle_ms for p in points if p.op == "wake_up"] == ([0, 200] if version == 2
                                                                    else [])  # fmt: skip
        assert [p for p in points if p.op != "wake_up"] == base.points
    (saved / "ops.csv").write_text("op,median_ms\n")
    with pytest.raises(ValueError, match="header must be"):
        Profile.load(saved)


def test_attn_chunk_times_chunks_over_their_cached_prefix(monkeypatch):
    """Each (chunk, prefix) point times iterations that feed the chunk on top of that many
    cached tokens; a prefix of 0 is the prefill's own point; the op round-trips a save."""
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    fed = []  # (tokens cached, tokens fed) of every one-sequence iteration begun
    begin = runner.begin

    def recording_begin(seqs, chunk_tokens=None):
        state = begin(seqs, chunk_tokens)
        if len(seqs) == 1:
            fed.append((seqs[0].num_cached, state.feed[0]))
        return state

    monkeypatch.setattr(runner, "begin", recording_begin)
    settings = Settings([4, 12], [1], [8], [1], warmup=0, repeats=2, wake_idle_ms=(),
                        chunk_kv=(6, 20))  # fmt: skip
    prof = Profiler(runner, settings, torch.device("cpu"))
    points = [p for p in prof.points(progress=False) if p.op == "attn_chunk"]
    assert sorted(p.key() for p in points) == [(n, kv) for n in (4, 12) for kv in (0, 6, 20)]
    for n in (4, 12):
        for kv in (6, 20):
            assert fed.count((kv, n)) == 2  # the repeats, each over the whole prefix
    prefill = {p.num_tokens: p.median_ms for p in prof.table() if p.op == "attn_prefill"}
    assert all(p.median_ms == prefill[p.num_tokens] for p in points if p.kv_tokens == 0)
    assert all(p.median_ms > 0 for p in points)


def test_self_check_is_the_models_mean_iteration_against_the_profiles_own():
    profile = linear_profile()  # every op's time known: an iteration's is too
    seqs = [Sequence(Request(0, BE, 0.0, 16, 2))]
    seqs[0].generated = 1
    model = LatencyModel(profile)
    decode_ms = 1e3 * model.plan(Batch(seqs, Phase.DECODE)).total_s
    # a decode batch of one at kv 16 ran 25% slower than the model adds it up; a prefill of 8
    # tokens ran as the model's mean over routing draws
    prefill_ms = 1e3 * np.mean([model.plan(Batch([Sequence(Request(0, BE, 0.0, 8, 2))],
                                                   Phase.PREFILL)).total_s
                                for _ in range(400)])  # fmt: skip
    totals = {(1, 1, 16, 1): [decode_ms * 1.25] * 3, (0, 8, 0, 1): [prefill_ms] * 3}
    check = measure.self_check(profile, totals, draws=400)
    rows = {r["phase"]: r for r in check["shapes"]}
    assert rows["decode"]["error_pct"] == pytest.approx(-20.0, abs=0.01)
    assert rows["prefill"]["error_pct"] == pytest.approx(0.0, abs=1.0)
    assert check["decode_worst_pct"] == rows["decode"]["error_pct"] == check["decode_median_pct"]
    line = measure.self_check_line(check)
    assert "decode median -20.0%, worst -20.0% (batch 1, kv 16)" in line
    assert "prefill median" in line and "(8 tokens)" in line


def test_step_overhead_is_fitted_to_the_profiles_own_mean_decode_iterations():
    """Decode iterations of one sequence ran 1.0 and 3.0 ms over the model's sum at two
    contexts (mean 2.0), those of 64 sequences 5 ms under it (more than the 3 ms term): the
    term at 1 moves by 2.0 / interference, at 64 to 0 (not below); the self-check after the
    fit is the contexts' spread around it (+-1.0 ms), and the prefill's row is untouched."""
    profile = replace(linear_profile(), interference=1.25)
    model = LatencyModel(profile)

    def decode_ms(batch: int, kv: int) -> float:
        seqs = [Sequence(Request(i, BE, 0.0, kv, 2)) for i in range(batch)]
        for q in seqs:
            q.generated = 1
        return 1e3 * model.plan(Batch(seqs, Phase.DECODE)).total_s

    totals = {(1, 1, 16, 1): [decode_ms(1, 16) + 1.0] * 3,
              (1, 1, 64, 1): [decode_ms(1, 64) + 3.0] * 3,
              (64, 64, 16, 64): [decode_ms(64, 16) - 5.0] * 2,
              (0, 8, 0, 1): [20.0]}  # fmt: skip
    fitted, moves = measure.fit_step_overhead(profile, totals)
    assert moves[1] == pytest.approx(2.0 / 1.25) and moves[64] == pytest.approx(-5.0 / 1.25)
    overhead = {p.batch_size: p for p in fitted.points if p.op == "step_overhead"}
    assert overhead[1].median_ms == pytest.approx(3.0 + 1.6)
    assert overhead[1].p90_ms == pytest.approx(3.0 + 1.6)
    assert overhead[64].median_ms == 0.0 == overhead[64].p90_ms
    rows = measure.self_check(fitted, totals)["shapes"]
    one = [r for r in rows if r["phase"] == "decode" and r["batch_size"] == 1]
    assert [r["measured_ms"] - r["predicted_ms"] for r in one] == [
        pytest.approx(-1.0, abs=1e-3), pytest.approx(1.0, abs=1e-3)]  # fmt: skip
    before = {(r["phase"], r["tokens"]): r for r in measure.self_check(profile, totals)["shapes"]}
    after = {(r["phase"], r["tokens"]): r for r in rows}
    assert after[("prefill", 8)]["predicted_ms"] == pytest.approx(
        before[("prefill", 8)]["predicted_ms"] + 1.6 * 1.25, abs=0.05
    )  # it pays step_overhead(1)
    others = [p for p in fitted.points if p.op != "step_overhead"]
    assert others == [p for p in profile.points if p.op != "step_overhead"]


def test_self_check_leaves_out_the_engines_host_time():
    profile = linear_profile()
    host = replace(profile, points=[*profile.points,
                                    OpPoint("engine_host", batch_size=1, median_ms=5.0,
                                            p90_ms=5.0)])  # fmt: skip
    totals = {(1, 1, 16, 1): [10.0]}
    assert (measure.self_check(host, totals)["shapes"]
            == measure.self_check(profile, totals)["shapes"])  # fmt: skip


def test_each_pass_runs_the_grids_shapes_in_an_order_of_its_own():
    """shuffle (default): every shape once a pass, in a random order, another each pass,
    seeded; false: the grid's order, every prefill shape before every decode shape (which put
    each phase in its own stretch of the host's drift)."""
    settings = Settings([4, 12], [1, 2], [8, 16], [1, 16], repeats=4, passes=2,
                        chunk_kv=(8,), prefill_batch_tokens=(36,))  # fmt: skip

    def orders(settings):
        prof = Profiler.__new__(Profiler)
        prof.settings, out = settings, []
        for prof.passes_done in range(settings.passes):
            out.append([(f.func.__name__, f.args, tuple(f.keywords.items()))
                        for f in prof.pass_shapes()])  # fmt: skip
        return out

    first, second = orders(settings)
    grid = orders(replace(settings, shuffle=False))[0]
    # 2 prompts, their pairs, 2 chunks, the batch of 3 and 3 prompts of 4, 4 decode shapes
    assert len(grid) == len(set(grid)) == settings.num_iterations == 12
    assert sorted(first) == sorted(second) == sorted(grid)
    assert first != grid and second != first
    assert orders(settings) == [first, second]  # seeded
    assert orders(replace(settings, seed=1)) != [first, second]
    kinds = [name for name, *_ in grid]
    assert kinds.index("decode") == len(kinds) - 4 and "decode" not in kinds[:-4]
    assert grid[:3] == [("prefill", (4, 2), ()), ("prefill", (4, 2), (("prompts", 2),)),
                        ("chunk", (4, 8, 2), ())]  # fmt: skip
    with pytest.raises(measure.SettingsError, match="shuffle=yes: must be true or false"):
        Settings.from_config({"grid": {"prefill_tokens": [4], "decode_batch": [1],
                                       "decode_kv": [8], "expert_tokens": [1]},
                              "routing": {"prompts": 1, "prompt_tokens": 8}, "warmup": 0,
                              "repeats": 1, "clock": "wall", "seed": 0,
                              "shuffle": "yes"})  # fmt: skip


def test_a_router_sample_is_an_iterations_mean_over_its_layers():
    """DeepSeek-V3's first layer is dense: its whole MLP runs in its router stage (1 ms here,
    the others' gates 0.1 ms). A median over all layers' stages kept 0.1 and lost the dense
    MLP; the iteration's mean over its layers (0.4) times the layers charges it all."""
    ref = measure.StageRef
    stages = [measure.StageTime(ref(0, "prepare", -1, -1), 0, 0.2)]
    for layer, router_ms in enumerate((1.0, 0.1, 0.1)):
        stages += [measure.StageTime(ref(0, "attention", layer, -1), 0, 0.5),
                   measure.StageTime(ref(0, "router", layer, -1), 0, router_ms),
                   measure.StageTime(ref(0, "expert", layer, 0), 1, 0.3)]  # fmt: skip
    stages.append(measure.StageTime(ref(0, "lm_head", -1, -1), 0, 0.4))
    total = sum(st.ms for st in stages)
    prof = Profiler.__new__(Profiler)
    prof.samples, prof.expert_samples, prof.totals = defaultdict(list), [], defaultdict(list)
    prof.totals_pass, prof.totals_unit, prof.passes_done = defaultdict(list), defaultdict(list), 0
    prof.record([(total, stages)] * 3, num_tokens=1, batch=1, kv=8)
    assert prof.samples[("router", 0, 1, 0)] == [pytest.approx(0.4)] * 3
    assert prof.samples[("attn_decode", 1, 0, 8)] == [0.5] * 9
    # what the stage medians leave of the iteration: the prepare stage alone, also filed as
    # prepare_decode (which step_overhead keeps: a prefill's plan swaps it for its own)
    assert prof.samples[("step_overhead", 1, 0, 0)] == [pytest.approx(0.2)]
    assert prof.samples[("prepare_decode", 1, 0, 0)] == [0.2] * 3
    assert prof.samples[("lm_head", 1, 0, 0)] == [0.4] * 3


def test_a_prefill_files_its_own_prepare_and_lm_head_stages_by_its_tokens_and_prompts():
    """A prefill's prepare stage embeds and masks all its N tokens and its lm_head stage runs
    the last layer's combine over them: filed as prepare_prefill and lm_head_prefill at N and
    its prompt count (one prompt: 0; a pair of 8 apart from one prompt of 16, which it pooled
    with until 2026-12-05: each prompt adds its own mask and row), never as the decode's
    lm_head(batch 0) nor into step_overhead."""
    ref = measure.StageRef

    def run(prepare_ms, lm_head_ms):
        stages = [measure.StageTime(ref(0, "prepare", -1, -1), 0, prepare_ms),
                  measure.StageTime(ref(0, "attention", 0, -1), 0, 0.5),
                  measure.StageTime(ref(0, "router", 0, -1), 0, 0.1),
                  measure.StageTime(ref(0, "expert", 0, 0), 16, 0.3),
                  measure.StageTime(ref(0, "lm_head", -1, -1), 0, lm_head_ms)]  # fmt: skip
        return sum(st.ms for st in stages), stages

    prof = Profiler.__new__(Profiler)
    prof.samples, prof.expert_samples, prof.totals = defaultdict(list), [], defaultdict(list)
    prof.totals_pass, prof.totals_unit, prof.passes_done = defaultdict(list), defaultdict(list), 0
    prof.record([run(0.3, 0.25)] * 2, num_tokens=16)
    prof.record([run(0.4, 0.35)] * 2, num_tokens=16, prompts=2)
    prof.record([run(0.6, 0.5)], num_tokens=64)
    assert prof.samples[("prepare_prefill", 0, 16, 0)] == [0.3, 0.3]
    assert prof.samples[("lm_head_prefill", 0, 16, 0)] == [0.25, 0.25]
    assert prof.samples[("prepare_prefill", 2, 16, 0)] == [0.4, 0.4]
    assert prof.samples[("lm_head_prefill", 2, 16, 0)] == [0.35, 0.35]
    assert prof.samples[("prepare_prefill", 0, 64, 0)] == [0.6]
    assert ("lm_head", 0, 0, 0) not in prof.samples
    assert not any(op in ("step_overhead", "prepare_decode") for op, *_ in prof.samples)


def test_a_batched_prefill_files_its_router_and_experts_and_splits_its_attention(monkeypatch):
    """grid.prefill_batch_tokens: k prompts of the longest prefill_tokens in one iteration (TGI's
    batched prefill): the router sample is keyed by the k P tokens, the expert stages are
    samples, the attention stage (every prompt's) is not filed as attn_prefill(k P) but split:
    its part outside the calls (attn_prefill_outer(k P)) and what each later prompt adds
    (attn_prefill_next(P)), as the pairs of each prompt length (prefill_pairs) give them; the
    self-check predicts that batch of k prompts."""
    model, info = build_model("tiny-mixtral")
    runner = ModelRunner(model)
    begun = []
    begin = runner.begin

    def recording_begin(seqs, chunk_tokens=None):
        begun.append(tuple(s.num_cached for s in seqs) + (len(seqs[0].token_ids),))
        return begin(seqs, chunk_tokens)

    monkeypatch.setattr(runner, "begin", recording_begin)
    settings = Settings([4, 12], [1], [8], [1, 16, 64], warmup=0, repeats=2, wake_idle_ms=(),
                        prefill_batch_tokens=(12, 36, 40))  # fmt: skip
    prof = Profiler(runner, settings, torch.device("cpu"))
    prof.grid_pass()
    # 2 prompts, 2 pairs, 1 batch, 3 prompts of 4 (the batch's count at 12), 1 decode shape
    assert settings.num_iterations == 7 and settings.prompt_counts == [3]
    # its repeats (warmup=0: no warm-up), on new prompts of 12 -+ 12 // PREFILL_JITTER tokens
    assert begun.count((0, 0, 0, 11)) == 1 and begun.count((0, 0, 0, 13)) == 1
    assert begun.count((0, 0, 11)) == 1 and begun.count((0, 0, 13)) == 1  # the pairs
    assert begun.count((0, 0, 4)) == 2  # too short to jitter
    assert begun.count((0, 0, 0, 4)) == 2  # 3 prompts of 4: 12 tokens, as one prompt of 12
    prof.warm_up()  # the largest prefill first: the batch
    assert begun[-3] == (0, 0, 0, 12)
    points = prof.table()
    assert {p.num_tokens for p in points if p.op == "router"} == {1, 4, 8, 12, 24, 36}
    assert {p.num_tokens for p in points if p.op == "attn_prefill"} == {4, 12}
    assert {p.num_tokens for p in points if p.op == "attn_prefill_first"} == {4, 12}
    assert {p.num_tokens for p in points if p.op == "attn_prefill_next"} == {4, 12}
    # every prefill's once-per-iteration stages, by its tokens in all and its prompt count
    # (one prompt: 0); decode's by batch
    counted = {(0, 4), (0, 12), (2, 8), (2, 24), (3, 12), (3, 36)}
    for op in ("attn_prefill_outer", "prepare_prefill", "lm_head_prefill"):
        assert {(p.batch_size, p.num_tokens) for p in points if p.op == op} == counted
    assert {p.batch_size for p in points if p.op == "prepare_decode"} == {1}
    # 2 runs x layers stages each of the batch: one outer sample, one of the later calls' mean
    layers = runner.num_layers
    # (folded onto the grid's lengths from 3 x 11 and 3 x 13 tokens)
    folded = prof.folded()
    assert len(folded[("attn_prefill_outer", 3, 36, 0)]) == 2 * layers
    assert len(folded[("attn_prefill_next", 0, 12, 0)]) == 2 * 2 * layers  # pair, batch
    assert len(folded[("attn_prefill_first", 0, 12, 0)]) == 2 * 2 * layers
    assert max(n for n, _ in prof.expert_samples) > 12  # more than one prompt's tokens
    assert len(prof.totals[(0, 33, 0, 3)]) == len(prof.totals[(0, 39, 0, 3)]) == 1
    check = measure.build_profile(prof, info, "t", points).extra["self_check"]
    row = next(r for r in check["shapes"] if r["tokens"] == 39)  # as it ran
    assert row["phase"] == "prefill" and row["batch_size"] == 3
    assert settings.prefill_batches == [3]  # 12 tokens: one prompt; 36 and 40: three
    with pytest.raises(measure.SettingsError, match="prefill_batch_tokens"):
        replace(settings, prefill_batch_tokens=(0,)).validate()
    # without the pairs, attn_prefill_next would hold the longest prompt's point alone (3x too
    # long for short prompts), or be missing (a profile error after the whole grid): no split
    prof.settings = replace(settings, prefill_pairs=False)
    unsplit = prof.table()
    assert not {p.op for p in unsplit} & set(measure.SPLIT_OPS)
    assert {p.num_tokens for p in unsplit if p.op == "attn_prefill"} == {4, 12}
    measure.build_profile(prof, info, "t", unsplit)  # a valid profile


@pytest.mark.parametrize(
    "override, said",
    [
        ("grid.decode_batch='16'", "grid.decode_batch=16: must be a list of integers"),  # [1, 6]
        ("grid.decode_batch=16", "grid.decode_batch=16: must be a list of integers"),
        ("grid.decode_batch=abc", "grid.decode_batch=abc: must be a list of integers"),
        ("grid.decode_kv=[16,1.5]", "grid.decode_kv=[16, 1.5]: must be a list of integers"),
        ("grid.chunk_kv=[true]", "grid.chunk_kv=[True]: must be a list of integers"),
        ("wake.idle_ms=10", "wake.idle_ms=10: must be a list of integers"),
        ("routing.prompts=abc", "routing.prompts=abc: must be an integer"),
        ("passes=2.5", "passes=2.5: must be an integer"),
    ],
)
def test_a_grid_setting_that_is_not_a_list_of_integers_is_refused(override, said):
    # a string was iterated character by character ('16' profiled batches 1 and 6) and a
    # float truncated, with no word; anything else ended in a traceback
    cfg = app.compose_config([*SMALL, override])
    with pytest.raises(measure.SettingsError) as e:
        Settings.from_config(cfg)
    assert str(e.value).startswith(said), e.value


def test_settings_refuse_no_passes_read_a_null_wake_as_off_and_warn_of_batches_not_run(capsys):
    """passes=0 ran one pass and recorded it; wake=null measured the default five idle times
    (9 repeats each); a prefill_batch_tokens value that makes no batch of its own, or the same
    batch as another, was dropped without a word while profile.json recorded it."""
    from omegaconf import OmegaConf

    from profiler.settings import Settings

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "profiler.yaml")
    assert Settings.from_config(cfg).wake_idle_ms  # measured by default
    assert "warning" not in capsys.readouterr().err  # the default grid runs what it names
    with pytest.raises(measure.SettingsError, match="^passes=0: must be an integer >= 1"):
        Settings.from_config(OmegaConf.merge(cfg, {"passes": 0}))
    assert Settings.from_config(OmegaConf.merge(cfg, {"wake": None})).wake_idle_ms == ()
    longest = max(cfg.grid.prefill_tokens)
    grid = {"grid": {"prefill_batch_tokens": [longest // 2, longest, 2 * longest,
                                              2 * longest + 1, 4 * longest]}}  # fmt: skip
    assert Settings.from_config(OmegaConf.merge(cfg, grid)).prefill_batches == [2, 4]
    err = capsys.readouterr().err
    assert f"grid.prefill_batch_tokens {longest // 2} with" in err and "no batch" in err
    assert f"{2 * longest}, {2 * longest + 1} with" in err and "profiled once" in err


def test_the_wake_up_gaps_are_waited_as_the_engine_waits(monkeypatch):
    """wake.wait (sleep by default, as the engine's idle_wait) is how each wake-up gap is
    waited, and is recorded in the profile's settings; a sleeping engine ran light-load
    iterations 6-13% slower on this VM than a spinning one, so a profile whose gaps were
    waited otherwise charges another engine's wake-up. spin holds the core (its CPU time),
    sleep gives it back."""
    from omegaconf import OmegaConf

    from profiler import settings as settings_module

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "profiler.yaml")
    assert Settings.from_config(cfg).wake_wait == "sleep"
    assert Settings.from_config(OmegaConf.merge(cfg, {"wake": {"wait": "spin"}})).wake_wait \
        == "spin"  # fmt: skip
    with pytest.raises(measure.SettingsError, match="^wake.wait=nap: expected one of sleep, s"):
        Settings.from_config(OmegaConf.merge(cfg, {"wake": {"wait": "nap"}}))
    for wait, held in (("spin", True), ("sleep", False)):
        cpu, wall = time.process_time(), time.perf_counter()
        settings_module.wait_idle(0.2, wait)
        assert time.perf_counter() - wall >= 0.2
        assert (time.process_time() - cpu > 0.1) is held, wait
    runner = ModelRunner(build_model("tiny-mixtral")[0])
    waited = []
    monkeypatch.setattr(measure, "wait_idle", lambda seconds, wait: waited.append((seconds, wait)))
    for wait in ("spin", "sleep"):
        settings = Settings([4], [1], [8], [1], wake_idle_ms=(3,), wake_repeats=1,
                            wake_wait=wait)  # fmt: skip
        Profiler(runner, settings, torch.device("cpu")).wake_points()
        assert waited.pop() == (0.003, wait)
        assert asdict(settings)["wake_wait"] == wait  # profile.json's extra.settings


def test_a_cuda_device_is_checked_and_made_current_and_its_cached_memory_counts_free(monkeypatch):
    """Faked CUDA (no GPU here; not run on one): cuda:N becomes the current device (CUDA events
    record on the current device's stream: cuda:1 timed device 0's idle stream); an index torch
    does not see, or a malformed name, is one ModelError; the memory torch's caching allocator
    holds unused counts as free for the KV (mem_get_info counts it taken)."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert models.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]
    assert models.resolve_device("cuda") == torch.device("cuda") and len(current) == 1
    with pytest.raises(ModelError, match=r"^device=cuda:5: torch sees 2 CUDA device\(s\)"):
        models.resolve_device("cuda:5")
    with pytest.raises(ModelError, match="^unknown device 'cudax'"):
        models.resolve_device("cudax")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 9 << 30)
    assert models.available_bytes(torch.device("cuda", 0)) == 43 << 30
