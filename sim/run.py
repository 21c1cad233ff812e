"""One simulation run from a config: workload -> scheduler + latency model -> outputs."""

from __future__ import annotations

import inspect
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import simpy
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.memory import build_memory
from policies.scheduler import CapacityError, Policy, Scheduler
from profiler.schema import Profile
from sim import profiles
from sim.cluster import ROUTERS, Cluster, replica_stats
from sim.config import MemoryConfig, UserError, validate
from sim.engine import SimResult, Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.metrics import Records, records_outputs
from sim.workloads import Workload, stream_workload

LONG_RUN_REQUESTS = 50_000  # a bar by default from here: 15-20 CPU s on the conversation trace


@dataclass
class RunOutput:
    requests: pd.DataFrame
    summary: dict
    result: SimResult
    timeline: pd.DataFrame  # (t_s, replica, in_system) at every arrival and completion
    # what the latency models read beyond the profile's grid (LatencyModel.extrapolations)
    extrapolated: list[str] = field(default_factory=list)


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
    allowed = policy_options(cls)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise UserError(f"policy.{unknown[0]}: not a setting of policy {name}; allowed: "
                        f"{sorted(allowed | {'name', '_target_'})}")  # fmt: skip
    for key, value in params.items():
        wrong = option_type_error(cls, key, value)
        if wrong:
            raise UserError(f"policy={name}: {key}={value}: {wrong}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as e:
        raise UserError(f"policy={name}: {e}") from None


# What a policy option's annotation (a string: policies use ``from __future__ import
# annotations``) takes, by the names in it; another annotation is not checked here.
_TAKES = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
}


def option_type_error(cls: type, key: str, value: Any) -> str | None:
    """Why ``value`` is not of the type ``cls``'s constructor declares for ``key`` (its own or
    a base's), or None. Hydra passes ``no``, ``off`` or ``abc`` through as strings, and a
    policy that reads one as a flag takes any of them for true (``evict_be_for_ls=no``
    evicted)."""
    for klass in cls.__mro__[:-1]:
        if "__init__" in klass.__dict__:
            param = inspect.signature(klass.__init__).parameters.get(key)
            if param is not None:
                break
    else:
        return None
    annotation = param.annotation
    if not isinstance(annotation, str):
        annotation = getattr(annotation, "__name__", str(annotation))
    names = [n.strip() for n in annotation.split("|")]
    if not names or any(n not in _TAKES and n != "None" for n in names):
        return None  # an annotation this check does not read
    if value is None and "None" in names:
        return None
    if any(_TAKES[n][1](value) for n in names if n != "None"):
        return None
    takes = " or ".join(_TAKES[n][0] for n in names if n != "None")
    return f"must be {takes}" + (", or null" if "None" in names else "")


def policy_options(cls: type) -> set[str]:
    """A policy class's constructor arguments, and its bases' while the chain passes
    ``**kwargs`` on (vllm takes vLLM's own names and does not forward the base's)."""
    options: set[str] = set()
    for klass in cls.__mro__[:-1]:  # object's own arguments are no options
        if "__init__" in klass.__dict__:
            params = inspect.signature(klass.__init__).parameters
            options |= {p for p in params if p not in ("self", "kwargs")}
            if "kwargs" not in params:
                break
    return options


def build_scheduler(cfg: Any, profile) -> Scheduler:
    mem = profile.memory
    capacity = cfg.profile.kv_capacity_tokens or mem.kv_capacity_tokens
    m = cfg.memory if "memory" in cfg else MemoryConfig()
    try:
        swap_tokens = int(m.swap_space_gib * 2**30 // mem.kv_bytes_per_token)
        memory = build_memory(m.model, capacity, m.block_size_tokens, m.watermark, m.preemption,
                              swap_tokens)  # fmt: skip
    except ValueError as e:
        raise UserError(f"memory.{e}") from None
    return Scheduler(
        build_policy(cfg.policy),
        kv_capacity_tokens=capacity,
        activation_tokens_per_token=mem.activation_bytes_per_token / mem.kv_bytes_per_token,
        memory=memory,
    )


def build_latency(cfg: Any, profile, replica: int = 0) -> LatencyModel:
    """The latency model of one replica; replica 0 draws routing from ``cfg.seed`` itself,
    the others from independent streams derived from it."""
    m = profile.model
    seed = cfg.seed if replica == 0 else int(np.random.SeedSequence([cfg.seed, replica])
                                              .generate_state(1)[0])  # fmt: skip
    mode = getattr(cfg.profile.routing, "value", cfg.profile.routing)
    try:
        routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, mode=mode,
                               skew=cfg.profile.routing_skew, expert_load=profile.expert_load,
                               seed=seed, prompt_experts=profile.prompt_experts)  # fmt: skip
    except ValueError as e:
        raise UserError(f"profile.routing={mode}: {e}") from None
    prefill = cfg.profile.prefill_attention
    try:
        return LatencyModel(profile, routing, prefill_attention=prefill)
    except ValueError as e:
        raise UserError(f"profile.prefill_attention={prefill}: {e}") from None


def extrapolation_warning(profile_name: str, lines: list[str]) -> str:
    """The one-line warning of ops read beyond the profile's grid: ``lines`` as
    ``LatencyModel.extrapolations`` gives them ("<op> <key> up to <x> (grid ends at <y>)");
    several lines of one op (from several runs) merge into the largest input."""
    largest: dict[str, tuple[float, str]] = {}
    for line in lines:
        match = re.fullmatch(r"(.+?) up to ([0-9.e+-]+) (\(grid ends at .*\))", line)
        if match is None:  # not that form: kept as it is
            largest.setdefault(line, (math.inf, line))
            continue
        what, value = match.group(1), float(match.group(2))
        if what not in largest or value > largest[what][0]:
            largest[what] = (value, line)
    return (f"warning: profile {profile_name}: extrapolated beyond the grid (the last "
            "segment's slope, never downwards; held where a curve has one point): "
            + "; ".join(line for _, line in largest.values()))  # fmt: skip


class RunStopped(Exception):
    """A watched run was stopped before its end (``simulate``'s ``watch``): its outputs would
    be of a part of the run, so there are none. The message is the watch's ``reason``."""


def simulate(cfg: Any, requests=None, record_trace: bool = False, keep_sequences: bool = False,
             profile: Profile | None = None, warn: bool = True,
             watch=None) -> RunOutput:  # fmt: skip
    """Run ``requests`` (None: the config's workload, streamed: its requests are made as
    they arrive; a ``Workload``: streamed as well) and fold each request into the outputs as
    it finishes. ``watch``: an object whose ``start(env)`` returns an event that stops the
    run when triggered, and whose ``finished(seq)`` sees every request as it finishes
    (``qllm-plan``'s verdict): a stopped run raises ``RunStopped`` with ``watch.reason``,
    and has no outputs. ``keep_sequences``:
    also keep every Sequence object in ``result.sequences`` (tests compare them; a long run
    would hold gigabytes). ``profile``: this profile instead of the one ``cfg.profile``
    names (``qllm-validate``'s speed-adjusted diagnostic). The ops the latency model
    extrapolated beyond the profile's grid are in ``extrapolated``; ``warn``:
    also print them in one line (a caller that runs many simulations merges them)."""
    validate(cfg)
    ordered = requests is None or isinstance(requests, Workload)
    if requests is None:
        requests = stream_workload(cfg.workload, seed=cfg.seed)
    if profile is None:
        profile = profiles.load(cfg.profile.name, cfg.profile.path)
    progress = cfg.progress
    if progress is None:
        progress = len(requests) >= LONG_RUN_REQUESTS and sys.stderr.isatty()
    bar = tqdm(total=len(requests), desc="simulating", unit="req") if progress else None
    cluster_cfg = getattr(cfg, "cluster", None)  # absent from the real engine's validation cfg
    n = cluster_cfg.replicas if cluster_cfg else 1
    router_name = cluster_cfg.router if cluster_cfg else "round_robin"
    try:
        router = ROUTERS[router_name](n, cluster_cfg.ls_replicas if cluster_cfg else 1)
    except ValueError as e:
        raise UserError(f"cluster.router={router_name}: {e}") from None
    records = Records(replica_order=True)  # exact ITL figures as from the sequences
    scheds = [build_scheduler(cfg, profile) for _ in range(n)]
    latencies = [build_latency(cfg, profile, i) for i in range(n)]
    core = getattr(cfg, "core", "simpy")
    if core in ("compiled", "auto"):
        from sim.compiled import CompiledCluster, unsupported

        reason = unsupported(scheds, latencies)
        if reason is None and (record_trace or keep_sequences):
            reason = "a run that records a trace or keeps its sequences"
        if reason is None and cfg.boundary_mode != "lookup":  # it steps iterations, not stages
            reason = f"boundary_mode={cfg.boundary_mode}"
        if reason is not None and core == "compiled":
            raise UserError(f"core=compiled: does not run {reason}; core=simpy does")
        core = "simpy" if reason is not None else "compiled"
    if core == "compiled":
        cluster = CompiledCluster(requests, scheds, latencies, router_name,
                                  cluster_cfg.ls_replicas if cluster_cfg else 1, records,
                                  ordered=ordered, on_finished=bar.update if bar else None,
                                  watch=watch,
                                  decode_runs=getattr(cfg, "fast_forward", True))  # fmt: skip
    else:
        env = simpy.Environment()
        replicas = [Simulation([], sched, latency, mode=cfg.boundary_mode,
                               record_trace=record_trace, env=env,
                               fast_forward=getattr(cfg, "fast_forward", True),
                               keep_sequences=keep_sequences)
                    for sched, latency in zip(scheds, latencies, strict=True)]  # fmt: skip
        stop = watch.start(env) if watch is not None else None
        seen = watch.finished if watch is not None else None

        def finished(seq, replica: int) -> None:
            records.add(seq, replica)
            if seen is not None:
                seen(seq)
            if bar:
                bar.update()

        cluster = Cluster(requests, replicas, router, env, on_finish=finished, ordered=ordered,
                          stop=stop)  # fmt: skip
    try:
        ran = cluster.run()
        result = ran.result
    except CapacityError as e:
        raise UserError(f"{e.key or 'profile.kv_capacity_tokens'}: {e}") from None
    finally:
        if bar:
            bar.close()
    beyond = list(dict.fromkeys(line for lat in latencies for line in lat.extrapolations()))
    if beyond and warn:
        print(extrapolation_warning(profile.name, beyond), file=sys.stderr)
    if cluster.stopped:
        raise RunStopped(watch.reason)
    df, summary = records_outputs(records, result.makespan_s, result.events, result.wall_s,
                                  cfg.slo, with_replica=True)  # fmt: skip
    summary["executor"]["merges"] = sum(sched.merges for sched in scheds)
    summary["executor"]["core"] = core
    summary["cluster"] = {"replicas": n, "router": router_name,
                          "per_replica": replica_stats(ran)}  # fmt: skip
    return RunOutput(df, summary, result, ran.timeline, beyond)
