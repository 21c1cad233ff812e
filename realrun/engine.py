"""The torch executor: drives the shared Scheduler with a real Hugging Face MoE model.

The loop mirrors ``sim.engine`` step for step, with the ``ModelRunner`` in place of the
latency model:

- arrivals are admitted (``sched.arrive``) once the clock has passed their arrival time: when
  idle, the engine sleeps until the next one; while a batch runs, it polls at every boundary
  the policy's granularity allows (``sim.latency.preemptible_boundaries``, the same list the
  simulator uses) and, when one has arrived, asks ``sched.should_preempt(now)``;
- a batch's ``plan`` is its runner ``IterationState`` (hidden states, routing, partial expert
  sums); a preempted batch keeps it, so a resumed batch continues from ``batch.cursor`` and
  recomputes nothing;
- every scheduler Sequence owns one ``KVSequence`` (its token ids and its KV cache) from
  arrival to finish; the runner appends the greedy token of each iteration, and a sequence
  stops after exactly its request's output tokens (no EOS);
- a sequence the scheduler preempted by recompute (``Sequence.evicted``) has its cache
  emptied before its next iteration, which then feeds prompt + generated tokens again; one it
  preempted by swap has its cache copied to CPU memory (``KVSequence.to_host``) as soon as
  the scheduler's decision returns, and back before its next iteration, which then feeds the
  one token whose KV was not written.
- a chunked prefill (``Sequence.chunk_tokens``, a mixed iteration's chunk) feeds that many
  tokens on top of its cached prefix; the runner yields its token with the last chunk, when
  the scheduler counts it too.

On CUDA, stage boundaries are host times: kernels run asynchronously, and the host waits for
the device only where the runner reads results back (each router's queue sizes, the tokens).

Every executed segment of an iteration (from its start or resume to its end or preemption) is
recorded in ``RealResult.segments`` with the batch's shape when its iteration was planned and
the idle time before it, so that ``qllm-validate`` can set each measured duration beside the
latency model's prediction for that very batch.
"""

from __future__ import annotations

import itertools
import time

try:
    import resource
except ImportError:  # not on Windows: page faults go uncounted
    resource = None
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.core import Batch, Request
from policies.core import Sequence as Seq
from policies.scheduler import Scheduler
from profiler.ops import KVSequence, ModelRunner
from profiler.probe import PROBE_AFTER_IDLE, SpeedProbe
from realrun.clock import CpuClock, VirtualClock, WallClock
from realrun.trace import ChromeTrace
from sim.latency import preemptible_boundaries


@dataclass
class Segment:
    """One executed segment of an iteration, as the engine measured it.

    ``shape`` is one (phase, new_tokens, context_tokens) per sequence, taken when the iteration
    was planned (a resumed segment carries its iteration's shape); ``idle_s`` is the time the
    engine had nothing to run just before the segment (0 when it came straight after another)."""

    batch: int
    phase: str
    shape: list[tuple[str, int, int]]
    start_cursor: int
    end_cursor: int
    start_s: float
    end_s: float
    idle_s: float
    preempted: bool
    merged: bool = False  # ended where it merged with a suspended batch (the rest runs merged)
    bound: bool = False  # its iteration's decode steps bound a new padded KV (a new batch)
    # minor page faults of the process while it ran (None where uncounted): host memory
    # mapped in mid-segment, in its measured time and in no profile term
    faults: int | None = None
    # requests the engine admitted in the host time just before it (while busy: not after an
    # idle gap, whose admissions are in idle_s), and during it (at a preemptible boundary)
    admitted: int = 0
    admitted_within: int = 0

    @property
    def measured_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RealResult:
    sequences: list[Seq]
    tokens: dict[int, list[int]]  # request id -> generated token ids
    makespan_s: float
    stages: int  # stages executed (the real engine's "events")
    wall_s: float
    iterations: int
    preemptions: int
    peak_kv_used_tokens: int
    segments: list[Segment]
    # minor page faults of the process while the engine ran (None where uncounted): host
    # memory mapped in mid-run, a cost in the measured times that no profile has
    page_faults: int | None = None
    # the host-speed probe's seconds, each time it ran during this run (none without a probe)
    probes: list[float] = dataclasses.field(default_factory=list)


def minor_faults() -> int | None:
    """This process's minor page faults so far (None where ``resource`` is missing)."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class RealEngine:
    def __init__(
        self,
        requests: Sequence[Request],
        prompts: dict[int, list[int]],
        scheduler: Scheduler,
        runner: ModelRunner,
        clock: WallClock | CpuClock | VirtualClock | None = None,
        trace: ChromeTrace | None = None,
        on_finish: Callable[[Seq], None] | None = None,
        probe: SpeedProbe | None = None,
    ) -> None:
        missing = [r.id for r in requests if len(prompts.get(r.id, ())) != r.prompt_tokens]
        if missing:
            raise ValueError(f"requests {missing[:5]} have no prompt of their prompt_tokens")
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.prompts = prompts
        self.sched = scheduler
        self.runner = runner
        self.clock = clock or WallClock()
        self.trace = trace
        self.on_finish = on_finish
        # the host-speed probe (profiler.probe): run between iterations, every probe.every_s
        # of the run's work, PROBE_AFTER_IDLE segments or more after an idle gap, its time
        # left out of the run's clock
        self.probe = probe
        self.probes: list[float] = []
        self._busy_segments = 0  # segments since the engine was last idle
        self.allowed = frozenset(preemptible_boundaries(
            runner.num_layers, runner.stages_per_layer, scheduler.granularity))  # fmt: skip
        self.kv: dict[int, KVSequence] = {}
        self.sequences: list[Seq] = []
        self.tokens: dict[int, list[int]] = {}
        self.stages = 0
        self.segments: list[Segment] = []
        self._shapes: dict[int, list[tuple[str, int, int]]] = {}  # batch id -> planned shape
        # when the engine last ran out of work (the clock's start); None while it has work
        self._idle_since: float | None = 0.0
        self._next = 0  # index of the next request to arrive
        self._swaps = 0  # the scheduler's swap count when swapped-out KV was last moved
        # requests admitted since the last segment ended while the engine had work, and within
        # the segment in progress (Segment.admitted, admitted_within); which of the two an
        # admission counts in (None: after an idle gap, in the next segment's idle_s)
        self._admitted = {"busy": 0, "within": 0}
        self._admitting: str | None = None

    # ----------------------------------------------------------------------------- arrivals
    def _admit(self, now: float) -> None:
        requests = self.requests
        while self._next < len(requests) and requests[self._next].arrival_s <= now:
            r = requests[self._next]
            self._next += 1
            if self._admitting is not None:
                self._admitted[self._admitting] += 1
            seq = self.sched.arrive(r, now)
            self.sequences.append(seq)
            # Sized once for every token it will hold: no KV buffer ever grows mid-run.
            capacity = r.prompt_tokens + r.output_tokens
            self.kv[r.id] = self.runner.new_sequence(self.prompts[r.id], seq, capacity)

    @property
    def _arrivals_done(self) -> bool:
        return self._next == len(self.requests)

    # ---------------------------------------------------------------------------------- run
    def run(self) -> RealResult:
        sched, clock = self.sched, self.clock
        faults = minor_faults()
        wall = time.perf_counter()
        clock.start()
        while True:
            self._admitting = "busy" if self._idle_since is None else None
            self._admit(clock.now())
            batch = sched.next_batch(clock.now())
            if sched.swaps != self._swaps:
                self._swap_out()
            if batch is None:
                if self._idle_since is None:
                    self._idle_since = clock.now()
                    self._busy_segments = 0
                if self._arrivals_done:
                    if sched.in_system:
                        raise RuntimeError(f"scheduler stalled with {sched.in_system} requests")
                    break
                clock.sleep_until(self.requests[self._next].arrival_s)
                continue
            if self.probe is None:
                self._execute(batch)
                continue
            start = clock.now()
            self._execute(batch)
            self.probe.work(clock.now() - start)
            if self.probe.due and self._busy_segments >= PROBE_AFTER_IDLE:
                start = clock.now()
                self.probes.append(self.probe.maybe())
                clock.exclude(clock.now() - start)
        return RealResult(
            sequences=self.sequences,
            tokens=self.tokens,
            makespan_s=clock.now(),
            stages=self.stages,
            wall_s=time.perf_counter() - wall,
            iterations=sched.iterations,
            preemptions=sched.preemptions,
            peak_kv_used_tokens=sched.peak_kv_used_tokens,
            segments=self.segments,
            page_faults=None if faults is None else minor_faults() - faults,
            probes=self.probes,
        )

    def _swap_out(self) -> None:
        """Move the KV of the sequences the scheduler has swapped out since the last call (now
        waiting with KV kept: ``prefilled_tokens``) to host memory."""
        self._swaps = self.sched.swaps
        for seq in itertools.chain(*self.sched.waiting.values()):
            kv = self.kv[seq.id]
            if seq.evicted and seq.prefilled_tokens and not kv.on_host:
                kv.to_host()

    def _execute(self, batch: Batch) -> None:
        """Run the batch's iteration from its cursor to the end, or to the first allowed
        boundary at which the policy wants the processor back.

        As the simulator does, the policy is asked only when a request has arrived: nothing
        else changes the scheduler's state while a batch runs."""
        sched, clock, runner, trace = self.sched, self.clock, self.runner, self.trace
        requests, allowed = self.requests, self.allowed
        state = batch.plan
        if state is None:
            kvs = [self.kv[s.id] for s in batch.sequences]
            for seq, kv in zip(batch.sequences, kvs, strict=True):
                if seq.evicted:  # its KV left: swapped back in, or freed (recompute)
                    if kv.on_host:
                        kv.to_device()
                    # a suspended batch's partial writes go: what the scheduler kept stays (a
                    # swapped sequence's KV, the chunks of a recomputation already fed)
                    kv.truncate(len(kv.token_ids), seq.context_tokens)
                if kv.num_cached != seq.context_tokens:
                    raise RuntimeError(f"sequence {seq.id}: {kv.num_cached} tokens cached, the "
                                       f"scheduler counts {seq.context_tokens}")  # fmt: skip
            state = runner.begin(kvs, [s.chunk_tokens for s in batch.sequences])
            batch.plan = state
            self._shapes[batch.id] = [(s.phase.value, s.new_tokens, s.context_tokens)
                                      for s in batch.sequences]  # fmt: skip
        stage_trace = trace is not None and trace.stages
        faults = minor_faults()  # read outside the segment's clock
        start = now = clock.now()
        start_cursor = state.cursor
        stages = 0
        self._admitting = "within"
        partner = sched.merge_partner()
        while not state.done:
            ref = runner.step(state)
            clock.tick()
            stages += 1
            before, now = now, clock.now()
            if stage_trace:  # the queue of the layer in progress is read after its expert ran
                tokens = state.queue_size(ref.expert) if ref.stage == "expert" else 0
                if tokens or ref.stage != "expert":
                    trace.stage(ref, batch, before, now, tokens)
            if (
                state.cursor in allowed
                and self._next < len(requests)
                and requests[self._next].arrival_s <= now
            ):
                self._admit(now)
                batch.cursor = state.cursor
                if sched.should_preempt(now):
                    self.stages += stages
                    self._record(batch, start_cursor, state.cursor, start, now, True, faults)
                    sched.preempt(now)
                    if trace is not None:
                        trace.segment(batch, start, now, preempted=True)
                    return
            if partner is not None and state.cursor == partner.cursor:  # the paper's merge
                batch.cursor = state.cursor
                self._record(batch, start_cursor, state.cursor, start, now, False, faults,
                             merged=True)  # fmt: skip
                faults = minor_faults()
                if trace is not None:
                    trace.segment(batch, start, now, preempted=False, merged=True)
                shape = self._shapes.pop(batch.id) + self._shapes.pop(partner.id)
                batch = sched.merge(partner, now)
                self._shapes[batch.id] = shape  # the merged batch's segment starts here
                start, start_cursor = now, state.cursor
                state = batch.plan = runner.merge(state, partner.plan)
                partner = sched.merge_partner()
        self.stages += stages
        self._record(batch, start_cursor, state.cursor, start, now, False, faults)
        self._shapes.pop(batch.id, None)
        if trace is not None:
            trace.segment(batch, start, now, preempted=False)
        for seq in sched.complete_iteration(now):
            self.tokens[seq.id] = self.kv.pop(seq.id).generated
            if trace is not None:
                trace.request(seq)
            if self.on_finish is not None:
                self.on_finish(seq)

    def _record(self, batch: Batch, start_cursor: int, end_cursor: int, start_s: float,
                end_s: float, preempted: bool, faults: int | None,
                merged: bool = False) -> None:  # fmt: skip
        """Files the segment; ``faults``: the process's minor faults when it started."""
        if faults is not None:
            faults = minor_faults() - faults
        idle_s = max(start_s - self._idle_since, 0.0) if self._idle_since is not None else 0.0
        self._idle_since = None  # busy until the scheduler next has nothing to run
        self._busy_segments += 1
        admitted = self._admitted
        self.segments.append(Segment(batch.id, batch.phase.value, self._shapes[batch.id],
                                     start_cursor, end_cursor, start_s, end_s, idle_s,
                                     preempted, merged, batch.plan.bound, faults,
                                     admitted["busy"], admitted["within"]))  # fmt: skip
        self._admitted = {"busy": 0, "within": 0}
        self._admitting = "within"  # until the loop admits again (a merge's segment goes on)
