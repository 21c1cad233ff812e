"""Structured configs of ``qllm-realrun`` and ``qllm-validate``, and their range checks.

The workload, policy and slo groups are the simulator's own (``sim.config``), so a run of the
real engine and a simulation read the very same settings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from omegaconf import MISSING

from sim.config import MemoryConfig, ProfileConfig, SloConfig, UserError, WorkloadConfig
from sim.config import validate as validate_sim


class ClockKind(enum.Enum):
    wall = "wall"  # arrivals replayed in real time
    virtual = "virtual"  # each stage costs virtual_stage_ms, idle time is skipped (tests)
    cpu = "cpu"  # this process's CPU time while busy, arrivals' gaps while idle (shared CPUs)


class IdleWait(enum.Enum):
    """How the engine waits when it has nothing to run (``profiler.settings.IDLE_WAITS``)."""

    sleep = "sleep"  # gives the core back to the OS (and to whatever else runs on it)
    spin = "spin"  # polls the clock on its core


class TraceLevel(enum.Enum):
    stages = "stages"  # every stage that did work, plus batches and requests
    batches = "batches"  # batches and requests only
    off = "off"


@dataclass
class ModelConfig:
    """The ``model`` group (conf/model), as ``profiler.models.build_model`` reads it."""

    name: str = "tiny-mixtral"
    path: str | None = None  # a local checkpoint directory (its tokenizer is used if it has one)
    config: dict[str, Any] = field(default_factory=dict)  # preset config overrides


@dataclass
class EngineConfig:
    """What the real engine needs beyond the shared groups."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "auto"  # auto (cuda when present) | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | float64 | ...
    threads: int | None = 1  # torch CPU threads; null: torch's default
    max_prompt_tokens: int = 512  # prompts are cut to this many tokens
    seed: int = 0
    warmup: bool = True  # run a few iterations before the clock starts
    # how idle gaps are waited: sleep, or spin (on a shared machine a sleeping engine ran
    # every light-load iteration 6-13% slower: profiler.settings.IDLE_WAITS)
    idle_wait: IdleWait = IdleWait.sleep


@dataclass
class RealrunConfig(EngineConfig):
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    policy: Any = MISSING
    slo: SloConfig = field(default_factory=SloConfig)
    kv_capacity_tokens: int | None = None  # null: measured KV bytes per token vs free memory
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # the simulator's group
    clock: ClockKind = ClockKind.wall
    virtual_stage_ms: float = 1.0
    trace: TraceLevel = TraceLevel.batches
    progress: bool = True


@dataclass
class ValidateConfig(EngineConfig):
    name: str | None = None  # results/validation/<name>/; null: <model>-<device type>
    out_dir: str = "results/validation"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    policies: list[str] = field(default_factory=lambda: ["fcfs", "iteration", "qllm"])
    # Offered load as the utilization of a server that runs one request at a time: rate =
    # utilization / (profiled time to serve the mean request alone).
    utilizations: list[float] = field(default_factory=lambda: [0.3, 1.5, 6.0])
    replays: int = 3  # real runs per point: their spread is the real engine's own noise
    # more requests at a point whose workload.num_requests arrivals would span less than this
    min_run_s: float = 2.0
    # fewer at a point whose workload.num_requests arrivals would span more than this (0: off)
    max_run_s: float = 12.0
    # each point is also simulated with every iteration this much slower and faster: how
    # far its figures move says how well a timing model can predict them at all (0: off)
    sensitivity_pct: float = 2.0
    # each round's real runs in a seeded random order (another each round), so that the host's
    # drift and what the profile's pass before a round leaves behind fall on every load alike;
    # false: the loads in turn (light, knee, overload), each policy in turn
    shuffle: bool = True
    clock: ClockKind = ClockKind.wall  # wall, or cpu (the profile then on the process clock)
    profile: dict[str, Any] = field(default_factory=dict)  # path, or the profiler's settings
    progress: bool = True
    # wall seconds from the start within which the real runs and the profile's passes between
    # them must end: a run or pass that would end past it is not started, and the points run
    # so far are reported (realrun.validate.RunBudget); null: no limit
    time_budget_s: float | None = None


def validate_engine(cfg: Any) -> None:
    def need(ok: bool, key: str, allowed: str) -> None:
        if not ok:
            raise UserError(f"{key}={cfg[key]}: {allowed}")

    need(cfg.max_prompt_tokens >= 1, "max_prompt_tokens", "must be >= 1")
    need(cfg.threads is None or cfg.threads >= 1, "threads", "must be >= 1 or null")
    need(cfg.device in ("auto", "cpu") or cfg.device.startswith("cuda"), "device",
         "must be auto, cpu, cuda or cuda:<index>")  # fmt: skip
    clock = cfg.get("clock")
    if clock is not None and ClockKind(clock) is ClockKind.cpu:
        import torch

        on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        if not on_cpu or cfg.threads != 1:
            raise UserError("clock=cpu: needs the CPU device and threads=1 (one thread's CPU "
                            "time is its time on a core of its own; a GPU's work is not CPU "
                            "time)")  # fmt: skip


def validate_shared(cfg: Any, policy: Any) -> None:
    """The simulator's own checks of the workload, policy, slo and (where the config has one)
    memory groups."""
    validate_sim(SimpleNamespace(workload=cfg.workload, profile=ProfileConfig(), policy=policy,
                                 slo=cfg.slo, memory=getattr(cfg, "memory", None),
                                 boundary_mode="lookup"))  # fmt: skip


def validate_realrun(cfg: Any) -> None:
    validate_engine(cfg)
    validate_shared(cfg, cfg.policy)
    if cfg.kv_capacity_tokens is not None and cfg.kv_capacity_tokens < 1:
        raise UserError(f"kv_capacity_tokens={cfg.kv_capacity_tokens}: must be >= 1 or null")
    if cfg.virtual_stage_ms <= 0:
        raise UserError(f"virtual_stage_ms={cfg.virtual_stage_ms}: must be > 0")
