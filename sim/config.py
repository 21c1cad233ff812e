"""Structured configs (Hydra ConfigStore schemas) and the checks OmegaConf cannot express.

Every run is validated twice: OmegaConf checks types and enum values against these dataclasses
when the config is composed, and ``validate`` checks ranges and cross-field rules. Both fail
with one line naming the key and what is allowed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING


class UserError(Exception):
    """An error the user caused (bad value, bad path, malformed file): printed as one line."""


class WorkloadKind(enum.Enum):
    sharegpt = "sharegpt"
    humaneval = "humaneval"
    trace = "trace"
    synthetic = "synthetic"
    card = "card"  # HumanEval jobs are LS, ShareGPT jobs are BE


class Arrival(enum.Enum):
    poisson = "poisson"
    gamma = "gamma"
    trace = "trace"  # the trace's own timestamps (optionally rescaled to ``rate``)


class LengthDist(enum.Enum):
    fixed = "fixed"
    uniform = "uniform"  # integers in [min, max]
    lognormal = "lognormal"  # median = tokens, shape = sigma, clipped to [min, max]


class RoutingMode(enum.Enum):
    uniform = "uniform"
    zipf = "zipf"
    profile = "profile"


@dataclass
class LengthConfig:
    dist: LengthDist = LengthDist.fixed
    tokens: int = 128
    min: int = 1
    max: int = 2048
    sigma: float = 0.8


@dataclass
class WorkloadConfig:
    name: str = "paper"
    kind: WorkloadKind = WorkloadKind.sharegpt
    num_requests: int = 1000
    rate: float | None = 5.0  # requests/s; for arrival=trace, null keeps the trace's own rate
    arrival: Arrival = Arrival.poisson
    cv: float = 1.0  # coefficient of variation of gamma inter-arrival times
    ls_fraction: float = 0.2  # each job is LS with this probability
    path: str | None = None  # ShareGPT JSON or trace CSV; null: the packaged data set
    max_output_tokens: int | None = None  # cap on output tokens (max_new_tokens)
    peak_to_trough: float | None = None  # a daily rate curve: peak rate / trough rate
    period_s: float = 86_400.0  # the rate curve's period (a day)
    min_tokens: int = 4  # vLLM's ShareGPT filter
    max_prompt_tokens: int = 1024
    max_total_tokens: int = 2048
    prompt: LengthConfig = field(default_factory=LengthConfig)  # synthetic only
    output: LengthConfig = field(default_factory=LengthConfig)  # synthetic only


@dataclass
class ProfileConfig:
    name: str = "a100-mixtral-nf4-hf"  # a built-in profile, or one under results/profiles/
    path: str | None = None  # a profile directory; overrides name
    kv_capacity_tokens: int | None = None  # null: the profile's own figure
    routing: RoutingMode = RoutingMode.uniform
    routing_skew: float = 1.0  # zipf exponent
    prefill_attention: str | None = None  # per_prompt | batched; null: the profile's own


@dataclass
class PolicyConfig:
    _target_: str = MISSING
    name: str = MISSING
    max_batch_size: int | None = 32  # null: no cap (TGI's default)
    max_batch_prefill_tokens: int = 4096


@dataclass
class SloConfig:
    ls_ttft_s: float | None = 3.0  # null: LS has no TTFT SLO
    be_ttft_s: float | None = None  # null: BE has no TTFT SLO
    ls_tpot_s: float | None = None  # time per output token; null: none (goodput ignores it)
    be_tpot_s: float | None = None


@dataclass
class ClusterConfig:
    replicas: int = 1  # each replica: its own scheduler and latency model, one shared clock
    router: str = "round_robin"  # see sim/cluster.py: ROUTERS
    ls_replicas: int = 1  # ls_dedicated: how many replicas serve LS requests only


@dataclass
class MemoryConfig:
    model: str = "reserve"  # reserve (TGI: prompt + output on admission) | paged (vLLM, SGLang)
    block_size_tokens: int = 16  # paged: KV block size
    watermark: float = 0.01  # paged: blocks admission keeps free (vLLM V0's 0.01; V1: 0)
    preemption: str = "recompute"  # paged: recompute | swap (KV to host, vLLM V0's other mode)
    swap_space_gib: float = 4.0  # swap: host memory for swapped-out KV (vLLM's swap_space)


@dataclass
class SimConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    policy: Any = MISSING  # PolicyConfig or a subclass schema from conf/policy
    slo: SloConfig = field(default_factory=SloConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    seed: int = 0
    boundary_mode: str = "lookup"  # lookup (one event per step) | step (every boundary)
    # runs of decode iterations that nothing can change advance in one event (sim/engine.py);
    # false: iteration by iteration (same per-request results, slower)
    fast_forward: bool = True
    # simpy: the SimPy executor (every policy); compiled: the compiled loop (sim/kernel.py),
    # the same per-request results for the policies it covers, many times faster; auto:
    # compiled where it covers the run, else simpy (summary.json's executor.core says which)
    core: str = "simpy"
    # a progress bar on stderr; null: only for a run of 50,000 requests or more (minutes of
    # CPU) when stderr is a terminal
    progress: bool | None = None
    resume: bool = True  # skip a run whose directory already holds a summary.json


def _name(value: Any) -> str:
    """An enum-valued config key's value as its name (a plain config holds the string)."""
    return value.value if isinstance(value, enum.Enum) else str(value)


def _kind(cfg: Any) -> str:
    return _name(cfg.workload.kind)


# (group, key, the setting that makes it count, whether it does): a key set away from its
# default where nothing reads it is warned of (not refused: a sweep over the setting that
# decides, e.g. workload.arrival=poisson,gamma with workload.cv=2, sets it for some runs only)
IGNORED_UNLESS = [
    ("workload", "path", "workload.kind=sharegpt, card or trace",
     lambda c: _kind(c) in ("sharegpt", "card", "trace")),
    *[("workload", key, "workload.kind=sharegpt or card (its ShareGPT filter)",
       lambda c: _kind(c) in ("sharegpt", "card"))
      for key in ("min_tokens", "max_prompt_tokens", "max_total_tokens")],
    ("workload", "cv", "workload.arrival=gamma", lambda c: _name(c.workload.arrival) == "gamma"),
    ("workload", "period_s", "workload.peak_to_trough",
     lambda c: c.workload.get("peak_to_trough") is not None),
    *[("workload", key, "workload.kind=synthetic", lambda c: _kind(c) == "synthetic")
      for key in ("prompt", "output")],
    ("profile", "routing_skew", "profile.routing=zipf",
     lambda c: _name(c.profile.routing) == "zipf"),
    ("cluster", "ls_replicas", "cluster.router=ls_dedicated",
     lambda c: c.cluster.router == "ls_dedicated"),
    *[("memory", key, "memory.model=paged", lambda c: c.memory.model == "paged")
      for key in ("block_size_tokens", "watermark")],
    ("memory", "swap_space_gib", "memory.model=paged memory.preemption=swap",
     lambda c: c.memory.model == "paged" and c.memory.preemption == "swap"),
]  # fmt: skip
DEFAULTS = {"workload": WorkloadConfig(), "profile": ProfileConfig(), "cluster": ClusterConfig(),
            "memory": MemoryConfig()}  # fmt: skip
# the keys of a synthetic length distribution that each ``dist`` reads (synthetic.lengths)
LENGTH_KEYS_READ = {"fixed": ("tokens",), "uniform": ("min", "max"),
                    "lognormal": ("tokens", "sigma", "min", "max")}  # fmt: skip


# sglang's admission budget (new_token_ratio) and retraction: under paged memory only
SGLANG_BUDGET_KEYS = ("schedule_conservativeness", "init_new_token_ratio",
                      "min_new_token_ratio_factor", "new_token_ratio_decay_steps",
                      "retract_decode_steps", "clip_max_new_tokens_estimation")  # fmt: skip


def ignored_keys(cfg: Any) -> list[str]:
    """The keys set away from their defaults where nothing reads them (a workload kind, an
    arrival process, a routing model or a router that ignores them), each as one line naming
    what would read it."""
    from omegaconf import OmegaConf

    out = []
    for group, key, unless, counts in IGNORED_UNLESS:
        node = getattr(cfg, group, None)
        if node is None or key not in node:
            continue
        value, default = node[key], getattr(DEFAULTS[group], key)
        if OmegaConf.is_config(value):  # a length distribution: compared as plain values
            value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
            default = {k: getattr(v, "value", v) for k, v in asdict(default).items()}
        if value == default or counts(cfg):
            continue
        if isinstance(value, dict):  # name the sub-keys set
            out += [f"{group}.{key}.{k}={v} is ignored without {unless}"
                    for k, v in value.items() if v != default.get(k)]  # fmt: skip
        else:
            out.append(f"{group}.{key}={value} is ignored without {unless}")
    policy, memory = getattr(cfg, "policy", None), getattr(cfg, "memory", None)
    if policy is not None and memory is not None and memory.model != "paged":
        if policy.get("name") == "sglang":  # its admission budget reads paged memory only
            own = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "policy"
                                 / "sglang.yaml")  # fmt: skip
            out += [
                f"policy.{key}={policy[key]} is ignored without memory.model=paged"
                for key in SGLANG_BUDGET_KEYS
                if key in policy and policy[key] != own[key]
            ]
    if _kind(cfg) == "synthetic":  # a length key its distribution does not read
        for name in ("prompt", "output"):
            lengths = cfg.workload[name]
            for key in ("tokens", "min", "max", "sigma"):
                value, unread = lengths[key], key not in LENGTH_KEYS_READ[_name(lengths.dist)]
                if unread and value != getattr(LengthConfig(), key):
                    readers = " or ".join(d for d, keys in LENGTH_KEYS_READ.items() if key in keys)
                    out.append(f"workload.{name}.{key}={value} is ignored without "
                               f"workload.{name}.dist={readers}")  # fmt: skip
    return out


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(cfg: Any) -> None:
    """Range and cross-field checks; raises UserError naming the key."""
    w, p, pol, slo = cfg.workload, cfg.profile, cfg.policy, cfg.slo

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            raise UserError(f"{key}={value}: {allowed}")

    need(w.num_requests >= 1, "workload.num_requests", w.num_requests, "must be >= 1")
    seed = getattr(cfg, "seed", 0)  # numpy's SeedSequence takes no negative seed
    need(seed >= 0, "seed", seed, "must be >= 0")
    arrival = w.arrival.value if isinstance(w.arrival, enum.Enum) else w.arrival
    if w.rate is None:
        need(arrival == "trace", "workload.rate", None, "required unless workload.arrival=trace")
    else:
        # inf would put every arrival at 0 and write Infinity (not JSON) to summary.json
        need(0 < w.rate < math.inf, "workload.rate", w.rate,
             "must be a finite number > 0 (requests per second)")  # fmt: skip
    need(0 < w.cv < math.inf, "workload.cv", w.cv, "must be a finite number > 0")
    if getattr(w, "peak_to_trough", None) is not None:
        need(1 <= w.peak_to_trough < math.inf, "workload.peak_to_trough", w.peak_to_trough,
             "must be a finite number >= 1")  # fmt: skip
        need(0 < w.period_s < math.inf, "workload.period_s", w.period_s,
             "must be a finite number of seconds > 0")  # fmt: skip
    need(0 <= w.ls_fraction <= 1, "workload.ls_fraction", w.ls_fraction, "must be in [0, 1]")
    if w.max_output_tokens is not None:
        need(
            w.max_output_tokens >= 1,
            "workload.max_output_tokens",
            w.max_output_tokens,
            "must be >= 1",
        )
    for name in ("prompt", "output"):
        d = w[name]
        need(1 <= d.min <= d.max, f"workload.{name}.min", d.min, f"must be in [1, {name}.max]")
        need(d.tokens >= 1, f"workload.{name}.tokens", d.tokens, "must be >= 1")
        # a uniform length never reads tokens, a fixed one neither min nor max (its tokens
        # over max was refused, and raising max then warned that max is ignored)
        if {"tokens", "max"} <= set(LENGTH_KEYS_READ[_name(d.dist)]):
            need(d.min <= d.tokens <= d.max, f"workload.{name}.tokens", d.tokens,
                 f"must be in [{name}.min, {name}.max] = [{d.min}, {d.max}]")  # fmt: skip
        need(d.sigma > 0, f"workload.{name}.sigma", d.sigma, "must be > 0")
    if p.kv_capacity_tokens is not None:
        need(
            p.kv_capacity_tokens >= 1,
            "profile.kv_capacity_tokens",
            p.kv_capacity_tokens,
            "must be >= 1",
        )
    need(p.routing_skew >= 0, "profile.routing_skew", p.routing_skew, "must be >= 0")
    need(
        p.prefill_attention in (None, "per_prompt", "batched"),
        "profile.prefill_attention",
        p.prefill_attention,
        "must be per_prompt, batched or null (the profile's own)",
    )
    if "max_batch_size" in pol:  # vllm names its limits max_num_seqs, max_num_batched_tokens
        need(
            pol.max_batch_size is None
            or (_integer(pol.max_batch_size) and pol.max_batch_size >= 1),
            "policy.max_batch_size",
            pol.max_batch_size,
            "must be an integer >= 1, or null for no cap",
        )
        need(
            _integer(pol.max_batch_prefill_tokens) and pol.max_batch_prefill_tokens >= 1,
            "policy.max_batch_prefill_tokens",
            pol.max_batch_prefill_tokens,
            "must be an integer >= 1",
        )
    m = getattr(cfg, "memory", None)  # the real engine's config has no memory group
    if m is not None:
        need(m.model in ("reserve", "paged"), "memory.model", m.model, "must be reserve or paged")
        need(m.block_size_tokens >= 1, "memory.block_size_tokens", m.block_size_tokens, ">= 1")
        need(0 <= m.watermark < 1, "memory.watermark", m.watermark, "must be in [0, 1)")
        need(m.preemption in ("recompute", "swap"), "memory.preemption", m.preemption,
             "must be recompute or swap")  # fmt: skip
        need(m.preemption == "recompute" or m.model == "paged", "memory.preemption",
             m.preemption, "swap needs memory.model=paged")  # fmt: skip
        need(m.swap_space_gib >= 0, "memory.swap_space_gib", m.swap_space_gib, "must be >= 0")
    for key in ("ls_ttft_s", "be_ttft_s", "ls_tpot_s", "be_tpot_s"):
        value = getattr(slo, key, None)
        need(value is None or value > 0, f"slo.{key}", value, "must be > 0 seconds or null")
    c = getattr(cfg, "cluster", None)  # the real engine's config has no cluster group
    if c is not None:
        from sim.cluster import ROUTERS

        need(c.replicas >= 1, "cluster.replicas", c.replicas, "must be >= 1")
        need(c.router in ROUTERS, "cluster.router", c.router, f"one of {', '.join(ROUTERS)}")
        if c.router == "ls_dedicated":
            need(1 <= c.ls_replicas < c.replicas, "cluster.ls_replicas", c.ls_replicas,
                 "must be in [1, cluster.replicas - 1] for ls_dedicated")  # fmt: skip
    core = getattr(cfg, "core", "simpy")
    need(core in ("simpy", "compiled", "auto"), "core", core, "must be simpy, compiled or auto")
    need(
        cfg.boundary_mode in ("lookup", "step"),
        "boundary_mode",
        cfg.boundary_mode,
        "must be lookup or step",
    )
