"""``qllm-realrun``: the real engine's Hydra app (also ``python -m realrun``).

Examples::

    qllm-realrun policy=qllm workload.rate=10
    qllm-realrun -m policy=iteration,qllm seed=0,1
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from realrun.config import ClockKind, IdleWait, RealrunConfig, validate_realrun
from realrun.validate import PAGE_FAULT_WARNING
from sim.app import config_notes, few_samples, job_config, overload
from sim.cli import CONF_DIR, App, discard_unfinished, fail, job, run
from sim.config import UserError
from sim.metrics import write_outputs
from sim.run import build_policy

PROG = "qllm-realrun"

ConfigStore.instance().store(name="realrun_schema", node=RealrunConfig)


def check(cfg: DictConfig) -> None:
    """What can be checked before Hydra makes a run directory (and before torch loads); and,
    as qllm-sim, a warning for each key set where nothing reads it (until 2026-12-04 they
    went into summary.json's config as if applied) and a note of a trace cut short."""
    validate_realrun(cfg)
    ignored = []
    default_ms = RealrunConfig.virtual_stage_ms
    if ClockKind(cfg.clock) is not ClockKind.virtual and cfg.virtual_stage_ms != default_ms:
        ignored.append(f"virtual_stage_ms={cfg.virtual_stage_ms:g} is ignored without "
                       "clock=virtual")  # fmt: skip
    if ClockKind(cfg.clock) is ClockKind.virtual and IdleWait(cfg.idle_wait) is not IdleWait.sleep:
        ignored.append(f"idle_wait={IdleWait(cfg.idle_wait).value} is ignored with clock=virtual "
                       "(it skips idle time)")  # fmt: skip
    config_notes(cfg, ignored)
    build_policy(cfg.policy)


APP = App(PROG, "realrun", ("workload", "policy", "slo", "model"),
          free_keys=("policy", "model.config"), check=check)  # fmt: skip


@hydra.main(config_path=str(CONF_DIR), config_name="realrun", version_base="1.3")
@job
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate_realrun(cfg)  # before torch loads: a bad value fails at once
        from realrun.run import realrun

        out = realrun(cfg)
    except UserError as e:
        discard_unfinished(run_dir)
        fail(PROG, str(e))
    if out.trace is not None:
        out.trace.write(run_dir / "trace.json")
    # summary.json last (the run is complete), with the config that produced it: a report
    # reads that, not .hydra/config.yaml, which a relaunch into this directory rewrites first
    write_outputs(run_dir, out.requests, {**out.summary, "config": job_config(cfg)})
    s, r = out.summary, out.result
    ls, be = s["classes"]["LS"], s["classes"]["BE"]
    print(
        f"policy={cfg.policy.name} rate={cfg.workload.rate} "
        f"ls_ttft_mean_s={_fmt(ls['ttft_s']['mean'])} be_ttft_mean_s={_fmt(be['ttft_s']['mean'])} "
        f"jobs_per_s={s['throughput']['jobs_per_s']:.3f} iterations={r.iterations} "
        f"preemptions={r.preemptions} -> {run_dir}",
        flush=True,
    )
    faults = s["executor"].get("page_faults") or 0
    mapped = (f"warning: the run page-faulted {faults} times: host memory mapped in mid-run is "
              "in its times (warmup=false skips the warm-up's reserve of the run's KV "
              "footprint)" if faults > PAGE_FAULT_WARNING else None)  # fmt: skip
    for warning in [overload(out.requests), *few_samples(out.summary), mapped]:
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return ls["ttft_s"]["mean"]


def _fmt(x) -> str:
    return "nan" if x is None else f"{x:.4f}"


def cli() -> None:
    run(APP, main)
