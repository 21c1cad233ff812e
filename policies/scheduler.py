"""The scheduler state machine that both executors drive.

Pure Python: queues, the running batch, suspended batches, KV accounting. A Policy plug-in
decides which batch runs next and whether the running batch should give way.

The executor contract (simulator and real engine alike)::

    sched.arrive(request, now)                 # for each arrival
    batch = sched.next_batch(now)              # when idle; None: wait for an arrival
    # run batch's iteration from batch.cursor; at every boundary the policy's granularity
    # allows (``sched.preemptible``), if sched.should_preempt(): set batch.cursor and call
    sched.preempt(now)                         # the batch is suspended, keeping its plan
    finished = sched.complete_iteration(now)   # at the end of the iteration

Memory: every sequence reserves prompt + output tokens of KV cache when it is admitted to a
prefill batch (TGI's ``max_new_tokens`` reservation), so a running batch never runs out of KV
cache and nothing is ever evicted or recomputed. A request whose reservation does not fit waits
in its queue. A suspended batch also holds its saved activations (hidden states, routing and
partial expert outputs), charged as ``activation_tokens_per_token`` KV-token equivalents per
token in flight; a policy does not preempt when that charge does not fit.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator

from policies.core import BE, LS, Batch, Granularity, Phase, Request, Sequence


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

    def wants_preempt(self, s: Scheduler, running: Batch) -> bool:
        """Asked only at boundaries finer than an iteration; False keeps the batch running."""
        return False

    def on_complete(self, s: Scheduler, batch: Batch, now: float) -> None:
        """Hook called after every completed iteration."""


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        kv_capacity_tokens: int,
        activation_tokens_per_token: float = 0.0,
    ) -> None:
        if kv_capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be >= 1")
        self.policy = policy
        self.kv_capacity_tokens = kv_capacity_tokens
        self.activation_tokens_per_token = activation_tokens_per_token
        self.waiting: dict[str, deque[Sequence]] = {LS: deque(), BE: deque()}  # prefill queues
        self.ready: dict[str, deque[Sequence]] = {LS: deque(), BE: deque()}  # decode queues
        self.running: Batch | None = None
        self.suspended: list[Batch] = []
        self.kv_used_tokens = 0
        self.peak_kv_used_tokens = 0
        self._held: dict[int, int] = {}  # batch id -> activation tokens held while suspended
        self.iterations = 0
        self.preemptions = 0

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
        if seq.reserved_tokens > self.kv_capacity_tokens:
            raise CapacityError(
                f"request {request.id} needs {seq.reserved_tokens} KV tokens, more than the "
                f"capacity of {self.kv_capacity_tokens}"
            )
        self.waiting[request.cls].append(seq)
        return seq

    def next_batch(self, now: float) -> Batch | None:
        if self.running is not None:
            raise RuntimeError("next_batch called while a batch is running")
        batch = self.policy.select(self, now)
        if batch is None:
            return None
        if batch in self.suspended:
            self.suspended.remove(batch)
            self._release(self._held.pop(batch.id))
        for seq in batch.sequences:
            if seq.scheduled_s is None:
                seq.scheduled_s = now
        self.running = batch
        return batch

    def should_preempt(self) -> bool:
        return self.running is not None and self.policy.wants_preempt(self, self.running)

    def preempt(self, now: float) -> Batch:
        batch = self._take_running()
        held = self.activation_tokens(batch)
        self._reserve(held)
        self._held[batch.id] = held
        for seq in batch.sequences:
            seq.preemptions += 1
        self.suspended.append(batch)
        self.preemptions += 1
        return batch

    def complete_iteration(self, now: float) -> list[Sequence]:
        batch = self._take_running()
        batch.cursor = 0
        batch.plan = None
        finished = []
        for seq in batch.sequences:
            seq.generated += 1
            seq.record_token(now)
            if seq.first_token_s is None:
                seq.first_token_s = now
            if seq.done:
                seq.finish_s = now
                self._release(seq.reserved_tokens)
                finished.append(seq)
            else:
                self.ready[seq.cls].append(seq)
        self.iterations += 1
        self.policy.on_complete(self, batch, now)
        return finished

    @property
    def idle(self) -> bool:
        return self.running is None

    @property
    def in_system(self) -> int:
        n = sum(len(q) for q in self.waiting.values()) + sum(len(q) for q in self.ready.values())
        n += sum(b.size for b in self.suspended)
        return n + (self.running.size if self.running else 0)

    # ------------------------------------------------------------------------- policy helpers
    def waiting_fifo(self, classes: Iterable[str] = (LS, BE)) -> Iterator[Sequence]:
        """Waiting prefills of the given classes, oldest arrival first."""
        queues = [self.waiting[c] for c in classes]
        return heapq.merge(*queues, key=lambda s: (s.request.arrival_s, s.id))

    def fits(self, tokens: int) -> bool:
        return self.kv_used_tokens + tokens <= self.kv_capacity_tokens

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
        for seq in candidates:
            if len(taken) >= max_seqs:
                break
            n = seq.request.prompt_tokens
            if tokens + n > token_budget and (taken or not alone_if_oversized):
                break
            need = reserved + seq.reserved_tokens
            if need > max_reserved_tokens or not self.fits(need):
                break
            taken.append(seq)
            tokens += n
            reserved += seq.reserved_tokens
        if not dry_run:
            for seq in taken:
                self.waiting[seq.cls].remove(seq)
                self._reserve(seq.reserved_tokens)
        return taken

    def take_ready(self, cls: str, max_seqs: int) -> list[Sequence]:
        queue = self.ready[cls]
        return [queue.popleft() for _ in range(min(max_seqs, len(queue)))]

    # ------------------------------------------------------------------------------ internals
    def _take_running(self) -> Batch:
        if self.running is None:
            raise RuntimeError("no batch is running")
        batch, self.running = self.running, None
        return batch

    def _reserve(self, tokens: int) -> None:
        self.kv_used_tokens += tokens
        self.peak_kv_used_tokens = max(self.peak_kv_used_tokens, self.kv_used_tokens)

    def _release(self, tokens: int) -> None:
        self.kv_used_tokens -= tokens


def prefill_batch(seqs: list[Sequence]) -> Batch | None:
    return Batch(seqs, Phase.PREFILL) if seqs else None


def decode_batch(seqs: list[Sequence]) -> Batch | None:
    return Batch(seqs, Phase.DECODE) if seqs else None
