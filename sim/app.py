"""``qllm-sim``: the Hydra app (also ``python -m sim``).

Examples::

    qllm-sim policy=qllm workload=paper workload.rate=5 workload.num_requests=500 seed=1
    qllm-sim -m policy=iteration,qllm workload.rate=1,3,5
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from sim import profiles, provenance
from sim.cli import CONF_DIR, FINISHED, App, discard_unfinished, fail, job, lock, run
from sim.config import SimConfig, UserError, ignored_keys, validate
from sim.metrics import write_outputs
from sim.run import build_policy, simulate

__all__ = ["CONF_DIR", "cli", "main"]
PROG = "qllm-sim"
# Arrivals faster than this many times the completions: the run is overloaded (see overload).
OVERLOAD_RATIO = 1.5
# Settings that change no result: a finished run with other values of these is still the run.
NOT_RESULTS = ("progress", "resume")

ConfigStore.instance().store(name="base_config", node=SimConfig)


_ignored_warned: set[str] = set()  # once per invocation, not once per run of a sweep


def config_notes(cfg: DictConfig, ignored: list[str] | None = None) -> None:
    """A warning for each key set where nothing reads it (``ignored_keys``, and ``ignored``:
    the caller's own), and a note of how much of a trace the workload replays: each line
    once per invocation (a sweep checks every job's config). qllm-sim's and qllm-realrun's."""
    lines = [f"warning: {line}" for line in [*ignored_keys(cfg), *(ignored or [])]]
    rows, n = _trace_rows(cfg.workload), cfg.workload.num_requests
    if rows is not None and n > rows:
        lines.append(f"note: workload.num_requests={n} is more than the trace's {rows} requests: "
                     f"it is replayed {n / rows:.3g} times over (its bursts recur)")  # fmt: skip
    elif rows is not None and n < rows:  # the preset's default of 1,000: a trace's first minutes
        lines.append(f"note: workload.num_requests={n} replays the first {n} of the trace's "
                     f"{rows} requests ({n / rows:.1%}); the rest are not used")  # fmt: skip
    for line in lines:
        if line not in _ignored_warned:
            _ignored_warned.add(line)
            print(line, file=sys.stderr)


def check(cfg: DictConfig) -> None:
    """What can be checked before Hydra makes a run directory; and a warning for each key set
    where nothing reads it."""
    validate(cfg)
    config_notes(cfg)
    build_policy(cfg.policy)
    profiles.load(cfg.profile.name, cfg.profile.path)


def _trace_rows(workload) -> int | None:
    """How many requests the workload's trace holds (None: not a trace, or no such file)."""
    kind = getattr(workload.kind, "value", workload.kind)
    path = Path(workload.path).expanduser() if kind == "trace" and workload.path else None
    if path is None or not path.is_file():
        return None  # a missing file is the workload's error, named when it is read
    stat = path.stat()
    return _rows(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _rows(path: str, size: int, mtime_ns: int) -> int:
    from sim.workloads import trace

    return len(trace.read_trace(Path(path))[0])


APP = App(PROG, "config", ("workload", "profile", "policy", "slo"), free_keys=("policy",),
          check=check, resumable=True)  # fmt: skip


def job_config(cfg: DictConfig) -> dict:
    """The resolved settings that determine the results, as summary.json stores them."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return json.loads(json.dumps({k: v for k, v in plain.items() if k not in NOT_RESULTS}))


def load_rates(requests: pd.DataFrame) -> tuple[float, float] | None:
    """(arrivals per second over the span of arrivals, completions per second from the first
    arrival to the last completion), or None where a run has too few arrivals to tell."""
    arrivals, finishes = requests["arrival_s"], requests["finish_s"].dropna()
    span_s = arrivals.max() - arrivals.min()
    busy_s = (finishes.max() - arrivals.min()) if len(finishes) else float("inf")
    if len(arrivals) < 2 or span_s <= 0 or busy_s <= 0:
        return None
    return len(arrivals) / span_s, len(finishes) / busy_s


def overload(requests: pd.DataFrame) -> str | None:
    """A warning when arrivals outpace what the machine completed: arrivals per second over
    the span of arrivals against completions per second from the first arrival to the last
    completion. Above OVERLOAD_RATIO the queue grows all run long and the latencies measure
    the backlog (they grow with num_requests), not a steady state."""
    rates = load_rates(requests)
    if rates is None:
        return None
    arrival_rate, completion_rate = rates
    arrivals = requests["arrival_s"]
    if arrival_rate <= OVERLOAD_RATIO * completion_rate:
        return None
    rates = (f"arrivals at {arrival_rate:.3g} req/s exceed the {completion_rate:.3g} req/s the "
             f"machine completed ({arrival_rate / completion_rate:.1f}x)")  # fmt: skip
    if len(arrivals) < FEW_SAMPLES:  # the drain of one long request can decide the ratio
        return (f"note: {rates} in a run of {len(arrivals)} requests, too few to tell a "
                "backlog from the drain of its last requests")  # fmt: skip
    return f"warning: {rates}: the latencies measure the backlog, not a steady state"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@job
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        profile = profiles.load(cfg.profile.name, cfg.profile.path)
    except UserError as e:
        discard_unfinished(run_dir)
        fail(PROG, str(e))
    cfg.profile.name = profile.name  # a run is labelled with the profile it used
    config, inputs = job_config(cfg), provenance.inputs(cfg)
    if hc.mode != RunMode.MULTIRUN:  # a single run's directory was claimed by cli()
        return run_job(cfg, run_dir, config, inputs)
    fd = lock(run_dir)
    if fd is None:
        print(f"skipping {run_dir}: another process is running it", flush=True)
        return None
    try:
        finished = run_dir / FINISHED
        if finished.is_file():
            summary = json.loads(finished.read_text())
            # a finished run is today's only if made by the same config from the same code,
            # profile and workload file
            same = summary.get("config") == config
            if cfg.resume and same and summary.get("inputs") == inputs:
                save_config(cfg, run_dir)  # Hydra rewrote it on launch: the profile's name
                print(f"skipping finished run {run_dir}", flush=True)
                return summary["classes"]["LS"]["ttft_s"]["mean"]
            if cfg.resume:
                why = ("its config differs from the finished run's" if not same
                       else rerun_reason(summary.get("inputs"), inputs))  # fmt: skip
                print(f"rerunning {run_dir}: {why}", flush=True)
            os.unlink(finished)  # the directory holds no finished run until this one finishes
        return run_job(cfg, run_dir, config, inputs)
    finally:
        os.close(fd)


def rerun_reason(before: dict | None, now: dict) -> str:
    """Which of a finished run's inputs differ from today's, in words."""
    if not before:
        return "it records no inputs (made by a qllm-sim from before summary.json had them)"
    what = {"code": "the simulator's code", "profile": "the profile's files",
            "workload": "the workload file",
            "data": "the installed data sets or tokenizer"}  # fmt: skip
    changed = provenance.changed(before, now)
    return " and ".join(what.get(k, k) for k in changed) + " changed since it finished"


def save_config(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's copy of the run's config and overrides, with the profile's own name (Hydra
    wrote the name the command gave, which ``profile.path`` overrides)."""
    hc = HydraConfig.get()
    if hc.output_subdir is not None:
        OmegaConf.save(cfg, run_dir / hc.output_subdir / "config.yaml")
        overrides = OmegaConf.create(list(hc.overrides.task))
        OmegaConf.save(overrides, run_dir / hc.output_subdir / "overrides.yaml")


def run_job(cfg: DictConfig, run_dir: Path, config: dict, inputs: dict) -> float | None:
    save_config(cfg, run_dir)
    try:
        out = simulate(cfg)
    except UserError as e:
        discard_unfinished(run_dir)
        fail(PROG, str(e))
    # again: a sweep that found this job running skipped it, but Hydra had rewritten the
    # directory's .hydra/ with that sweep's config first
    save_config(cfg, run_dir)
    # summary.json is the run's record: its results, the config that produced them and the
    # digests of what they were made from, written in one atomic step, so they never disagree
    write_outputs(run_dir, out.requests, {**out.summary, "config": config, "inputs": inputs},
                  {"replicas": out.timeline})  # fmt: skip
    ls, be = out.summary["classes"]["LS"], out.summary["classes"]["BE"]
    jobs_per_s = out.summary["throughput"]["jobs_per_s"]
    print(
        f"policy={cfg.policy.name} rate={cfg.workload.rate} "
        f"ls_ttft_mean_s={_fmt(ls['ttft_s']['mean'])} be_ttft_mean_s={_fmt(be['ttft_s']['mean'])} "
        f"ls_slo={_fmt(ls['slo_attainment'])} jobs_per_s={jobs_per_s:.3f} -> {run_dir}",
        flush=True,  # joblib workers share the terminal: print each line whole, now
    )
    for warning in [overload(out.requests), *few_samples(out.summary)]:
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return ls["ttft_s"]["mean"]


FEW_SAMPLES = 100  # below: a class's p99 is, to within one sample, its largest value


def few_samples(summary: dict) -> list[str]:
    """A warning for each class whose percentiles rest on fewer than FEW_SAMPLES requests."""
    out = []
    for cls in ("LS", "BE"):
        n = summary["classes"][cls]["count"]
        if 0 < n < FEW_SAMPLES:
            out.append(f"warning: {cls} has {n} requests in this run: its p99 rests on fewer "
                       f"than {FEW_SAMPLES} samples (it is about their largest); more "
                       "workload.num_requests make it a percentile")  # fmt: skip
    return out


def _fmt(x) -> str:
    return "nan" if x is None else f"{x:.3f}"


def cli() -> None:
    run(APP, main)
