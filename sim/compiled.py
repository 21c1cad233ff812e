"""``executor=compiled``: the cluster's replicas run in a compiled loop (sim/kernel.py).

The SimPy executor (sim/engine.py) runs any policy; this one runs the policies it knows,
written again on typed arrays, and gives every request the same times and token gaps to the
bit (tests/test_compiled.py compares the two on several configurations), some 10 to 50 times
faster. It covers, for now: policy ``iteration`` (TGI's router, any of its settings: also
``tgi-0.3``) under ``memory.model=reserve``, on any number of replicas behind any router,
with a profile without ``wake_up``, ``attn_decode_bind``, measured prompts' routing or a
split per-prompt prefill attention. Anything else is refused in one line that names what is
not covered (``executor=python`` runs it).

The latency model's random routing stays in Python: the loop hands back to the replica's own
``LatencyModel`` and ``RoutingModel`` whenever a pool of routing samples is to be built or a
block of picks drawn, so the draws are the SimPy executor's, in its order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd

from policies.core import LS, Request
from policies.iteration import IterationFCFS
from policies.memory import ReserveMemory
from policies.scheduler import CapacityError, Scheduler
from sim import kernel as K
from sim.cluster import ClusterResult
from sim.engine import SimResult
from sim.latency import Curve1D, Curve2D, LatencyModel
from sim.metrics import Records
from sim.workloads import Workload

FLUSH_EVERY = 8192  # finished requests handed to Python at a time


def unsupported(scheds: list[Scheduler], latencies: list[LatencyModel]) -> str | None:
    """Why the compiled executor cannot run these replicas (None: it can)."""
    policy, lat = scheds[0].policy, latencies[0]
    if type(policy) is not IterationFCFS:
        return f"policy {policy.name} (it runs iteration, and tgi-0.3)"
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
    """The curves the loop reads, in ``kernel.run``'s order of ``curves``."""
    prefill = lat.attn_prefill_batch if lat.prefill_batched else lat.attn_prefill
    return [lat.overhead, lat.router, lat.lm_head, lat.attn_decode, prefill]


def _pack(c: Curve1D | Curve2D, replicas: int) -> tuple:
    rows = c.rows if isinstance(c, Curve2D) else [c]
    batches = np.array(c.batches if isinstance(c, Curve2D) else [0], dtype=np.int64)
    offs = np.cumsum([0] + [len(row.xs) for row in rows]).astype(np.int64)
    xs = np.concatenate([np.asarray(row.xs, dtype=np.float64) for row in rows])
    ys = np.concatenate([np.asarray(row.ys, dtype=np.float64) for row in rows])
    slopes = np.array([row.slope for row in rows], dtype=np.float64)
    beyond = np.full((replicas, len(rows) + 1), np.nan)
    return batches, offs, xs, ys, slopes, beyond


def _unpack_beyond(c: Curve1D | Curve2D, beyond: np.ndarray) -> None:
    """Note in a replica's curve what the loop extrapolated on it."""
    rows = c.rows if isinstance(c, Curve2D) else [c]
    for row, x in zip(rows, beyond[: len(rows)].tolist(), strict=True):
        if not math.isnan(x):
            row._beyond(x)
    if isinstance(c, Curve2D) and not math.isnan(beyond[-1]):
        if c.beyond_batch is None or beyond[-1] > c.beyond_batch:
            c.beyond_batch = float(beyond[-1])


def _columns(requests: Iterable[Request] | Workload, ordered: bool):
    """(ids, arrival, prompt, output, is_ls, source codes, source names) in replay order."""
    if isinstance(requests, Workload):
        jobs = requests.jobs
        names: dict[str, int] = {}
        codes = np.fromiter((names.setdefault(s, len(names)) for s in jobs.source), np.int16,
                            len(requests))  # fmt: skip
        return (np.arange(len(requests), dtype=np.int64), np.asarray(requests.times, float),
                jobs.prompt.astype(np.int64), jobs.output.astype(np.int64),
                np.asarray(requests.is_ls, dtype=np.int64), codes, list(names))  # fmt: skip
    reqs = list(requests)
    if not ordered:
        reqs.sort(key=lambda r: (r.arrival_s, r.id))
    names = {}
    codes = np.array([names.setdefault(r.source, len(names)) for r in reqs], dtype=np.int16)
    return (np.array([r.id for r in reqs], dtype=np.int64),
            np.array([r.arrival_s for r in reqs], dtype=np.float64),
            np.array([r.prompt_tokens for r in reqs], dtype=np.int64),
            np.array([r.output_tokens for r in reqs], dtype=np.int64),
            np.array([r.cls == LS for r in reqs], dtype=np.int64), codes, list(names))  # fmt: skip


class CompiledCluster:
    """``sim.cluster.Cluster`` for the compiled loop: the same inputs (a router by name),
    the same ``ClusterResult``; finished requests go to ``records`` in the order they
    finish, as the SimPy executor's ``on_finish`` adds them. ``on_finished(k)``: called
    after every batch of k requests folded (a progress bar). ``watch``: as ``simulate``'s,
    fed each finished request (``finished_values``); the run stops once it has a
    ``reason``."""

    def __init__(self, requests: Iterable[Request] | Workload, scheds: list[Scheduler],
                 latencies: list[LatencyModel], router: str, ls_replicas: int,
                 records: Records, ordered: bool = False,
                 on_finished: Callable[[int], None] | None = None, watch=None) -> None:  # fmt: skip
        self.scheds, self.latencies, self.records = scheds, latencies, records
        self.on_finished, self.watch = on_finished, watch
        self.stopped = False
        (self.ids, self.arrival, self.prompt, self.output, self.is_ls, codes,
         names) = _columns(requests, ordered)  # fmt: skip
        # Records' own source codes for ours
        self.codes = np.array([records.sources.setdefault(s, len(records.sources))
                               for s in names], dtype=np.int16)[codes]  # fmt: skip
        n, replicas = len(self.ids), len(scheds)
        policy, cap = scheds[0].policy, scheds[0].kv_capacity_tokens
        reserved = self.prompt + self.output
        most = cap // max(int(reserved.min()), 1) + 1 if n else 1  # sequences that fit at once
        width = int(min(policy.max_batch_size, most, max(n, 1)))

        def limit(x: float) -> int:
            return K.NO_CAP if x == math.inf else int(x)

        ci = np.zeros(K.C_SIZE, dtype=np.int64)
        ci[K.C_REPLICAS], ci[K.C_ROUTER] = replicas, K.ROUTER_CODES[router]
        ci[K.C_LS_REPLICAS] = ls_replicas
        ci[K.C_MAX_BATCH] = limit(policy.max_batch_size)
        ci[K.C_MAX_PREFILL] = policy.max_batch_prefill_tokens
        ci[K.C_MAX_WAITING] = policy.max_waiting_tokens
        ci[K.C_MAX_TOTAL] = limit(policy.max_batch_total_tokens)
        ci[K.C_CAPACITY] = cap
        lat = latencies[0]
        ci[K.C_LAYERS] = lat.routing.num_layers
        ci[K.C_POOL] = lat.routing.pool_size
        ci[K.C_POOLED_MAX] = lat.routing.POOLED_MAX_TOKENS
        ci[K.C_PER_PROMPT] = not lat.prefill_batched
        ci[K.C_FLUSH_EVERY] = 256 if watch is not None else FLUSH_EVERY
        gaps = int((self.output - 1).sum())
        # an event admits at most a replica's capacity of gaps; what is in flight at most
        # every replica's capacity: room for both, twice the latter so compaction is rare
        ci[K.C_ARENA_FREE] = min(cap, gaps) + 1
        self.arena = np.zeros(2 * min(replicas * cap, gaps) + ci[K.C_ARENA_FREE] + 1,
                              dtype=np.float32)  # fmt: skip
        self.ci = ci
        self.cf = np.array([policy.waiting_served_ratio], dtype=np.float64)
        self.g = np.zeros(K.G_SIZE, dtype=np.int64)
        self.g[K.G_PENDING] = -1
        self.gf = np.zeros(K.GF_SIZE, dtype=np.float64)
        size = 2 * replicas + 4
        self.heap = (np.zeros(size), np.zeros(size, np.int64), np.zeros(size, np.int64),
                     np.zeros(size, np.int64), np.zeros(size, np.int64))  # fmt: skip
        self.ri = np.zeros((replicas, K.R_SIZE), dtype=np.int64)
        self.ri[:, K.R_WAITING_TOKENS] = 1  # TGI's counter starts at 1
        self.rf = np.zeros((replicas, K.RF_SIZE), dtype=np.float64)
        self.ready = np.zeros((replicas, width), dtype=np.int64)
        self.batch = np.zeros((replicas, width), dtype=np.int64)
        self.req = (self.arrival, self.prompt, self.output, self.is_ls)
        # generated, first token, last token, finish, gap slice, largest gap
        self.seqs = (np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan),
                     np.full(n, np.nan), np.zeros(n, np.int64),
                     np.zeros(n, np.float32))  # fmt: skip
        self.nxt = np.zeros(n, dtype=np.int64)
        self.placed = np.zeros(n, dtype=np.int64)
        self.fin = np.zeros(n, dtype=np.int64)
        self.tl = (np.zeros(2 * n), np.zeros(2 * n, np.int64), np.zeros(2 * n, np.int64))
        self.curves = tuple(_pack(c, replicas) for c in _curves(lat))
        e = lat.expert
        self.expert = (lat._expert_table, float(e.xs[-1]), float(e.ys[-1]), float(e.slope),
                       np.full(replicas, np.nan))  # fmt: skip
        most_pooled = lat.routing.POOLED_MAX_TOKENS
        width_e = lat.routing.num_layers * lat.routing.num_experts
        self.pools = (np.zeros((replicas, most_pooled + 1, lat.routing.pool_size, width_e),
                               dtype=np.int8),
                      np.zeros((replicas, most_pooled + 1), dtype=np.int64),
                      np.zeros((replicas, most_pooled + 1, lat.routing.pool_size)),
                      np.zeros((replicas, most_pooled + 1), dtype=np.int64))  # fmt: skip
        self.picks = (
            np.zeros((replicas, lat.routing.PICK_BLOCK), dtype=np.int64),
            np.zeros(replicas, dtype=np.int64),
            np.zeros(replicas, dtype=np.int64),
        )
        for r in range(replicas):
            self._sync_pools(r)
            self._sync_picks(r)

    # -------------------------------------------------------------------- the routing draws
    def _sync_pools(self, r: int) -> None:
        """Copy the pools replica r's models have built since the last call."""
        counts, routed, sums, summed = self.pools
        lat = self.latencies[r]
        for n, pool in enumerate(lat.routing._pools, start=1):
            if not routed[r, n]:
                counts[r, n] = pool.reshape(pool.shape[0], -1)
                routed[r, n] = 1
        for n, (_, times) in lat._pools.items():
            if not summed[r, n]:
                sums[r, n] = [float(t.sum()) for t in times]  # Plan.total_s's sum of each
                summed[r, n] = 1

    def _sync_picks(self, r: int) -> None:
        """Give the loop replica r's block of picks as its routing model holds it."""
        block, filled, taken = self.picks
        routing = self.latencies[r].routing
        drawn = routing._picks_array
        if len(drawn) > block.shape[1]:
            block = np.zeros((block.shape[0], len(drawn)), dtype=np.int64)
            block[:, : self.picks[0].shape[1]] = self.picks[0]
            self.picks = (block, filled, taken)
        block[r, : len(drawn)] = drawn
        filled[r], taken[r] = len(drawn), routing._next

    def _hand_back(self, r: int) -> None:
        """Tell replica r's routing model how many of its picks the loop took."""
        self.latencies[r].routing._next = int(self.picks[2][r])

    # ------------------------------------------------------------------------------- outputs
    def _flush(self) -> None:
        """Fold the requests finished since the last call into the records."""
        g = self.g
        which = self.fin[g[K.G_FLUSHED] : g[K.G_FIN]]
        g[K.G_FLUSHED] = g[K.G_FIN]
        if not len(which):
            return
        gen, first, last, finish, off, itl = self.seqs
        lengths = self.output - 1
        ls = self.is_ls[which].astype(bool)
        gaps = {}
        for cls, mine in ((LS, which[ls]), ("BE", which[~ls])):
            gaps[cls] = (K.gather(self.arena, off, lengths, mine), lengths[mine])
        self.records.add_columns(
            self.ids[which], ls, self.codes[which], self.arrival[which], self.prompt[which],
            self.output[which], first[which], finish[which], itl[which].astype(np.float64),
            self.placed[which], gaps)  # fmt: skip
        if self.watch is not None:
            for i in which.tolist():
                self.watch.finished_values(bool(self.is_ls[i]), float(self.arrival[i]),
                                           int(self.output[i]), float(first[i]),
                                           float(finish[i]))  # fmt: skip
                if self.watch.reason is not None:
                    self.stopped = True
                    break
        if self.on_finished is not None:
            self.on_finished(len(which))

    def run(self) -> ClusterResult:
        wall = time.perf_counter()
        g, replicas = self.g, len(self.scheds)
        # SimPy's start: the arrival process, then each executor, at time 0 (urgent)
        K.schedule(g, self.heap, 0.0, K.URGENT, K.EV_ARRIVAL_INIT, -1)
        for r in range(replicas):
            K.schedule(g, self.heap, 0.0, K.URGENT, K.EV_EXEC_INIT, r)
        while True:
            status = K.run(g, self.gf, self.ci, self.cf, self.heap, self.ri, self.rf,
                           self.ready, self.batch, self.req, self.seqs, self.nxt, self.placed,
                           self.arena, self.fin, self.tl, self.curves, self.expert,
                           self.pools, self.picks)  # fmt: skip
            if status == K.DONE:
                self._flush()
                break
            if status == K.FLUSH:
                self._flush()
                if self.stopped:
                    break
                if len(self.arena) - g[K.G_TOP] < self.ci[K.C_ARENA_FREE]:
                    K.compact(g, self.ci, self.ri, self.ready, self.batch, self.seqs, self.req,
                              self.arena)  # fmt: skip
            elif status == K.NEED_PICKS:
                r = int(g[K.G_PENDING])
                self._hand_back(r)
                self.latencies[r].routing._draw_picks(int(g[K.G_NEED]))
                self._sync_picks(r)
            elif status == K.NEED_EXPERTS:
                r = int(g[K.G_PENDING])
                self._hand_back(r)
                _, times = self.latencies[r].experts(int(g[K.G_ARG]))
                self.gf[K.GF_SUM] = float(times.sum())
                g[K.G_PENDING_MODE] = 1
                self._sync_pools(r)
                self._sync_picks(r)
            else:
                self._flush()  # what finished before, as the SimPy executor has added it
                self._raise(status)
        for r in range(replicas):  # what was drawn but not taken goes back, as in stepping
            self._hand_back(r)
            self._unpack(r)
        return self._result(time.perf_counter() - wall)

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
        sched.memory.used_tokens = int(self.ri[r, K.R_USED])
        sched.memory.peak_used_tokens = int(self.ri[r, K.R_PEAK])
        for c, packed in zip(_curves(lat), self.curves, strict=True):
            _unpack_beyond(c, packed[5][r])
        if not math.isnan(self.expert[4][r]):
            lat.expert._beyond(float(self.expert[4][r]))

    def _result(self, wall_s: float) -> ClusterResult:
        g, ri = self.g, self.ri
        n = int(g[K.G_NEXT]) if self.stopped else len(self.ids)
        events = int(g[K.G_ARR_EVENTS] + ri[:, K.R_EVENTS].sum())
        result = SimResult(sequences=[], makespan_s=float(self.gf[K.GF_MAKESPAN]) if not
                           self.stopped else float(self.gf[K.GF_NOW]), events=events,
                           wall_s=wall_s, iterations=int(ri[:, K.R_ITERS].sum()),
                           preemptions=0,
                           peak_kv_used_tokens=int(ri[:, K.R_PEAK].max()))  # fmt: skip
        rows = int(g[K.G_TL])
        timeline = pd.DataFrame({"t_s": self.tl[0][:rows].copy(),
                                 "replica": self.tl[1][:rows].copy(),
                                 "in_system": self.tl[2][:rows].copy()})  # fmt: skip
        return ClusterResult(result, self.ids[:n].copy(), self.placed[:n].copy(),
                             self.rf[:, K.RF_BUSY].tolist(), timeline)  # fmt: skip
