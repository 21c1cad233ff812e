"""Replicas and a global router on one simulated clock.

Each replica is a Scheduler with its own latency model, driven by its own ``Simulation``
executor; all share one SimPy environment. A router is pure, like a policy: it reads the
replicas' schedulers and returns the index of the replica that receives an arrival. It
decides once, on arrival (no migration), as Vidur's global schedulers and the serving
routers of vLLM's production stack do.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import simpy

from policies.core import LS, Request
from policies.core import Sequence as Seq
from policies.scheduler import Scheduler
from sim.engine import SimResult, Simulation, Upcoming, replay


class Router:
    """Base class: ``choose`` returns the replica index for a request arriving now."""

    name = "base"
    reads_memory = False  # whether ``choose`` reads the replicas' KV memory

    def __init__(self, num_replicas: int, ls_replicas: int = 1) -> None:
        self.num_replicas = num_replicas

    def choose(self, scheds: Sequence[Scheduler], request: Request) -> int:
        raise NotImplementedError

    @staticmethod
    def fewest_replicas(ls_replicas: int = 1) -> int:
        """The fewest replicas this router can serve (``cluster.ls_replicas`` given)."""
        return 1


def _least(scheds: Sequence[Scheduler], among: range, key: Callable[[Scheduler], Any]) -> int:
    """The replica in ``among`` with the smallest key; ties go to the lowest index."""
    return min(among, key=lambda i: (key(scheds[i]), i))


def _outstanding(s: Scheduler) -> int:
    return s.in_system


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, num_replicas: int, ls_replicas: int = 1) -> None:
        super().__init__(num_replicas)
        self.next = 0

    def choose(self, scheds, request):
        i, self.next = self.next, (self.next + 1) % self.num_replicas
        return i


class LeastOutstanding(Router):
    """Fewest requests in the system (waiting, running or suspended)."""

    name = "least_outstanding"

    def choose(self, scheds, request):  # _least's rule, without a key tuple per replica
        counts = [s.in_system for s in scheds]
        return counts.index(min(counts))


class LeastKV(Router):
    """Most free KV cache: what the replica's memory model holds, plus what its waiting
    requests will be charged on admission (``reserve``: prompt + output; ``paged``: the blocks
    of what their prefill writes, as paged memory never holds the rest in advance)."""

    name = "least_kv"
    reads_memory = True

    def choose(self, scheds, request):
        def used(s: Scheduler) -> float:
            waiting = sum(s.memory.admit_tokens(q) for c in s.waiting for q in s.waiting[c])
            return (s.kv_used_tokens + waiting) / s.kv_capacity_tokens

        return _least(scheds, range(len(scheds)), used)


class LSDedicated(Router):
    """The first ``ls_replicas`` replicas serve LS requests only, the others BE only; within
    each group, fewest outstanding requests."""

    name = "ls_dedicated"

    def __init__(self, num_replicas: int, ls_replicas: int = 1) -> None:
        super().__init__(num_replicas)
        if not 1 <= ls_replicas < num_replicas:
            raise ValueError(
                f"ls_dedicated needs 1 <= cluster.ls_replicas < cluster.replicas "
                f"({num_replicas}), not {ls_replicas}"
            )
        self.ls = range(ls_replicas)
        self.be = range(ls_replicas, num_replicas)

    @staticmethod
    def fewest_replicas(ls_replicas: int = 1) -> int:
        return ls_replicas + 1  # at least one BE replica

    def choose(self, scheds, request):
        return _least(scheds, self.ls if request.cls == LS else self.be, _outstanding)


def _ls_queued(s: Scheduler) -> tuple[int, int]:
    return len(s.waiting[LS]) + len(s.ready[LS]), s.in_system


class LSFirst(Router):
    """LS requests to the replica with the fewest LS requests queued (waiting or ready), ties
    (often: an LS-first policy keeps its LS queues empty) to the fewest outstanding requests;
    BE requests to the one with the fewest outstanding requests."""

    name = "ls_first"

    def choose(self, scheds, request):
        if request.cls == LS:
            return _least(scheds, range(len(scheds)), _ls_queued)
        return _least(scheds, range(len(scheds)), _outstanding)


ROUTERS = {r.name: r for r in (RoundRobin, LeastOutstanding, LeastKV, LSDedicated, LSFirst)}


@dataclass
class ClusterResult:
    result: SimResult  # all replicas together (events, iterations, preemptions summed)
    ids: np.ndarray  # request ids, in arrival order
    replicas: np.ndarray  # the replica each of them was placed on
    busy_s: list[float]  # per replica
    timeline: pd.DataFrame  # (t_s, replica, in_system) at every arrival and completion

    @property
    def replica_of(self) -> dict[int, int]:
        """Request id -> replica index."""
        return dict(zip(self.ids.tolist(), self.replicas.tolist(), strict=True))


class Cluster:
    """Replicas on one clock, fed by a router. One replica behaves exactly as a lone
    ``Simulation`` of the same requests (a test checks it).

    ``ordered``: the requests are already in (arrival, id) order, as a streamed workload's
    are: they are pulled one at a time as the clock reaches them, never held all at once.
    ``on_finish(seq, replica)`` is called for every finished sequence. Placements and the
    timeline are kept as columns (about 14 bytes an event): a day of arrivals fits.
    ``stop``: an event that ends the run where it stands when it is triggered (``stopped``
    then says so; the result is of a part of the run)."""

    def __init__(
        self,
        requests: Iterable[Request],
        replicas: list[Simulation],
        router: Router,
        env: simpy.Environment,
        on_finish: Callable[[Seq, int], None] | None = None,
        ordered: bool = False,
        stop: simpy.Event | None = None,
    ) -> None:
        self.requests = requests if ordered else sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.replicas = replicas
        self.scheds = [r.sched for r in replicas]
        self.router = router
        self.env = env
        self.events = 0
        self.ids, self.placed = array("q"), array("q")  # request id, replica
        self.t_s, self.replica, self.in_system = array("d"), array("q"), array("q")
        for i, rep in enumerate(replicas):
            rep.on_finish = self._finished(i, on_finish)
        # the next request to arrive: a lone replica's to plan its runs by (with several, the
        # router decides on arrival which one receives it)
        self.upcoming = Upcoming()
        self.stop = stop
        self.stopped = False
        if len(replicas) == 1:
            replicas[0].upcoming = self.upcoming

    def _note(self, i: int) -> None:
        self.t_s.append(self.env.now)
        self.replica.append(i)
        self.in_system.append(self.scheds[i].in_system)

    def _finished(self, i: int, outer):
        def record(seq: Seq) -> None:
            self._note(i)
            if outer is not None:
                outer(seq, i)

        return record

    def _place(self, req: Request) -> None:
        if self.router.reads_memory:  # a fast-forwarded run's blocks, as stepping's by now
            for rep in self.replicas:
                rep.sync_run()
        i = self.router.choose(self.scheds, req)
        self.ids.append(req.id)
        self.placed.append(i)
        self.replicas[i].admit(req)
        self._note(i)

    def _arrivals(self):
        waited = yield from replay(self.env, self.requests, self._place, self.upcoming)
        self.events += waited
        for rep in self.replicas:
            rep.close_arrivals()

    def run(self) -> ClusterResult:
        wall = time.perf_counter()
        self.env.process(self._arrivals())
        executors = [rep.start(arrivals=False) for rep in self.replicas]
        done = self.env.all_of(executors)
        self.env.run(until=done if self.stop is None else done | self.stop)
        self.stopped = self.stop is not None and self.stop.triggered
        parts = [rep.result(0.0) for rep in self.replicas]
        merged = SimResult(
            sequences=[s for p in parts for s in p.sequences],
            makespan_s=self.env.now,
            events=self.events + sum(p.events for p in parts),
            wall_s=time.perf_counter() - wall,
            iterations=sum(p.iterations for p in parts),
            preemptions=sum(p.preemptions for p in parts),
            peak_kv_used_tokens=max(p.peak_kv_used_tokens for p in parts),
            trace=[t for p in parts for t in p.trace],
        )
        timeline = pd.DataFrame(
            {
                "t_s": np.frombuffer(self.t_s),
                "replica": np.frombuffer(self.replica, dtype=np.int64),
                "in_system": np.frombuffer(self.in_system, dtype=np.int64),
            }
        )
        return ClusterResult(merged, np.frombuffer(self.ids, dtype=np.int64),
                             np.frombuffer(self.placed, dtype=np.int64),
                             [r.busy_s for r in self.replicas], timeline)  # fmt: skip


def replica_stats(result: ClusterResult) -> list[dict]:
    """Per replica: requests served, utilisation (busy time / makespan), and the number of
    requests in the system (time-weighted mean over the makespan, and maximum)."""
    makespan = max(result.result.makespan_s, 1e-12)
    n = len(result.busy_s)
    served = np.bincount(result.replicas, minlength=n)
    times = result.timeline["t_s"].to_numpy()
    counts = result.timeline["in_system"].to_numpy(dtype=float)
    which = result.timeline["replica"].to_numpy()
    out = []
    for i in range(n):
        mine = which == i
        mean = peak = 0.0
        if mine.any():
            t = np.append(times[mine], makespan)
            k = counts[mine]
            mean = float((k * np.diff(t)).sum() / makespan)
            peak = float(k.max())
        out.append({"replica": i, "requests": int(served[i]),
                    "utilization": result.busy_s[i] / makespan,
                    "mean_in_system": mean, "max_in_system": int(peak)})  # fmt: skip
    return out
