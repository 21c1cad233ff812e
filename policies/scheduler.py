"""The scheduler state machine that both executors drive.

Pure Python: queues, the running batch, suspended batches, KV accounting. A Policy plug-in
decides which batch runs next and whether the running batch should give way.

The executor contract (simulator and real engine alike)::

    sched.arrive(request, now)                 # for each arrival
    batch = sched.next_batch(now)              # when idle; None: wait for an arrival
    # run batch's iteration from batch.cursor; at every boundary the policy's granularity
    # allows (``sched.preemptible``), if sched.should_preempt(now): set batch.cursor, call
    sched.preempt(now)                         # the batch is suspended, keeping its plan
    partner = sched.merge_partner()            # when a batch starts or resumes; None: no merge
    # run batch's iteration up to partner.cursor, then (unless preempted before)
    batch = sched.merge(partner, now)          # one batch of both continues from that cursor
    finished = sched.complete_iteration(now)   # at the end of the iteration

Memory is a component (policies/memory.py) the scheduler asks: can this sequence be admitted
(``take_prefill``), can it grow (before every fresh decode batch runs), what does freeing it
release. Under ``reserve`` (TGI) a sequence reserves prompt + output tokens on admission, so a
running batch never runs out of KV cache. Under ``paged`` (vLLM, SGLang) blocks are allocated
as tokens are written; when a sequence of a new decode batch cannot grow, the policy names a
victim (``Policy.victim``) and the scheduler preempts it (``evict``): it goes back to the front
of its waiting queue (the back for a policy whose ``requeue_front`` is False) with its generated
tokens kept. The memory model says how: by recompute (its blocks are freed, its next prefill
recomputes prompt + generated tokens) or by swap (its written KV goes to host memory and comes
back when it is admitted again, its next prefill feeds only the token whose KV was not written
yet); the KV tokens swapped are charged to the next fresh batch (``Batch.swap_tokens``), whose
executor pays the copy time. A request whose largest footprint exceeds the capacity is refused
on arrival. A suspended batch also holds its saved activations (hidden states, routing and
partial expert outputs), charged as ``activation_tokens_per_token`` KV-token equivalents per
token in flight; a policy does not preempt when that charge does not fit. Sequences of a
suspended batch are never victims of a growth shortage.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from policies.core import BE, LS, Batch, Granularity, Phase, Request, Sequence
from policies.memory import Memory, ReserveMemory


class CapacityError(ValueError):
    """A request can never fit; ``key`` names the limit it exceeds (None: the KV cache, whose
    key the executor knows)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def cap(key: str, value: int | None) -> float:
    """A limit given as an integer >= 1, or None for none; None becomes infinity, so the
    policies' arithmetic (room = cap - used) needs no special case."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value}: must be an integer >= 1, or null for no cap")
    return value


class Policy:
    """Base class of scheduling policies. Subclasses override ``select``.

    A policy is small: it reads the scheduler's queues, takes sequences out of them with the
    scheduler's helpers and returns the batch to run.
    """

    name = "base"
    granularity = Granularity.ITERATION
    # whether ``decode_run`` also holds under memory that grows (paged): the selection reads
    # memory only through admissions, which fail the more surely the fuller the cache (free
    # memory only shrinks during a run). The scheduler then cuts the run before the first
    # iteration whose blocks would not fit, and after a selection that evicted.
    decode_run_grows = False
    # where a sequence preempted for memory goes back: the front of its waiting queue (vLLM,
    # TGI), or its back (False: SGLang re-queues behind the requests already waiting)
    requeue_front = True

    def __init__(
        self, max_batch_size: int | None = 32, max_batch_prefill_tokens: int = 4096
    ) -> None:
        if max_batch_prefill_tokens < 1:
            raise ValueError("max_batch_prefill_tokens must be >= 1")
        # None (TGI's default: no cap, memory bounds the batch) is kept as infinity
        self.max_batch_size = cap("max_batch_size", max_batch_size)
        self.max_batch_prefill_tokens = max_batch_prefill_tokens

    def select(self, s: Scheduler, now: float) -> Batch | None:
        raise NotImplementedError

    def wants_preempt(self, s: Scheduler, running: Batch, now: float) -> bool:
        """Asked only at boundaries finer than an iteration (``now``: the boundary's time);
        False keeps the batch running."""
        return False

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        """Hook called after every completed iteration."""

    def make_room(self, s: Scheduler, tokens: int, now: float) -> None:
        """Hook called when the running batch is suspended, before its saved activations
        (``tokens``) are charged: a policy that evicts work for what it preempts for frees
        the memory here, so that memory in use never exceeds the capacity."""

    def merge_partner(self, s: Scheduler, running: Batch) -> Batch | None:
        """A suspended batch whose cursor lies ahead of the running batch's, for the running
        batch to merge with when it gets there (``Scheduler.merge``); None (the default):
        the running batch runs on alone."""
        return None

    def decode_run(self, s: Scheduler, batch: Batch) -> float:
        """Iterations in a row, this one included, for which ``select`` would return this very
        decode batch (its sequences, in its order) if nothing happened but their decoding: no
        arrival, no sequence finishing, no change of memory. The scheduler has checked that the
        batch holds every decode-ready sequence, so before each of them the queues are as they
        were before this one. The simulator fast-forwards such runs; 1 (the default) never
        does, so a policy must say what its choice depends on to be fast-forwarded."""
        return 1

    def decode_run_on_arrival(self, s: Scheduler, batch: Batch, seq: Sequence) -> float:
        """``seq`` arrived (it is in its waiting queue) while a fast-forwarded run of ``batch``
        was in progress: ``decode_run`` as if it had been waiting when the run's first
        iteration was selected (the policy's own state is still that of that moment, and the
        queues are, but for ``seq``). The run goes on when this is at least its length, so a
        policy that says so avoids a cut per arrival on an overloaded replica; 1 (the default)
        cuts the run at every arrival. Preemption inside an iteration is asked separately."""
        return 1

    def arrival_ends_run(self, s: Scheduler, batch: Batch, request: Request) -> bool:
        """Whether ``request``, the next to arrive, would likely end a fast-forwarded run of
        ``batch`` (just selected) if it arrived during it (``decode_run_on_arrival`` below
        the run's length): the simulator then plans the run only up to its arrival. A hint
        for speed only: any answer gives the same results. False (the default): plan the
        whole run."""
        return False

    def on_decodes(self, s: Scheduler, batch: Batch, ends_s: np.ndarray) -> None:
        """What ``on_complete`` does after each of ``len(ends_s)`` decode iterations of
        ``batch`` that finish no sequence (``Scheduler.advance_decodes``)."""
        for now in ends_s.tolist():
            self.on_complete(s, batch, now)

    def victim(self, s: Scheduler, batch: Batch) -> Sequence:
        """The sequence to preempt by recompute when one of ``batch`` cannot grow: by default
        vLLM V1's priority rule (vllm/v1/core/sched/scheduler.py, ``schedule``): the lowest
        priority (BE before LS), then the latest arrival, among the sequences holding KV
        outside suspended batches (``Scheduler.evictable``)."""
        return max(s.evictable(batch), key=priority_victim_key)


def priority_victim_key(q: Sequence) -> tuple:
    return (not q.is_ls, q.request.arrival_s, q.id)


def latest_arrival_victim(s: Scheduler, batch: Batch) -> Sequence:
    """A class-blind policy's growth victim (``Policy.victim``): the latest arrival among the
    evictable sequences, whatever its class (the last in FIFO order, as vLLM V1's ``fcfs``
    preempts the last request it admitted). Until 2026-12-05 ``fcfs`` and ``iteration`` took
    the default, class-aware rule under ``memory.model=paged``: a BE sequence was preempted
    before an LS one that arrived later, which favoured LS in policies documented (and
    compared) as class-blind."""
    return max(s.evictable(batch), key=ARRIVAL_ORDER)


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        kv_capacity_tokens: int,
        activation_tokens_per_token: float = 0.0,
        memory: Memory | None = None,
    ) -> None:
        """``memory``: the KV memory model (None: ``reserve`` over ``kv_capacity_tokens``);
        when given, its own capacity is the scheduler's."""
        self.memory = memory if memory is not None else ReserveMemory(kv_capacity_tokens)
        self.policy = policy
        self.kv_capacity_tokens = self.memory.capacity_tokens
        self.activation_tokens_per_token = activation_tokens_per_token
        self.waiting: dict[str, deque[Sequence]] = {LS: deque(), BE: deque()}  # prefill queues
        self.ready: dict[str, deque[Sequence]] = {LS: deque(), BE: deque()}  # decode queues
        self.prefilling: deque[Sequence] = deque()  # admitted, prefill chunked part of the way
        self.running: Batch | None = None
        self.suspended: list[Batch] = []
        self._held: dict[int, int] = {}  # batch id -> activation tokens held while suspended
        self.iterations = 0
        self.preemptions = 0
        self.recomputes = 0
        self.swaps = 0
        self.merges = 0
        self._admissions = itertools.count()
        self._evictions = itertools.count()
        self._in_system = 0  # arrived, not finished: routers ask at every arrival
        self._evicted = False  # whether the last next_batch preempted for memory
        self.step_kv_preemptions = 0  # kv_preemptions when the step being chosen began
        # a fast-forwarded run under growing memory: whether one is in progress, the KV tokens
        # each sequence of its batch holds in its first iteration (None: not counted yet) and
        # through which iteration its blocks are charged
        self._growth_run = False
        self._run_tokens: np.ndarray | None = None
        self._run_grown = 1

    # ----------------------------------------------------------------------------- executor API
    @property
    def granularity(self) -> Granularity:
        return self.policy.granularity

    @property
    def preemptible(self) -> bool:
        """Whether the executor must stop at boundaries inside an iteration to ask."""
        return self.policy.granularity > Granularity.ITERATION

    def arrive(self, request: Request, now: float) -> Sequence:
        seq = Sequence(request)
        need = self.memory.max_tokens(seq)
        if need > self.kv_capacity_tokens:
            raise CapacityError(
                f"request {request.id} needs {need} KV tokens, more than the "
                f"capacity of {self.kv_capacity_tokens}"
            )
        self.waiting[request.cls].append(seq)
        self._in_system += 1
        return seq

    def next_batch(self, now: float) -> Batch | None:
        if self.running is not None:
            raise RuntimeError("next_batch called while a batch is running")
        # (a policy reads whether this step has preempted: kv_preemptions against this)
        self.step_kv_preemptions = kv_preemptions = self.kv_preemptions
        while True:
            batch = self.policy.select(self, now)
            if batch is None:
                return None
            if batch in self.suspended:
                self.suspended.remove(batch)
                self.memory.release(self._held.pop(batch.id))
                break
            # a fresh decode batch grows; if all its sequences were preempted, select again
            if not self.memory.grows or batch.phase is Phase.PREFILL or self._grow(batch):
                batch.swap_tokens = self.memory.take_transfer_tokens()
                break
        self._evicted = self.kv_preemptions != kv_preemptions
        for seq in batch.sequences:
            if seq.scheduled_s is None:
                seq.scheduled_s = now
        self.running = batch
        return batch

    def should_preempt(self, now: float) -> bool:
        return self.running is not None and self.policy.wants_preempt(self, self.running, now)

    def preempt(self, now: float) -> Batch:
        batch = self._take_running()
        held = self.activation_tokens(batch)
        self.policy.make_room(self, held, now)
        self.memory.hold(held)
        self._held[batch.id] = held
        for seq in batch.sequences:
            seq.preemptions += 1
        self.suspended.append(batch)
        self.preemptions += 1
        return batch

    def merge_partner(self) -> Batch | None:
        """The suspended batch the running batch is to merge with once its cursor reaches that
        batch's cursor (the policy's choice), or None. Asked when a batch starts or resumes and
        again after each merge: the executor runs the batch to the partner's cursor, then calls
        ``merge``."""
        if self.running is None:
            return None
        partner = self.policy.merge_partner(self, self.running)
        if partner is not None and partner.cursor <= self.running.cursor:
            raise RuntimeError(f"merge partner {partner} is not ahead of {self.running}")
        return partner

    def merge(self, partner: Batch, now: float) -> Batch:
        """Merge the running batch with the suspended ``partner`` at the cursor both have
        reached: the batch of both sets of sequences runs on from there as the running batch
        (a new Batch, mixed when the phases differ). The partner's saved activations become
        live state again, so their memory charge is released as on a resume. The executor
        plans the rest of the iteration at the merged composition."""
        running = self._take_running()
        if partner not in self.suspended or partner.cursor != running.cursor:
            self.running = running
            raise RuntimeError(
                f"cannot merge {running} at cursor {running.cursor} with {partner} "
                f"at cursor {partner.cursor}: merges happen at equal cursors only"
            )
        self.suspended.remove(partner)
        self.memory.release(self._held.pop(partner.id))
        phase = running.phase if running.phase is partner.phase else Phase.MIXED
        self.running = Batch(running.sequences + partner.sequences, phase, cursor=running.cursor)
        self.merges += 1
        return self.running

    def complete_iteration(self, now: float) -> list[Sequence]:
        batch = self._take_running()
        batch.cursor = 0
        batch.plan = None
        finished = []
        ready = self.ready
        # a decode batch's sequences each have a token (no chunk, not evicted): the loop skips
        # what only a prefill needs (it runs once per token of every request)
        prefill = batch.phase is not Phase.DECODE
        for seq in batch.sequences:
            if prefill:
                if seq.chunk_tokens:  # a prefill chunk: a token only once the prefill is whole
                    seq.prefilled_tokens += seq.chunk_tokens
                    seq.chunk_tokens = 0
                    if seq.prefill_left_tokens:
                        self.prefilling.append(seq)
                        continue
                seq.prefilled_tokens = 0
                seq.evicted = False
                if seq.first_token_s is None:
                    seq.first_token_s = now
            seq.generated = generated = seq.generated + 1
            last = seq.last_token_s  # seq.record_token(now), inlined
            if last is not None:
                seq.token_gaps_s.append(now - last)
            seq.last_token_s = now
            request = seq.request
            if generated >= request.output_tokens:  # seq.done
                seq.finish_s = now
                self.memory.free(seq)
                finished.append(seq)
                self._in_system -= 1
            else:
                ready[request.cls].append(seq)
        self.iterations += 1
        self.policy.on_complete(self, batch, now)
        return finished

    def decode_run(self, batch: Batch) -> int:
        """How many iterations of the batch just selected, this one included, are certain to
        run one after another unless a request arrives: the policy's ``decode_run``, up to the
        first that finishes a sequence. 1 unless the batch is a fresh decode batch of every
        decode-ready sequence, with no chunked prefill pending. Under paged memory also 1
        unless the policy's ``decode_run_grows`` and its selection preempted nothing (an
        evicted sequence at the head of its queue may be admitted next); else up to the
        iteration before the first whose blocks would not fit (stepping would preempt there).
        """
        self._growth_run, self._run_tokens = False, None
        grows = self.memory.grows
        if (
            batch.phase is not Phase.DECODE
            or batch.cursor
            or self.ready[LS]
            or self.ready[BE]
            or self.prefilling
            or (grows and (not self.policy.decode_run_grows or self._evicted))
        ):
            return 1
        runs = self.policy.decode_run(self, batch)  # first: often 1, and the cheaper
        if runs <= 1:
            return 1
        left = min([q.request.output_tokens - q.generated for q in batch.sequences])
        if left <= 1:
            return 1
        n = int(min(left, runs))
        return self._blocks_run(batch, n) if grows and n > 1 else n

    def _blocks_run(self, batch: Batch, n: int) -> int:
        """The first ``n`` iterations of the run, up to the last whose new blocks fit: a
        sequence holding T tokens' blocks in the first iteration needs one more block in
        iteration i when T + i - 2 is a multiple of the block size, first in iteration
        2 + (-T) mod block. When even ceil((n - 1) / block) new blocks each fit, the
        sequences are not counted (until ``grow_run`` needs them: most runs are cut early)."""
        block = self.memory.block_size_tokens
        free_blocks = (self.memory.capacity_tokens - self.memory.used_tokens) // block
        if batch.size * -(-(n - 1) // block) <= free_blocks:
            self._growth_run, self._run_grown = True, 1
            return n
        tokens = _run_tokens(batch)
        first = 2 + (-tokens) % block

        def fits(i: int) -> bool:  # the new blocks of iterations 2..i together
            return int(np.maximum(0, (i - first) // block + 1).sum()) <= free_blocks

        if not fits(n):
            lo, hi = 1, n  # fits(lo), not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            n = lo
        if n > 1:
            self._growth_run, self._run_tokens, self._run_grown = True, tokens, 1
        return n

    def grow_run(self, batch: Batch, iterations: int) -> None:
        """Charge the blocks that the fast-forwarded run of ``batch`` allocates through its
        ``iterations``-th iteration (each at its selection, as stepping does), those not
        charged yet: for a reader of memory (an arrival, a router) during the run, and for
        ``advance_decodes``. Nothing outside a run under growing memory. Memory only grows in
        a run, so the peak is the last total, as stepping's."""
        if not self._growth_run or iterations <= self._run_grown:
            return
        if self._run_tokens is None:  # the run's sequences have not decoded yet
            self._run_tokens = _run_tokens(batch)
        tokens = self._run_tokens
        block = self.memory.block_size_tokens
        before = -(-(tokens + (self._run_grown - 1)) // block)
        new = -(-(tokens + (iterations - 1)) // block) - before
        self._run_grown = iterations
        seqs = batch.sequences
        for k in np.flatnonzero(new).tolist():
            self.memory.add_blocks(seqs[k], int(new[k]))

    def decode_run_on_arrival(self, seq: Sequence) -> float:
        """While a fast-forwarded run of the running batch is in progress, ``seq`` arrived:
        for how many iterations from the run's first the policy still selects the batch."""
        return self.policy.decode_run_on_arrival(self, self.running, seq)

    def advance_decodes(self, batch: Batch, ends_s: np.ndarray) -> None:
        """Apply ``len(ends_s)`` decode iterations of the running batch, ending at ``ends_s``,
        that finish no sequence, as as many ``complete_iteration`` and ``next_batch`` calls
        would (the batch stays running): every sequence's tokens, with the same float32 gaps,
        and under growing memory the blocks of the iterations up to the next one."""
        k = len(ends_s)
        if self._growth_run:
            self.grow_run(batch, k + 1)
            self._growth_run, self._run_tokens = False, None
        gaps = (ends_s[1:] - ends_s[:-1]).astype(np.float32).tobytes()  # np.diff, faster
        first, last = float(ends_s[0]), float(ends_s[-1])
        for seq in batch.sequences:
            seq.token_gaps_s.append(first - seq.last_token_s)
            seq.token_gaps_s.frombytes(gaps)
            seq.last_token_s = last
            seq.generated += k
        self.iterations += k
        self.policy.on_decodes(self, batch, ends_s)

    @property
    def idle(self) -> bool:
        return self.running is None

    @property
    def in_system(self) -> int:
        """Requests arrived and not finished: waiting, ready, prefilling, running or
        suspended (a sequence leaves the system only by finishing)."""
        return self._in_system

    # ------------------------------------------------------------------------- policy helpers
    def waiting_fifo(self, classes: Iterable[str] = (LS, BE)) -> Iterator[Sequence]:
        """Waiting prefills of the given classes, oldest arrival first."""
        queues = [q for c in classes if (q := self.waiting[c])]
        if len(queues) == 1:  # each queue is in arrival order: one needs no merge
            return iter(queues[0])
        if len(queues) == 2:  # LS and BE: asked several times per iteration
            return _merge2(*queues)
        return heapq.merge(*queues, key=ARRIVAL_ORDER)

    @property
    def kv_used_tokens(self) -> int:
        return self.memory.used_tokens

    @property
    def peak_kv_used_tokens(self) -> int:
        return self.memory.peak_used_tokens

    def fits(self, tokens: int) -> bool:
        """Whether an admission charge of ``tokens`` fits."""
        return self.memory.fits(tokens)

    def evictable(self, batch: Batch | None = None) -> Iterator[Sequence]:
        """Sequences holding KV that a recompute may preempt: those of ``batch`` (being formed,
        not yet run), the decode-ready ones and chunked prefills between chunks; not those of
        suspended batches."""
        members = batch.sequences if batch is not None else ()
        return itertools.chain(members, self.ready[LS], self.ready[BE], self.prefilling)

    def held_tokens(self, what: Sequence | Batch) -> int:
        """What evicting a sequence, or a suspended batch, would free."""
        if isinstance(what, Sequence):
            return self.memory.held_tokens(what)
        held = sum(self.memory.held_tokens(q) for q in what.sequences)
        return held + self._held.get(what.id, 0)

    @property
    def kv_preemptions(self) -> int:
        return self.recomputes + self.swaps

    def evict(self, seq: Sequence) -> None:
        """Preempt ``seq`` for memory and put it back in its waiting queue (at the front, or
        at the back when the policy's ``requeue_front`` is False), its generated tokens kept:
        by swap when the memory model swaps it out (its written KV survives on host, its next
        prefill feeds the rest), else by recompute (its KV is freed, its next prefill
        recomputes prompt + generated tokens). The caller has taken it out of the batch or
        queue it was in."""
        context = seq.context_tokens
        if self.memory.swap_out(seq):
            seq.prefilled_tokens = context
            seq.swaps += 1
            self.swaps += 1
        else:
            self.memory.free(seq)
            seq.prefilled_tokens = 0
            seq.recomputes += 1
            self.recomputes += 1
        seq.chunk_tokens = 0
        seq.evicted = True
        seq.eviction = next(self._evictions)
        if self.policy.requeue_front:
            self.waiting[seq.cls].appendleft(seq)
        else:
            self.waiting[seq.cls].append(seq)

    def evict_ready(self, seq: Sequence) -> None:
        self.ready[seq.cls].remove(seq)
        self.evict(seq)

    def evict_suspended(self, batch: Batch) -> None:
        """Drop a suspended batch: its activations and its sequences' KV are freed; the work of
        its unfinished iteration is lost with them."""
        self.suspended.remove(batch)
        self.memory.release(self._held.pop(batch.id))
        for seq in reversed(batch.sequences) if self.policy.requeue_front else batch.sequences:
            self.evict(seq)

    def _grow(self, batch: Batch) -> bool:
        """Charge what each sequence of a fresh decode (or mixed) batch writes; when one cannot
        grow, preempt the policy's victims by recompute until it can (or it is the victim).
        Returns whether any sequence is left to run."""
        gone: set[int] = set()
        try_grow = self.memory.try_grow
        for seq in list(batch.sequences):
            if seq.id in gone:
                continue
            while not try_grow(seq):
                victim = self.policy.victim(self, batch)
                if victim in batch.sequences:
                    batch.sequences.remove(victim)
                elif victim in self.prefilling:
                    self.prefilling.remove(victim)
                else:
                    self.ready[victim.cls].remove(victim)
                gone.add(victim.id)
                self.evict(victim)
                if victim is seq:
                    break
        return bool(batch.sequences)

    def activation_tokens(self, batch: Batch) -> int:
        return math.ceil(batch.new_tokens * self.activation_tokens_per_token)

    def take_prefill(
        self,
        candidates: Iterable[Sequence],
        max_seqs: int,
        token_budget: int,
        dry_run: bool = False,
        alone_if_oversized: bool = True,
        max_reserved_tokens: float = math.inf,
    ) -> list[Sequence]:
        """Admit candidates in order while the batch size, the prefill token budget and the KV
        cache allow; stop at the first that does not fit (no overtaking). A single prompt larger
        than the budget is admitted alone (unless ``alone_if_oversized`` is False, for filling a
        batch that has other members), so it cannot block its queue forever.
        ``max_reserved_tokens`` caps the KV the admitted reserve together (a policy's own token
        budget, such as TGI's max_batch_total_tokens, below the cache's capacity)."""
        taken: list[Sequence] = []
        tokens = 0
        reserved = 0
        admit_tokens, fits = self.memory.admit_tokens, self.memory.fits
        for seq in candidates:
            if len(taken) >= max_seqs:
                break
            n = seq.new_tokens
            if tokens + n > token_budget and (taken or not alone_if_oversized):
                break
            charge = admit_tokens(seq)
            need = reserved + charge
            if need > max_reserved_tokens or not fits(need):
                break
            taken.append(seq)
            tokens += n
            reserved += charge
        if not dry_run:
            self.take(taken)
        return taken

    def take(self, seqs: list[Sequence]) -> None:
        """Take these waiting sequences out of their queues and admit them (what a dry run of
        ``take_prefill`` returned, when nothing has changed since)."""
        for seq in seqs:
            self.waiting[seq.cls].remove(seq)
            self.admit(seq)

    def admit(self, seq: Sequence) -> None:
        """Charge a sequence taken out of its waiting queue (by ``take_prefill`` or a policy
        that picks its own)."""
        self.memory.admit(seq)
        seq.admission = next(self._admissions)

    def take_ready(self, cls: str, max_seqs: int) -> list[Sequence]:
        queue = self.ready[cls]
        if max_seqs >= len(queue):  # all of them (the usual case): one copy, not a pop each
            taken = list(queue)
            queue.clear()
            return taken
        return [queue.popleft() for _ in range(max_seqs)]

    # ------------------------------------------------------------------------------ internals
    def _take_running(self) -> Batch:
        if self.running is None:
            raise RuntimeError("no batch is running")
        batch, self.running = self.running, None
        return batch


# (arrival, id): the order of the waiting queues, oldest first (ids break ties)
ARRIVAL_ORDER = operator.attrgetter("request.arrival_s", "request.id")


def _merge2(a: deque[Sequence], b: deque[Sequence]) -> Iterator[Sequence]:
    """``heapq.merge(a, b, key=ARRIVAL_ORDER)`` of two non-empty queues in arrival order (the
    keys, which hold the ids, are unique), with less to set up: callers mostly read a few."""
    ia, ib = iter(a), iter(b)
    x, y = next(ia), next(ib)
    kx, ky = ARRIVAL_ORDER(x), ARRIVAL_ORDER(y)
    while True:
        if ky < kx:  # x is always the head to yield next
            x, y, kx, ky, ia, ib = y, x, ky, kx, ib, ia
        yield x
        x = next(ia, None)
        if x is None:
            yield y
            yield from ib
            return
        kx = ARRIVAL_ORDER(x)


def _run_tokens(batch: Batch) -> np.ndarray:
    """The KV tokens each sequence of a decode batch holds in its next iteration."""
    return np.fromiter((q.request.prompt_tokens + q.generated for q in batch.sequences),
                       np.int64, len(batch.sequences))  # fmt: skip


def prefill_batch(seqs: list[Sequence]) -> Batch | None:
    return Batch(seqs, Phase.PREFILL) if seqs else None


def decode_batch(seqs: list[Sequence]) -> Batch | None:
    return Batch(seqs, Phase.DECODE) if seqs else None
