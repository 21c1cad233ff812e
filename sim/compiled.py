"""``core=compiled``: the cluster's replicas run in a compiled loop (sim/kernel.py).

The SimPy executor (sim/engine.py) runs any policy; this one runs the policies it knows,
written again on typed arrays, and gives every request the same times and token gaps to the
bit (tests/test_compiled.py compares the two on 20 configurations), about 20 times faster on
the conversation trace (README, "Benchmarks"). It covers, for now: policies ``iteration``
(TGI's router, any of its settings: also ``tgi-0.3``) and ``alg1``, ``layer``, ``qllm``
(Algorithm 1, preempting inside iterations for the latter two; not the starvation guard,
``evict_be_for_ls`` or ``merge``) under
``memory.model=reserve``, on any number of replicas behind any router, with a profile
without ``wake_up``, ``attn_decode_bind``, measured prompts' routing or a split per-prompt
prefill attention. Anything else is refused in one line that names what is not covered
(``core=simpy`` runs it).

The latency model's random routing stays in Python: the loop hands back to the replica's own
``LatencyModel`` and ``RoutingModel`` whenever a pool of routing samples is to be built or a
block of picks drawn, so the draws are the SimPy executor's, in its order.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd

from policies.alg1 import Algorithm1
from policies.core import LS, Request
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.memory import ReserveMemory
from policies.qllm import QLLM
from policies.scheduler import CapacityError, Scheduler
from profiler.schema import OpPoint
from sim import kernel as K
from sim.cluster import ClusterResult
from sim.engine import SimResult
from sim.latency import Curve1D, Curve2D, LatencyModel
from sim.metrics import Records
from sim.workloads import Workload

COVERED = {IterationFCFS: "iteration", Algorithm1: "alg1", LayerPreemptive: "layer", QLLM: "qllm"}
NO_SWITCH = Curve1D([OpPoint("preempt_switch", num_tokens=1, median_ms=0.0, p90_ms=0.0)],
                    "num_tokens")  # fmt: skip
FLUSH_EVERY = 8192  # finished requests handed to Python at a time
PICKS_AHEAD = 1 << 16  # routing picks drawn at a time
MEMO_WIDTH = 8192  # inputs of the one-key curves remembered
RUN_BUFFER = 512  # a decode run's iteration ends held before they are applied


def unsupported(scheds: list[Scheduler], latencies: list[LatencyModel]) -> str | None:
    """Why the compiled executor cannot run these replicas (None: it can)."""
    policy, lat = scheds[0].policy, latencies[0]
    if type(policy) not in COVERED:
        return f"policy {policy.name} (it runs {', '.join(COVERED.values())})"
    if isinstance(policy, Algorithm1):
        for key, value in (("be_max_wait_s", policy.be_max_wait_s),
                           ("evict_be_for_ls", policy.evict_be_for_ls),
                           ("merge", getattr(policy, "merge", False))):  # fmt: skip
            if value not in (None, False):
                return f"policy.{key}={value}"
    if not isinstance(scheds[0].memory, ReserveMemory):
        return f"memory.model={scheds[0].memory.name} (it runs reserve)"
    if lat.wake is not None:
        return "a profile with wake_up"
    if lat.attn_decode_bind is not None:
        return "a profile with attn_decode_bind"
    if lat.routing.prompts is not None:
        return "profile.routing=profile with measured prompts (prompt_experts)"
    if lat.routing.pool_size < 1:
        return "routing without pools"
    if not lat.prefill_batched and lat.attn_prefill_next is not None:
        return "per-prompt prefill attention split in attn_prefill_outer/next"
    if lat.prepare_prefill is not None:
        return "a prefill's own prepare and lm_head stages (prepare_prefill, lm_head_prefill)"
    expert = lat.expert
    if len(lat._expert_table) != int(expert.xs[-1]) + 1 or expert.xs[-1] != int(expert.xs[-1]):
        return "an expert grid beyond the latency model's table"
    for c in _curves(lat):
        rows = c.rows if isinstance(c, Curve2D) else [c]
        keys = [x for row in rows for x in row.xs] + list(getattr(c, "batches", []))
        if any(float(x) != int(x) for x in keys):
            return f"op {c.op}: a grid of non-integer points"
    return None


def _curves(lat: LatencyModel) -> list[Curve1D | Curve2D]:
    """The curves the loop reads, in ``sim.kernel``'s order (a profile without
    ``preempt_switch`` gets a stand-in the loop never reads)."""
    prefill = lat.attn_prefill_batch if lat.prefill_batched else lat.attn_prefill
    switch = lat.switch if lat.switch is not None else NO_SWITCH
    return [lat.overhead, lat.router, lat.lm_head, lat.attn_decode, prefill, switch]


def _pack(curves: list[Curve1D | Curve2D], replicas: int) -> tuple:
    """(CF, CV, BEY) of the curves, as ``sim.kernel`` lays them out."""
    cf: list[float] = []
    cv = [0] * K.CV_ROW0
    rows = 0
    for c, curve in enumerate(curves):
        parts = curve.rows if isinstance(curve, Curve2D) else [curve]
        keys = curve.batches if isinstance(curve, Curve2D) else [0]
        cv[2 * c], cv[2 * c + 1] = rows, len(parts)
        for key, row in zip(keys, parts, strict=True):
            cv += [int(key), len(cf), len(row.xs)]
            cf += [float(x) for x in row.xs] + [float(y) for y in row.ys] + [float(row.slope)]
            rows += 1
    cv[K.CV_ROWS] = rows
    bey = np.full((replicas, rows + K.CURVES + 1), np.nan)
    return np.array(cf), np.array(cv, dtype=np.int64), bey


def _unpack_beyond(curves: list[Curve1D | Curve2D], cv: np.ndarray, bey: np.ndarray) -> None:
    """Note in a replica's curves what the loop extrapolated on them (``bey``: its row)."""
    rows = int(cv[K.CV_ROWS])
    for c, curve in enumerate(curves):
        parts = curve.rows if isinstance(curve, Curve2D) else [curve]
        first = int(cv[2 * c])
        for j, row in enumerate(parts):
            if not math.isnan(bey[first + j]):
                row._beyond(float(bey[first + j]))
        x = bey[rows + c]
        if isinstance(curve, Curve2D) and not math.isnan(x):
            if curve.beyond_batch is None or x > curve.beyond_batch:
                curve.beyond_batch = float(x)


_NOTED = []


def _note_first_compile() -> None:
    """Say so on stderr when the loop is about to be compiled for this machine (no cache
    yet: about a minute, once), so that a first run does not look hung. numba's cache
    index is an internal detail: if it cannot be read, nothing is said."""
    if _NOTED:
        return
    _NOTED.append(True)
    try:
        index = K.run._cache._cache_file._index_path
    except AttributeError:
        return
    if not os.path.exists(index):
        print("note: core=compiled: compiling the loop for this machine (about a minute, "
              "once; cached in sim/__pycache__)", file=sys.stderr)  # fmt: skip


def _columns(requests: Iterable[Request] | Workload, ordered: bool):
    """(ids, arrival, prompt, output, is_ls, source codes, source names) in replay order."""
    if isinstance(requests, Workload):
        jobs = requests.jobs
        codes, names = pd.factorize(pd.Series(jobs.source, dtype=object))
        return (np.arange(len(requests), dtype=np.int64), np.asarray(requests.times, float),
                jobs.prompt.astype(np.int64), jobs.output.astype(np.int64),
                np.asarray(requests.is_ls, dtype=np.int64), codes.astype(np.int16),
                list(names))  # fmt: skip
    reqs = list(requests)
    names = {}
    codes = np.array([names.setdefault(r.source, len(names)) for r in reqs], dtype=np.int16)
    cols = (np.array([r.id for r in reqs], dtype=np.int64),
            np.array([r.arrival_s for r in reqs], dtype=np.float64),
            np.array([r.prompt_tokens for r in reqs], dtype=np.int64),
            np.array([r.output_tokens for r in reqs], dtype=np.int64),
            np.array([r.cls == LS for r in reqs], dtype=np.int64), codes)  # fmt: skip
    if not ordered:  # Cluster's order: (arrival, id)
        order = np.lexsort((cols[0], cols[1]))
        cols = tuple(c[order] for c in cols)
    return (*cols, list(names))


class CompiledCluster:
    """``sim.cluster.Cluster`` for the compiled loop: the same inputs (a router by name),
    the same ``ClusterResult``; finished requests go to ``records`` in the order they
    finish, as the SimPy executor's ``on_finish`` adds them. ``on_finished(k)``: called
    after every batch of k requests folded (a progress bar). ``watch``: as ``simulate``'s,
    fed each finished request (``finished_values``); the run stops once it has a
    ``reason``. ``decode_runs`` (config ``fast_forward``): the loop's decode runs (see
    sim/kernel.py's ``run``), which change no result; False steps every iteration's work."""

    def __init__(self, requests: Iterable[Request] | Workload, scheds: list[Scheduler],
                 latencies: list[LatencyModel], router: str, ls_replicas: int,
                 records: Records, ordered: bool = False,
                 on_finished: Callable[[int], None] | None = None, watch=None,
                 decode_runs: bool = True) -> None:  # fmt: skip
        self.scheds, self.latencies, self.records = scheds, latencies, records
        self.on_finished, self.watch = on_finished, watch
        self.stopped = False
        self.heap_events = self.run_iterations = 0  # set by run (see _result)
        (self.ids, self.arrival, self.prompt, self.output, self.is_ls, codes,
         names) = _columns(requests, ordered)  # fmt: skip
        # Records' own source codes for ours
        self.codes = np.array([records.sources.setdefault(s, len(records.sources))
                               for s in names], dtype=np.int16)[codes]  # fmt: skip
        n, replicas = len(self.ids), len(scheds)
        policy, cap = scheds[0].policy, scheds[0].kv_capacity_tokens
        reserved = self.prompt + self.output
        most = cap // max(int(reserved.min()), 1) + 1 if n else 1  # sequences that fit at once
        alg1 = isinstance(policy, Algorithm1)
        # a batch holds at most max_batch_size; Algorithm 1's decode queues may hold more
        width = int(min(most, max(n, 1)) if alg1 else min(policy.max_batch_size, most, max(n, 1)))

        def limit(x: float) -> int:
            return K.NO_CAP if x == math.inf else int(x)

        ci = np.zeros(K.C_SIZE, dtype=np.int64)
        ci[K.C_REPLICAS], ci[K.C_ROUTER] = replicas, K.ROUTER_CODES[router]
        ci[K.C_LS_REPLICAS] = ls_replicas
        ci[K.C_MAX_BATCH] = limit(policy.max_batch_size)
        ci[K.C_MAX_PREFILL] = policy.max_batch_prefill_tokens
        if alg1:
            ci[K.C_POLICY] = 1
            ci[K.C_REFILL], ci[K.C_FILL] = policy.refill_be, policy.fill_be_prefill
            ci[K.C_MAX_IN_FLIGHT] = limit(policy.max_in_flight)
            ci[K.C_PREEMPT_PREFILL] = getattr(policy, "preempt_prefill", True)
            ci[K.C_MAX_TOTAL] = K.NO_CAP
        else:
            ci[K.C_MAX_WAITING] = policy.max_waiting_tokens
            ci[K.C_MAX_TOTAL] = limit(policy.max_batch_total_tokens)
        ci[K.C_GRAN] = int(policy.granularity)
        ci[K.C_CAPACITY] = cap
        lat = latencies[0]
        ci[K.C_LAYERS] = lat.routing.num_layers
        ci[K.C_POOLED_MAX] = lat.routing.POOLED_MAX_TOKENS
        ci[K.C_PER_PROMPT] = not lat.prefill_batched
        ci[K.C_SWITCH] = lat.switch is not None
        experts = lat.routing.num_experts
        ci[K.C_EXPERTS] = experts
        ci[K.C_STAGES] = 2 + lat.routing.num_layers * (2 + experts)
        ci[K.C_FLUSH_EVERY] = 256 if watch is not None else FLUSH_EVERY
        ci[K.C_RUNS] = decode_runs
        gaps = int((self.output - 1).sum())
        # an event admits at most a replica's capacity of gaps; what is in flight at most
        # every replica's capacity: room for both, twice the latter so compaction is rare
        ci[K.C_ARENA_FREE] = min(cap, gaps) + 1
        self.arena = np.zeros(2 * min(replicas * cap, gaps) + ci[K.C_ARENA_FREE] + 1,
                              dtype=np.float32)  # fmt: skip
        self.ci = ci
        e = lat.expert
        self.cf = np.zeros(K.CF_SIZE)
        self.cf[K.CF_RATIO] = getattr(policy, "waiting_served_ratio", 0.0)
        self.cf[K.CF_ACT] = scheds[0].activation_tokens_per_token
        self.cf[K.CF_GRID_X], self.cf[K.CF_GRID_Y] = float(e.xs[-1]), float(e.ys[-1])
        self.cf[K.CF_SLOPE] = float(e.slope)
        self.g = np.zeros(K.G_SIZE, dtype=np.int64)
        self.g[K.G_PENDING] = -1
        self.gf = np.zeros(K.GF_SIZE, dtype=np.float64)
        self.H = np.zeros((2 * replicas + 5, K.H_COLS))  # events pending (two a replica), a spare
        self.ri = np.zeros((replicas, K.R_SIZE), dtype=np.int64)
        self.ri[:, K.R_WAITING_TOKENS] = 1  # TGI's counter starts at 1
        self.rf = np.zeros((replicas, K.RF_SIZE), dtype=np.float64)
        # ready (Algorithm 1: the LS decode queue), batch, BE decode queue, suspended batch
        self.lists = np.zeros((replicas, 4, width), dtype=np.int64)
        self.REQ = np.stack([self.prompt, self.output, self.is_ls], axis=1).astype(np.int64)
        # views of it from here on, not copies beside it (a day-long run holds millions)
        self.prompt, self.output = self.REQ[:, K.Q_PROMPT], self.REQ[:, K.Q_OUT]
        self.is_ls = self.REQ[:, K.Q_LS]
        self.SI = np.zeros((n, K.SI_COLS), dtype=np.int64)  # generated, gap slice, link, ...
        self.SF = np.full((n, 4), np.nan)  # first token, last token, finish, largest gap
        self.fin = np.zeros(n, dtype=np.int64)
        self.TL = np.zeros((2 * n, 3))
        self.CF, self.CV, self.BEY = _pack(_curves(lat), replicas)
        self.MEMO = np.full((3, MEMO_WIDTH), np.nan)  # overhead, router, lm_head (K's order)
        ci[K.C_MEMO_ROUTER] = min(MEMO_WIDTH, int(lat.router.xs[-1]) + 1)
        ci[K.C_MEMO_SIZE] = min(MEMO_WIDTH, int(lat.overhead.xs[-1]) + 1,
                                int(lat.lm_head.xs[-1]) + 1)  # fmt: skip
        self.EXP = lat._expert_table
        most_pooled = lat.routing.POOLED_MAX_TOKENS
        width_e = lat.routing.num_layers * lat.routing.num_experts
        pool = lat.routing.pool_size
        self.PC = np.zeros((replicas, most_pooled + 1, pool, width_e), dtype=np.int8)
        self.PF = np.zeros((replicas, most_pooled + 1, 2), dtype=np.int64)  # routed, summed
        self.PS = np.zeros((replicas, most_pooled + 1, pool))
        self.PB = np.zeros((replicas, lat.routing.PICK_BLOCK), dtype=np.int64)
        # a preemptible policy's running and suspended plans: stage offsets; expert times
        stages = int(ci[K.C_STAGES]) + 1 if ci[K.C_GRAN] > K.G_ITERATION else 1
        self.OFF = np.zeros((replicas, 2, stages))
        self.ET = np.zeros((replicas, width_e if ci[K.C_GRAN] > K.G_ITERATION else 1))
        self.RUNT = np.zeros((replicas, RUN_BUFFER))  # a decode run's ends not yet applied
        for r in range(replicas):
            self._sync_pools(r)
            self._sync_picks(r)

    # -------------------------------------------------------------------- the routing draws
    def _sync_pools(self, r: int) -> None:
        """Copy the pools replica r's models have built since the last call."""
        lat = self.latencies[r]
        for n, pool in enumerate(lat.routing._pools, start=1):
            if not self.PF[r, n, 0]:
                self.PC[r, n] = pool.reshape(pool.shape[0], -1)
                self.PF[r, n, 0] = 1
        for n, (_, times) in lat._pools.items():
            if not self.PF[r, n, 1]:
                self.PS[r, n] = [float(t.sum()) for t in times]  # Plan.total_s's sum of each
                self.PF[r, n, 1] = 1

    def _sync_picks(self, r: int) -> None:
        """Give the loop replica r's block of picks as its routing model holds it."""
        routing = self.latencies[r].routing
        drawn = routing._picks_array
        if len(drawn) > self.PB.shape[1]:
            wider = np.zeros((self.PB.shape[0], len(drawn)), dtype=np.int64)
            wider[:, : self.PB.shape[1]] = self.PB
            self.PB = wider
        self.PB[r, : len(drawn)] = drawn
        self.ri[r, K.R_PICKS], self.ri[r, K.R_TAKEN] = len(drawn), routing._next

    def _hand_back(self, r: int) -> None:
        """Tell replica r's routing model how many of its picks the loop took."""
        self.latencies[r].routing._next = int(self.ri[r, K.R_TAKEN])

    # ------------------------------------------------------------------------------- outputs
    def _flush(self) -> None:
        """Fold the requests finished since the last call into the records."""
        g = self.g
        which = self.fin[g[K.G_FLUSHED] : g[K.G_FIN]]
        g[K.G_FLUSHED] = g[K.G_FIN]
        if not len(which):
            return
        first, finish = self.SF[which, K.S_FIRST], self.SF[which, K.S_FIN]
        lengths = self.output - 1
        ls = self.is_ls[which].astype(bool)
        gaps = {}
        for cls, mine in ((LS, which[ls]), ("BE", which[~ls])):
            gaps[cls] = (K.gather(self.arena, self.SI, lengths, mine), lengths[mine])
        self.records.add_columns(
            self.ids[which], ls, self.codes[which], self.arrival[which], self.prompt[which],
            self.output[which], first, finish, self.SF[which, K.S_ITL],
            self.SI[which, K.S_PLACED], gaps, self.SI[which, K.S_PREEMPTIONS])  # fmt: skip
        if self.watch is not None:
            for k, i in enumerate(which.tolist()):
                self.watch.finished_values(bool(self.is_ls[i]), float(self.arrival[i]),
                                           int(self.output[i]), float(first[k]),
                                           float(finish[k]))  # fmt: skip
                if self.watch.reason is not None:
                    self.stopped = True
                    break
        if self.on_finished is not None:
            self.on_finished(len(which))

    def run(self) -> ClusterResult:
        _note_first_compile()
        wall = time.perf_counter()
        g, replicas = self.g, len(self.scheds)
        # SimPy's start: the arrival process, then each executor, at time 0 (urgent)
        K.schedule(g, self.H, 0.0, K.URGENT, K.EV_ARRIVAL_INIT, -1)
        for r in range(replicas):
            K.schedule(g, self.H, 0.0, K.URGENT, K.EV_EXEC_INIT, r)
        while True:
            status = K.run(g, self.gf, self.ci, self.cf, self.H, self.ri, self.rf, self.lists,
                           self.arrival, self.REQ, self.SI, self.SF, self.arena, self.fin,
                           self.TL, self.CF, self.CV, self.BEY, self.MEMO, self.EXP, self.PC,
                           self.PF, self.PS, self.PB, self.OFF, self.ET,
                           self.RUNT)  # fmt: skip
            if status == K.DONE:
                self._flush()
                break
            if status == K.FLUSH:
                self._flush()
                if self.stopped:
                    break
                if len(self.arena) - g[K.G_TOP] < self.ci[K.C_ARENA_FREE]:
                    K.compact(g, self.ci, self.ri, self.lists, self.REQ, self.SI, self.arena)
            elif status == K.NEED_PICKS:
                r = int(g[K.G_PENDING])
                self._hand_back(r)
                # a long block: numpy draws the same numbers in one call as in many, and
                # each return to Python costs as much as thousands of iterations
                self.latencies[r].routing._draw_picks(max(int(g[K.G_NEED]), PICKS_AHEAD))
                self._sync_picks(r)
            elif status == K.NEED_EXPERTS:
                r = int(g[K.G_PENDING])
                self._hand_back(r)
                _, times = self.latencies[r].experts(int(g[K.G_ARG]))
                self.gf[K.GF_SUM] = float(times.sum())
                self.ri[r, K.R_EPOOL] = -1
                if self.ET.shape[1] == times.size:
                    self.ET[r] = times.ravel()
                g[K.G_PENDING_MODE] = 1
                self._sync_pools(r)
                self._sync_picks(r)
            else:
                self._flush()  # what finished before, as the SimPy executor has added it
                self._raise(status)
        for r in range(replicas):  # what was drawn but not taken goes back, as in stepping
            self._hand_back(r)
            self._unpack(r)
        result = self._result(time.perf_counter() - wall)
        self._release()
        return result

    def _release(self) -> None:
        """Drop the loop's arrays (some 200 bytes a request, and the gap arena) once the
        result holds what it needs: the outputs are built next, and a day-long run's peak
        memory is then."""
        for name in ("REQ", "SI", "SF", "fin", "TL", "arena", "PC", "lists", "prompt",
                     "output", "is_ls", "arrival", "codes", "ids"):  # fmt: skip
            setattr(self, name, None)

    def _raise(self, status: int) -> None:
        i = int(self.g[K.G_ARG])
        if status == K.ERR_CAPACITY:
            need = int(self.prompt[i] + self.output[i])
            raise CapacityError(f"request {self.ids[i]} needs {need} KV tokens, more than the "
                                f"capacity of {self.scheds[0].kv_capacity_tokens}")  # fmt: skip
        if status == K.ERR_BATCH_CAP:
            cap = self.scheds[0].policy.max_batch_total_tokens
            raise CapacityError(
                f"request {self.ids[i]} needs {int(self.prompt[i] + self.output[i])} KV "
                f"tokens, more than the batch may hold",
                key=f"policy.max_batch_total_tokens={cap}",
            )
        raise RuntimeError(f"compiled executor: replica {i} stalled with "
                           f"{int(self.ri[i, K.R_IN_SYS])} requests (status {status})")  # fmt: skip

    def _unpack(self, r: int) -> None:
        """Write back replica r's state that outlives the run: its scheduler's counters and
        its latency model's extrapolations."""
        sched, lat = self.scheds[r], self.latencies[r]
        sched.iterations = int(self.ri[r, K.R_ITERS])
        sched.preemptions = int(self.ri[r, K.R_PREEMPTS])
        sched.memory.used_tokens = int(self.ri[r, K.R_USED])
        sched.memory.peak_used_tokens = int(self.ri[r, K.R_PEAK])
        _unpack_beyond(_curves(lat), self.CV, self.BEY[r])
        if not math.isnan(self.BEY[r, -1]):
            lat.expert._beyond(float(self.BEY[r, -1]))

    def _result(self, wall_s: float) -> ClusterResult:
        g, ri = self.g, self.ri
        n = int(g[K.G_NEXT]) if self.stopped else len(self.ids)
        # stepping's events (the result's, as SimPy's executor counts them without
        # fast-forward); the loop took fewer off its heap, and ran some iterations as runs
        events = int(g[K.G_ARR_EVENTS] + ri[:, K.R_EVENTS].sum())
        self.heap_events = int(g[K.G_POPS])
        self.run_iterations = int(ri[:, K.R_RUN_ITERS].sum())
        result = SimResult(sequences=[], makespan_s=float(self.gf[K.GF_MAKESPAN]) if not
                           self.stopped else float(self.gf[K.GF_NOW]), events=events,
                           wall_s=wall_s, iterations=int(ri[:, K.R_ITERS].sum()),
                           preemptions=int(ri[:, K.R_PREEMPTS].sum()),
                           peak_kv_used_tokens=int(ri[:, K.R_PEAK].max()))  # fmt: skip
        rows = int(g[K.G_TL])
        timeline = pd.DataFrame({"t_s": self.TL[:rows, 0].copy(),
                                 "replica": self.TL[:rows, 1].astype(np.int64),
                                 "in_system": self.TL[:rows, 2].astype(np.int64)})  # fmt: skip
        return ClusterResult(result, self.ids[:n].copy(), self.SI[:n, K.S_PLACED].copy(),
                             self.rf[:, K.RF_BUSY].tolist(), timeline)  # fmt: skip
