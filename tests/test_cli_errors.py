"""Every entry point answers a bad command with one line, exit 2, and writes nothing."""

from __future__ import annotations

import importlib
import sys

import pytest

ENTRY_POINTS = {
    "qllm-sim": "sim.app",
    "qllm-realrun": "realrun.app",
    "qllm-validate": "realrun.validate",
    "qllm-profile": "profiler.app",
}
COMMON = [  # (argv, what the line must say)
    (["seed=1.5"], "seed=1.5: must be an integer"),
    (["+foo=1"], "+foo=1: unknown key"),
    (["foo=1"], "foo=1: unknown key"),
    (["~seed"], "~seed: cannot be removed"),
    (["seed=[1"], "seed=[1: not an override"),
]
WORKLOAD = [
    (["workload.rate=abc"], "workload.rate=abc: must be a number"),
    (["workload.arrival=poison"], "workload.arrival=poison: must be one of poisson, gamma"),
    (["workload.rate=1,2"], "workload.rate=1,2: several values sweep only with -m"),
    (["-m", "workload.rate=1,abc"], "workload.rate=abc: must be a number"),
    (["workload.max_output_tokens=0"], "workload.max_output_tokens=0: must be >= 1"),
    (["workload=nope"], "workload=nope: unknown workload; choose one of"),
]
POLICY = [
    (["policy.batch_size=8"], "policy.batch_size=8: unknown key; policy has"),
    (["-m", "policy=fcfs,nope"], "policy=nope: unknown policy; choose one of"),
    (["policy=qllm", "policy.merge=maybe"], "policy=qllm: merge=maybe: must be true or false"),
    # the keys of the policy chosen, not of the default one (qllm's, which vllm lacks and
    # iteration too: it listed max_in_flight as a key the iteration policy has)
    (["policy=vllm", "policy.max_batch_size=8"], "policy.max_batch_size=8: unknown key; policy "
     "has _target_, enable_chunked_prefill, max_num_batched_tokens, max_num_seqs, name, "
     "scheduling_policy"),
    (["policy=iteration", "policy.max_in_flight=32"], "policy.max_in_flight=32: unknown key; "
     "policy has _target_, max_batch_prefill_tokens, max_batch_size, max_batch_total_tokens, "
     "max_waiting_tokens, name, waiting_served_ratio"),
]  # fmt: skip
CASES = (
    [("qllm-sim", *c) for c in COMMON + WORKLOAD + POLICY]
    + [("qllm-sim", ["profile.path=/nonexistent"], "profile.path=/nonexistent: not a directory")]
    + [("qllm-sim", ["seed=-1"], "seed=-1: must be >= 0")]
    + [("qllm-sim", ["workload.rate=inf"], "workload.rate=inf: must be a finite number > 0")]
    + [("qllm-sim", ["workload=synthetic", "workload.prompt.dist=lognormal",
                     "workload.prompt.tokens=5000"],
        "workload.prompt.tokens=5000: must be in [prompt.min, prompt.max] = [1, 2048]")]
    # sweeps the basic sweeper cannot check or run (tracebacks until 2026-12-04), and ++
    + [("qllm-sim", ["-m", "workload.rate=interval(1,2)"],
        "workload.rate=interval(1,2): interval() needs a sweeper that samples"),
       ("qllm-sim", ["-m", "seed=glob(*)"], "seed=glob(*): glob() picks options of a config"),
       ("qllm-sim", ["-m", "policy=glob(zz*)"], "policy=glob(zz*): matches no policy"),
       ("qllm-sim", ["hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN: give -m (--multirun)"),
       ("qllm-sim", ["++seedx=3"], "++seedx=3: unknown key")]
    + [("qllm-realrun", *c) for c in COMMON + WORKLOAD + POLICY]
    + [("qllm-realrun", ["device=tpu"], "device=tpu: must be auto, cpu, cuda")]
    # qllm-validate sets each point's rate itself: a valid workload.rate is refused too
    + [("qllm-validate", *c) for c in COMMON + WORKLOAD if c[0] != ["-m", "workload.rate=1,abc"]]
    + [("qllm-validate", ["workload.rate=2"], "workload.rate=2.0: qllm-validate sets each point's "
        "rate from utilizations")]
    + [("qllm-profile", *c) for c in COMMON]
    + [("qllm-profile", ["threads=0"], "threads=0: must be an integer >= 1 or null"),
       ("qllm-profile", ["repeats=x"], "repeats=x: must be an integer >= 1"),
       ("qllm-profile", ["decode_warmup=-1"], "decode_warmup=-1: must be an integer >= 0"),
       ("qllm-validate", ["profile.decode_warmup=1.5"],
        "profile.decode_warmup=1.5: must be an integer >= 0"),
       ("qllm-validate", ["profile.repeats=0"], "profile.repeats=0: must be an integer >= 1"),
       ("qllm-validate", ["profile.wake.prompt_tokens=0"],
        "profile.wake.prompt_tokens=0: must be an integer >= 1"),
       # every rule of profiler.settings.Settings, before torch and before any output
       ("qllm-validate", ["profile.wake.repeats=0"],
        "profile.wake.repeats=0: must be an integer >= 1"),
       ("qllm-validate", ["profile.routing.prompts=0"],
        "profile.routing.prompts=0: must be an integer >= 1"),
       ("qllm-profile", ["routing.prompt_tokens=0"],
        "routing.prompt_tokens=0: must be an integer >= 1"),
       ("qllm-profile", ["clock=cpu"], "clock=cpu: expected one of wall, process"),
       ("qllm-profile", ["model=nope"], "model=nope: unknown model; choose one of")]
    # a grid that is not a list of integers: '16' was profiled as batches 1 and 6, 1.5 as 1
    + [(prog, [f"{pre}grid.decode_batch={v}"], f"{pre}grid.decode_batch={said}: must be a list "
        "of integers")
       for prog, pre in (("qllm-profile", ""), ("qllm-validate", "profile."))
       for v, said in (("'16'", "16"), ("16", "16"), ("[4,1.5]", "[4, 1.5]"))]
)  # fmt: skip


@pytest.mark.parametrize("prog, argv, said", CASES, ids=[f"{p}:{' '.join(a)}" for p, a, _ in CASES])
def test_bad_command_is_one_line_exit_2_and_writes_nothing(
    prog, argv, said, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # the default run directories are relative to the cwd
    monkeypatch.setattr(sys, "argv", [prog, *argv])
    cli = importlib.import_module(ENTRY_POINTS[prog]).cli
    with pytest.raises(SystemExit) as exit_:
        cli()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: {said}"), lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, said",
    [(["--bogus", "x"], "unrecognized arguments: --bogus"), (["nope"], "nope: no such directory")],
)
def test_qllm_report_bad_command_is_one_line(argv, said, tmp_path, monkeypatch, capsys):
    from sim.report import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.strip().splitlines() == [f"qllm-report: error: {said}"]


def test_sharegpt_path_that_is_a_directory_says_so(tmp_path):
    from test_app import cfg

    from sim.config import UserError
    from sim.run import simulate

    with pytest.raises(UserError, match="a directory, not a ShareGPT JSON file"):
        simulate(cfg("workload=sharegpt", f"workload.path={tmp_path}", "workload.num_requests=5"))
