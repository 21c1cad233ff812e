"""One simulation run from a config: workload -> scheduler + latency model -> outputs."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import pandas as pd
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.scheduler import CapacityError, Policy, Scheduler
from sim import profiles
from sim.config import UserError, validate
from sim.engine import SimResult, Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.metrics import outputs
from sim.workloads import build_workload


@dataclass
class RunOutput:
    requests: pd.DataFrame
    summary: dict
    result: SimResult


def build_policy(cfg: Any) -> Policy:
    """Instantiate ``policy._target_`` with the other keys (but ``name``), checking each key
    against the constructor so a typo fails with the key's name."""
    params = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    target = params.pop("_target_", None)
    name = params.pop("name", target)
    try:
        cls = get_class(target)
    except Exception:
        raise UserError(f"policy._target_={target}: not an importable class") from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise UserError(f"policy._target_={target}: not a policies.Policy subclass")
    allowed = set()
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            sig = inspect.signature(klass.__init__)
            allowed |= {p for p in sig.parameters if p not in ("self", "kwargs")}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise UserError(f"policy.{unknown[0]}: not a setting of policy {name}; allowed: "
                        f"{sorted(allowed | {'name', '_target_'})}")  # fmt: skip
    try:
        return cls(**params)
    except (TypeError, ValueError) as e:
        raise UserError(f"policy={name}: {e}") from None


def build_scheduler(cfg: Any, profile) -> Scheduler:
    mem = profile.memory
    capacity = cfg.profile.kv_capacity_tokens or mem.kv_capacity_tokens
    return Scheduler(
        build_policy(cfg.policy),
        kv_capacity_tokens=capacity,
        activation_tokens_per_token=mem.activation_bytes_per_token / mem.kv_bytes_per_token,
    )


def build_latency(cfg: Any, profile) -> LatencyModel:
    m = profile.model
    mode = getattr(cfg.profile.routing, "value", cfg.profile.routing)
    try:
        routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, mode=mode,
                               skew=cfg.profile.routing_skew, expert_load=profile.expert_load,
                               seed=cfg.seed)  # fmt: skip
    except ValueError as e:
        raise UserError(f"profile.routing={mode}: {e}") from None
    prefill = cfg.profile.prefill_attention
    try:
        return LatencyModel(profile, routing, prefill_attention=prefill)
    except ValueError as e:
        raise UserError(f"profile.prefill_attention={prefill}: {e}") from None


def simulate(cfg: Any, requests=None, record_trace: bool = False) -> RunOutput:
    validate(cfg)
    if requests is None:
        requests = build_workload(cfg.workload, seed=cfg.seed)
    profile = profiles.load(cfg.profile.name, cfg.profile.path)
    bar = tqdm(total=len(requests), desc="simulating", unit="req") if cfg.progress else None
    sim = Simulation(requests, build_scheduler(cfg, profile), build_latency(cfg, profile),
                     mode=cfg.boundary_mode, record_trace=record_trace,
                     on_finish=(lambda _: bar.update()) if bar else None)  # fmt: skip
    try:
        result = sim.run()
    except CapacityError as e:
        raise UserError(f"profile.kv_capacity_tokens: {e}") from None
    finally:
        if bar:
            bar.close()
    beyond = sim.latency.extrapolations()
    if beyond:
        print(f"warning: profile {profile.name}: extrapolated linearly beyond the grid: "
              + "; ".join(beyond), file=sys.stderr)  # fmt: skip
    df, summary = outputs(result.sequences, result.makespan_s, result.events, result.wall_s,
                          cfg.slo)  # fmt: skip
    return RunOutput(df, summary, result)
