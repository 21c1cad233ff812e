"""``qllm-plan``: capacity planning. For each (policy, router, replica count), the highest arrival
rate a cluster sustains within the SLO targets, found by bisection over the rate, with what BE
work pays there (its TTFT p99 and turnaround); and, for a target rate, the fewest replicas that
sustain it (bisected over the count between the counts searched), with the LS and BE figures
of runs at that rate on them.

A rate is *sustained* when, for every seed, a run of ``max(min_requests x replicas, rate x
horizon_s)`` arrivals (a trace workload: the whole trace, rescaled to the rate and repeated
where it is short of ``min_requests x replicas``, unless ``--horizon-s`` is given) meets
every target: LS TTFT p99 <= ``--ls-ttft-p99-s``, goodput (the fraction of requests meeting
every SLO that is set) >= ``--goodput``, and the cluster keeps up: the completions in the
run's steady window are at least ``--keeps-up`` (0.95) times its arrivals there
(``keeps_up``), so that BE work without an SLO cannot pile up unseen. The search
brackets the capacity by doubling from ``--rate-lo`` (the fewest replicas of a policy and
router) or by steps from the capacity that search found, scaled to the replicas (the others:
``Search``), then bisects until the bracket is within ``--rel-tol``; it assumes that a cluster
that sustains a rate sustains every lower one. The searches advance together: the runs of one
step (every ready search's next rate x seeds) go to a pool
of processes (``--jobs``), or to Ray workers (``--executor ray``; ``RAY_ADDRESS`` picks a
cluster, else a local one). A run stops as soon as it is certain to miss a target (``Verdict``:
enough LS requests finished late for the p99, enough requests out of their SLO for goodput,
or the steady window closed short of ``keeps_up``), since no later request can bring it back;
``--full-runs`` runs each to its end instead, for the figures of every run (the answers are
the same).
Evaluations are appended to ``evaluations.csv`` in the output directory as they finish, so an
interrupted search rerun with the same ``--out`` resumes where it stopped. Each row carries a
digest of the resolved config and of what the run was made from (the simulator's code, the
profile's files, the workload file, the installed data sets it reads: ``sim.provenance``),
computed by the run from the config it composed; a run is reused only when it equals today's,
so a resumed search never mixes in runs of other code or inputs, and a search whose config or
inputs change under it stops at the end of the step. Its ``ok`` says whether the run meets the
targets of the latest search over the directory.

Example::

    qllm-plan --replicas 1 2 4 8 --policies iteration qllm --routers least_outstanding \\
        --target-rate 20 workload=trace workload.path=data/traces/splitwise_conv.csv \\
        workload.max_output_tokens=null profile=h200-mixtral-bf16
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import math
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.core import BE, LS
from sim.config import ClusterConfig, UserError, ignored_keys

FIELDS = ["policy", "router", "replicas", "rate", "seed", "num_requests", "setup",
          "ls_ttft_p99_s", "goodput", "keeps_up", "jobs_per_s", "be_ttft_p99_s",
          "be_turnaround_mean_s", "be_turnaround_p99_s", "ok", "stopped", "inputs"]  # fmt: skip
# what the LS guarantee costs BE work, reported at each search's capacity and at the target rate
BE_COST = ("be_ttft_p99_s", "be_turnaround_mean_s", "be_turnaround_p99_s")


@dataclass
class Targets:
    ls_ttft_p99_s: float
    goodput: float
    keeps_up: float

    def met(self, row: dict) -> bool:
        if row.get("stopped"):  # stopped when certain to miss (``Runs.rows`` re-runs the rest)
            return False
        ls, goodput, keeps_up = (_float(row[k]) for k in ("ls_ttft_p99_s", "goodput", "keeps_up"))
        ttft_ok = ls is None or ls <= self.ls_ttft_p99_s
        return ttft_ok and goodput >= self.goodput and keeps_up >= self.keeps_up

    def missed_by(self, stopped: str) -> bool:
        """Whether a run stopped for ``stopped`` (``Verdict.reason``: a bound its whole run
        would have had) certainly misses these targets: a search of other targets may reuse
        it only then."""
        key, value = parse_stopped(stopped)
        if key == "ls_ttft_p99_s":  # p99 above the value
            return value >= self.ls_ttft_p99_s
        if key == "goodput":  # goodput at most the value
            return value < self.goodput
        return value < self.keeps_up  # keeps_up, exact


STOPPED = {"ls_ttft_p99_s": ">", "goodput": "<=", "keeps_up": "="}


def parse_stopped(stopped: str) -> tuple[str, float]:
    """(figure, bound) of a ``Verdict.reason``; ValueError if it is none."""
    found = re.fullmatch(r"([a-z_0-9]+)(>|<=|=)(\S+)", stopped)
    if found is None or STOPPED.get(found[1]) != found[2]:
        raise ValueError(f"not a stop reason: {stopped!r}")
    return found[1], float(found[3])


class Verdict:
    """Watches a run (``simulate``'s ``watch``) and stops it once it is certain to miss the
    targets, whatever the rest of it does: the search then needs no more of it. Every
    request of the run is known before it starts (its arrival and class), and a finished
    request's figures are final, so each bound below is what the whole run's figure
    (``evaluate``'s, computed as ``sim.metrics`` does) cannot escape:

    - LS TTFT p99 (numpy's linear percentile of the n LS TTFTs, at index h = 0.99 (n - 1)):
      at least the value of rank floor(h); once n - floor(h) + 1 LS requests (one spare for
      the rounding of h) have finished with a TTFT above the target plus a nanosecond (a
      margin for the interpolation's rounding), p99 is above the target.
    - goodput (the share of the requests of classes with an SLO that finished within it):
      at most (n - missed) / n, however the others fare.
    - keeps_up (the completions in the steady window (a[n // 10], a[-1]] per arrival there,
      ``keeps_up``): exact once the clock is past the last arrival, as no later completion
      falls in the window; so the drain of a backlog is never simulated for a run that
      did not keep up.

    ``reason`` then names the bound, as ``Targets.missed_by`` reads it: ``ls_ttft_p99_s>B``
    (p99 above B), ``goodput<=B``, ``keeps_up=B`` (the exact ratio)."""

    MARGIN_S = 1e-9

    def __init__(self, targets: Targets, slo: Any, times, is_ls) -> None:
        import numpy as np

        self.targets = targets
        self.ttft = {LS: slo.ls_ttft_s, BE: slo.be_ttft_s}
        self.tpot = {LS: slo.ls_tpot_s, BE: slo.be_tpot_s}
        has = {c: self.ttft[c] is not None or self.tpot[c] is not None for c in (LS, BE)}
        n_ls = int(np.count_nonzero(is_ls))
        counts = {LS: n_ls, BE: len(times) - n_ls}
        self.n_slo = sum(counts[c] for c in (LS, BE) if has[c])
        self.missed = 0
        self.ls_late_s = targets.ls_ttft_p99_s + self.MARGIN_S
        self.ls_late = 0
        # the LS requests late that put p99 above the target (never reached when n_ls < 2)
        self.ls_late_needed = n_ls - math.floor(0.99 * (n_ls - 1)) + 1 if n_ls else math.inf
        self.window = None
        if len(times):
            start, end = float(times[len(times) // 10]), float(times[-1])
            arrived = int(np.count_nonzero((times > start) & (times <= end)))
            if arrived:
                self.window = (start, end, arrived)
        self.in_window = 0
        self.window_closed = False
        self.reason: str | None = None
        self.stop = None

    def start(self, env):
        self.stop = env.event()
        return self.stop

    def finished(self, seq) -> None:
        request = seq.request
        self.finished_values(request.cls == LS, request.arrival_s, request.output_tokens,
                             seq.first_token_s, seq.finish_s)  # fmt: skip

    def finished_values(self, is_ls: bool, arrival_s: float, out: int, first: float,
                        finish: float) -> None:  # fmt: skip
        """``finished`` of a request given by its figures (the compiled executor's)."""
        if self.reason is not None:
            return
        cls = LS if is_ls else BE
        ttft = first - arrival_s  # as requests.parquet's ttft_s
        if self.ttft[cls] is not None or self.tpot[cls] is not None:
            ok = self.ttft[cls] is None or ttft <= self.ttft[cls]
            if ok and self.tpot[cls] is not None and out > 1:
                ok = not (finish - first) / (out - 1) > self.tpot[cls]
            if not ok:
                self.missed += 1
                bound = (self.n_slo - self.missed) / self.n_slo
                if bound < self.targets.goodput:
                    return self._stop(f"goodput<={bound!r}")
        if cls == LS and ttft > self.ls_late_s:
            self.ls_late += 1
            if self.ls_late >= self.ls_late_needed:
                return self._stop(f"ls_ttft_p99_s>{self.targets.ls_ttft_p99_s!r}")
        if self.window is not None and not self.window_closed:
            start, end, arrived = self.window
            if start < finish <= end:
                self.in_window += 1
            elif finish > end:
                self.window_closed = True
                ratio = self.in_window / arrived
                if ratio < self.targets.keeps_up:
                    return self._stop(f"keeps_up={ratio!r}")

    def _stop(self, reason: str) -> None:
        self.reason = reason
        if self.stop is not None:  # the compiled executor reads the reason itself
            self.stop.succeed()


# the keys each run's overrides set (after the user's, which they would silently replace)
SEARCHED = {
    "policy": "--policies",
    "cluster.router": "--routers",
    "cluster.replicas": "--replicas",
    "workload.rate": "--rate-lo and --target-rate (the search sets the rate)",
    "seed": "--seeds",
    "workload.num_requests": "--min-requests and --horizon-s",
}


# qllm-sim's options about a run directory, which a search's runs do not have
NOT_PLAN = {
    "resume": "qllm-plan reuses the runs of --out (whose inputs are today's); give another "
    "--out for fresh runs",
    "progress": "qllm-plan shows its own progress bar (the runs' would interleave)",
}


def override_keys(override: str) -> list[str]:
    """The keys an override sets: its own, and where its value is a dict (``workload={rate:
    2}``, which Hydra merges into the group), every key inside it, dotted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = override.split("=", 1)[0].lstrip("+~")
    try:
        (parsed,) = OverridesParser.create().parse_overrides([override])
        value = parsed.value()
    except Exception:  # noqa: BLE001  (not an override: composing it says why, in one line)
        return [key]

    def inner(prefix: str, node: Any) -> list[str]:
        out = []
        if isinstance(node, dict):
            for sub, v in node.items():
                out += [f"{prefix}.{sub}", *inner(f"{prefix}.{sub}", v)]
        return out

    return [key, *inner(key, value)]


def router_spec(router: str) -> tuple[str, int | None]:
    """A --routers entry: a router's name, or ``ls_dedicated:k`` for k replicas reserved for
    LS work; (name, k), k None when not given. ``router_problem`` has checked it."""
    name, sep, k = router.partition(":")
    return name, int(k) if sep else None


def router_overrides(router: str) -> list[str]:
    """A --routers entry as overrides (``ls_dedicated:k``: ``cluster.ls_replicas=k``)."""
    name, k = router_spec(router)
    return [f"cluster.router={name}", *([] if k is None else [f"cluster.ls_replicas={k}"])]


def router_problem(router: str) -> str | None:
    """What is wrong with a --routers entry (None: nothing)."""
    from sim.cluster import ROUTERS

    name, sep, k = router.partition(":")
    if name not in ROUTERS:
        return f"--routers {router}: unknown router; choose from {', '.join(ROUTERS)}"
    if not sep:
        return None
    lo, dash, hi = k.partition("-")
    counts = [lo, hi] if dash else [k]
    valid = k == "all" or all(c.isdigit() and int(c) >= 1 for c in counts)
    if name != "ls_dedicated" or not valid or (dash and int(lo) > int(hi)):
        return (f"--routers {router}: only ls_dedicated takes a count, ls_dedicated:k with "
                "k >= 1 replicas reserved for LS work, a range ls_dedicated:a-b (a <= b), or "
                "ls_dedicated:all (every split of every count searched)")  # fmt: skip
    return None


def expand_routers(routers: list[str], replicas: list[int]) -> tuple[list[str], set[str]]:
    """The --routers entries with each range of LS reservations (``ls_dedicated:a-b``;
    ``ls_dedicated:all``: 1 to the most replicas searched less one) as one entry per count,
    in order, without repeats; and the entries a range made (whose counts too small to
    serve them are expected, not warned of). ``router_problem`` has checked them."""
    out, ranged = [], set()
    for router in routers:
        name, _, k = router.partition(":")
        lo, dash, hi = k.partition("-")
        if k == "all":
            ks = range(1, max(replicas))
        elif dash:
            ks = range(int(lo), int(hi) + 1)
        else:
            out.append(router)
            continue
        made = [f"{name}:{j}" for j in ks]
        out += made
        ranged.update(made)
    return list(dict.fromkeys(out)), ranged - set(routers)


def best_splits(rows: list[dict], target: list[dict]) -> list[str]:
    """For each policy with two or more ``ls_dedicated:k`` searched: the reservation of the
    highest capacity on each replica count, and the one that serves the target rate on the
    fewest replicas (ties: the lower LS TTFT p99 there), as lines to print."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [
            r for r in rows if r["policy"] == policy and r["router"].startswith("ls_dedicated:")
        ]
        if len({r["router"] for r in mine}) < 2:
            continue
        for n in sorted({r["replicas"] for r in mine}):
            at_n = [r for r in mine if r["replicas"] == n]
            best = max(at_n, key=lambda r: r["max_rate"])
            if len(at_n) > 1 and best["max_rate"]:
                lines.append(f"  {policy} on {n} replicas: {best['router']} "
                             f"({best['max_rate']:.3f} req/s; of {len(at_n)} splits)")  # fmt: skip
        served = [t for t in target if t["policy"] == policy and t["replicas"] is not None
                  and t["router"].startswith("ls_dedicated:")]  # fmt: skip
        if served:
            best = min(served, key=lambda t: (t["replicas"], t["ls_ttft_p99_s"] or 0.0))
            lines.append(f"  {policy} for {best['rate']:g} req/s: {best['router']} on "
                         f"{best['replicas']} replicas")  # fmt: skip
    return lines


def fewest_replicas(router: str, ls_replicas: int) -> int:
    """The fewest replicas a --routers entry serves (``ls_replicas``: the config's)."""
    from sim.cluster import ROUTERS

    name, k = router_spec(router)
    return ROUTERS[name].fewest_replicas(ls_replicas if k is None else k)


# what a run's overrides set beyond the search's config (``fingerprints``): set back to that
# config's values, a run's config is the search's, and its fingerprint the same
RUN_KEYS = ("cluster.router", "cluster.ls_replicas", "cluster.replicas", "workload.rate", "seed",
            "workload.num_requests")  # fmt: skip


_run_key_defaults: dict[tuple, dict] = {}


def run_key_defaults(policy: str, overrides: tuple[str, ...]) -> dict:
    """The search's values of ``RUN_KEYS`` (what a run's own overrides replace), read from conf/
    once per worker process (a plain dict, not functools.cache: Ray ships ``evaluate`` and
    what it calls by value): a run's fingerprint takes every other key from its own
    composition, so a change of conf/ during a search still shows in it."""
    key = (policy, overrides)
    if key not in _run_key_defaults:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf

        from sim.app import CONF_DIR

        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            base = compose("config", overrides=[*overrides, f"policy={policy}"])
        _run_key_defaults[key] = {k: OmegaConf.select(base, k) for k in RUN_KEYS}
    return _run_key_defaults[key]


def evaluate(task: tuple, targets: Targets | None = None) -> dict:
    """One run: (policy, router, replicas, rate, seed, num_requests, overrides) -> a row, whose
    ``inputs`` is the fingerprint of the config this run composed (conf/ as it was then, the
    code and inputs as this process reads them), computed as ``fingerprints`` does.
    ``targets``: stop the run once it certainly misses them (``Verdict``); the row then has
    the bound in ``stopped`` and no figures (but keeps_up, when that is what it missed)."""
    import numpy as np
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from sim import provenance
    from sim.app import CONF_DIR, job_config
    from sim.run import RunStopped, simulate
    from sim.workloads import stream_workload

    policy, router, replicas, rate, seed, n, overrides = task
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            *overrides, f"policy={policy}", *router_overrides(router),
            f"cluster.replicas={replicas}", f"workload.rate={rate}", f"seed={seed}",
            f"workload.num_requests={n}"])  # fmt: skip
    searched = copy.deepcopy(cfg)
    for key, value in run_key_defaults(policy, tuple(overrides)).items():
        OmegaConf.update(searched, key, value, merge=False)
    inputs = provenance.fingerprint(job_config(searched), provenance.inputs(searched))
    workload = stream_workload(cfg.workload, seed=cfg.seed)
    verdict = Verdict(targets or Targets(math.inf, 0.0, 0.0), cfg.slo, workload.times,
                      workload.is_ls)  # fmt: skip
    # what the figures would lack, known before the run
    if not verdict.n_slo:  # a target no run can meet would report a capacity of 0 without a word
        raise UserError(no_slo_problem(cfg, len(workload)))
    if cfg.workload.get("ls_fraction", 1.0) > 0 and not workload.is_ls.any():
        # the LS target would pass untested (a p99 of no request), and a capacity come out high
        raise UserError(f"--ls-ttft-p99-s: a run of {len(workload)} requests drew no LS "
                        "request, so its LS TTFT p99 target would pass untested: raise "
                        "--min-requests")  # fmt: skip
    if verdict.window is None:
        raise UserError(f"a run of {len(workload)} requests at {rate:g} req/s has no "
                        "window to measure keeps_up in: nine tenths of its arrivals or more "
                        "come at one instant")  # fmt: skip
    row = {"policy": policy, "router": router, "replicas": replicas, "rate": rate,
           "seed": seed, "num_requests": n, "setup": " ".join(overrides), "inputs": inputs,
           "stopped": ""}  # fmt: skip
    try:
        out = simulate(cfg, requests=workload, watch=verdict if targets else None)
    except RunStopped as e:
        # the largest request alone: what the whole run would have refused (a request no
        # replica can hold) is not left unsaid by a stop before it arrived
        big = int(np.argmax(workload.jobs.prompt + workload.jobs.output))
        simulate(cfg, requests=[workload.request(big)], warn=False)
        key, value = parse_stopped(str(e))
        return {**row, **dict.fromkeys(("ls_ttft_p99_s", "goodput", "jobs_per_s", *BE_COST), ""),
                "keeps_up": value if key == "keeps_up" else "", "stopped": str(e)}  # fmt: skip
    classes = out.summary["classes"]
    ls, be = classes["LS"]["ttft_s"]["p99"], classes["BE"]
    # A policy that keeps LS within its SLO can let BE work pile up without bound: a sustained
    # rate must also be completed, i.e. the steady-state completions keep up with arrivals.
    ratio = keeps_up(out.requests["arrival_s"].to_numpy(), out.requests["finish_s"].to_numpy())
    return {**row, "ls_ttft_p99_s": ls, "goodput": classes["all"]["goodput"],
            "keeps_up": ratio, "jobs_per_s": out.summary["throughput"]["jobs_per_s"],
            "be_ttft_p99_s": be["ttft_s"]["p99"],
            "be_turnaround_mean_s": be["turnaround_s"]["mean"],
            "be_turnaround_p99_s": be["turnaround_s"]["p99"]}  # fmt: skip


def keeps_up(arrival_s, finish_s) -> float | None:
    """Completions over arrivals in the run's steady window, from the arrival of request
    floor(n/10) (in arrival order; warm-up before it) to the last arrival (the drain after
    it), both counted in (start, end]: 1 when every request finishes on arrival, whatever the
    arrivals' shape; below 1 by the share of the window's arrivals that the backlog kept.
    ``steady_jobs_per_s`` over the window's own arrival rate, not the run's mean rate (a trace
    whose first tenth is sparser than the rest would read above 1 at zero latency). None:
    the window is empty."""
    import numpy as np

    a = np.sort(np.asarray(arrival_s, dtype=float))
    if len(a) == 0:
        return None
    start, end = a[len(a) // 10], a[-1]
    arrived = int(((a > start) & (a <= end)).sum())
    if arrived == 0:
        return None
    f = np.asarray(finish_s, dtype=float)
    return int(((f > start) & (f <= end)).sum()) / arrived


def slos_set(slo) -> tuple[bool, bool]:
    """Whether LS and whether BE work has an SLO (TTFT or TPOT)."""
    return (slo.ls_ttft_s is not None or slo.ls_tpot_s is not None,
            slo.be_ttft_s is not None or slo.be_tpot_s is not None)  # fmt: skip


def slo_problem(cfg) -> str | None:
    """Why no run of this config can have a request with an SLO, which --goodput needs: no
    class with requests has one. None: some run can."""
    ls_slo, be_slo = slos_set(cfg.slo)
    ls_fraction = cfg.workload.get("ls_fraction", 1.0)
    if be_slo and ls_fraction < 1:
        return None
    if ls_slo and ls_fraction > 0:
        return None
    if not ls_slo and not be_slo:
        return "--goodput: no class has an SLO (slo.ls_ttft_s and slo.ls_tpot_s are null)"
    if not ls_slo:
        return ("--goodput: no request of this workload has an SLO (workload.ls_fraction=1 "
                "makes no BE request, and LS has none): set slo.ls_ttft_s")  # fmt: skip
    return ("--goodput: no request of this workload has an SLO (workload.ls_fraction=0 "
            "makes no LS request): set slo.be_ttft_s")  # fmt: skip


def no_slo_problem(cfg, n: int) -> str:
    """Why a run of ``n`` requests has no request with an SLO (so no goodput)."""
    if not slos_set(cfg.slo)[0]:  # then BE has one (slo_problem)
        drew, other = "no BE request (LS has no SLO)", "slo.ls_ttft_s"
    else:
        drew, other = "no LS request", "slo.be_ttft_s"
    return slo_problem(cfg) or (
        f"--goodput: a run of {n} requests drew {drew}, so none has an SLO: raise "
        f"--min-requests (or set {other})")  # fmt: skip


@dataclass
class Search:
    """The search for one (policy, router, replicas): from ``start``, steps up while the rate
    is sustained and down while it is not, until a sustained and a failed rate bracket the
    capacity; then bisection until the bracket is within ``rel_tol``. Each step is a factor
    of ``step`` (by default 2: doublings from --rate-lo). A failed ``floor`` (the lowest rate
    searched, --rate-lo x replicas) ends it with capacity 0.

    ``base``: a search of fewer replicas of the same policy and router. This one waits for it
    and starts at replicas / base.replicas x its capacity, with steps of 1 + 4 rel_tol, each
    the square of the one before (1.2, 1.44, 2.07, 4.3, ... at rel_tol 0.05): capacity grows
    about in proportion to the replicas (a little faster, as load evens out over more of
    them), so the guess brackets the capacity in two or three runs instead of the doublings
    from --rate-lo, and a guess far off is still bracketed in a few. A base of capacity 0
    changes nothing."""

    policy: str
    router: str
    replicas: int
    start: float  # the first rate to try (set from ``base`` when that is done)
    rel_tol: float
    floor: float | None = None  # None: ``start``
    step: float = 2.0
    squared: bool = False  # whether each step is the square of the one before
    base: Search | None = None
    ok_rate: float | None = None  # the highest rate sustained
    hi: float | None = None  # the lowest rate not sustained
    evaluations: int = 0
    history: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.floor is None:
            self.floor = self.start

    @property
    def ready(self) -> bool:
        """Whether its next rate is known (it has no base, or that is done)."""
        return self.base is None or self.evaluations > 0 or self.base.done

    @property
    def done(self) -> bool:
        if self.ok_rate is None:
            return self.hi is not None and self.hi <= self.floor
        return self.hi is not None and (self.hi - self.ok_rate) <= self.rel_tol * self.hi

    def next_rate(self) -> float:
        if not self.evaluations:
            if self.base is not None and self.base.capacity > 0 and not self.squared:
                guess = self.base.capacity * self.replicas / self.base.replicas
                self.start, self.step = max(guess, self.floor), 1 + 4 * self.rel_tol
                self.squared = True
            return self.start
        if self.hi is None:
            return self.ok_rate * self.step
        if self.ok_rate is None:
            return max(self.hi / self.step, self.floor)
        return (self.ok_rate + self.hi) / 2

    def record(self, rate: float, ok: bool) -> None:
        if self.evaluations and self.squared and (self.hi is None or self.ok_rate is None):
            self.step *= self.step  # a step was made from an unbracketed rate
        self.evaluations += 1
        self.history.append((rate, ok))
        if ok:
            self.ok_rate = rate
        else:
            self.hi = rate
        if self.evaluations > 60:  # a non-monotone response cannot loop forever
            self.hi = self.ok_rate if self.ok_rate is not None else self.floor

    @property
    def capacity(self) -> float:
        return self.ok_rate or 0.0


HORIZON_S = 300.0  # a run's span where the workload is not a trace (or --horizon-s)


# at least this many arrivals per replica in a run (--min-requests): on shorter runs the
# completions-per-arrival ratio of a cluster that keeps up scatters too widely to tell 5% of
# backlog growth from noise (README, Capacity planning)
MIN_REQUESTS = 2000


def num_requests(rate: float, horizon_s: float, min_requests: int, replicas: int) -> int:
    """A run's arrivals: rate x horizon_s, at least ``min_requests`` per replica."""
    return max(min_requests * replicas, math.ceil(rate * horizon_s))


def trace_requests(workload: Any) -> int | None:
    """The number of requests of the workload's trace (None: the workload is not a trace).
    Rescaled to a rate, the whole trace is the workload at that rate: its first part alone
    has other bursts and lengths than the rest (on the conversation trace, 4 replicas under
    ``iteration`` at 6.5 req/s give an LS TTFT p99 of 2.2-2.4 s over its first 1,950 requests
    and 3.2-3.4 s over its first 7,800)."""
    from sim.workloads import trace

    kind = getattr(workload.kind, "value", workload.kind)
    if kind != "trace" or not workload.path:
        return None
    return len(trace.read_trace(Path(workload.path).expanduser())[0])


class Evaluations:
    """evaluations.csv: every finished run, appended as it finishes (resume = reuse). A file
    of another layout (an older qllm-plan's) is set aside as evaluations.csv.old: its runs
    carry no inputs digest, so none of them can be known to be today's. A row that cannot be
    read (a line cut short by a crash or a full disk) is skipped and counted in ``malformed``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[tuple, dict] = {}
        self.set_aside: Path | None = None
        self.malformed = 0
        if path.is_file():
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                rows = list(reader)
                layout = reader.fieldnames
            if layout != FIELDS:
                self.set_aside = path.with_name(path.name + ".old")
                path.replace(self.set_aside)
                rows = []
            for row in rows:
                try:
                    key = self.key(row)
                    _check(row)
                except (TypeError, ValueError):
                    self.malformed += 1
                    continue
                self.rows[key] = row

    @staticmethod
    def key(row) -> tuple:
        return (row["policy"], row["router"], int(row["replicas"]), f"{float(row['rate']):.9g}",
                int(row["seed"]), int(row["num_requests"]), row["setup"],
                row["inputs"])  # fmt: skip

    def get(self, task: tuple, inputs: str) -> dict | None:
        """The finished run of ``task`` made from these inputs (a fingerprint), if any."""
        policy, router, replicas, rate, seed, n, overrides = task
        return self.rows.get((policy, router, replicas, f"{rate:.9g}", seed, n,
                              " ".join(overrides), inputs))  # fmt: skip

    def others(self, fingerprints: dict[str, str]) -> int:
        """How many runs of these policies were made from other config, code or inputs than
        their ``fingerprints`` (policy -> fingerprint) say."""
        return sum(row["policy"] in fingerprints and row["inputs"] != fingerprints[row["policy"]]
                   for row in self.rows.values())  # fmt: skip

    def retarget(self, targets: Targets) -> int:
        """Set every row's ``ok`` to whether it meets ``targets`` (a search's), rewriting the
        file where one changes (rows that could not be read are dropped then); how many
        changed."""
        changed = 0
        for row in self.rows.values():
            ok = targets.met(row)
            if str(row["ok"]) != str(ok):
                row["ok"] = ok
                changed += 1
        if changed:
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(self.rows.values())
            tmp.replace(self.path)
        return changed

    def add(self, row: dict) -> None:
        size = self.path.stat().st_size if self.path.is_file() else 0
        cut = False
        if size:
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                cut = f.read(1) != b"\n"
        with self.path.open("a", newline="") as f:
            if cut:  # a last line cut short is ended, so that this row is not appended to it
                f.write("\r\n")
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if not size:
                w.writeheader()
            w.writerow(row)
        self.rows[self.key(row)] = row


def _check(row: dict) -> None:
    """Raises TypeError or ValueError where a read row lacks a field, has one too many (a
    line cut short with the next one appended to it), or has a figure that is no number."""
    if None in row or None in row.values():
        raise ValueError("fields missing or extra")
    if row["stopped"]:
        parse_stopped(row["stopped"])
    for k in ("goodput", "keeps_up"):  # never empty (``evaluate``) but in a stopped run's
        if not row["stopped"] or row[k]:
            float(row[k])
    for k in ("ls_ttft_p99_s", "jobs_per_s", *BE_COST):
        _float(row[k])


def _float(x) -> float | None:
    if x is None or x == "":
        return None
    return float(x)


@dataclass
class Runs:
    """The runs of one ``qllm-plan``: each point (policy, router, replicas, rate) is a run per
    seed of ``max(min_requests x replicas, rate x horizon_s)`` arrivals (``horizon_s`` None:
    ``max(min_requests x replicas, whole)``, every request of the trace, repeated where it is
    shorter), made by ``pool`` unless ``cache`` holds it from the same inputs
    (``fingerprints``: policy -> fingerprint)."""

    targets: Targets
    seeds: list[int]
    horizon_s: float | None
    min_requests: int
    overrides: list[str]
    cache: Evaluations
    pool: Any
    fingerprints: dict[str, str]
    whole: int | None = None
    on_run: Any = None  # called after each run made (a progress bar's tick)
    full_runs: bool = False  # run every run to its end (else stop it once it misses: Verdict)
    made: set = field(default_factory=set)  # the tasks run by this search
    reused: set = field(default_factory=set)  # those it found in ``cache`` from before it

    def tasks(self, policy: str, router: str, replicas: int, rate: float) -> list[tuple]:
        if self.horizon_s is None:  # the whole trace, repeated where it is short of
            n = max(self.whole, self.min_requests * replicas)  # min_requests per replica
        else:
            n = num_requests(rate, self.horizon_s, self.min_requests, replicas)
        return [(policy, router, replicas, rate, seed, n, tuple(self.overrides))
                for seed in self.seeds]  # fmt: skip

    def run(self, tasks: list[tuple]) -> None:
        """Make the runs of ``tasks`` that are not cached (in parallel, by the pool). Each
        row is kept under the fingerprint of the config its run composed; where that is not
        the one the search began with (conf/, the code or an input changed during the
        search), the row is not this search's: a warning says so, and once the step's runs
        are in, the search stops (UserError) rather than mix the two."""
        todo = []
        for t in tasks:
            if self.rows([t]) == [None]:
                todo.append(t)
            elif t not in self.made:
                self.reused.add(t)
        changed = 0
        run = evaluate if self.full_runs else functools.partial(evaluate, targets=self.targets)
        for task, row in zip(todo, self.pool(run, todo), strict=True):
            row["ok"] = self.targets.met(row)
            self.cache.add(row)
            self.made.add(task)
            if row["inputs"] != self.fingerprints[row["policy"]]:
                if not changed:
                    print("qllm-plan: warning: a run was made from another config, code, "
                          "profile, workload file or data set than the search began with "
                          "(changed during the search): its row is kept under its own digest, "
                          "not counted as this search's", file=sys.stderr)  # fmt: skip
                changed += 1
            if self.on_run is not None:
                self.on_run()
        if changed:
            raise UserError(
                f"{changed} runs of this step were made from a config, code or input that "
                "changed during the search, so it stopped rather than mix the two in one "
                "plan; rerun the same command to search what is there now (those runs are "
                "reused)"
            )

    def rows(self, tasks: list[tuple]) -> list[dict | None]:
        """The runs of ``tasks`` made (None: to make). A run stopped when it was certain to
        miss some targets counts only if it is certain to miss this search's too, and not
        under ``full_runs``, which asks for every run's figures (a rerun with --full-runs
        over a search's --out reused its stopped runs, their figures still empty)."""
        out = []
        for t in tasks:
            row = self.cache.get(t, self.fingerprints[t[0]])
            stopped = row.get("stopped") if row is not None else None
            if stopped and (self.full_runs or not self.targets.missed_by(stopped)):
                row = None
            out.append(row)
        return out

    def point(self, policy: str, router: str, replicas: int, rate: float) -> dict:
        """A point's figures (its runs made if need be): each metric's mean over the seeds
        (None where no seed has one)."""
        tasks = self.tasks(policy, router, replicas, rate)
        self.run(tasks)
        rows = self.rows(tasks)
        out = {}
        for key in ("ls_ttft_p99_s", "goodput", "keeps_up", *BE_COST):
            values = [v for v in (_float(r[key]) for r in rows) if v is not None]
            out[key] = sum(values) / len(values) if values else None
        return out


def run_searches(searches: list[Search], runs: Runs, progress=None) -> None:
    """Advance every search to its end, the runs of a step (every ready search's next rate x
    seeds) together; a search that starts from a base's capacity joins once that is done."""
    while True:
        left = [s for s in searches if not s.done]
        if not left:
            return
        active = [s for s in left if s.ready]
        tasks = {id(s): runs.tasks(s.policy, s.router, s.replicas, s.next_rate()) for s in active}
        runs.run([t for ts in tasks.values() for t in ts])
        for s in active:
            ok = all(runs.targets.met(r) for r in runs.rows(tasks[id(s)]))
            s.record(tasks[id(s)][0][3], ok)
        if progress:
            progress(searches)


def process_pool(jobs: int):
    if jobs <= 1:
        return lambda fn, tasks: map(fn, tasks)
    executor = ProcessPoolExecutor(max_workers=jobs)
    return lambda fn, tasks: executor.map(fn, tasks)


def ray_pool(jobs: int):
    try:
        import ray
        from ray.util.multiprocessing import Pool
    except ImportError:
        raise UserError(
            "--executor ray: ray is not installed (pip install 'ray[default]')"
        ) from None
    if not ray.is_initialized():
        ray.init(num_cpus=jobs if jobs > 0 else None, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
    pool = Pool(processes=jobs if jobs > 0 else None)
    return lambda fn, tasks: pool.map(fn, list(tasks))


def frontier_figure(rows: list[dict], path: Path, target_rate: float | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["policy"], r["router"]), []).append((r["replicas"], r["max_rate"]))
    for (policy, router), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy}, {router}")
    if target_rate:
        ax.axhline(target_rate, color="k", ls="--", lw=1, label=f"target {target_rate:g} req/s")
    ax.set(xlabel="replicas", ylabel="highest sustained arrival rate (req/s)",
           title="Capacity frontier (within the SLO targets)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fingerprints(overrides: list[str], policies: list[str]) -> tuple[dict[str, str], Any]:
    """Compose and validate each policy's config once, so that a bad override fails here in
    one line; returns each policy's fingerprint (its resolved config, at the defaults of what
    the search varies, and the digests of the code, profile and workload file it reads) and
    the last one's config (its workload and cluster groups are every policy's)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from sim import provenance
    from sim.app import CONF_DIR, job_config
    from sim.config import validate

    GlobalHydra.instance().clear()
    out = {}
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            for policy in policies:
                cfg = compose("config", overrides=[*overrides, f"policy={policy}"])
                validate(cfg)
                out[policy] = provenance.fingerprint(job_config(cfg), provenance.inputs(cfg))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (Hydra's many error types: one line each)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{' '.join(overrides)}: {first}") from None
    return out, cfg


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qllm-plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Trailing arguments are qllm-sim overrides (workload=..., "
                                 "profile=..., slo.ls_ttft_s=...).")  # fmt: skip
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--policies", nargs="+", default=["iteration", "qllm"])
    ap.add_argument("--routers", nargs="+", default=["least_outstanding"],
                    help="routers to search; ls_dedicated:k reserves k replicas for LS work "
                    "(ls_dedicated alone: cluster.ls_replicas), ls_dedicated:a-b each of a to "
                    "b, ls_dedicated:all every split of every count")  # fmt: skip
    ap.add_argument("--ls-ttft-p99-s", type=float, default=3.0)
    ap.add_argument("--goodput", type=float, default=0.99)
    ap.add_argument("--keeps-up", type=float, default=0.95,
                    help="steady-state completions per arrival at least this (a backlog that "
                    "grows without bound is not sustained)")  # fmt: skip
    ap.add_argument("--target-rate", type=float, default=None,
                    help="also report the fewest replicas that sustain this rate")  # fmt: skip
    ap.add_argument(
        "--rate-lo",
        type=float,
        default=0.25,
        help="lowest rate per replica searched (where the search of the fewest replicas starts)",
    )
    ap.add_argument("--rel-tol", type=float, default=0.05)
    ap.add_argument("--horizon-s", type=float, default=None,
                    help=f"each run's span: rate x this many arrivals (default {HORIZON_S:g}; "
                    "a trace workload: the whole trace at every rate)")  # fmt: skip
    ap.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                    help="arrivals per replica a run has at least (default %(default)s; a "
                    "trace workload with fewer is replayed repeated up to this many per "
                    "replica)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--full-runs", action="store_true",
                    help="run every run to its end, for the figures of the runs that miss the "
                    "targets too (by default a run stops once it is certain to miss them; the "
                    "search's answers are the same)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--executor", choices=["process", "ray"], default="process")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default results/plan/<date>_<time>); an existing "
                    "one resumes its search")  # fmt: skip
    ap.add_argument("overrides", nargs="*")
    return ap


def few_samples_warning(smallest: int, ls_fraction: float) -> None:
    """qllm-sim's warning of a class whose p99 rests on fewer than FEW_SAMPLES requests, for
    the smallest runs of a search (``smallest`` requests: those at --rate-lo on the fewest
    replicas; a run at a higher rate has as many or more), before they run."""
    from sim.app import FEW_SAMPLES

    for cls, share, which in ((LS, ls_fraction, "the LS TTFT p99 target's reading"),
                              (BE, 1 - ls_fraction, "plan.csv's BE p99s")):  # fmt: skip
        n = smallest * share
        if 0 < n < FEW_SAMPLES:
            print(f"qllm-plan: warning: the smallest runs ({smallest} requests) hold about "
                  f"{n:.0f} {cls} requests: their {cls} p99s ({which}) rest on fewer than "
                  f"{FEW_SAMPLES} samples, about their largest; raise --min-requests",
                  file=sys.stderr)  # fmt: skip


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.out is not None and args.out.is_dir():  # an earlier search's results, which this
        for name in ("plan.csv", "target.csv", "frontier.png"):  # one, stopped or refused
            (args.out / name).unlink(missing_ok=True)  # (exit 2), would leave standing
    problems = [p for p in map(router_problem, args.routers) if p]
    sets = {o: override_keys(o) for o in args.overrides}
    problems += [
        f"{o}: qllm-plan sets {key} in every run; use {SEARCHED[key]}"
        for o in args.overrides
        for key in sets[o]
        if key in SEARCHED
    ]
    # qllm-sim's run options that a search has its own ways for: accepted, they did nothing
    problems += [
        f"{o}: {NOT_PLAN[key]}" for o in args.overrides for key in sets[o] if key in NOT_PLAN
    ]
    # a count in --routers sets cluster.ls_replicas in its runs, after the user's override,
    # which evaluations.csv's setup would still record
    counted = [r for r in args.routers if ":" in r]
    problems += [
        f"{o}: --routers {counted[0]} sets cluster.ls_replicas in its runs; give the count "
        "there (ls_dedicated:k), or this override with a plain ls_dedicated only"
        for o in args.overrides
        if counted and "cluster.ls_replicas" in sets[o]
    ]
    problems += [f"--replicas {n}: must be >= 1" for n in args.replicas if n < 1]
    if not 0 < args.goodput <= 1:
        problems.append(f"--goodput {args.goodput}: must be in (0, 1]")
    if not 0 < args.keeps_up <= 1:  # 95 for 95% would fail every rate without a word
        problems.append(f"--keeps-up {args.keeps_up}: must be in (0, 1], a share of arrivals")
    if args.target_rate is not None and args.target_rate <= 0:
        problems.append(f"--target-rate {args.target_rate}: must be > 0 (req/s)")
    if args.ls_ttft_p99_s <= 0:
        problems.append(f"--ls-ttft-p99-s {args.ls_ttft_p99_s}: must be > 0 seconds")
    if args.rate_lo <= 0 or args.rel_tol <= 0 or (args.horizon_s is not None
                                                   and args.horizon_s <= 0):  # fmt: skip
        problems.append("--rate-lo, --rel-tol and --horizon-s must be > 0")
    if problems:
        print(f"qllm-plan: error: {problems[0]}", file=sys.stderr)
        return 2
    args.routers, ranged = expand_routers(args.routers, args.replicas)
    try:
        fps, cfg = fingerprints(args.overrides, args.policies)
        if problem := slo_problem(cfg):  # before any run, not after a step of them
            raise UserError(problem)
        if cfg.workload.get("ls_fraction", 1.0) == 0:
            print(f"qllm-plan: note: workload.ls_fraction=0 makes no LS request: --ls-ttft-p99-s "
                  f"{args.ls_ttft_p99_s:g} constrains nothing (--goodput and --keeps-up do)",
                  file=sys.stderr)  # fmt: skip
        for line in ignored_keys(cfg):  # a router's keys: each run's router decides
            if not line.startswith("cluster."):
                print(f"qllm-plan: warning: {line}", file=sys.stderr)
        if (cfg.cluster.ls_replicas != ClusterConfig.ls_replicas
                and "ls_dedicated" not in args.routers):  # fmt: skip
            print(f"qllm-plan: warning: cluster.ls_replicas={cfg.cluster.ls_replicas} is "
                  "ignored without --routers ls_dedicated (no other router reads it)",
                  file=sys.stderr)  # fmt: skip
        if cfg.workload.get("peak_to_trough") is not None:
            raise UserError(
                f"workload.peak_to_trough={cfg.workload.peak_to_trough}: a daily curve keeps "
                "the mean rate over whole periods only, and the search's runs span what "
                "their rates make them: a capacity would be reported at a rate its runs did "
                "not have; search the rate of the hour you plan for, without the curve"
            )
        whole = trace_requests(cfg.workload)
    except UserError as e:
        print(f"qllm-plan: error: {e}", file=sys.stderr)
        return 2
    horizon_s = args.horizon_s
    if whole is None and horizon_s is None:
        horizon_s = HORIZON_S
    elif whole is not None and horizon_s is not None:  # say what part of the trace is replayed
        fewest = min(args.replicas)
        first = args.rate_lo * fewest  # the lowest rate tried
        part = num_requests(first, horizon_s, args.min_requests, fewest)
        if part < whole:
            print(f"qllm-plan: warning: --horizon-s {horizon_s:g} replays only the first rate x "
                  f"{horizon_s:g} of the trace's {whole} requests ({part} at {first:g} req/s), "
                  "rescaled to the rate: a capacity found there has not seen the rest of the "
                  "trace's bursts; leave --horizon-s out to replay the whole trace at every "
                  "rate", file=sys.stderr)  # fmt: skip
        print(f"qllm-plan: note: a run at more than {whole / horizon_s:.4g} req/s (the trace's "
              f"{whole} requests in --horizon-s {horizon_s:g}), or of more than {whole} "
              f"requests by --min-requests {args.min_requests} per replica, replays the trace "
              "repeated (its bursts recur)", file=sys.stderr)  # fmt: skip
    if whole is not None and horizon_s is None:
        short = [n for n in sorted(args.replicas) if whole < args.min_requests * n]
        if short:
            print(f"qllm-plan: note: the trace's {whole} requests are fewer than "
                  f"--min-requests {args.min_requests} per replica on {short[0]} replicas and "
                  "more: there it is replayed repeated to --min-requests per replica (its "
                  "bursts recur), which keeps_up needs to tell a backlog from noise",
                  file=sys.stderr)  # fmt: skip
    if whole is None and (share := cfg.workload.get("ls_fraction")) is not None:
        fewest = min(args.replicas)  # a search's lowest rate is --rate-lo per replica
        few_samples_warning(num_requests(args.rate_lo * fewest, horizon_s, args.min_requests,
                                         fewest), share)  # fmt: skip
    out = args.out or Path("results/plan") / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    cache = Evaluations(out / "evaluations.csv")
    if cache.set_aside is not None:
        print(f"qllm-plan: {out}/evaluations.csv is of an older layout (other columns): set "
              f"aside as {cache.set_aside.name}, its runs not reused", file=sys.stderr)  # fmt: skip
    if cache.malformed:
        print(f"qllm-plan: warning: {cache.malformed} rows of {out}/evaluations.csv could not be "
              "read (a line cut short?): skipped, not reused", file=sys.stderr)  # fmt: skip
    others = cache.others(fps)
    if others:
        print(f"qllm-plan: {others} runs in {out}/evaluations.csv were made from another "
              "config, code, profile, workload file or installed data set: not reused",
              file=sys.stderr)  # fmt: skip
    targets = Targets(args.ls_ttft_p99_s, args.goodput, args.keeps_up)
    cache.retarget(targets)  # ok: whether each run meets this search's targets
    # a router that reserves replicas (ls_dedicated) serves no fewer than it reserves, plus one
    least = {r: fewest_replicas(r, cfg.cluster.ls_replicas) for r in args.routers}
    for r in args.routers:
        below = [n for n in sorted(args.replicas) if n < least[r]]
        if below and r not in ranged:
            print(f"qllm-plan: warning: --routers {r} needs at least {least[r]} replicas "
                  f"({least[r] - 1} reserved for LS, plus one): not searched on "
                  f"{', '.join(map(str, below))}", file=sys.stderr)  # fmt: skip
    searches = []
    for p in args.policies:
        for r in args.routers:
            base = None  # each count's search starts from the fewest's capacity
            for n in sorted(args.replicas):
                if n >= least[r]:
                    searches.append(Search(p, r, n, args.rate_lo * n, args.rel_tol, base=base))
                    base = base or searches[-1]
    if not searches:
        print("qllm-plan: error: no --replicas count is enough for any --routers",
              file=sys.stderr)  # fmt: skip
        return 2
    pool = ray_pool(args.jobs) if args.executor == "ray" else process_pool(args.jobs)
    from tqdm import tqdm

    # a bar per stage, each counting its searches done; the runs made so far tick after it
    bar = tqdm(total=len(searches), desc="searching", unit="search")
    made = 0

    def ran():
        nonlocal made
        made += 1
        bar.set_postfix_str(f"{made} runs made", refresh=True)

    def progress(ss):
        bar.n = sum(s.done for s in ss)
        bar.refresh()

    def fewest_progress(done, total):
        nonlocal bar
        if bar.desc != "fewest replicas":
            bar.close()
            bar = tqdm(total=total, desc="fewest replicas", unit="search")
        bar.n = done
        bar.set_postfix_str(f"{made} runs made", refresh=True)

    runs = Runs(targets, args.seeds, horizon_s, args.min_requests, args.overrides, cache,
                pool, fps, whole, on_run=ran, full_runs=args.full_runs)  # fmt: skip
    start = time.perf_counter()
    try:
        run_searches(searches, runs, progress)
        rows = plan_rows(searches, runs)
        target = (at_target(rows, runs, args.target_rate, least, fewest_progress)
                  if args.target_rate else [])  # fmt: skip
        bar.close()
    except UserError as e:
        bar.close()
        print(f"qllm-plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        bar.close()
        print(f"qllm-plan: interrupted; {len(cache.rows)} runs kept in {out}/evaluations.csv; "
              f"resume with the same command and --out {out}", file=sys.stderr)  # fmt: skip
        return 130
    write_csv(out / "plan.csv", rows)
    frontier_figure(rows, out / "frontier.png", args.target_rate)
    print(f"{'policy':>10s} {'router':>18s} {'replicas':>8s} {'max req/s':>10s} "
          f"{'BE TTFT p99 there':>18s}")  # fmt: skip
    for r in rows:
        # a search whose first rate already failed knows only an upper bound
        shown = f"{r['max_rate']:.3f}" if r["max_rate"] else f"< {r['bracket_hi']:g}"
        print(f"{r['policy']:>10s} {r['router']:>18s} {r['replicas']:>8d} {shown:>10s} "
              f"{_seconds(r['be_ttft_p99_s']):>18s}")  # fmt: skip
    if cfg.slo.be_ttft_s is None and cfg.workload.ls_fraction < 1:
        print("qllm-plan: note: BE work has no SLO (slo.be_ttft_s): a capacity bounds LS TTFT "
              "and the backlog's growth over the run, not what BE work waits in the workload's "
              "bursts (its TTFT p99 above); set slo.be_ttft_s to bound that too",
              file=sys.stderr)  # fmt: skip
    if not target:  # a previous search's would stand beside this plan.csv
        (out / "target.csv").unlink(missing_ok=True)
    if target:
        write_csv(out / "target.csv", [t for t, _ in target])
        print(f"\nfewest replicas for {args.target_rate:g} req/s, and the figures of its runs at "
              "that rate (mean of the seeds):")  # fmt: skip
        for t, overturned in target:
            if t["replicas"] is None:
                print(f"  {t['policy']}, {t['router']}: more than {max(args.replicas)}")
            else:
                print(f"  {t['policy']}, {t['router']}: {t['replicas']}  LS TTFT p99 "
                      f"{_seconds(t['ls_ttft_p99_s'])}, BE TTFT p99 "
                      f"{_seconds(t['be_ttft_p99_s'])}, BE turnaround mean "
                      f"{_seconds(t['be_turnaround_mean_s'])}, p99 "
                      f"{_seconds(t['be_turnaround_p99_s'])}")  # fmt: skip
            for n in overturned:
                print(f"qllm-plan: warning: {t['policy']}, {t['router']} on {n} replicas: its "
                      f"capacity search says it sustains {args.target_rate:g} req/s, but its "
                      "runs at that rate missed the targets (the response is not monotone in "
                      "the rate there; more --seeds or a longer --horizon-s may settle it): "
                      "more replicas were searched", file=sys.stderr)  # fmt: skip
    splits = best_splits(rows, [t for t, _ in target])
    if splits:
        print("\nbest ls_dedicated split (LS replicas), of those searched:")
        print("\n".join(splits))
    written = "plan.csv, " + ("target.csv, " if target else "") + "frontier.png, evaluations.csv"
    stopped = sum(bool((r := cache.get(t, fps[t[0]])) and r["stopped"]) for t in runs.made)
    if stopped:  # before the last line, which says what was made
        print(
            f"\n{stopped} of the runs made stopped once certain to miss the targets (their "
            "rows in evaluations.csv have no figures; --full-runs runs them to the end)"
        )
    print(f"\n{len(runs.made)} runs made, {len(runs.reused)} reused, in "
          f"{time.perf_counter() - start:.0f} s -> {out}/: {written}")  # fmt: skip
    return 0


def plan_rows(searches: list[Search], runs: Runs) -> list[dict]:
    """plan.csv: each search's capacity and, at that rate, what BE work paid (the runs the
    search made there)."""
    rows = []
    for s in searches:
        row = {"policy": s.policy, "router": s.router, "replicas": s.replicas,
               "max_rate": s.capacity, "max_rate_per_replica": s.capacity / s.replicas,
               "bracket_hi": s.hi, "evaluations": s.evaluations}  # fmt: skip
        there = runs.point(s.policy, s.router, s.replicas, s.capacity) if s.capacity else {}
        rows.append({**row, **{k: there.get(k) for k in BE_COST}})
    return rows


@dataclass
class Fewest:
    """The bisection over the replica count for one (policy, router) at the target rate.
    ``hints``: what the capacity searches say of the counts they searched (a capacity at or
    above the rate: sustained; a failed rate at or below it: not); ``ran``: the counts run at
    the rate itself, and whether they met the targets, which overrule a hint. The answer is
    always a count that ran at the rate and met them, with the next lower count known not to
    (a count's status: its run's, else its hint's). More replicas are assumed never to
    sustain less: a hint that a run overturns is kept in ``overturned``, for a warning."""

    policy: str
    router: str
    most: int  # the largest count searched: none above it is tried
    hints: dict[int, bool]
    least: int = 1  # the fewest the router can serve: none below it is tried
    ran: dict[int, bool] = field(default_factory=dict)
    overturned: list[int] = field(default_factory=list)

    def status(self, n: int) -> bool | None:
        return self.ran[n] if n in self.ran else self.hints.get(n)

    def _hi(self) -> int | None:
        return min((n for n in [*self.hints, *self.ran] if self.status(n)), default=None)

    def next(self) -> int | None:
        """The count to run at the rate next; None: the search is over."""
        hi = self._hi()
        if hi is None:  # nothing known to sustain it: the most replicas, unless known to fail
            return None if self.status(self.most) is False else self.most
        lo = max((n for n in [*self.hints, *self.ran] if n < hi and self.status(n) is False),
                 default=self.least - 1)  # fmt: skip
        if hi - lo > 1:
            return (lo + hi) // 2
        return None if hi in self.ran else hi  # the answer itself runs at the rate

    def record(self, n: int, ok: bool) -> None:
        if self.hints.get(n) and not ok:
            self.overturned.append(n)
        self.ran[n] = ok

    @property
    def answer(self) -> int | None:
        hi = self._hi()
        return hi if hi is not None and self.ran.get(hi) else None


def fewest_searches(rows: list[dict], rate: float, least: dict[str, int]) -> list[Fewest]:
    """One ``Fewest`` per (policy, router) of plan.csv's rows, with what their searches say
    (``least``: router -> the fewest replicas it serves)."""
    out = []
    for policy, router in dict.fromkeys((r["policy"], r["router"]) for r in rows):
        mine = [r for r in rows if r["policy"] == policy and r["router"] == router]
        hints = {}
        for r in mine:
            if r["max_rate"] >= rate:
                hints[r["replicas"]] = True
            elif r["bracket_hi"] is not None and r["bracket_hi"] <= rate:
                hints[r["replicas"]] = False
        most = max(r["replicas"] for r in mine)
        out.append(Fewest(policy, router, most, hints, least.get(router, 1)))
    return out


def at_target(
    rows: list[dict], runs: Runs, rate: float, least: dict[str, int], progress=None
) -> list[tuple[dict, list[int]]]:
    """target.csv: for each (policy, router), the fewest replicas whose runs at ``rate`` meet
    the targets (None: not even the most searched), by bisection over the count between those
    the capacity searches bracket, and the figures of those runs, which a capacity above the
    rate does not give: what the LS SLO costs BE work at that load. Each row comes with the
    counts whose capacity said they sustain ``rate`` but whose runs at it missed.
    ``progress(done, total)``: called with the searches finished before each step."""
    searches = fewest_searches(rows, rate, least)
    while True:
        steps = [(f, f.next()) for f in searches]
        steps = [(f, n) for f, n in steps if n is not None]
        if progress:
            progress(len(searches) - len(steps), len(searches))
        if not steps:
            break
        tasks = [runs.tasks(f.policy, f.router, n, rate) for f, n in steps]
        runs.run([t for ts in tasks for t in ts])
        for (f, n), ts in zip(steps, tasks, strict=True):
            f.record(n, all(runs.targets.met(r) for r in runs.rows(ts)))
    out = []
    keys = ("ls_ttft_p99_s", "goodput", "keeps_up", *BE_COST)
    for f in searches:
        n = f.answer
        there = runs.point(f.policy, f.router, n, rate) if n is not None else {}
        row = {"policy": f.policy, "router": f.router, "replicas": n, "rate": rate,
               **{k: there.get(k) for k in keys}}  # fmt: skip
        out.append((row, f.overturned))
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
