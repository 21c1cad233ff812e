"""``qllm-validate``: the simulator against the real engine, on this machine.

1. Profile the model in-process (``profiler.measure``, a grid sized to the workload), in
   (``replays`` + 1) x ``profile.passes_per_round`` passes over the grid (``ProfileSource``):
   that many now, and after each round of real replays, so that the profile samples the
   stretch of time the runs do; or read ``profile.path``.
2. Choose the rates: ``rate = utilization / S1``, S1 the time the profile of the first
   round's passes predicts for serving the workload's mean request alone (its prefill and
   its decode steps at batch 1).
3. At each rate, build the request list once (prompts cut, token ids drawn) and, for each
   policy, replay it ``replays`` times through the real engine (``clock``: wall, or cpu, this
   process's CPU time while busy, for a machine shared with other work), round by round
   (every point's first replay, ``passes_per_round`` profile passes, every point's
   second, ...), and once through
   the simulator (``sim.run.simulate`` reading the final profile, routing from its measured
   expert load; it is deterministic). Both get their scheduler from
   ``sim.run.build_scheduler`` with the same profile, so they differ only in how time passes.
4. Write ``<out_dir>/<name>/validation.json``, a list of records ``{policy, rate, load, cls,
   metric, requests, sim, real, error_pct, replays, real_min, real_max, real_values,
   real_cv_pct}`` for ttft_mean and turnaround_mean per class (LS, BE, all) and
   throughput_jobs (all): ``real`` is the mean over the replays (``real_values``, round by
   round), ``real_min``/``real_max``/``real_cv_pct`` their spread (the real engine's own noise
   floor; ``validation_table.noise_floor`` turns it into how many per-class means an exact
   simulator, and a real replay against the others, would get within 10%), error_pct = 100
   (sim - real) / real. Also ``validation.png`` (sim
   against real, the replays' range as error bars), the profile and the resolved config.
   A diagnostic beside it, ``sim_speed_adjusted`` / ``speed_adjusted_error_pct``: the
   simulator rerun once per replay with the profile scaled by how slow that replay's
   iterations ran against their predictions (``run_speed``, ``run_speed_min``/``max``): the
   error left when the machine's mean speed during each run is known. It uses the real runs'
   times, so it is not a prediction; it separates the machine's speed from the rest
   (scheduling, queueing, the profile's shape).
5. Per-iteration error: every executed segment of every real run (``RealResult.segments``)
   beside the latency model's prediction for that very batch (the mean over routing draws of
   the plan's time from the segment's start cursor to its end, plus the resume switch and the
   wake-up after an idle gap that the simulator charges): ``iterations.csv.gz`` (one row per
   segment) and ``iteration_errors.json`` (the error by phase, batch size, context and
   segment kind), printed as a second table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.core import BE, LS, Batch, Phase, Request, Sequence
from profiler.schema import GRID_KEYS, SettingsError, int_list
from profiler.settings import wait_idle
from realrun.config import ClockKind, IdleWait, ValidateConfig, validate_engine, validate_shared
from realrun.validation_table import (
    GOAL_PCT,
    ILL_CONDITIONED_PCT,
    THROUGHPUT_GOAL_PCT,
    noise_floor,
    within_replays,
)
from sim.app import CONF_DIR  # registers the simulator's schema (base_config) that it composes
from sim.cli import App, fail, job, run
from sim.config import UserError, WorkloadConfig

PROG = "qllm-validate"
CLASSES = (LS, BE, "all")
METRICS = {"ttft_mean": "ttft_s", "turnaround_mean": "turnaround_s"}
PREDICTION_DRAWS = 8  # routing draws averaged per predicted segment
HOST_POLICY = "iteration"  # the engine_host calibration's scheduler (continuous batching)

ConfigStore.instance().store(name="validate_schema", node=ValidateConfig)


def write_config(out: Path, cfg: DictConfig, rates: list[float] | None) -> None:
    """config.yaml: the resolved config, with the rates the points ran at as
    ``workload.rate`` (each point's from its utilization; null until they are known)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["workload"]["rate"] = rates
    (out / "config.yaml").write_text(OmegaConf.to_yaml(plain))


def check(cfg: DictConfig) -> None:
    validate_engine(cfg)
    if ClockKind(cfg.clock) is ClockKind.virtual:  # its times are stage counts, not the model's
        raise UserError("clock=virtual: the virtual clock charges every stage 1 ms and times "
                        "none of the model's work, so the real runs would measure nothing to "
                        "validate against; use wall or cpu")  # fmt: skip
    if cfg.workload.rate != WorkloadConfig().rate:  # each point's rate: utilization / S1
        raise UserError(f"workload.rate={cfg.workload.rate}: qllm-validate sets each point's "
                        "rate from utilizations (a utilization over the solo service time); "
                        "set utilizations instead")  # fmt: skip
    if not cfg.utilizations or min(cfg.utilizations) <= 0:
        raise UserError(f"utilizations={list(cfg.utilizations)}: need values > 0")
    if not cfg.policies:
        raise UserError("policies=[]: name at least one policy")
    if cfg.replays < 1:
        raise UserError(f"replays={cfg.replays}: must be >= 1")
    if not cfg.min_run_s >= 0:
        raise UserError(f"min_run_s={cfg.min_run_s}: must be >= 0")
    if not cfg.max_run_s >= 0:
        raise UserError(f"max_run_s={cfg.max_run_s}: must be >= 0")
    if cfg.max_run_s and cfg.max_run_s < cfg.min_run_s:
        raise UserError(f"max_run_s={cfg.max_run_s}: below min_run_s={cfg.min_run_s} (no "
                        "point's arrivals span both); raise it, or 0 for no cap")  # fmt: skip
    budget_s = cfg.get("time_budget_s")
    if budget_s is not None and not budget_s > 0:
        raise UserError(f"time_budget_s={budget_s}: must be > 0, or null for no limit")
    if not 0 <= cfg.sensitivity_pct < 100:
        raise UserError(f"sensitivity_pct={cfg.sensitivity_pct}: must be >= 0 and below 100")
    known = sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))
    for name in cfg.policies:
        if name not in known:
            raise UserError(f"policies: {name} is not a policy; choose from {', '.join(known)}")
    # the workload and slo checks, before the minutes of profiling
    validate_shared(cfg, OmegaConf.load(CONF_DIR / "policy" / f"{cfg.policies[0]}.yaml"))
    if cfg.profile.get("path") is None:  # every rule of the profiler's settings, the grid's
        profile_settings(cfg, profile_settings_cfg(cfg), (0, 0, 0))  # before any output


def passes_per_round(cfg: DictConfig) -> tuple[int, int]:
    """(asked, given): the profile's passes before the first round of real replays and after
    each, ``profile.passes_per_round`` (default 1), given fewer where ``profile.repeats`` does
    not give every pass of the replays + 1 rounds a repeat of each shape."""
    asked = cfg.profile.get("passes_per_round", 1)
    asked = 1 if asked is None else asked
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise UserError(f"profile.passes_per_round={asked}: must be an integer >= 1")
    repeats = cfg.profile.get("repeats")
    if not isinstance(repeats, int) or repeats < 1:  # Settings rejects it
        return asked, asked
    return asked, max(1, min(asked, repeats // (cfg.replays + 1)))


def idle_wait(cfg: DictConfig) -> str:
    """How the runs wait when idle (``idle_wait``: sleep | spin)."""
    return IdleWait(cfg.get("idle_wait", "sleep")).value


WAITING = {"spin": "spinning", "sleep": "sleeping"}


def profile_settings_cfg(cfg: DictConfig) -> dict:
    """The profiler's settings as ``cfg.profile`` gives them (but ``path``), its null clock the
    runs' (CPU time: the process clock), its null ``wake.wait`` the runs' ``idle_wait``, its
    ``passes`` the rounds' (``passes_per_round``)."""
    settings_cfg = {k: v for k, v in OmegaConf.to_container(cfg.profile).items()
                    if k not in ("path", "passes_per_round")}  # fmt: skip
    if settings_cfg.get("clock") is None:
        settings_cfg["clock"] = "process" if ClockKind(cfg.clock) is ClockKind.cpu else "wall"
    wake = settings_cfg.get("wake")
    if isinstance(wake, dict) and wake.get("wait") is None:
        settings_cfg["wake"] = {**wake, "wait": idle_wait(cfg)}
    settings_cfg["passes"] = (cfg.replays + 1) * passes_per_round(cfg)[1]
    return settings_cfg


def profile_settings(cfg: DictConfig, settings_cfg: dict, cover: tuple[int, ...]):
    """(``profiler.settings.Settings``, the grid points added): the settings with the grid
    extended to cover (``covering_grid``: largest batch, longest prompt, longest context[,
    largest batched prefill]), through every rule of ``Settings``, each a one-line UserError
    under ``profile.``. torch-free: ``check`` runs it before any output is written."""
    from profiler.settings import Settings

    try:
        grid, added = covering_grid(settings_cfg["grid"], *cover)
        return Settings.from_config({**settings_cfg, "grid": grid, "seed": cfg.seed}), added
    except SettingsError as e:  # its message starts with the key, under profile.
        raise UserError(f"profile.{e}") from None
    except KeyError as e:
        raise UserError(f"profile: {e}") from None


def sim_config(cfg: DictConfig, policy: str, profile_dir: Path) -> DictConfig:
    """The simulator's config for one policy, reading the profile at ``profile_dir``."""
    sim_cfg = hydra.compose("config", overrides=[
        f"policy={policy}", f"profile.path={profile_dir}", "profile.routing=profile",
        f"seed={cfg.seed}"])  # fmt: skip
    sim_cfg.slo = cfg.slo
    validate_shared(cfg, sim_cfg.policy)
    return sim_cfg


def covering_grid(
    grid: dict, largest_batch: int, longest_prompt: int, longest_context: int,
    largest_prefill: int = 0,
) -> tuple[dict, list[str]]:  # fmt: skip
    """The profile grid extended to every shape a run can form: decode batches up to the
    largest a policy can form, prefills up to the longest prompt, contexts up to the longest
    prompt + output (one point added at each end that falls short; none inside), batched
    prefills up to ``largest_prefill`` tokens (``prefill_batch_tokens``: 2, 4, 8, ... prompts
    of the grid's longest prefill, up to enough of them; the time per token of the router
    and the experts still falls there, which one end point would extrapolate linearly) and
    expert queues up to the largest prefill (doubling: one expert can get every token of a
    prefill); and the lines saying what was added."""
    grid, added = dict(grid), []
    # a string or a float is refused, not misread
    ints = {key: sorted(set(int_list(f"grid.{key}", grid.get(key) or ())))
            for key in (*GRID_KEYS, "prefill_batch_tokens")}  # fmt: skip
    for key in GRID_KEYS:
        if not ints[key]:
            raise SettingsError(f"grid.{key} must be a non-empty list of integers >= 1")
    for key, need in (("decode_batch", largest_batch), ("prefill_tokens", longest_prompt),
                      ("decode_kv", longest_context)):  # fmt: skip
        values = ints[key]
        if need > values[-1]:
            grid[key] = ints[key] = [*values, need]
            added.append(f"{key} to {need}")
    longest = max(ints["prefill_tokens"])
    batches = ints["prefill_batch_tokens"]
    if largest_prefill > max([longest, *(n // longest * longest for n in batches)]):
        need, k = math.ceil(largest_prefill / longest), 2
        while k < need:
            batches.append(k * longest)
            k *= 2
        grid["prefill_batch_tokens"] = sorted({*batches, need * longest})
        added.append(f"prefill_batch_tokens to {need * longest} ({need} prompts of {longest})")
    experts, most = ints["expert_tokens"], max(largest_prefill, longest)
    if most > experts[-1]:
        while experts[-1] < most:
            experts.append(min(2 * experts[-1], most))
        grid["expert_tokens"] = experts
        added.append(f"expert_tokens to {most}")
    return grid, added


def largest_prefill(policies: list[str], requests) -> int:
    """Prompt tokens of the largest prefill batch any of ``policies`` can form from
    ``requests``: its ``max_batch_prefill_tokens`` (none: no cap), at most its
    ``max_batch_size`` of the longest prompts, at most every prompt."""
    prompts = sorted((r.prompt_tokens for r in requests), reverse=True)
    largest = 0
    for policy in policies:
        conf = OmegaConf.load(CONF_DIR / "policy" / f"{policy}.yaml")
        size = conf.get("max_batch_size") or len(prompts)
        most = sum(prompts[:size])
        cap = conf.get("max_batch_prefill_tokens")
        largest = max(largest, min(most, cap) if cap else most)
    return largest


class ProfileSource:
    """The validation's profile: read from ``profile.path``, or measured now, in passes run
    between the rounds of real replays (``Settings.passes`` = (replays + 1) x
    ``per_round``: ``per_round`` before the first round, as many after each), so that the
    profile samples the same stretch of the machine's life as the real runs: on a shared
    machine the same work runs up to 1.9x slower for seconds at a time, and a profile taken
    all before the runs read some shapes in a slow stretch, the runs in another.
    ``per_round`` is ``profile.passes_per_round``, fewer where the repeats do not give every
    pass one (``Settings.passes`` <= repeats). ``first()``: the profile after the first
    round's passes (it chooses the rates); ``between_rounds()`` runs the next round's;
    ``final()`` runs any passes left and the wake-up, saves the profile to ``directory`` and
    returns it."""

    def __init__(self, cfg: DictConfig, runner, info, out: Path, cover: tuple[int, int, int, int],
                 probe=None):  # fmt: skip
        from sim import profiles

        self.info, self.name = info, f"{out.name}-profile"
        self.directory = (out / "profile").resolve()
        self.prof = None
        self.per_round = 1  # the profile's passes before the first round and after each
        self.extra: list = []
        path = cfg.profile.get("path")
        if path:
            profile = profiles.load("", path)
            theirs = dataclasses.asdict(profile.model)
            ours = dataclasses.asdict(info.shape)
            differ = [k for k in ours if theirs.get(k) != ours[k]]
            if differ:  # presets share layers x experts: the whole shape must agree
                k = differ[0]
                raise UserError(f"profile.path={path}: a profile of {profile.model.name}, not "
                                f"of this model ({info.name}): {k} {theirs.get(k)} against "
                                f"{ours[k]}")  # fmt: skip
            dtype = str(info.dtype).removeprefix("torch.")  # as build_profile writes it
            if profile.dtype != dtype:  # other op times and KV bytes per token
                raise UserError(f"profile.path={path}: measured in {profile.dtype}, these runs "
                                f"in {dtype} (dtype={cfg.dtype}): profile this dtype, or run "
                                f"with dtype={profile.dtype}")  # fmt: skip
            from profiler.measure import device_name

            if profile.device != device_name(info.device):
                print(f"warning: profile.path={path} was measured on {profile.device}, these "
                      f"runs on {device_name(info.device)}: its op times are another "
                      "machine's", file=sys.stderr)  # fmt: skip
            clock = "process" if ClockKind(cfg.clock) is ClockKind.cpu else "wall"
            timed = ((profile.extra or {}).get("settings") or {}).get("clock")
            if timed is not None and timed != clock:
                print(f"warning: profile.path={path} was timed on the {timed} clock, these "
                      f"runs on the {clock} clock (clock={ClockKind(cfg.clock).value}): their "
                      "errors mix the two", file=sys.stderr)  # fmt: skip
            # profiles before 2026-12-05 slept through their wake-up gaps (no wake_wait)
            waited = ((profile.extra or {}).get("settings") or {}).get("wake_wait", "sleep")
            if profile.op_points("wake_up") and waited != idle_wait(cfg):
                print(f"warning: profile.path={path} waited its wake-up gaps by "
                      f"{WAITING.get(waited, waited)}, these runs {idle_wait(cfg)} (idle_wait="
                      f"{idle_wait(cfg)}): the wake-up it charges after a gap is another "
                      "engine's", file=sys.stderr)  # fmt: skip
            # the results folder holds the profile its runs were predicted with (unless the
            # profile given is that folder's own: a rerun into the same results)
            if Path(path).resolve() != self.directory:
                if self.directory.exists():
                    shutil.rmtree(self.directory)
                shutil.copytree(Path(path), self.directory)
            self.profile = profile
            return
        from profiler.measure import Profiler

        settings_cfg = profile_settings_cfg(cfg)
        runs_clock = "process" if ClockKind(cfg.clock) is ClockKind.cpu else "wall"
        wake = settings_cfg.get("wake")
        waited = wake.get("wait") if isinstance(wake, dict) else None
        if waited is not None and waited != idle_wait(cfg):  # as for a profile.path's
            print(f"warning: profile.wake.wait={waited}: the profile's wake-up gaps are "
                  f"waited by {WAITING.get(waited, waited)}, these runs' by "
                  f"{WAITING[idle_wait(cfg)]} "
                  f"(idle_wait={idle_wait(cfg)}): the wake-up it charges after a gap is another "
                  "engine's", file=sys.stderr)  # fmt: skip
        if settings_cfg["clock"] != runs_clock:  # as for a profile.path timed on another
            print(f"warning: profile.clock={settings_cfg['clock']}: the profile is timed on the "
                  f"{settings_cfg['clock']} clock, these runs on the {runs_clock} clock "
                  f"(clock={ClockKind(cfg.clock).value}): their errors mix the two",
                  file=sys.stderr)  # fmt: skip
        asked, per_round = passes_per_round(cfg)
        if per_round < asked:
            print(f"warning: profile.passes_per_round={asked}: {per_round} per round (a pass "
                  f"needs a repeat: profile.repeats={cfg.profile.repeats} over "
                  f"{cfg.replays + 1} rounds)", file=sys.stderr)  # fmt: skip
        self.per_round = per_round
        settings, added = profile_settings(cfg, settings_cfg, cover)
        if added:
            print(f"profile grid extended to cover the runs: {', '.join(added)}")
        self.prof = Profiler(runner, settings, info.device, probe)
        self.progress = cfg.progress
        self.pass_s: list[float] = []  # each pass's wall time (RunBudget)
        self.between_rounds()
        self.profile = self._build(self.prof.table())
        # saved now, and replaced by the final one: a run stopped by a time limit (the GPU
        # check's) keeps the profile its predictions were made with
        self.profile.save(self.directory)

    def first(self):
        return self.profile

    def between_rounds(self, budget: RunBudget | None = None) -> bool:
        """The next round's passes; False when ``budget`` left no time for one (as long as
        the longest so far), which is then not run."""
        if self.prof is None:
            return True
        for _ in range(self.per_round):
            if self.prof.passes_done >= self.prof.settings.passes:
                return True
            if budget is not None and not budget.fits_pass(max(self.pass_s, default=0.0)):
                return False
            bar = tqdm(total=self.prof.settings.num_iterations, unit="shape",
                       desc=f"profiling (pass {self.prof.passes_done + 1} of "
                            f"{self.prof.settings.passes})", disable=not self.progress)  # fmt: skip
            start = time.perf_counter()
            self.prof.grid_pass(bar)
            self.pass_s.append(time.perf_counter() - start)
            bar.close()
        return True

    @property
    def passes(self) -> tuple[int, int]:
        """(done, planned) passes of the profile measured now; (0, 0) for a profile.path."""
        if self.prof is None:
            return 0, 0
        return self.prof.passes_done, self.prof.settings.passes

    def final(self, complete: bool = True):
        """The profile of every pass and the wake-up (those left run now), saved; with
        ``complete`` False (a validation that ``time_budget_s`` stopped), of the passes done
        and the wake-up's repeats they ran, if any (else it runs them)."""
        if self.prof is not None:
            if complete:
                points = self.prof.points(progress=False)
            else:
                points = self.prof.table() + self.prof.wake_points(top_up=False)
            # the first profile's memory: the real runs' schedulers were built with it
            # (on CPU its KV capacity follows the free memory of the moment)
            profile = self._build(points)
            self.profile = dataclasses.replace(profile, memory=self.profile.memory)
            self.profile.save(self.directory)
        return self.profile

    @property
    def measuring(self) -> bool:
        """Whether the profile is measured now (not read from ``profile.path``)."""
        return self.prof is not None

    def add_points(self, points: list) -> None:
        """Points measured outside the profiler (``engine_host``, ``engine_admit``): in the
        final profile."""
        self.extra = list(points)

    def _build(self, points):
        from profiler.measure import build_profile

        return build_profile(self.prof, self.info, self.name, [*points, *self.extra])


class RunBudget:
    """``time_budget_s``: wall seconds from the validation's start (``start``, on ``clock``)
    within which its real runs and the profile's passes between them must end, so that a
    validation under an outside time limit (the GPU check's, a device lease's) reports the
    points it ran instead of being killed with nothing written. Before each run it asks
    whether the run, as long as expected, still ends within the budget: the simulator's
    makespan for its point times the largest ratio of a run's measured wall time
    to its point's makespan seen so far (1 before the first run); before each pass, the
    longest pass so far. What follows the runs (predictions, simulations, the plot: seconds on
    a tiny model or the GPU check's) comes on top. ``budget_s`` None: everything fits."""

    def __init__(self, budget_s: float | None, start: float, clock=time.perf_counter) -> None:
        self.budget_s, self.start, self.clock = budget_s, start, clock
        self.ratio = 1.0  # measured wall time over the predicted makespan, the largest yet
        self.cut: str | None = None  # what was not run, once something did not fit

    @property
    def active(self) -> bool:
        return self.budget_s is not None

    def left_s(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - (self.clock() - self.start)

    def fits_run(self, makespan_s: float) -> bool:
        return makespan_s * self.ratio <= self.left_s()

    def fits_pass(self, longest_pass_s: float) -> bool:
        return longest_pass_s <= self.left_s()

    def ran(self, makespan_s: float, wall_s: float) -> None:
        """A run of a point whose predicted makespan is ``makespan_s`` took ``wall_s``."""
        if makespan_s > 0:
            self.ratio = max(self.ratio, wall_s / makespan_s)


def cut_message(budget_s: float, runs_done: int, runs_planned: int, points_left: list[str],
                passes_done: int, passes_planned: int) -> str:  # fmt: skip
    """The one-line warning of a validation that ``time_budget_s`` stopped."""
    parts = []
    if runs_done < runs_planned:
        parts.append(f"the real runs stopped after {runs_done} of {runs_planned}: the points "
                     "have fewer replays than asked (each record's replays)")  # fmt: skip
    if points_left:
        parts.append(f"{len(points_left)} point(s) not measured at all: {', '.join(points_left)}")
    if passes_done < passes_planned:
        parts.append(f"the profile from {passes_done} of its {passes_planned} passes")
    return (f"warning: time_budget_s={budget_s:g}: the next run or pass would have ended past "
            f"it; {'; '.join(parts)}")  # fmt: skip


class Phases:
    """Wall time per phase of a validation (the issue's budget is 6 minutes a preset):
    ``with phases("runs"): ...`` adds that block's time to ``seconds["runs"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    # the order a validation's phases are printed in (the order they mostly run in; the
    # budget's makespan simulations come before the real runs but print with "simulation")
    ORDER = ("profile", "warm-up and calibration", "real runs", "iteration predictions",
             "simulation")  # fmt: skip

    def line(self, total_s: float) -> str:
        """ "profile 2 min 1 s, real runs 3 min 10 s, ..., other 12 s" (other: the rest of
        total_s); phases in ORDER, any other after them in the order first timed."""
        names = sorted(self.seconds, key=lambda n: (
            self.ORDER.index(n) if n in self.ORDER else len(self.ORDER)))  # fmt: skip
        parts = [*((n, self.seconds[n]) for n in names),
                 ("other", total_s - sum(self.seconds.values()))]  # fmt: skip
        return ", ".join(f"{name} {_min_s(s)}" for name, s in parts)


def _min_s(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def run_orders(cases: int, replays: int, seed: int, shuffle: bool = True) -> list[list[int]]:
    """Per round (one per replay), the order of the cases' real runs: each case once, in a
    random order drawn from ``seed`` and the round (another each round), or in turn when
    not ``shuffle``. Run in turn, the light points came first in every round, right after the
    profile's pass, and the host's drift over a round fell on the loads unevenly."""
    orders = []
    for r in range(replays):
        order = list(range(cases))
        if shuffle:
            random.Random(f"{seed}/{r}").shuffle(order)
        orders.append(order)
    return orders


def point_requests(num_requests: int, rate: float, min_run_s: float, max_run_s: float) -> int:
    """How many requests a point at ``rate`` replays: ``num_requests``, more where their
    arrivals would span less than ``min_run_s`` (ceil(rate x min_run_s)), fewer where they
    would span more than ``max_run_s`` (ceil(rate x max_run_s); 0: no cap)."""
    n = max(num_requests, math.ceil(rate * min_run_s))
    return min(n, math.ceil(rate * max_run_s)) if max_run_s else n


def solo_service_s(latency, prompt_tokens: int, output_tokens: int, draws: int = 20) -> float:
    """Predicted time to serve one request alone: its prefill, then each decode step."""
    seq = Sequence(Request(0, BE, 0.0, prompt_tokens, output_tokens))
    total = 0.0
    for generated in range(output_tokens):
        seq.generated = generated
        batch = Batch([seq], seq.phase)
        total += statistics.fmean(latency.plan(batch).total_s for _ in range(draws))
    return total


def load_label(utilization: float, utilizations: list[float]) -> str:
    """light / knee / overload for three or more levels (lowest, middle ones, highest)."""
    ordered = sorted(utilizations)
    if len(ordered) < 3:
        return "light" if utilization == ordered[0] else "loaded"
    if utilization == ordered[0]:
        return "light"
    return "overload" if utilization == ordered[-1] else "knee"


def records_of(
    policy: str,
    rate: float,
    load: str,
    reals: list[dict],
    sim: dict,
    drift_pct: float | None = None,
    duty: float | None = None,
    adjusted: list[dict] | None = None,
    speeds: list[float] | None = None,
    windows: list[float] | None = None,
    bounds: list[dict] | None = None,
    sensitivity_pct: float | None = None,
    normalized: list[dict] | None = None,
    probe_speeds: list[float] | None = None,
) -> list[dict]:
    """Sim against the mean of the real replays, with the replays' spread (and ``drift_pct``,
    how much slower the host ran during them than during the profile, the median of
    ``probe_speeds`` in %; and the machine's duty-cycle slowdown, ``duty_slowdown``).
    ``adjusted``: per replay, the simulator's summary with the
    profile scaled by that replay's measured speed (``speeds``, ``run_speed``): the
    diagnostic ``sim_speed_adjusted`` / ``speed_adjusted_error_pct`` (the mean over the
    replays against the real mean), which says what is left of the error once the machine's
    mean speed during each real run is known; not a prediction. ``bounds``: the simulator's
    summaries with every iteration ``sensitivity_pct`` faster and slower: ``sim_faster``,
    ``sim_slower`` and ``sim_sensitivity_pct``, the larger move from ``sim`` (in % of it),
    the point's conditioning (``ILL_CONDITIONED_PCT``). ``normalized``: per replay, the
    simulator's summary with the profile scaled by the host's speed during that replay as the
    probe measured it (``probe_speeds``: the replay's probes over the profile's,
    ``profiler.probe``): ``sim_host_normalized`` / ``host_normalized_error_pct``, the
    prediction for a machine of the speed measured, which reads no time of the run's own
    iterations."""
    rows = []
    counted = [f for real in reals
               if (f := real.get("executor", {}).get("page_faults")) is not None]  # fmt: skip
    faults = max(counted) if counted else None

    def add(cls: str, metric: str, get) -> None:
        s = math.nan if (s := get(sim)) is None else s
        values = [math.nan if (v := get(real)) is None else v for real in reals]
        r = statistics.fmean(values)
        err = 100 * (s - r) / r if r else math.nan
        # one replay measures no spread: None, not 0
        cv = 100 * statistics.pstdev(values) / r if r and len(values) > 1 else None
        row = {"policy": policy, "rate": rate, "load": load, "cls": cls, "metric": metric,
               "requests": reals[0]["classes"][cls]["count"],
               "sim": s, "real": r, "error_pct": err, "replays": len(values),
               "real_min": min(values), "real_max": max(values), "real_values": values,
               "real_cv_pct": cv, "real_page_faults": faults,
               "probe_drift_pct": drift_pct,
               "duty_slowdown": None if duty is None else round(duty, 3)}  # fmt: skip
        if adjusted:
            a = statistics.fmean(math.nan if (v := get(x)) is None else v for x in adjusted)
            row |= {"sim_speed_adjusted": a,
                    "speed_adjusted_error_pct": 100 * (a - r) / r if r else math.nan,
                    "run_speed_min": round(min(speeds), 3) if speeds else None,
                    "run_speed_max": round(max(speeds), 3) if speeds else None,
                    "run_speeds": [round(x, 3) for x in speeds]}  # fmt: skip
        if normalized:
            a = statistics.fmean(math.nan if (v := get(x)) is None else v for x in normalized)
            row |= {"sim_host_normalized": a,
                    "host_normalized_error_pct": 100 * (a - r) / r if r else math.nan,
                    "probe_speeds": [round(x, 4) for x in probe_speeds or ()]}  # fmt: skip
        if bounds:
            fast, slow = (math.nan if (v := get(b)) is None else v for b in bounds)
            moved = max(abs(fast - s), abs(slow - s))
            row |= {"sim_faster": fast, "sim_slower": slow,
                    "speed_step_pct": sensitivity_pct,
                    "sim_sensitivity_pct": 100 * moved / s if s else math.nan}  # fmt: skip
        p10, p90 = np.percentile(windows, [10, 90]) if windows else (None, None)
        row |= {"host_speed_p10": None if p10 is None else round(float(p10), 3),
                "host_speed_p90": None if p90 is None else round(float(p90), 3)}  # fmt: skip
        rows.append(row)

    for cls in CLASSES:
        if reals[0]["classes"][cls]["count"] == 0:
            continue
        for metric, key in METRICS.items():
            add(cls, metric, lambda summary, c=cls, k=key: summary["classes"][c][k]["mean"])
    add("all", "throughput_jobs", lambda summary: summary["throughput"]["jobs_per_s"])
    return rows


# The window over which the machine's speed is read within a run (``window_speeds``), and the
# least measured work a window needs to count.
SPEED_WINDOW_S = 1.0
SPEED_WINDOW_MIN_S = 0.1


def window_speeds(rows: list[dict], window_s: float = SPEED_WINDOW_S) -> list[float]:
    """The machine's speed second by second within one real run: ``run_speed`` of the
    iterations that started in each ``window_s`` of the run (by their start time), for the
    windows that hold at least SPEED_WINDOW_MIN_S of measured work. A model error moves every
    window of a run alike (a light load's windows hold the same shapes); a spread between
    them is the host's: on this project's VM, a second at a time, the same steps ran 0.8x to
    1.8x the profile's prediction, switching back and forth within each run."""
    windows: dict[int, list[dict]] = {}
    for r in rows:
        windows.setdefault(int(r["start_s"] // window_s), []).append(r)
    return [run_speed(w) for w in windows.values()
            if sum(r["measured_s"] for r in w) >= SPEED_WINDOW_MIN_S]  # fmt: skip


def run_speed(rows: list[dict]) -> float:
    """How slow the machine ran during one real run, against the profile: the run's summed
    measured time over its summed predicted time, wake-ups excluded from both (the factor
    ``Profile.interference`` scales; 1.2: every iteration 20% slower than predicted, on
    average)."""
    measured = sum(r["measured_s"] - r["wake_s"] for r in rows)
    predicted = sum(r["predicted_s"] - r["wake_s"] for r in rows)
    return measured / predicted if predicted > 0 and measured > 0 else 1.0


def shape_batch(phase: str, shape: list[tuple[str, int, int]]) -> Batch:
    """A batch with the recorded (phase, new_tokens, context_tokens) of each sequence."""
    seqs = []
    for i, (seq_phase, new, context) in enumerate(shape):
        if seq_phase == Phase.PREFILL.value:  # new = its prompt (+ tokens to recompute),
            # or a chunk of it over `context` already cached (chunked prefill)
            request = Request(i, BE, 0.0, context + new, 2)
            seqs.append(Sequence(request, prefilled_tokens=context, chunk_tokens=new))
        else:  # one token on a cache of `context`: the context, then one generated token
            seq = Sequence(Request(i, BE, 0.0, max(context, 1), 2))
            seq.generated = 1
            seqs.append(seq)
    return Batch(seqs, Phase(phase))


def predict_segment(
    latency,
    segment,
    draws: int = PREDICTION_DRAWS,
    wake: tuple[float, float] | None = None,
    partner: list | None = None,
) -> tuple[float, float]:
    """(predicted seconds, of which wake-up) of a recorded segment, as the simulator charges
    it: the plan's time from the start to the end cursor (mean over routing draws; binding a
    new padded KV when the engine did), the switch of a resumed batch (after a merge: of the
    suspended batch merged in, whose shape is ``partner``, as ``Simulation._merge`` charges
    it), and its share of the wake-up: ``wake`` is (idle seconds, busy seconds since), by
    default the idle time just before the segment and none since."""
    batch = shape_batch(segment.phase, segment.shape)
    run_s = statistics.fmean(
        (plan := latency.plan(batch, segment.bound)).offset(segment.end_cursor)
        - plan.offset(segment.start_cursor)
        for _ in range(draws)
    )
    if partner is not None:
        merged_in = shape_batch(segment.phase, partner)
        merged_in.cursor = segment.start_cursor
        run_s += latency.switch_s(merged_in)
    elif segment.start_cursor:
        batch.cursor = segment.start_cursor
        run_s += latency.switch_s(batch)
    idle_s, busy_s = wake if wake is not None else (segment.idle_s, 0.0)
    wake_s = latency.wake_s(idle_s, busy_s, run_s)
    return run_s + wake_s, wake_s


SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# decode steps since the last idle gap (iteration_errors): the wake-up and its tail
SINCE_IDLE_BUCKETS = (1, 3, 7, 15, 31, 63)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096)
# minor page faults within a segment (iteration_errors)
FAULT_BUCKETS = (0, 10, 100, 1000)


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """'<=e' for the first edge e >= value, '>last' beyond."""
    for edge in edges:
        if value <= edge:
            return f"<={edge}"
    return f">{edges[-1]}"


IDLE_AFTER_S = 1e-3  # an idle time before a segment longer than this is a gap ("after idle")


def host_term(profile, op: str):
    """The profile's ``engine_host`` or ``engine_admit`` as the simulator reads it (batch size,
    or requests admitted -> seconds, interference applied; 0 for no request), or None."""
    from sim.latency import Curve1D

    points = profile.op_points(op)
    if not points:
        return None
    curve = Curve1D(points, "batch_size")
    return lambda n: curve.scalar(n) * profile.interference if n > 0 else 0.0


def iteration_rows(policy: str, rate: float, replay: int, segments, latency,
                   host=None, run: int | None = None, load: str = "",
                   admit=None) -> list[dict]:  # fmt: skip
    """One row per executed segment: its shape, measured and predicted time (``latency``'s
    plan for that batch, plus ``admit`` of the requests the engine admitted within it), and
    the engine's host time just before it (``host_gap_s``, see ``host_gaps``) beside what
    ``host`` (batch size -> seconds: the ``engine_host`` term) and ``admit`` (requests ->
    seconds: ``engine_admit``, of those admitted in that time) predict for it; ``run``: the
    real run's place in the validation's order (0 first);
    ``load``: the point's (``load_label``); ``since_idle``: the segments since the run's last
    idle gap (0: the first after it; None before the first)."""
    rows = []
    wake = None  # (idle seconds, busy seconds since) while the simulator would charge a wake-up
    after = "start"  # the phase of the segment just before (the run's first: start)
    before = None  # the segment just before
    since = None  # segments since the last idle gap
    for seg, host_gap_s in zip(segments, host_gaps(segments), strict=True):
        if seg.idle_s > 0:
            wake = (seg.idle_s, 0.0)
        since = 0 if seg.idle_s > IDLE_AFTER_S else None if since is None else since + 1
        # the rest of an iteration after a merge: the merged batch, the running batch's
        # sequences first (the engine's shape), the partner's after them
        partner = (seg.shape[len(before.shape):] if before is not None and before.merged
                   else None)  # fmt: skip
        predicted_s, wake_s = predict_segment(latency, seg, wake=wake or (0.0, 0.0),
                                              partner=partner)  # fmt: skip
        if admit is not None:  # arrivals admitted at a preemptible boundary, mid-segment
            predicted_s += admit(seg.admitted_within)
        if wake is not None:
            busy_s = wake[1] + predicted_s - wake_s
            wake = (wake[0], busy_s) if busy_s < latency.wake_window_s else None
        measured_s = seg.measured_s
        phase_tokens = (sum(n for _, n, _ in seg.shape) if seg.phase == Phase.PREFILL.value
                        else max(c for _, _, c in seg.shape))  # fmt: skip
        kind = ("preempted" if seg.preempted else "merged" if seg.merged
                else "after merge" if partner is not None
                else "resumed" if seg.start_cursor else "whole")  # fmt: skip
        rows.append({"policy": policy, "rate": rate, "replay": replay, "run": run,
                     "load": load, "since_idle": since, "batch": seg.batch,
                     "phase": seg.phase, "size": len(seg.shape), "tokens": phase_tokens,
                     "start_cursor": seg.start_cursor, "end_cursor": seg.end_cursor,
                     "kind": kind, "bound": seg.bound, "idle_s": seg.idle_s,
                     "after": "idle" if seg.idle_s > IDLE_AFTER_S else after,
                     "start_s": seg.start_s,
                     "host_gap_s": math.nan if host_gap_s is None else host_gap_s,
                     "admitted": seg.admitted, "admitted_within": seg.admitted_within,
                     "host_predicted_s": (host(len(seg.shape)) if host else 0.0)
                     + (admit(seg.admitted) if admit else 0.0),
                     "measured_s": measured_s,
                     "predicted_s": predicted_s, "wake_s": wake_s,
                     "faults": math.nan if seg.faults is None else seg.faults,
                     "error_pct": 100 * (predicted_s - measured_s) / measured_s
                     if measured_s > 0 else math.nan})  # fmt: skip
        after, before = seg.phase, seg
    return rows


def error_group(by: str, value: str, predicted: list[float], measured: list[float]) -> dict | None:
    """One group of ``iteration_errors``: the error of each member (predicted against measured
    seconds; members measured at 0 left out of the distribution), its median, p10 and p90, the
    summed-time error and the median measured time; None when no member has an error."""
    errors = sorted(100 * (p - m) / m for p, m in zip(predicted, measured, strict=True) if m > 0)
    if not errors:
        return None
    return {"by": by, "value": value, "n": len(measured),
            "median_error_pct": statistics.median(errors),
            "p10_error_pct": float(np.percentile(errors, 10)),
            "p90_error_pct": float(np.percentile(errors, 90)),
            "time_error_pct": 100 * (sum(predicted) - sum(measured)) / sum(measured),
            "measured_ms_median": 1e3 * statistics.median(measured)}  # fmt: skip


def iteration_errors(rows: list[dict]) -> list[dict]:
    """The per-iteration error by group: phase x batch size, phase x tokens (prefill: prompt
    tokens; decode: longest context), segment kind, whether an idle gap came before, each
    load (``load``) and its decode steps by the steps since the run's last idle gap
    (``<load> since idle``),
    whether a decode iteration bound a new padded KV (a new batch) or reused the last one, and
    what ran just before a decode iteration (``after``: the phase of the segment before it,
    idle after a gap, start for a run's first);
    the engine's host time between segments against ``engine_host`` ("engine host": not
    part of the other groups, whose segments hold none); and each real run
    (policy@rate#replay), whose summed-time error shows the drift of the machine from replay
    to replay.
    ``time_error_pct`` compares the group's summed predicted and measured time (what a run's
    makespan sees); ``median_error_pct`` is the typical iteration's."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        keys = [("all", "all"), (f"{r['phase']} size", bucket(r["size"], SIZE_BUCKETS)),
                (f"{r['phase']} tokens", bucket(r["tokens"], TOKEN_BUCKETS)),
                ("segment", r["kind"]),
                ("after idle", "yes" if r["idle_s"] > IDLE_AFTER_S else "no")]  # fmt: skip
        if (faults := r.get("faults")) is not None and not math.isnan(faults):
            # host memory mapped in mid-segment: a cost no profile term holds (0.1 ms a fault
            # on the H200's VM, results/gpu/h200/run3)
            keys.append(("page faults", bucket(faults, FAULT_BUCKETS)))
        if r.get("load"):  # each load's summed error, and its decode steps by steps since
            # the last idle gap (a wake-up's tail, or a load's own speed, at the same distance)
            keys.append(("load", r["load"]))
            if r["phase"] == Phase.DECODE.value:
                since = r.get("since_idle")
                keys.append((f"{r['load']} since idle", "no gap" if since is None
                             else bucket(since, SINCE_IDLE_BUCKETS)))  # fmt: skip
        if r["phase"] != Phase.PREFILL.value:
            keys.append((f"{r['phase']} KV", "bound" if r["bound"] else "reused"))
            # what ran just before: a prefill's activations stream through the caches the
            # decode step's weights would be in (or an idle gap: the wake-up)
            keys.append((f"{r['phase']} after", r["after"]))
        # each real run on its own: how far its total busy time drifts from the prediction,
        # replay to replay of the same request list (the machine's part of the error)
        keys.append(("run", f"{r['policy']}@{r['rate']:g}#{r['replay']}"))
        for key in keys:
            groups.setdefault(key, []).append(r)
    out = []
    for (by, value), members in groups.items():
        group = error_group(by, value, [m["predicted_s"] for m in members],
                            [m["measured_s"] for m in members])  # fmt: skip
        if group is not None:
            out.append(group)
    # the engine's host time between segments against engine_host (not in the rows above)
    hosts = [r for r in rows if r.get("host_predicted_s") and r.get("host_gap_s", 0) > 0]
    # (a run's first segment has no gap: NaN, left out by the comparison)
    if hosts:
        out.append(error_group("engine host", "all", [r["host_predicted_s"] for r in hosts],
                               [r["host_gap_s"] for r in hosts]))  # fmt: skip
    order = {
        "all": 0,
        "segment": 3,
        "after idle": 4,
        "decode KV": 5,
        "mixed KV": 5,
        "decode after": 5,
        "mixed after": 5,
        "load": 5.5,
        "page faults": 5.7,
        "engine host": 6,
        "run": 7,
    }
    out.sort(key=lambda g: (order.get(g["by"], 1 if g["by"].startswith("prefill") else 2),
                            g["by"], _bucket_key(g["value"])))  # fmt: skip
    return out


def _bucket_key(value: str) -> tuple[int, str]:
    digits = "".join(ch for ch in value if ch.isdigit())
    return (int(digits) + (value.startswith(">")) if digits else 0, value)


# How much slower or faster (|%|) the host-speed probe ran during a point's runs than during
# the profile (``probe_drift_pct``) above which the validation warns: more than half the goal's
# 10%. (Until 2026-12-03 a separate probe of 60 decode steps of 4 sequences, timed after each
# point's runs against three right after the profile, told it: it correlated 0.32 with the
# runs' speeds, and cost some 10 s a preset.)
DRIFT_WARNING_PCT = 5.0


def make_speed_probe(runner, clock: ClockKind, seed: int):
    """The host-speed probe (``profiler.probe.SpeedProbe``) on the runs' clock, or None on the
    virtual clock (which times nothing)."""
    if clock is ClockKind.virtual:
        return None
    from profiler.probe import PROBE_KV, SpeedProbe
    from realrun.prompts import random_ids

    now = time.process_time if clock is ClockKind.cpu else time.perf_counter
    # ids no request has (requests count from 0)
    return SpeedProbe(runner, random_ids(PROBE_KV, runner.config.vocab_size, seed, 2**40 + 7), now)


def probe_reference(profile, probe, path: str | None = None) -> float | None:
    """The profile's mean probe time (seconds, ``extra.probe``: measured now, or saved with a
    ``profile.path``), the reference of the runs' probes; None, with a warning, where the
    profile has none or its probe ran other work than ``probe`` (another token, context or
    warm-up: its times are then no reference); None without a probe (the virtual clock)."""
    if probe is None:
        return None
    saved = (profile.extra or {}).get("probe") or {}
    where = f"profile.path={path}" if path else "the profile measured now"
    ours = probe.identity()
    if not saved.get("mean_ms"):
        reason = ("has no host-speed probe (extra.probe: profiles measured by qllm-validate "
                  "since 2026-12-03 have one)")  # fmt: skip
    elif any(k not in saved for k in ours):
        reason = ("has a host-speed probe that does not say what it ran (measured before "
                  "commit 85b8914)")  # fmt: skip
    elif (theirs := {k: saved.get(k) for k in ours}) != ours:
        key = next(k for k in ours if theirs[k] != ours[k])
        reason = (f"timed another host-speed probe ({key} {theirs[key]} against {ours[key]}: "
                  "another seed, model or version)")  # fmt: skip
    else:
        return saved["mean_ms"] / 1e3
    print(f"warning: {where} {reason}: no host-normalized figures, no drift figure",
          file=sys.stderr)  # fmt: skip
    return None


# The duty-cycle check: decode steps of one sequence of 64 cached tokens, back to back and in
# a light load's pattern (DUTY_STEPS steps, then DUTY_GAP_S idle), DUTY_SECONDS of each in turn,
# DUTY_CYCLES times. On this project's VM one day, steps in that pattern ran 1.55-1.8x slower
# (medians) than back to back, in every cycle; another day, no slower.
DUTY_STEPS, DUTY_GAP_S, DUTY_SECONDS, DUTY_CYCLES = 10, 0.1, 2.0, 2
# A slowdown above which the validation warns (more than the goal's 10%).
DUTY_WARNING = 1.10


def duty_slowdown(runner, clock: ClockKind, seed: int, idle_wait: str = "sleep") -> float | None:
    """How many times slower decode steps run in bursts of DUTY_STEPS, DUTY_GAP_S apart (the
    gaps waited as the runs wait them: ``idle_wait``), than back to back (medians, on the
    runs' clock; None on the virtual clock): what a low duty cycle costs on this machine
    beyond the wake-up, which the profile measures from a warm state (the first steps after
    one gap)."""
    if clock is ClockKind.virtual:
        return None
    from realrun.prompts import random_ids

    now = time.process_time if clock is ClockKind.cpu else time.perf_counter
    seq = runner.new_sequence(random_ids(64, runner.config.vocab_size, seed, 2**40 + 99))
    runner.run(runner.begin([seq]))  # the prefill: 64 cached, a token to feed
    mark = (len(seq.token_ids), seq.num_cached)

    def step() -> float:
        t = now()
        runner.run(runner.begin([seq]))
        elapsed = now() - t
        seq.truncate(*mark)
        return elapsed

    busy, duty = [], []
    for _ in range(DUTY_CYCLES):
        end = time.perf_counter() + DUTY_SECONDS
        while time.perf_counter() < end:
            busy.append(step())
        end = time.perf_counter() + DUTY_SECONDS
        while time.perf_counter() < end:
            duty += [step() for _ in range(DUTY_STEPS)]
            wait_idle(DUTY_GAP_S, idle_wait)
    return statistics.median(duty) / statistics.median(busy)


def duty_warning(records: list[dict]) -> str | None:
    """A warning when steps in a light load's pattern ran DUTY_WARNING times slower or more."""
    slowdown = next((d for r in records if (d := r.get("duty_slowdown")) is not None), None)
    if slowdown is None or slowdown < DUTY_WARNING:
        return None
    return (f"warning: in bursts of {DUTY_STEPS} decode steps {DUTY_GAP_S * 1e3:.0f} ms apart "
            f"(a light load's pattern) this machine ran them {slowdown:.2f}x slower than back to "
            f"back; the profile's wake-up holds only the first steps after a gap from a warm "
            f"state, so light-load times may be predicted that much short")  # fmt: skip


def drift_warning(records: list[dict]) -> str | None:
    """A warning when the host ran more than DRIFT_WARNING_PCT slower or faster during a point's
    runs than during the profile (``probe_drift_pct``)."""
    drifts = [d for r in records if (d := r.get("probe_drift_pct")) is not None]
    worst = max(drifts, key=abs, default=0.0)
    if abs(worst) <= DRIFT_WARNING_PCT:
        return None
    return (f"warning: the machine's own speed drifted {worst:+.1f}% during the runs (the "
            f"host-speed probe within a point's runs against the profile's): the raw errors "
            f"may be the machine's that much, not the model's")  # fmt: skip


# The engine's host time calibration (``engine_host``): a burst of requests, one per batch
# slot, all at once, the i-th generating HOST_STEPS * i tokens, so that decode batches of
# every size from the largest down to 1 run HOST_STEPS times each; HOST_ROUNDS times. Each
# round after the first adds HOST_ADMITS requests of one token arriving one at a time, spread
# over the first round's run, whose admissions (``engine_admit``) land between iterations.
# Admitting a request took 120-155 us on the tiny presets (the host gap after an iteration
# during which one arrived, over the gaps after none; process clock, 2026-12-05): unmodelled
# before, about 1% of an overloaded run's time.
HOST_STEPS = 3
HOST_ROUNDS = 3
HOST_PROMPT_TOKENS = 16
HOST_ADMITS = 8


def host_gaps(segments) -> list[float | None]:
    """Per segment, the engine's host seconds just before it: the time since the last segment
    ended, less the time the engine sat idle, which no segment holds (admitting arrivals, the
    scheduler's selection and bookkeeping, starting the iteration); None for a run's first
    segment, whose gap holds the run's own start."""
    gaps, end_s = [], None
    for seg in segments:
        gaps.append(None if end_s is None else max(seg.start_s - end_s - seg.idle_s, 0.0))
        end_s = seg.end_s
    return gaps


def host_line(gaps: list[tuple[int, float]]) -> tuple[float, float, list[int]]:
    """(intercept, slope, the batch sizes measured) of a line a + b * batch size (both >= 0)
    fitted by least squares through the median gap at each batch size; no sizes: no gaps."""
    by_size: dict[int, list[float]] = {}
    for size, gap in gaps:
        by_size.setdefault(size, []).append(gap)
    sizes = sorted(by_size)
    if not sizes:
        return 0.0, 0.0, []
    medians = [statistics.median(by_size[b]) for b in sizes]
    if len(sizes) == 1:
        return medians[0], 0.0, sizes
    slope, intercept = statistics.linear_regression(sizes, medians)
    if slope < 0:
        return statistics.fmean(medians), 0.0, sizes
    if intercept < 0:  # through the origin
        return 0.0, sum(b * m for b, m in zip(sizes, medians, strict=True)) / sum(
            b * b for b in sizes), sizes  # fmt: skip
    return intercept, slope, sizes


def fit_host(gaps: list[tuple[int, float]]) -> list:
    """``engine_host`` points: ``host_line`` through the gaps, given at the smallest and
    largest size (the latency model interpolates between them and extrapolates the slope)."""
    from profiler.schema import OpPoint

    intercept, slope, sizes = host_line(gaps)
    return [OpPoint("engine_host", batch_size=b, median_ms=1e3 * (intercept + slope * b),
                    p90_ms=1e3 * (intercept + slope * b))
            for b in dict.fromkeys(sizes[:1] + sizes[-1:])]  # fmt: skip


def fit_admit(gaps: list[tuple[int, float]], admits: list[tuple[int, int, float]],
              largest: int) -> list:  # fmt: skip
    """``engine_admit`` points: the median over ``admits`` (batch size, requests admitted,
    gap) of each gap's excess over ``host_line`` through ``gaps`` (the gaps with no
    admission), per request admitted: a line through 0, given at 1 and ``largest`` (at least
    2) requests; none without such gaps, or where admitting cost nothing measurable."""
    from profiler.schema import OpPoint

    intercept, slope, sizes = host_line(gaps)
    if not admits or not sizes:
        return []
    per = statistics.median((gap - intercept - slope * size) / k for size, k, gap in admits)
    if per <= 0:
        return []
    return [OpPoint("engine_admit", batch_size=k, median_ms=1e3 * per * k,
                    p90_ms=1e3 * per * k) for k in (1, max(largest, 2))]  # fmt: skip


def measure_engine_host(runner, sim_cfg, profile, largest_batch: int, clock: ClockKind,
                        seed: int) -> list:  # fmt: skip
    """The real engine's host time per iteration (``engine_host`` points), measured on a burst
    of its own (``HOST_*``; not the validation's requests) under ``sim_cfg``'s policy, on the
    runs' clock."""
    from realrun.prompts import random_ids
    from realrun.run import execute, make_clock
    from sim.run import build_scheduler

    vocab = runner.config.vocab_size
    burst = [Request(i, LS if i % 2 else BE, 0.0, HOST_PROMPT_TOKENS, HOST_STEPS * (i + 1))
             for i in range(largest_batch)]  # fmt: skip
    ids = range(largest_batch + HOST_ADMITS)
    prompts = {i: random_ids(HOST_PROMPT_TOKENS, vocab, seed + 7919, i) for i in ids}
    gaps, admits = [], []
    span = None  # the first round's run, over which the later rounds' arrivals spread
    for _ in range(HOST_ROUNDS):
        singles = [] if span is None else [
            Request(largest_batch + j, LS if j % 2 else BE, span * (j + 1) / (HOST_ADMITS + 1),
                    HOST_PROMPT_TOKENS, 1) for j in range(HOST_ADMITS)]  # fmt: skip
        real = execute(burst + singles, prompts, build_scheduler(sim_cfg, profile), runner,
                       sim_cfg.slo, make_clock(clock))  # fmt: skip
        span = real.result.makespan_s if span is None else span
        segments = real.result.segments
        for seg, gap in zip(segments, host_gaps(segments), strict=True):
            if gap is not None:
                if seg.admitted:
                    admits.append((len(seg.shape), seg.admitted, gap))
                else:
                    gaps.append((len(seg.shape), gap))
    return fit_host(gaps) + fit_admit(gaps, admits, largest_batch)


# What a validation writes at its end, from its runs (config.yaml and the profile come first).
RESULT_FILES = ("validation.json", "iteration_errors.json", "iterations.csv.gz", "validation.png")


def run_validation(cfg: DictConfig, phases: Phases | None = None,
                   budget: RunBudget | None = None) -> tuple[list[dict], Path]:  # fmt: skip
    """The whole comparison; needs Hydra initialized with CONF_DIR (the app or a test).
    ``phases``: where to add each phase's wall time (profile, real runs, simulation);
    ``budget``: ``time_budget_s``'s, from when the caller started (default: from now), whose
    ``cut`` says afterwards what it left out."""
    phases = phases if phases is not None else Phases()
    if budget is None:
        budget = RunBudget(cfg.get("time_budget_s"), time.perf_counter())
    check(cfg)
    from profiler.probe import probe_speed
    from realrun.run import (
        RESERVE_HEADROOM,
        execute,
        footprint_bytes,
        load_model,
        make_clock,
        prepare_requests,
        warm_up,
    )
    from sim.run import build_latency, build_scheduler, extrapolation_warning, simulate
    from sim.workloads import build_workload

    runner, info = load_model(cfg)
    name = cfg.name or f"{info.name}-{info.device.type}"
    out = Path(cfg.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    # an earlier validation's results go before this one's config is written: a run stopped
    # midway must not leave them beside a config (and profile) that did not produce them
    for stale in RESULT_FILES:
        (out / stale).unlink(missing_ok=True)
    write_config(out, cfg, None)  # the rates come with the profile's first pass
    # Lengths and classes do not depend on the rate (separate random streams): measure S1 once.
    nominal, _ = prepare_requests(cfg, runner, build_workload(cfg.workload, seed=cfg.seed))
    policy_caps = [OmegaConf.load(CONF_DIR / "policy" / f"{p}.yaml").get("max_batch_size")
                   for p in cfg.policies]  # fmt: skip
    largest_batch = min(max(cap or len(nominal) for cap in policy_caps), len(nominal))
    cover = (largest_batch, max(r.prompt_tokens for r in nominal),
             max(r.prompt_tokens + r.output_tokens for r in nominal),
             largest_prefill(list(cfg.policies), nominal))  # fmt: skip
    # the host-speed probe, run between the profile's shapes and the real runs' iterations
    speed_probe = make_speed_probe(runner, ClockKind(cfg.clock), cfg.seed)
    with phases("profile"):
        source = ProfileSource(cfg, runner, info, out, cover, speed_probe)
    profile = source.first()
    sims = {p: sim_config(cfg, p, source.directory) for p in cfg.policies}
    prompt = statistics.fmean(r.prompt_tokens for r in nominal)
    output = statistics.fmean(r.output_tokens for r in nominal)
    solo_s = solo_service_s(build_latency(sims[cfg.policies[0]], profile),
                            round(prompt), round(output))  # fmt: skip
    rates = [float(f"{u / solo_s:.3g}") for u in cfg.utilizations]
    write_config(out, cfg, rates)
    print(f"S1={solo_s * 1e3:.1f} ms (prompt {prompt:.0f}, output {output:.0f} tokens): "
          f"rates {rates} req/s")  # fmt: skip

    cases = [(u, rate, policy) for u, rate in zip(cfg.utilizations, rates, strict=True)
             for policy in cfg.policies]  # fmt: skip
    # Each point's request list: the workload's num_requests, or more where their arrivals
    # would span less than min_run_s (an overloaded run of 120 requests lasts about a second,
    # and this host's speed varies from second to second), or fewer where they would span
    # more than max_run_s (a light load's runs are mostly idle, and their requests barely
    # interact: they set the validation's wall time); the first requests have the same
    # lengths at every rate (the lengths' and the arrivals' random streams are apart).
    lists = {}
    for _, rate, _ in cases:
        if rate not in lists:
            n = point_requests(cfg.workload.num_requests, rate, cfg.min_run_s, cfg.max_run_s)
            workload = OmegaConf.merge(cfg.workload, {"rate": rate, "num_requests": n})
            lists[rate] = prepare_requests(cfg, runner, build_workload(workload, cfg.seed))
    workloads = [lists[rate] for _, rate, _ in cases]
    counts = [len(lists[rate][0]) for rate in rates]
    if counts != [cfg.workload.num_requests] * len(rates):
        print(f"requests per point {counts} (min_run_s={cfg.min_run_s:g}, "
              f"max_run_s={cfg.max_run_s:g})")  # fmt: skip
    with phases("warm-up and calibration"):
        if cfg.warmup:
            warm_up(runner, cover[1], largest_batch)
            longest = max((requests for requests, _ in lists.values()), key=len)
            footprint = footprint_bytes(longest, largest_batch, profile.memory.kv_bytes_per_token)
            runner.reserve(RESERVE_HEADROOM * footprint)
        duty = duty_slowdown(runner, ClockKind(cfg.clock), cfg.seed, idle_wait(cfg))
        if source.measuring:  # a given profile (profile.path) is used as it is
            host_cfg = sim_config(cfg, HOST_POLICY, source.directory)
            host_points = measure_engine_host(runner, host_cfg, profile, largest_batch,
                                              ClockKind(cfg.clock), cfg.seed)  # fmt: skip
            source.add_points(host_points)
            per_batch = [p for p in host_points if p.op == "engine_host"]
            admit = [f"{p.median_ms * 1e3:.0f} us" for p in host_points
                     if p.op == "engine_admit"][:1] or ["none measured"]  # fmt: skip
            print("engine host time per iteration (engine_host): "
                  + ", ".join(f"{p.median_ms * 1e3:.0f} us at batch {p.batch_size}"
                              for p in per_batch)
                  + f"; per request admitted (engine_admit): {admit[0]}")  # fmt: skip
    reals = [[] for _ in cases]  # per case: each replay's summary, segments
    # time_budget_s: each point's predicted makespan, against which its runs are expected
    with phases("simulation"):
        makespans = [simulate(sims[policy], requests=workloads[i][0], profile=profile,
                              warn=False).summary["makespan_s"] if budget.active else 0.0
                     for i, (_, _, policy) in enumerate(cases)]  # fmt: skip
    bar = tqdm(total=len(cases) * cfg.replays, desc="validating", unit="run",
               disable=not cfg.progress)  # fmt: skip
    # Round by round: every case once (in a random order: run_orders), then a pass of the
    # profile (when measured now).
    orders = run_orders(len(cases), cfg.replays, cfg.seed, cfg.shuffle)
    for round_no, order in enumerate(orders):
        for place, i in enumerate(order):
            if not budget.fits_run(makespans[i]):
                break
            requests, prompts = workloads[i]
            start = time.perf_counter()
            with phases("real runs"):
                real = execute(requests, prompts, build_scheduler(sims[cases[i][2]], profile),
                               runner, cfg.slo,
                               make_clock(ClockKind(cfg.clock), idle_wait=idle_wait(cfg)),
                               probe=speed_probe)  # fmt: skip
            budget.ran(makespans[i], time.perf_counter() - start)
            reals[i].append((real.summary, real.result.segments, round_no * len(cases) + place,
                             real.result.probes))  # fmt: skip
            bar.update()
        else:
            with phases("profile"):
                if source.between_rounds(budget):
                    continue
        break  # time_budget_s: what is left is not run
    bar.close()
    runs_done = sum(map(len, reals))
    if runs_done < len(cases) * cfg.replays or source.passes[0] < source.passes[1]:
        points_left = [f"{cases[i][2]} at {cases[i][1]:g} req/s" for i in range(len(cases))
                       if not reals[i]]  # fmt: skip
        budget.cut = cut_message(budget.budget_s, runs_done, len(cases) * cfg.replays,
                                 points_left, *source.passes)  # fmt: skip
        print(budget.cut, file=sys.stderr)
        if not runs_done:
            raise UserError(f"time_budget_s={budget.budget_s:g}: no real run fits in what the "
                            "profile left of it; raise it")  # fmt: skip
    with phases("profile"):
        profile = source.final(complete=budget.cut is None)
    print(f"profile interference {profile.interference:.3f}: a timed iteration ran "
          f"{100 * (profile.interference - 1):+.1f}% over its shape's median, on average; "
          f"the simulator scales its iterations by it")  # fmt: skip
    if passes := profile.extra.get("pass_speeds"):  # the machine's drift between the rounds
        n = source.per_round  # (a profile.path's passes ran beside another validation's runs)
        when = (f" ({n} before the first round of real runs, {n} after each)"
                if source.prof is not None else "")  # fmt: skip
        print(f"the profile's passes ran {', '.join(f'{x:.2f}x' for x in passes)} of its "
              f"medians, as timed{when}")  # fmt: skip
    host_reference_s = probe_reference(profile, speed_probe, cfg.profile.get("path"))
    if profile.extra.get("self_check"):  # a profile measured now (or saved with one)
        from profiler.measure import self_check_line

        print(self_check_line(profile.extra["self_check"]))
    records, rows = [], []
    segment_profile = dataclasses.replace(profile, points=[
        p for p in profile.points if p.op not in ("engine_host", "engine_admit")])  # fmt: skip
    host = host_term(profile, "engine_host")
    admit = host_term(profile, "engine_admit")
    beyond = []  # what the simulations read beyond the profile's grid: one warning for all
    for i, (u, rate, policy) in enumerate(cases):
        if not reals[i]:  # time_budget_s: not run (cut_message named it)
            continue
        # a segment holds no host time between iterations: predicted without engine_host
        predictor = build_latency(sims[policy], segment_profile)
        load = load_label(u, cfg.utilizations)
        speeds, adjusted, windows, probed, normalized = [], [], [], [], []
        for replay, (_, segments, place, probes) in enumerate(reals[i]):
            with phases("iteration predictions"):
                replay_rows = iteration_rows(policy, rate, replay, segments, predictor, host,
                                             place, load, admit)  # fmt: skip
            rows += replay_rows
            speeds.append(run_speed(replay_rows))
            windows += window_speeds(replay_rows)
            scaled = dataclasses.replace(profile, interference=profile.interference * speeds[-1])
            with phases("simulation"):
                rerun = simulate(sims[policy], requests=workloads[i][0], profile=scaled,
                                 warn=False)  # fmt: skip
            adjusted.append(rerun.summary)
            beyond += rerun.extrapolated
            if (host_speed := probe_speed(probes, host_reference_s)) is not None:
                probed.append(host_speed)
                scaled = dataclasses.replace(
                    profile, interference=profile.interference * host_speed
                )
                with phases("simulation"):
                    normalized.append(simulate(sims[policy], requests=workloads[i][0],
                                               profile=scaled, warn=False).summary)  # fmt: skip
        with phases("simulation"):
            sim = simulate(sims[policy], requests=workloads[i][0], warn=False)
        beyond += sim.extrapolated
        bounds = []  # every iteration sensitivity_pct faster, then slower
        for sign in (-1, 1) if cfg.sensitivity_pct else ():
            scale = 1 + sign * cfg.sensitivity_pct / 100
            moved = dataclasses.replace(profile, interference=profile.interference * scale)
            with phases("simulation"):
                bounds.append(simulate(sims[policy], requests=workloads[i][0], profile=moved,
                                       warn=False).summary)  # fmt: skip
        # the host's speed during the point's runs against the profile's, as the probe within
        # them measured it
        drift = round(100 * (statistics.median(probed) - 1), 2) if probed else None
        records += records_of(policy, rate, load,
                              [summary for summary, *_ in reals[i]], sim.summary, drift,
                              duty, adjusted, speeds, windows, bounds, cfg.sensitivity_pct,
                              normalized if len(normalized) == len(reals[i]) else None,
                              probed)  # fmt: skip
    if beyond:
        print(extrapolation_warning(profile.name, beyond), file=sys.stderr)
    (out / "validation.json").write_text(json.dumps(records, indent=1) + "\n")
    errors = iteration_errors(rows)
    (out / "iteration_errors.json").write_text(json.dumps(errors, indent=1) + "\n")
    pd.DataFrame(rows).to_csv(out / "iterations.csv.gz", index=False, float_format="%.6g")
    plot(records, out / "validation.png")
    return records, out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(records: list[dict]) -> str:
    lines = [f"{'policy':<10} {'rate':>7} {'load':<8} {'cls':<4} {'metric':<16} {'sim':>10} "
             f"{'real':>10} {'error%':>8} {'real cv%':>8} {'real min-max':>17} "
             f"{'adj err%':>8} {'norm err%':>9} {'sens%':>6}"]  # fmt: skip
    for r in records:
        adjusted = r.get("speed_adjusted_error_pct")
        normal = r.get("host_normalized_error_pct")
        sens = r.get("sim_sensitivity_pct")
        lines.append(f"{r['policy']:<10} {r['rate']:>7g} {r['load']:<8} {r['cls']:<4} "
                     f"{r['metric']:<16} {r['sim']:>10.4f} {r['real']:>10.4f} "
                     f"{r['error_pct']:>8.1f} {_pct(r['real_cv_pct']):>8} "
                     f"{r['real_min']:>8.4f}-{r['real_max']:<8.4f} "
                     f"{'' if adjusted is None else f'{adjusted:.1f}':>8} "
                     f"{'' if normal is None else f'{normal:.1f}':>9} "
                     f"{'' if sens is None else f'{sens:.1f}':>6}")  # fmt: skip
    speeds = [(r["run_speed_min"], r["run_speed_max"]) for r in records
              if r.get("run_speed_min") is not None]  # fmt: skip
    if speeds:
        lines.append(f"adj err%: the simulator with the profile scaled by each real run's "
                     f"measured speed ({min(a for a, _ in speeds):.2f}x .. "
                     f"{max(b for _, b in speeds):.2f}x its prediction): a diagnostic of what "
                     f"the machine's speed explains, not a prediction")  # fmt: skip
    hosts = [x for r in records for x in r.get("probe_speeds") or ()]
    if hosts:
        lines.append(f"norm err%: the simulator with the profile scaled by the host's speed "
                     f"during each real run, as the probe between its iterations measured it "
                     f"({min(hosts):.2f}x .. {max(hosts):.2f}x the profile's): a prediction "
                     f"for a machine of that speed")  # fmt: skip
    moved = next((r["speed_step_pct"] for r in records if "speed_step_pct" in r), None)
    if moved is not None:
        lines.append(f"sens%: how far the simulator's figure moves with every iteration "
                     f"{moved:g}% faster or slower (above {ILL_CONDITIONED_PCT:g}%: "
                     f"ill-conditioned)")  # fmt: skip
    return "\n".join(lines)


def iteration_table(groups: list[dict]) -> str:
    lines = [f"{'by':<19} {'value':<8} {'n':>6} {'median ms':>10} {'median err%':>11} "
             f"{'p10-p90 err%':>15} {'time err%':>9}"]  # fmt: skip
    runs = [g["time_error_pct"] for g in groups if g["by"] == "run"]
    for g in groups:
        if g["by"] == "run":
            continue
        lines.append(f"{g['by']:<19} {g['value']:<8} {g['n']:>6} {g['measured_ms_median']:>10.3f} "
                     f"{g['median_error_pct']:>11.1f} "
                     f"{g['p10_error_pct']:>7.1f}..{g['p90_error_pct']:<6.1f} "
                     f"{g['time_error_pct']:>9.1f}")  # fmt: skip
    if runs:
        lines.append(f"each real run's summed time error: {min(runs):+.1f}% .. {max(runs):+.1f}% "
                     f"over {len(runs)} runs (\"run\" in iteration_errors.json)")  # fmt: skip
    return "\n".join(lines)


def conditioning(records: list[dict]) -> str | None:
    """How many per-class means are ill-conditioned, and the worst (None: not measured)."""
    moved = [(r["sim_sensitivity_pct"], r) for r in records if r["cls"] != "all"
             and math.isfinite(r.get("sim_sensitivity_pct", math.nan))]  # fmt: skip
    if not moved:
        return None
    ill = [r for m, r in moved if m > ILL_CONDITIONED_PCT]
    worst, r = max(moved, key=lambda x: x[0])
    return (f"ill-conditioned: {len(ill)} of {len(moved)} per-class means move more than "
            f"{ILL_CONDITIONED_PCT:g}% when every iteration is {r['speed_step_pct']:g}% "
            f"faster or slower (worst {worst:.0f}%: {r['policy']} {r['load']} {r['cls']} "
            f"{r['metric']})")  # fmt: skip


def errors_clause(records: list[dict], key: str, label: str) -> str:
    """'; <label>: worst, median, how many within 10%' of the per-class means' ``key`` (an
    error in %), or '' where no record has it."""
    errors = [abs(e) for r in records if r["cls"] != "all"
              and math.isfinite(e := r.get(key, math.nan))]  # fmt: skip
    if not errors:
        return ""
    return (f"; {label}: worst {max(errors):.1f}%, median {statistics.median(errors):.1f}%, "
            f"{sum(e <= GOAL_PCT for e in errors)} of {len(errors)} within 10%")  # fmt: skip


def summary_line(records: list[dict]) -> str:
    """The worst and median per-class mean error, and how many points are within 10%."""
    errors = [abs(r["error_pct"]) for r in records
              if r["cls"] != "all" and math.isfinite(r["error_pct"])]  # fmt: skip
    if not errors:
        return "no per-class means"
    within = sum(e <= GOAL_PCT for e in errors)
    cvs = [cv for r in records if (cv := r["real_cv_pct"]) is not None]
    median = statistics.median(errors)
    if (floor := noise_floor(records)) is not None:  # what the real engine's spread allows
        exact, replay, n = floor
        within_of = (f" (of the {n} whose replays measure a spread: an exact simulator ~{exact:.0f}"
                     f" expected, from the replays' spread; a real replay against the others' "
                     f"mean ~{replay:.0f})")  # fmt: skip
    else:
        within_of = ""
    drifts = [d for r in records if (d := r.get("probe_drift_pct")) is not None]
    drift = f"; machine drift {min(drifts):+.1f}%..{max(drifts):+.1f}%" if drifts else ""
    duty = next((d for r in records if (d := r.get("duty_slowdown")) is not None), None)
    drift += f"; duty-cycle slowdown {duty:.2f}x" if duty is not None else ""
    lows = [v for r in records if (v := r.get("host_speed_p10")) is not None]
    highs = [v for r in records if (v := r.get("host_speed_p90")) is not None]
    if lows and highs:
        drift += (f"; host speed per second within runs (p10-p90 of the measured over the "
                  f"predicted time) {min(lows):.2f}x-{max(highs):.2f}x")  # fmt: skip
    if line := conditioning(records):
        drift += f"; {line}"
    overload = [r for r in records if r["load"] == "overload"]
    if (floor := noise_floor(overload, THROUGHPUT_GOAL_PCT, throughput=True)) is not None:
        exact, replay, _ = floor
        thr = [r["error_pct"] for r in overload if r["metric"] == "throughput_jobs"]
        hits = sum(abs(e) <= THROUGHPUT_GOAL_PCT for e in thr)
        drift += (f"; throughput at overload within {THROUGHPUT_GOAL_PCT:g}%: {hits} of {len(thr)} "
                  f"(an exact simulator ~{exact:.1f} expected; a real replay against the "
                  f"others ~{replay:.1f})")  # fmt: skip
    if (inside := within_replays(records)) is not None:
        n_in, below, above, n, exact = inside
        drift += (f"; the simulator within the real replays' min-max: {n_in} of {n} ({below} "
                  f"below, {above} above; one exact on each point's real median would be in "
                  f"{100 * exact:.0f}% of them)")  # fmt: skip
    drift += errors_clause(records, "speed_adjusted_error_pct", "speed-adjusted (diagnostic)")
    drift += errors_clause(records, "host_normalized_error_pct",
                           "host-normalized (the profile scaled by the probe's speed during "
                           "each run)")  # fmt: skip
    return (
        f"per-class means: worst |error| {max(errors):.1f}%, median {median:.1f}%, "
        f"{within} of {len(errors)} within 10%{within_of}; real replays' worst cv "
        f"{f'{max(cvs):.1f}%' if cvs else '- (one replay each: no spread measured)'}{drift}"
    )


# Minor page faults in one timed real run above which the validation warns: each costs about
# 2 us on a CPU (4-5 ms for the 2,400 of one unretained 32-sequence bind), none is profiled.
PAGE_FAULT_WARNING = 1000


def page_fault_warning(records: list[dict]) -> str | None:
    """A warning when a timed real run page-faulted: its times then hold the host's cost of
    mapping memory mid-run, which no profile term predicts."""
    faults = [f for r in records if (f := r.get("real_page_faults")) is not None]
    if not faults or max(faults) <= PAGE_FAULT_WARNING:
        return None
    return (f"warning: a timed real run page-faulted {max(faults)} times: host memory mapped "
            f"in mid-run is in the measured times and in no profile term (allocator not "
            f"retaining freed memory? see profiler.ops.retain_freed_memory)")  # fmt: skip


def plot(records: list[dict], path: Path) -> None:
    """Sim against real per metric: points on the diagonal are exact, the band is +-10%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["ttft_mean", "turnaround_mean", "throughput_jobs"]
    policies = sorted({r["policy"] for r in records})
    markers = {LS: "o", BE: "s", "all": "^"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.5))
    for ax, metric in zip(axes, metrics, strict=True):
        rows = [r for r in records if r["metric"] == metric and math.isfinite(r["sim"])]
        for i, policy in enumerate(policies):
            for cls, marker in markers.items():
                pts = [r for r in rows if r["policy"] == policy and r["cls"] == cls]
                if pts:  # horizontal bars: the real replays' min-max
                    xs, ys = [r["real"] for r in pts], [r["sim"] for r in pts]
                    xerr = [[r["real"] - r["real_min"] for r in pts],
                            [r["real_max"] - r["real"] for r in pts]]  # fmt: skip
                    ax.errorbar(xs, ys, xerr=xerr, fmt=marker, color=f"C{i}", ms=5, lw=0.8,
                                capsize=2, label=f"{policy} {cls}")  # fmt: skip
        values = [v for r in rows for v in (r["sim"], r["real"]) if v > 0]
        if values:
            lo, hi = min(values) / 1.5, max(values) * 1.5
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey",
                            alpha=0.2, label="±10%")  # fmt: skip
        unit = "jobs/s" if metric == "throughput_jobs" else "s"
        if unit == "s" and values:  # latencies span decades between the light and loaded rates
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set(title=metric, xlabel=f"real ({unit})", ylabel=f"simulated ({unit})")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@hydra.main(config_path=str(CONF_DIR), config_name="validate", version_base="1.3")
@job
def main(cfg: DictConfig) -> None:
    started = time.perf_counter()
    phases = Phases()
    budget = RunBudget(cfg.get("time_budget_s"), started)
    try:
        records, out = run_validation(cfg, phases, budget)
    except UserError as e:
        fail(PROG, str(e))
    print(table(records))
    print()
    print("per-iteration error (predicted - measured) / measured, every executed segment:")
    print(iteration_table(json.loads((out / "iteration_errors.json").read_text())))
    for warning in (page_fault_warning(records), drift_warning(records), duty_warning(records),
                    budget.cut):  # fmt: skip
        if warning is not None:
            print(warning, file=sys.stderr)
    took = round(time.perf_counter() - started)  # the budget: 6 minutes a preset
    print(f"{summary_line(records)} -> {out / 'validation.json'} "
          f"({took // 60} min {took % 60} s: {phases.line(took)})")  # fmt: skip


def cli() -> None:
    app = App(PROG, "validate", ("workload", "slo", "model"), free_keys=("model.config",),
              check=check, run_dir_per_run=False)  # fmt: skip
    run(app, main)


if __name__ == "__main__":  # python -m realrun.validate, where no console script is installed
    cli()
