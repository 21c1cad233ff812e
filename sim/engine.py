"""The SimPy executor: drives the shared Scheduler with simulated time.

One iteration is one ``env.timeout`` over its precomputed stage times. When an arrival makes
the policy want the processor back, the arrival process interrupts the executor, which looks up
the next preemption boundary of the policy's granularity (``Plan.next_boundary``, a bisect),
runs to it and suspends the batch there. Simulated events therefore grow with iterations and
arrivals, not with layers x experts. ``mode="step"`` instead yields one timeout per stage and
asks the scheduler at every boundary; tests use it to check the lookup.

Fast-forward (``fast_forward=True``, the default): when the scheduler can tell that the next n
iterations repeat the decode batch just selected (``Scheduler.decode_run``: nothing arrives,
nothing finishes before the n-th, the policy's choice does not change), they run as one timeout
to the end of the n-th; the latency model plans them at once (``LatencyModel.decode_run``, the
same routing draws in the same order). An arrival cuts the run when the policy would preempt
the batch or select otherwise before the run's end (``Policy.decode_run_on_arrival``; on an
overloaded replica most arrivals only join a queue that the run does not reach): the
iterations it completed are applied in bulk (``Scheduler.advance_decodes``) and the one in
progress continues as any iteration does, preemptible. Under paged memory a run also ends
before the first iteration whose new KV blocks would not fit (stepping preempts there); its
blocks are charged as stepping charges them, at each iteration's selection, when anyone reads
memory during the run (an arrival, a router: ``sync_run``), else in bulk at its end. Events
then grow with completions and the arrivals that change a decision, and every per-request
result equals the iteration-by-iteration path's (tests/test_fast_forward.py), but for exact
ties on several replicas: an arrival at the very float at which another replica's run ends
comes after that end here (the run's timeout was scheduled when it started) and may come
before it in stepping; measured profile times and timestamps do not tie so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from policies.core import Batch, Phase, Request
from policies.core import Sequence as Seq
from policies.scheduler import Scheduler
from sim.latency import DecodeRun, LatencyModel


class Upcoming:
    """The next request to arrive (None: none will), kept by ``replay`` for an executor that
    plans fast-forwarded runs."""

    __slots__ = ("request",)

    def __init__(self) -> None:
        self.request: Request | None = None


def replay(
    env: simpy.Environment,
    requests: Iterable[Request],
    admit: Callable[[Request], None],
    upcoming: Upcoming | None = None,
):
    """A SimPy process body: each request, in order, goes to ``admit`` at its arrival time.
    Returns the number of timeouts it waited (simulated events)."""
    upcoming = upcoming or Upcoming()
    events = 0
    for req in requests:
        upcoming.request = req
        delay = req.arrival_s - env.now
        if delay > 0:
            yield env.timeout(delay)
            events += 1
        admit(req)
    upcoming.request = None
    return events


def delay_to(now: float, t: float) -> float:
    """The longest delay d for which SimPy's clock, now + d, does not pass t: t - now itself
    may round either way. Usually now + d == t; when no float d makes the sum round to t (a
    tie can step over it), ``Simulation._until`` waits the few ulps left in a second timeout."""
    d = t - now
    while now + d < t:
        d = math.nextafter(d, math.inf)
    while now + d > t:
        d = math.nextafter(d, -math.inf)
    return d


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
        fast_forward: bool = True,
        keep_sequences: bool = True,
    ) -> None:
        """``keep_sequences``: hold every request's Sequence for ``result`` (False: a long run
        hands each to ``on_finish`` and keeps none)."""
        if mode not in ("lookup", "step"):
            raise ValueError(f"mode must be lookup or step, not {mode!r}")
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.sched = scheduler
        self.latency = latency
        self.mode = mode
        self.record_trace = record_trace
        self.on_finish = on_finish
        # the stepping reference and a recorded trace (one row per iteration) run every iteration
        self.fast_forward = fast_forward and mode == "lookup" and not record_trace
        self.env = env or simpy.Environment()
        self.events = 0
        self.busy_s = 0.0  # simulated time the executor spent running batches
        self.keep_sequences = keep_sequences
        self.sequences: list[Seq] = []
        self.trace: list[tuple] = []
        self._wakeup: simpy.Event | None = None
        # since when the executor has had nothing to run (None: busy); it starts idle at 0
        self._idle_since: float | None = 0.0
        # (idle time, busy time since) while a wake-up is being charged (None: spent)
        self._wake: tuple[float, float] | None = None
        self._interruptible = False
        self._in_run = False  # in a fast-forwarded run of decode iterations
        self._run_iterations = 0  # its length
        self._run_ends: np.ndarray | None = None  # its start, then each iteration's end
        self._arrivals_done = False
        # the next request to arrive, when this simulation replays its own (None: a cluster's
        # replica, which cannot tell whether the next arrival is its own)
        self.upcoming: Upcoming | None = None
        self.run_planned = 0  # iterations of fast-forwarded runs planned, and run
        self.run_kept = 0
        # the sequences (ids, in order) of the last decode steps, whose padded KV is bound
        self._bound: tuple[int, ...] | None = None
        # arrivals whose admission (the profile's engine_admit) the executor has yet to pay:
        # the real engine admits them between iterations, before it runs the next batch
        self._admits_owed = 0
        self._admits_cost = latency.admit is not None

    # ------------------------------------------------------------------------------ processes
    def _arrivals(self):
        waited = yield from replay(self.env, self.requests, self.admit, self.upcoming)
        self.events += waited  # after the wait: the executor counts into it meanwhile
        self.close_arrivals()

    def admit(self, req: Request) -> None:
        """A request arrives now: queue it, and wake or interrupt the executor if it must act.
        A cluster's router calls this for the requests it places on this replica."""
        self.sync_run()
        seq = self.sched.arrive(req, self.env.now)
        if self.keep_sequences:
            self.sequences.append(seq)
        if self._admits_cost:
            self._admits_owed += 1
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._in_run and self._cuts_run(seq):
            self._in_run = False
            self._executor.interrupt()
            self.events += 1
        elif self._interruptible and self.sched.should_preempt(self.env.now):
            self._interruptible = False
            self._executor.interrupt()
            self.events += 1

    def sync_run(self) -> None:
        """During a fast-forwarded run under growing memory, charge the blocks that stepping
        has allocated by now (up to the iteration in progress: an arrival at an iteration's
        end counts as before it, as a cut does), so that whoever reads memory now (the
        policy on an arrival, a router) sees what stepping's would."""
        if self._in_run and self._run_ends is not None:
            j = max(1, int(np.searchsorted(self._run_ends, self.env.now)))
            self.sched.grow_run(self.sched.running, j)

    def _cuts_run(self, seq: Seq) -> bool:
        """Whether an arrival during a fast-forwarded run changes what the run assumed: the
        policy preempts the batch, or would select otherwise before the run's end."""
        sched = self.sched
        if self._admits_cost:  # its admission runs before the next iteration
            return True
        if sched.preemptible and sched.should_preempt(self.env.now):
            return True
        return sched.decode_run_on_arrival(seq) < self._run_iterations

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
                batch.plan = self.latency.plan(batch, self._binds(batch))
            start = env.now
            if self._admits_owed:  # the engine admits what arrived before it runs the batch
                admit_s = self.latency.admit_s(self._admits_owed)
                self._admits_owed = 0
                yield env.timeout(admit_s)
                self.events += 1
            if self._idle_since is not None:  # the device sat idle: it wakes up first
                self._wake = (env.now - self._idle_since, 0.0)
                self._idle_since = None
            if self._wake is not None:  # each batch its share of the wake-up, until it is spent
                idle_s, busy_s = self._wake
                run_s = batch.plan.total_s - batch.plan.offset(batch.cursor)
                wake_s = self.latency.wake_s(idle_s, busy_s, run_s)
                busy_s += run_s
                self._wake = (idle_s, busy_s) if busy_s < self.latency.wake_window_s else None
                if wake_s > 0:
                    yield env.timeout(wake_s)
                    self.events += 1
            if batch.cursor:  # a suspended batch resumes: its saved state is restored first
                switch_s = self.latency.switch_s(batch)
                if switch_s > 0:
                    yield env.timeout(switch_s)
                    self.events += 1
            if env.now > start:  # the wake-up and switch are busy time of their own, so that
                self.busy_s += env.now - start  # a fast-forwarded run (which restarts the
                start = env.now  # count at its last iteration) keeps them too
            partner = sched.merge_partner()
            # a fast-forwarded run charges no wake-up: none runs before the wake-up is spent
            run = self._decode_run(batch) if partner is None and self._wake is None else None
            if run is not None:
                start, preempted = yield from self._run_decodes(batch, run)
            else:
                step = self._run_lookup if self.mode == "lookup" else self._run_steps
                while True:
                    stop = None if partner is None else partner.cursor
                    preempted = yield from step(batch, stop)
                    if preempted or stop is None:
                        break
                    self.busy_s += env.now - start
                    if self.record_trace:  # the batch's part up to the merge; note: the partner
                        self.trace.append((start, env.now, batch.id, "merged", partner.id))
                    start = env.now
                    batch = yield from self._merge(partner)
                    partner = sched.merge_partner()
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

    def _binds(self, batch: Batch) -> bool:
        """Whether the batch's decode steps bind a new padded KV buffer: they are not the last
        decode steps' sequences, in that order. The real runner keeps the buffer of its last
        decode batch only; a prefill leaves it, a suspended batch keeps its own."""
        if self.latency.attn_decode_bind is None:  # binding is free: no need to track it
            return False
        ids = tuple(s.id for s in batch.sequences if s.phase is Phase.DECODE)
        if not ids or ids == self._bound:
            return False
        self._bound = ids
        return True

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

    def _decode_run(self, batch: Batch) -> DecodeRun | None:
        """The iterations of this batch to fast-forward, planned; None: run just this one."""
        if not self.fast_forward:
            return None
        sched = self.sched
        n = sched.decode_run(batch)
        upcoming = self.upcoming.request if self.upcoming is not None else None
        if (
            n > 1
            and upcoming is not None
            and (self._admits_cost or sched.policy.arrival_ends_run(sched, batch, upcoming))
        ):
            # plan only up to about the next arrival, which will end the run there: a longer
            # plan would be thrown away (a run may end anywhere; the results are the same)
            ahead = upcoming.arrival_s - self.env.now
            n = min(n, math.ceil(ahead / batch.plan.total_s))
        if n <= 1:
            return None
        run = self.latency.decode_run(batch, n)
        if run is not None:
            self.run_planned += len(run.totals_s)
        return run

    def _run_decodes(self, batch: Batch, run: DecodeRun):
        """The planned iterations of a decode batch in one timeout. Returns (start of the last
        iteration run, whether it was preempted); that iteration is left for the caller to
        complete, as one run by ``_run_lookup`` is."""
        env, sched = self.env, self.sched
        # sequential sums: each end is the float env.now reaches iteration by iteration
        ends = np.concatenate(([env.now], run.totals_s)).cumsum()
        self._in_run, self._run_iterations = True, len(run.totals_s)
        self._run_ends = ends if sched.memory.grows else None
        try:
            yield from self._until(float(ends[-1]))
            self._in_run = False
            j, cut = len(run.totals_s), False
        except simpy.Interrupt:  # an arrival: iteration j is in progress
            j, cut = max(1, int(np.searchsorted(ends, env.now))), True
        run.keep(j)
        self.run_kept += j
        if j > 1:
            sched.advance_decodes(batch, ends[1:j])
            busy = self.busy_s
            for step_s in (ends[1:j] - ends[: j - 1]).tolist():  # summed as step by step
                busy += step_s
            self.busy_s = busy
        start = float(ends[j - 1])
        if not cut:  # the caller completes the last iteration, which needs no plan of its own
            return start, False
        if j > 1:  # the iteration in progress runs on by its plan
            batch.plan = run.plan(j)
        if sched.preemptible and sched.should_preempt(self.env.now):
            preempted = yield from self._to_boundary(batch, env.now - start)
        else:
            preempted = yield from self._run_lookup(batch, start_s=start)
        return start, preempted

    def _run_lookup(self, batch: Batch, stop: int | None = None, start_s: float | None = None):
        """Run from the cursor to boundary ``stop`` (None: the end) in one timeout, leaving the
        cursor there; on an interrupt, run to the next preemptible boundary and return True
        (suspend) there. A stop is a suspended batch's cursor, itself a preemptible boundary,
        so an interrupt before it suspends the batch at or before it. ``start_s``: when the
        iteration started, if before now (the one in progress when an arrival cut a
        fast-forward; then no stop)."""
        env, plan = self.env, batch.plan
        if start_s is None and self.sched.preemptible and self.sched.should_preempt(self.env.now):
            # asked already (an arrival during a wake-up or a switch, which nothing
            # interrupts): the next preemptible boundary past the cursor, as stepping finds it
            return (yield from self._to_next_allowed(batch, stop))
        offset = plan.offset(batch.cursor)
        end = plan.num_stages if stop is None else stop
        start = env.now if start_s is None else start_s
        self._interruptible = self.sched.preemptible
        try:
            if start_s is None:
                yield env.timeout(plan.offset(end) - offset)
                self.events += 1
            else:
                yield from self._until(start + (plan.total_s - offset))
            self._interruptible = False
            if stop is not None:
                batch.cursor = stop
            return False
        except simpy.Interrupt:
            self._interruptible = False
        return (yield from self._to_boundary(batch, offset + (env.now - start)))

    def _to_next_allowed(self, batch: Batch, stop: int | None = None):
        """Run to the first preemptible boundary after the cursor, up to ``stop`` (None: the
        end), and return True there; without one, run to ``stop`` or the end and return
        False. ``_run_steps``' times and choice, in one timeout."""
        env, plan = self.env, batch.plan
        end = plan.num_stages if stop is None else stop
        start = env.now - plan.offset(batch.cursor)
        ahead = [b for b in plan.preemptible(self.sched.granularity) if batch.cursor < b <= end]
        target = ahead[0] if ahead else end
        yield env.timeout(max(0.0, start + plan.offset(target) - env.now))
        self.events += 1
        if ahead or stop is not None:
            batch.cursor = target
        return bool(ahead)

    def _until(self, t: float):
        """Wait until the clock reads exactly t: a fast-forwarded run must end on the very
        float that iteration-by-iteration steps reach."""
        env = self.env
        yield env.timeout(delay_to(env.now, t))
        self.events += 1
        if env.now < t:  # this close to t, t - now is exact and now + (t - now) is t
            yield env.timeout(t - env.now)
            self.events += 1

    def _to_boundary(self, batch: Batch, elapsed: float):
        """Asked to give way ``elapsed`` seconds into the iteration: run to the next
        preemptible boundary and return True there, or to the end and return False."""
        env, plan = self.env, batch.plan
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
            if boundary in allowed and self.sched.should_preempt(self.env.now):
                return True
        return False

    # ------------------------------------------------------------------------------------ run
    def start(self, arrivals: bool = True) -> simpy.Process:
        """Register the processes (the arrival process only when this simulation replays its
        own requests) and return the executor's."""
        if arrivals:
            self.upcoming = Upcoming()
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
