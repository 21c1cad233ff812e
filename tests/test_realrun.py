"""The real engine: every policy, with preemptions mid-layer and mid-expert, produces exactly
``model.generate``'s greedy tokens for every request; qllm-realrun writes the simulator's
output schema plus a Chrome trace; idle waits sleep; user errors are one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import greedy_setup
from omegaconf import OmegaConf

from policies.core import BE, LS, Request
from policies.scheduler import Scheduler
from profiler.models import ModelError, build_model
from profiler.ops import ModelRunner
from realrun.clock import CpuClock, VirtualClock, WallClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from realrun.trace import ChromeTrace
from sim.app import CONF_DIR
from sim.metrics import REQUEST_COLUMNS
from sim.run import build_policy

POLICIES = ("fcfs", "iteration", "priority", "alg1", "layer", "qllm")
STAGE_S = 1e-3  # virtual time per stage: an iteration of tiny-mixtral is 42 ms


def mixed_requests() -> list[Request]:
    """12 BE jobs with long outputs arrive first; 10 short LS jobs follow one by one while BE
    batches run, so most LS arrivals find a BE-only batch mid-iteration."""
    be = [Request(i, BE, 0.01 * i, 3 + (7 * i) % 37, 6 + i % 7) for i in range(12)]
    ls = [Request(12 + j, LS, 0.15 + 0.133 * j, 2 + (5 * j) % 23, 1 + j % 3) for j in range(10)]
    return be + ls


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the apps use: OpenMP teams on a busy 2-core machine run tiny ops
    ~30x slower and spin through idle waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def f64():
    """float64 (argmax ties cannot flip by rounding) with larger random weights, so greedy
    tokens depend on the whole context (as the runner's own exactness tests do)."""
    return greedy_setup(mixed_requests(), max_prompt_tokens=64)


class RecordingScheduler(Scheduler):
    """Keeps the cursor of every batch it suspends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursors: list[int] = []

    def preempt(self, now):
        self.cursors.append(self.running.cursor)
        return super().preempt(now)


def policy(name: str, max_batch_size: int = 6):
    cfg = OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml")
    cfg.max_batch_size = max_batch_size
    return build_policy(cfg)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_generates_exactly_the_greedy_tokens(f64, name):
    runner, requests, prompts, reference = f64
    sched = RecordingScheduler(policy(name), kv_capacity_tokens=100_000,
                               activation_tokens_per_token=1.0)  # fmt: skip
    trace = ChromeTrace()
    result = RealEngine(requests, prompts, sched, runner, VirtualClock(STAGE_S), trace).run()
    assert result.tokens == reference
    assert len(result.sequences) == len(requests) and all(s.done for s in result.sequences)
    # A resumed batch continues from its cursor: no stage of any iteration runs twice.
    assert result.stages == result.iterations * runner.num_stages
    assert sum(s.preemptions for s in result.sequences) >= result.preemptions
    if name in ("layer", "qllm"):  # named, not read from the code under test
        assert result.preemptions >= 8, f"{name}: only {result.preemptions} preemptions"
        where = [runner.locate(c) for c in sched.cursors]
        assert all(0 < c < runner.num_stages for c in sched.cursors)
        if name == "qllm":  # some stop between two experts
            assert any(ref.stage == "expert" and ref.expert > 0 for ref in where)
        preempted = [e for e in trace.events if e["name"].endswith("(preempted)")]
        assert len(preempted) == result.preemptions
    else:
        assert result.preemptions == 0


def test_virtual_clock_runs_are_deterministic(f64):
    runner, requests, prompts, _ = f64
    runs = []
    for _ in range(2):
        sched = Scheduler(policy("qllm"), kv_capacity_tokens=100_000)
        result = RealEngine(requests, prompts, sched, runner, VirtualClock(STAGE_S)).run()
        runs.append([(s.id, s.first_token_s, s.finish_s, s.preemptions) for s in result.sequences])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["iteration", "qllm"])
def test_each_segment_counts_the_requests_admitted_before_and_within_it(f64, name):
    """``Segment.admitted``: requests the engine admitted in the host time just before the
    segment, ``admitted_within``: at a preemptible boundary inside it (qllm's); one arriving
    at an idle engine is in neither (its admission is in the segment's idle time)."""
    runner, requests, prompts, _ = f64
    by_id = {r.id: r for r in requests}
    arrivals = {0: 0.0, 1: 0.2, 2: 0.5, 3: 0.8, 4: 0.8}  # 1-4 while 0 runs, 3 and 4 together
    reqs = [dataclasses.replace(by_id[i], arrival_s=t, output_tokens=30 if i == 0 else 2)
            for i, t in arrivals.items()]  # fmt: skip
    sched = Scheduler(policy(name), kv_capacity_tokens=100_000)
    segments = RealEngine(reqs, prompts, sched, runner, VirtualClock(STAGE_S)).run().segments
    before = [seg.admitted for seg in segments]
    within = [seg.admitted_within for seg in segments]
    assert before[0] == within[0] == 0  # request 0 found the engine idle
    assert sum(before) + sum(within) == 4
    if name == "iteration":  # admitted only between iterations
        assert sorted(n for n in before if n) == [1, 1, 2] and not any(within)
    else:
        assert any(within)


@pytest.mark.skipif(sys.platform != "linux", reason="page faults via resource")
def test_each_segment_counts_the_page_faults_taken_while_it_ran(f64):
    """Every segment carries its minor faults (host memory mapped mid-segment, in its measured
    time: the H200's runs slowed with them), none more than the whole run took."""
    runner, requests, prompts, _ = f64
    sched = Scheduler(policy("qllm"), kv_capacity_tokens=100_000)
    result = RealEngine(requests, prompts, sched, runner, VirtualClock(STAGE_S)).run()
    faults = [seg.faults for seg in result.segments]
    assert all(isinstance(f, int) and f >= 0 for f in faults), faults
    assert sum(faults) <= result.page_faults


@pytest.mark.parametrize("wait", ["sleep", "spin"])
def test_idle_waits_sleep_or_spin_as_idle_wait_says(wait):
    """idle_wait=sleep (the default) gives the core back while the engine waits for an
    arrival; spin holds it, polling the clock (a sleeping engine's core and caches went to
    other work on this VM, and its light-load iterations ran 6-13% slower). Either way the
    run lands on the arrival."""
    model, _ = build_model("tiny-mixtral")
    runner = ModelRunner(model)
    reqs, prompts = build_prompts([Request(0, BE, 0.0, 4, 2), Request(1, LS, 0.6, 4, 2)], 512,
                                  max_prompt_tokens=8, seed=0)  # fmt: skip
    sched = Scheduler(policy("qllm"), kv_capacity_tokens=1000)
    cpu = time.process_time()
    result = RealEngine(reqs, prompts, sched, runner, WallClock(wait)).run()
    cpu = time.process_time() - cpu
    assert result.makespan_s >= 0.6
    if wait == "sleep":
        assert cpu < 0.3, f"{cpu:.2f} s of CPU while sleeping 0.6 s for an arrival"
    else:  # the wait's CPU time, less whatever the machine took of the core meanwhile
        assert cpu > 0.3, f"{cpu:.2f} s of CPU while spinning 0.6 s for an arrival"
    assert WallClock().idle_wait == CpuClock().idle_wait == "sleep"
    with pytest.raises(ValueError, match="idle_wait=nap: expected one of sleep, spin"):
        WallClock("nap")


@pytest.mark.parametrize("wait", ["sleep", "spin"])
def test_the_cpu_clock_counts_work_and_idle_gaps_not_time_the_core_was_taken_away(wait):
    """clock=cpu: a stretch in which this process does not run (another holds the core; here
    an unaccounted sleep) does not advance it; work does, as its CPU time; an idle wait for an
    arrival takes that long (slept, or spun: its CPU time is not counted twice) and lands
    exactly on the arrival."""
    clock = CpuClock(wait)
    clock.start()
    time.sleep(0.2)
    assert clock.now() < 0.05
    before, cpu = clock.now(), time.process_time()
    while time.process_time() - cpu < 0.1:
        pass
    assert clock.now() - before == pytest.approx(0.1, abs=0.02)
    wall = time.perf_counter()
    clock.sleep_until(clock.now() + 0.3)
    assert time.perf_counter() - wall >= 0.3
    target = clock.now() + 0.25
    clock.sleep_until(target)
    assert clock.now() == pytest.approx(target, abs=0.005)


def test_a_cpu_clock_run_times_arrivals_and_work(tmp_path):
    done = run_cli(tmp_path, "workload=synthetic", "workload.num_requests=4", "workload.rate=10",
                   "workload.prompt.tokens=12", "workload.output.tokens=3", "policy=qllm",
                   "clock=cpu", "device=cpu")  # fmt: skip
    assert done.returncode == 0, done.stderr
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(df) == 4 and (df.ttft_s > 0).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["makespan_s"] >= df.arrival_s.max()
    bad = run_cli(tmp_path / "bad", "clock=cpu", "threads=2")
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("qllm-realrun: error: clock=cpu: needs the CPU device")


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "realrun", f"hydra.run.dir={tmp_path}", "progress=false",
         *overrides],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )  # fmt: skip


def test_cli_writes_the_simulator_schema_and_a_chrome_trace(tmp_path):
    done = run_cli(tmp_path, "workload=synthetic", "workload.num_requests=6", "workload.rate=50",
                   "workload.prompt.tokens=12", "workload.output.tokens=3", "policy=qllm",
                   "workload.ls_fraction=0.5", "trace=stages")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "policy=qllm" in done.stdout
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert list(df.columns) == REQUEST_COLUMNS and len(df) == 6
    assert (df.ttft_s > 0).all() and (df.turnaround_s >= df.ttft_s).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["executor"]["events"] > 0
    # what ran where the config says auto or null: device, dtype, threads, the KV capacity
    executor = summary["executor"]
    assert summary["config"]["device"] == "auto" and summary["config"]["dtype"] == "auto"
    assert (executor["device"], executor["dtype"], executor["threads"]) == ("cpu", "float32", 1)
    assert summary["config"]["kv_capacity_tokens"] is None and executor["kv_capacity_tokens"] > 0
    # the config that produced the results, as qllm-sim stores it: what a report reads
    # (.hydra/config.yaml is rewritten by a relaunch into the same directory)
    assert summary["config"]["policy"]["name"] == "qllm"
    assert summary["config"]["workload"]["rate"] == 50 and "progress" not in summary["config"]
    assert set(summary["classes"]) == {"LS", "BE", "all"}
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"prepare", "attention", "router", "expert", "lm_head",
                                         "prefill", "LS", "BE", "ttft"}  # fmt: skip
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and {"pid", "tid", "name"} <= set(e)
    assert sum(e["cat"] == "ttft" for e in spans) == 6
    # by default batches and requests only: stage records would slow the timed run
    default = run_cli(tmp_path / "default", "workload=synthetic", "workload.num_requests=3",
                      "workload.rate=50", "workload.prompt.tokens=12",
                      "workload.output.tokens=3")  # fmt: skip
    assert default.returncode == 0, default.stderr
    events = json.loads((tmp_path / "default" / "trace.json").read_text())["traceEvents"]
    cats = {e["cat"] for e in events if e["ph"] == "X"}
    assert "ttft" in cats and "prefill" in cats and not cats & {"attention", "expert"}


@pytest.mark.parametrize(
    "override, message",
    [("model=nope", "model=nope: unknown model"),
     ("workload.rate=-1", "workload.rate=-1.0: must be a finite number > 0"),
     ("max_prompt_tokens=0", "max_prompt_tokens=0: must be >= 1")],
)  # fmt: skip
def test_user_errors_are_one_line(tmp_path, override, message):
    done = subprocess.run(
        [Path(sys.executable).parent / "qllm-realrun", f"hydra.run.dir={tmp_path}", override],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    err = done.stderr.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exact_tokens_on_cuda():
    model, _ = build_model({"name": "tiny-mixtral", "config": {"initializer_range": 0.2}},
                           device="cuda", dtype="float64", seed=3)  # fmt: skip
    requests, prompts = build_prompts(mixed_requests(), 512, max_prompt_tokens=64, seed=0)
    sched = Scheduler(policy("qllm"), kv_capacity_tokens=100_000)
    result = RealEngine(requests, prompts, sched, ModelRunner(model), VirtualClock(STAGE_S)).run()
    for r in requests:
        ref = model.generate(
            torch.tensor([prompts[r.id]], device="cuda"),
            do_sample=False,
            max_new_tokens=r.output_tokens,
        )[0, r.prompt_tokens :].tolist()
        assert result.tokens[r.id] == ref
    assert result.preemptions >= 5


def test_keys_nothing_reads_are_warned_of_as_qllm_sim_does(tmp_path):
    """qllm-realrun took memory.block_size_tokens without paged memory, workload.cv without
    gamma arrivals and virtual_stage_ms on the wall clock without a word, and summary.json's
    config recorded them as applied; the p99 of a class of few requests went unflagged. The
    virtual clock skips idle time, so idle_wait=spin does nothing there."""
    done = run_cli(tmp_path, "workload=synthetic", "workload.num_requests=3", "workload.rate=50",
                   "workload.prompt.tokens=12", "workload.output.tokens=3", "clock=virtual",
                   "memory.block_size_tokens=64", "workload.cv=3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: memory.block_size_tokens=64 is ignored without memory.model=paged" in (
        done.stderr
    )
    assert "warning: workload.cv=3.0 is ignored without workload.arrival=gamma" in done.stderr
    assert "requests in this run: its p99 rests on fewer than 100 samples" in done.stderr
    assert "idle_wait" not in done.stderr  # the default: nothing to say
    done = run_cli(tmp_path / "spin", "workload=synthetic", "workload.num_requests=2",
                   "workload.rate=50", "workload.prompt.tokens=12", "workload.output.tokens=2",
                   "clock=virtual", "idle_wait=spin")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: idle_wait=spin is ignored with clock=virtual (it skips idle time)" in (
        done.stderr
    )
    done = run_cli(tmp_path / "wall", "workload=synthetic", "workload.num_requests=2",
                   "workload.rate=50", "workload.prompt.tokens=12", "workload.output.tokens=2",
                   "virtual_stage_ms=50")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: virtual_stage_ms=50 is ignored without clock=virtual" in done.stderr


def test_threads_null_is_torchs_default_again_after_a_job_set_one(monkeypatch):
    """In a -m sweep the jobs share the process: threads=null kept the previous job's count,
    so threads=1,null ran both on one thread."""
    from realrun import run as realrun_run

    monkeypatch.setattr(realrun_run, "DEFAULT_THREADS", 3)  # torch's own, as imported
    cfg = OmegaConf.create({"threads": 1, "model": {"name": "tiny-mixtral"}, "device": "cpu",
                            "dtype": "float32", "seed": 0})  # fmt: skip
    try:
        realrun_run.load_model(cfg)
        assert torch.get_num_threads() == 1
        cfg.threads = None
        realrun_run.load_model(cfg)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)  # this module's (one_thread)


def test_model_config_overrides_are_checked(tmp_path, capsys):
    """A misspelt override (num_local_expert) built the preset unchanged, and with model.path
    every override was dropped: both recorded in summary.json as applied."""
    model, _ = build_model({"name": "tiny-mixtral", "config": {"num_local_expert": 4}})
    assert model.config.num_local_experts == 8
    assert ("warning: model.config.num_local_expert is not a field of MixtralConfig"
            in capsys.readouterr().err)  # fmt: skip
    model, _ = build_model({"name": "tiny-mixtral", "config": {"num_local_experts": 4}})
    assert model.config.num_local_experts == 4 and capsys.readouterr().err == ""
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ModelError, match=r"model.config \['num_local_experts'\] with "
                                         r"model.path=.*apply to a preset only"):  # fmt: skip
        build_model({"path": str(tmp_path / "ckpt"), "config": {"num_local_experts": 2}})


def test_a_checkpoint_whose_tokenizer_does_not_load_is_warned_of(tmp_path, capsys):
    """A checkpoint with no tokenizer feeds random ids without a word (the tiny presets); one
    whose tokenizer files are there but do not load (a broken file, a missing package) is
    warned of: its text prompts would otherwise silently become random ids."""
    from realrun.prompts import load_tokenizer

    assert load_tokenizer(str(tmp_path)) is None
    assert capsys.readouterr().err == ""
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert load_tokenizer(str(tmp_path)) is None
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"warning: {tmp_path} has a tokenizer (tokenizer_config.json) that did not load ("
        )
        and "the prompts are random token ids" in err
    )


def test_default_run_directories_are_named_to_the_microsecond_as_qllm_sims():
    """Two qllm-realrun runs started in the same second got one directory, and the second was
    refused (its results lost); qllm-sim's names carry microseconds."""

    def dirs(name):  # unresolved: ${now:...} resolves only inside Hydra
        hydra = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / name), resolve=False)
        return [hydra["hydra"][kind]["dir"] for kind in ("run", "sweep")]

    for d in dirs("config.yaml") + dirs("realrun.yaml"):
        assert d.endswith("${now:%H-%M-%S-%f}"), d
