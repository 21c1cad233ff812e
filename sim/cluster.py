"""Replicas and a global router on one simulated clock.

Each replica is a Scheduler with its own latency model, driven by its own ``Simulation``
executor; all share one SimPy environment. A router is pure, like a policy: it reads the
replicas' schedulers and returns the index of the replica that receives an arrival. It
decides once, on arrival (no migration), as Vidur's global schedulers and the serving
routers of vLLM's production stack do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from policies.core import LS, Request
from policies.core import Sequence as Seq
from policies.scheduler import Scheduler
from sim.engine import SimResult, Simulation, replay


class Router:
    """Base class: ``choose`` returns the replica index for a request arriving now."""

    name = "base"

    def __init__(self, num_replicas: int, ls_replicas: int = 1) -> None:
        self.num_replicas = num_replicas

    def choose(self, scheds: Sequence[Scheduler], request: Request) -> int:
        raise NotImplementedError


def _least(scheds: Sequence[Scheduler], among: range, key: Callable[[Scheduler], float]) -> int:
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

    def choose(self, scheds, request):
        return _least(scheds, range(len(scheds)), _outstanding)


class LeastKV(Router):
    """Most free KV cache: what the replica's memory model holds, plus what its waiting
    requests will be charged on admission (``reserve``: prompt + output; ``paged``: the blocks
    of what their prefill writes, as paged memory never holds the rest in advance)."""

    name = "least_kv"

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

    def choose(self, scheds, request):
        return _least(scheds, self.ls if request.cls == LS else self.be, _outstanding)


class LSFirst(Router):
    """LS requests to the replica with the fewest LS requests queued (waiting or ready), BE
    requests to the one with the fewest outstanding requests."""

    name = "ls_first"

    def choose(self, scheds, request):
        if request.cls == LS:
            return _least(scheds, range(len(scheds)),
                          lambda s: len(s.waiting[LS]) + len(s.ready[LS]))  # fmt: skip
        return _least(scheds, range(len(scheds)), _outstanding)


ROUTERS = {r.name: r for r in (RoundRobin, LeastOutstanding, LeastKV, LSDedicated, LSFirst)}


@dataclass
class ClusterResult:
    result: SimResult  # all replicas together (events, iterations, preemptions summed)
    replica_of: dict[int, int]  # request id -> replica index
    busy_s: list[float]  # per replica
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, replica, n)


class Cluster:
    """Replicas on one clock, fed by a router. One replica behaves exactly as a lone
    ``Simulation`` of the same requests (a test checks it)."""

    def __init__(
        self,
        requests: Sequence[Request],
        replicas: list[Simulation],
        router: Router,
        env: simpy.Environment,
        on_finish: Callable[[Seq], None] | None = None,
    ) -> None:
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.replicas = replicas
        self.scheds = [r.sched for r in replicas]
        self.router = router
        self.env = env
        self.events = 0
        self.replica_of: dict[int, int] = {}
        self.timeline: list[tuple[float, int, int]] = []
        for i, rep in enumerate(replicas):
            rep.on_finish = self._finished(i, on_finish)

    def _finished(self, i: int, outer):
        def record(seq: Seq) -> None:
            self.timeline.append((self.env.now, i, self.scheds[i].in_system))
            if outer is not None:
                outer(seq)

        return record

    def _place(self, req: Request) -> None:
        i = self.router.choose(self.scheds, req)
        self.replica_of[req.id] = i
        self.replicas[i].admit(req)
        self.timeline.append((self.env.now, i, self.scheds[i].in_system))

    def _arrivals(self):
        waited = yield from replay(self.env, self.requests, self._place)
        self.events += waited
        for rep in self.replicas:
            rep.close_arrivals()

    def run(self) -> ClusterResult:
        wall = time.perf_counter()
        self.env.process(self._arrivals())
        executors = [rep.start(arrivals=False) for rep in self.replicas]
        self.env.run(until=self.env.all_of(executors))
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
        return ClusterResult(merged, self.replica_of, [r.busy_s for r in self.replicas],
                             self.timeline)  # fmt: skip


def replica_stats(result: ClusterResult) -> list[dict]:
    """Per replica: requests served, utilisation (busy time / makespan), and the number of
    requests in the system (time-weighted mean over the makespan, and maximum)."""
    makespan = max(result.result.makespan_s, 1e-12)
    n = len(result.busy_s)
    served = np.bincount(np.fromiter(result.replica_of.values(), int), minlength=n)
    out = []
    for i in range(n):
        pts = [(t, k) for t, r, k in result.timeline if r == i]
        mean = peak = 0.0
        if pts:
            t = np.array([p[0] for p in pts] + [makespan])
            k = np.array([p[1] for p in pts], dtype=float)
            mean = float((k * np.diff(t)).sum() / makespan)
            peak = float(k.max())
        out.append({"replica": i, "requests": int(served[i]),
                    "utilization": result.busy_s[i] / makespan,
                    "mean_in_system": mean, "max_in_system": int(peak)})  # fmt: skip
    return out
