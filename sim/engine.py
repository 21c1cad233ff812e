"""The SimPy executor: drives the shared Scheduler with simulated time.

One iteration is one ``env.timeout`` over its precomputed stage times. When an arrival makes
the policy want the processor back, the arrival process interrupts the executor, which looks up
the next preemption boundary of the policy's granularity (``Plan.next_boundary``, a bisect),
runs to it and suspends the batch there. Simulated events therefore grow with iterations and
arrivals, not with layers x experts. ``mode="step"`` instead yields one timeout per stage and
asks the scheduler at every boundary; tests use it to check the lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import simpy

from policies.core import Batch, Request
from policies.core import Sequence as Seq
from policies.scheduler import Scheduler
from sim.latency import LatencyModel


def replay(env: simpy.Environment, requests: Sequence[Request], admit: Callable[[Request], None]):
    """A SimPy process body: each request, in order, goes to ``admit`` at its arrival time.
    Returns the number of timeouts it waited (simulated events)."""
    events = 0
    for req in requests:
        delay = req.arrival_s - env.now
        if delay > 0:
            yield env.timeout(delay)
            events += 1
        admit(req)
    return events


@dataclass
class SimResult:
    sequences: list[Seq]
    makespan_s: float
    events: int
    wall_s: float
    iterations: int
    preemptions: int
    peak_kv_used_tokens: int
    trace: list[tuple] = field(default_factory=list)  # (start_s, end_s, batch_id, kind, note)


class Simulation:
    def __init__(
        self,
        requests: Sequence[Request],
        scheduler: Scheduler,
        latency: LatencyModel,
        mode: str = "lookup",
        record_trace: bool = False,
        on_finish: Callable[[Seq], None] | None = None,
        env: simpy.Environment | None = None,
    ) -> None:
        if mode not in ("lookup", "step"):
            raise ValueError(f"mode must be lookup or step, not {mode!r}")
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.sched = scheduler
        self.latency = latency
        self.mode = mode
        self.record_trace = record_trace
        self.on_finish = on_finish
        self.env = env or simpy.Environment()
        self.events = 0
        self.busy_s = 0.0  # simulated time the executor spent running batches
        self.sequences: list[Seq] = []
        self.trace: list[tuple] = []
        self._wakeup: simpy.Event | None = None
        # since when the executor has had nothing to run (None: busy); it starts idle at 0
        self._idle_since: float | None = 0.0
        self._interruptible = False
        self._arrivals_done = False

    # ------------------------------------------------------------------------------ processes
    def _arrivals(self):
        waited = yield from replay(self.env, self.requests, self.admit)
        self.events += waited  # after the wait: the executor counts into it meanwhile
        self.close_arrivals()

    def admit(self, req: Request) -> None:
        """A request arrives now: queue it, and wake or interrupt the executor if it must act.
        A cluster's router calls this for the requests it places on this replica."""
        self.sequences.append(self.sched.arrive(req, self.env.now))
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._interruptible and self.sched.should_preempt():
            self._interruptible = False
            self._executor.interrupt()
            self.events += 1

    def close_arrivals(self) -> None:
        """No request will arrive any more: an idle executor may finish."""
        self._arrivals_done = True
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def _executor_loop(self):
        env, sched = self.env, self.sched
        while True:
            batch = sched.next_batch(env.now)
            if batch is None:
                if self._arrivals_done:
                    if sched.in_system:
                        raise RuntimeError(f"scheduler stalled with {sched.in_system} requests")
                    return
                if self._idle_since is None:
                    self._idle_since = env.now
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None
                self.events += 1
                continue
            if batch.plan is None:
                batch.plan = self.latency.plan(batch)
            start = env.now
            if self._idle_since is not None:  # the device sat idle: it wakes up first
                wake_s = self.latency.wake_s(env.now - self._idle_since)
                self._idle_since = None
                if wake_s > 0:
                    yield env.timeout(wake_s)
                    self.events += 1
            if batch.cursor:  # a suspended batch resumes: its saved state is restored first
                switch_s = self.latency.switch_s(batch)
                if switch_s > 0:
                    yield env.timeout(switch_s)
                    self.events += 1
            run = self._run_lookup if self.mode == "lookup" else self._run_steps
            while True:
                partner = sched.merge_partner()
                stop = None if partner is None else partner.cursor
                preempted = yield from run(batch, stop)
                if preempted or stop is None:
                    break
                self.busy_s += env.now - start
                if self.record_trace:  # the batch's part up to the merge; note: the partner
                    self.trace.append((start, env.now, batch.id, "merged", partner.id))
                start = env.now
                batch = yield from self._merge(partner)
            self.busy_s += env.now - start
            if self.record_trace:
                kind = "preempted" if preempted else batch.phase.value
                self.trace.append((start, env.now, batch.id, kind, batch.size))
            if preempted:
                sched.preempt(env.now)
            else:
                for seq in sched.complete_iteration(env.now):
                    if self.on_finish is not None:
                        self.on_finish(seq)

    def _merge(self, partner: Batch):
        """The running batch has reached ``partner``'s cursor: merge them and plan the rest of
        the iteration at the merged composition. The partner's saved state is restored first,
        as on a resume. Returns the merged batch."""
        batch = self.sched.merge(partner, self.env.now)
        batch.plan = self.latency.plan(batch)
        switch_s = self.latency.switch_s(partner)
        if switch_s > 0:
            yield self.env.timeout(switch_s)
            self.events += 1
        return batch

    def _run_lookup(self, batch: Batch, stop: int | None = None):
        """Run from the cursor to boundary ``stop`` (None: the end) in one timeout, leaving the
        cursor there; on an interrupt, run to the next preemptible boundary and return True
        (suspend) there. A stop is a suspended batch's cursor, itself a preemptible boundary,
        so an interrupt before it suspends the batch at or before it."""
        env, plan = self.env, batch.plan
        offset = plan.offset(batch.cursor)
        end = plan.num_stages if stop is None else stop
        start = env.now
        self._interruptible = self.sched.preemptible
        try:
            yield env.timeout(plan.offset(end) - offset)
            self.events += 1
            self._interruptible = False
            if stop is not None:
                batch.cursor = stop
            return False
        except simpy.Interrupt:
            self._interruptible = False
        elapsed = offset + (env.now - start)
        boundary = plan.next_boundary(elapsed, self.sched.granularity)
        if boundary is None:  # past the last boundary: never when a stop (itself one) is ahead
            yield env.timeout(plan.total_s - elapsed)
            self.events += 1
            return False
        yield env.timeout(plan.offset(boundary) - elapsed)
        self.events += 1
        batch.cursor = boundary
        return True

    def _run_steps(self, batch: Batch, stop: int | None = None):
        """Reference path: one timeout per stage up to boundary ``stop`` (None: the end),
        asking the scheduler at every boundary."""
        env, plan = self.env, batch.plan
        allowed = set(plan.preemptible(self.sched.granularity))
        start = env.now - plan.offset(batch.cursor)
        end = plan.num_stages if stop is None else stop
        for boundary in range(batch.cursor + 1, end + 1):
            yield env.timeout(max(0.0, start + plan.offset(boundary) - env.now))
            self.events += 1
            batch.cursor = boundary
            if boundary in allowed and self.sched.should_preempt():
                return True
        return False

    # ------------------------------------------------------------------------------------ run
    def start(self, arrivals: bool = True) -> simpy.Process:
        """Register the processes (the arrival process only when this simulation replays its
        own requests) and return the executor's."""
        if arrivals:
            self.env.process(self._arrivals())
        self._executor = self.env.process(self._executor_loop())
        return self._executor

    def run(self) -> SimResult:
        wall = time.perf_counter()
        self.env.run(until=self.start())
        return self.result(time.perf_counter() - wall)

    def result(self, wall_s: float) -> SimResult:
        return SimResult(
            sequences=self.sequences,
            makespan_s=self.env.now,
            events=self.events,
            wall_s=wall_s,
            iterations=self.sched.iterations,
            preemptions=self.sched.preemptions,
            peak_kv_used_tokens=self.sched.peak_kv_used_tokens,
            trace=self.trace,
        )
