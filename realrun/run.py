"""One real-engine run from a config: workload -> prompts -> scheduler + model -> outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.core import Request
from policies.memory import build_memory
from policies.scheduler import CapacityError, Scheduler
from profiler.measure import Profiler, Settings
from profiler.models import ModelError, ModelInfo, build_model
from profiler.ops import ModelRunner, RunnerError
from profiler.schema import Memory
from realrun.clock import CpuClock, VirtualClock, WallClock
from realrun.config import ClockKind, IdleWait, TraceLevel, validate_realrun
from realrun.engine import RealEngine, RealResult
from realrun.prompts import build_prompts, load_tokenizer, random_ids
from realrun.trace import ChromeTrace
from sim.config import UserError
from sim.metrics import outputs
from sim.run import build_policy
from sim.workloads import build_workload


@dataclass
class RealOutput:
    requests: pd.DataFrame
    summary: dict
    result: RealResult
    trace: ChromeTrace | None


# torch's own thread count, before any job set one: threads=null restores it (in a -m sweep
# the jobs share the process, and threads=null ran with the previous job's count)
DEFAULT_THREADS = torch.get_num_threads()


def load_model(cfg: Any) -> tuple[ModelRunner, ModelInfo]:
    """The configured model on its device, behind a runner; model errors become UserErrors."""
    torch.set_num_threads(int(cfg.threads) if cfg.threads else DEFAULT_THREADS)
    model_cfg = cfg.model
    if isinstance(model_cfg, DictConfig):  # config overrides reach transformers as plain values
        model_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    try:
        model, info = build_model(model_cfg, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed)
        return ModelRunner(model), info
    except (ModelError, RunnerError) as e:
        raise UserError(f"model: {e}") from None


def prepare_requests(
    cfg: Any, runner: ModelRunner, requests: list[Request] | None = None
) -> tuple[list[Request], dict[int, list[int]]]:
    """The workload's requests (built from ``cfg.workload`` unless given) with the token ids
    they feed, prompts cut to ``cfg.max_prompt_tokens``."""
    if requests is None:
        requests = build_workload(cfg.workload, seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    return build_prompts(requests, runner.config.vocab_size, cfg.max_prompt_tokens, cfg.seed,
                         tokenizer)  # fmt: skip


def measure_memory(runner: ModelRunner) -> Memory:
    """KV and saved-activation bytes per token and the KV capacity, as the profiler defines
    them (so a run with a profile and one without account for memory alike)."""
    return Profiler(runner, Settings([1], [1], [1], [1]), runner.device).memory()


def warm_up(runner: ModelRunner, prompt_tokens: int, batch_size: int = 2) -> None:
    """The first calls of each torch op and GEMM shape are slow (allocations, kernel choice; on
    CUDA, kernels load at first use): before the clock starts, run a prefill of the longest
    prompt and decode steps of the largest batch the run will use, so that no request is
    charged for them."""
    vocab = runner.config.vocab_size
    runner.run(runner.begin([runner.new_sequence(random_ids(prompt_tokens, vocab, 0, 0))]))
    seqs = [runner.new_sequence(random_ids(8, vocab, 0, i + 1)) for i in range(batch_size)]
    for _ in range(3):  # the batch's prefill, then two decode steps
        runner.run(runner.begin(seqs))


# The warm-up maps this many times ``footprint_bytes``: a preempting policy also holds its
# suspended batch's padded KV, and buffers that sequences pin until they bind anew, and the
# heap fragments (tiny-olmoe, qllm at 6x load: the heap grew 150-370 MB over the run, against a
# footprint bound of 100 MB; a run that still page-faults is counted, and validation warns).
RESERVE_HEADROOM = 8


def footprint_bytes(requests: list[Request], batch_size: int, kv_bytes_per_token: int) -> int:
    """A bound on the KV bytes a run holds at once: every request's own cache at its full
    length (the engine sizes it so on admission), and two padded buffers of the largest decode
    batch at the longest length (a new batch's is made while the last one's still lives)."""
    lengths = [r.prompt_tokens + r.output_tokens for r in requests]
    return (sum(lengths) + 2 * batch_size * max(lengths)) * kv_bytes_per_token


def make_clock(kind: ClockKind, virtual_stage_ms: float = 1.0, idle_wait: str = "sleep"):
    """The run's clock; ``idle_wait`` (sleep | spin): how a real clock waits for an arrival."""
    if kind is ClockKind.virtual:
        return VirtualClock(virtual_stage_ms / 1e3)
    return CpuClock(idle_wait) if kind is ClockKind.cpu else WallClock(idle_wait)


def execute(
    requests: list[Request],
    prompts: dict[int, list[int]],
    scheduler: Scheduler,
    runner: ModelRunner,
    slo: Any,
    clock=None,
    trace: ChromeTrace | None = None,
    progress: bool = False,
    probe=None,
) -> RealOutput:
    """Run the engine over the requests and summarize in the simulator's schema (``probe``: a
    ``profiler.probe.SpeedProbe`` to run between iterations, ``RealResult.probes``)."""
    bar = tqdm(total=len(requests), desc="serving", unit="req") if progress else None
    engine = RealEngine(requests, prompts, scheduler, runner, clock, trace,
                        on_finish=(lambda _: bar.update()) if bar else None,
                        probe=probe)  # fmt: skip
    try:
        result = engine.run()
    except CapacityError as e:
        raise UserError(f"{e.key or 'kv_capacity_tokens'}: {e}") from None
    finally:
        if bar:
            bar.close()
    df, summary = outputs(result.sequences, result.makespan_s, result.stages, result.wall_s, slo)
    summary["executor"]["merges"] = scheduler.merges
    summary["executor"]["page_faults"] = result.page_faults
    return RealOutput(df, summary, result, trace)


def realrun(cfg: Any) -> RealOutput:
    """The ``qllm-realrun`` pipeline."""
    validate_realrun(cfg)
    runner, info = load_model(cfg)
    requests, prompts = prepare_requests(cfg, runner)
    memory = measure_memory(runner)
    capacity = cfg.kv_capacity_tokens or memory.kv_capacity_tokens
    m = cfg.memory
    try:
        swap_tokens = int(m.swap_space_gib * 2**30 // memory.kv_bytes_per_token)
        kv_memory = build_memory(m.model, capacity, m.block_size_tokens, m.watermark,
                                 m.preemption, swap_tokens)  # fmt: skip
    except ValueError as e:
        raise UserError(f"memory.{e}") from None
    policy = build_policy(cfg.policy)
    scheduler = Scheduler(
        policy,
        kv_capacity_tokens=capacity,
        activation_tokens_per_token=memory.activation_bytes_per_token / memory.kv_bytes_per_token,
        memory=kv_memory,
    )
    if cfg.warmup:
        # the policy's own cap (vllm names it max_num_seqs; null: infinite)
        largest_batch = int(min(policy.max_batch_size, len(requests)))
        warm_up(runner, max(r.prompt_tokens for r in requests), largest_batch)
        runner.reserve(
            RESERVE_HEADROOM * footprint_bytes(requests, largest_batch, memory.kv_bytes_per_token)
        )
    level = TraceLevel(cfg.trace)
    trace = None if level is TraceLevel.off else ChromeTrace(stages=level is TraceLevel.stages)
    clock = make_clock(
        ClockKind(cfg.clock),
        cfg.get("virtual_stage_ms", 1.0),
        IdleWait(cfg.get("idle_wait", "sleep")).value,
    )
    out = execute(requests, prompts, scheduler, runner, cfg.slo, clock, trace, cfg.progress)
    # what ran, where the config says auto or null (summary.json's config keeps what was asked:
    # a CPU and a GPU run of one config, or two jobs of a sweep that measured another free
    # memory, were otherwise told apart by nothing)
    out.summary["executor"].update({
        "device": str(info.device), "dtype": str(info.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "kv_capacity_tokens": int(capacity)})  # fmt: skip
    return out
