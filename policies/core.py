"""The shared vocabulary of both executors: requests, sequences, batches, cursors.

Plain classes with no dependency beyond the standard library, so that the simulator and the real
engine hold the very same objects.
"""

from __future__ import annotations

import enum
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any

LS = "LS"  # latency-sensitive
BE = "BE"  # best-effort
CLASSES = (LS, BE)


class Granularity(enum.IntEnum):
    """Where a policy may take the processor away from the running batch (coarse to fine)."""

    REQUEST = 0  # a batch runs until all its sequences finish (static batching)
    ITERATION = 1  # decisions between iterations only (Orca, vLLM, TGI)
    ROUTER = 2  # after each layer's router, before its experts (the authors' public code)
    LAYER = 3  # also after each attention and router stage and at each layer's end
    EXPERT = 4  # also after every expert (per-expert queues, QLLM)


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # a batch only: decode tokens and prefill chunks in one iteration


class Stage(enum.IntEnum):
    """Stages inside one layer, in execution order."""

    ATTENTION = 0
    ROUTER = 1
    EXPERT = 2


@dataclass(frozen=True)
class Request:
    """One job as the workload describes it. ``output_tokens`` counts the first token too."""

    id: int
    cls: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    source: str = "synthetic"
    text: str | None = None  # prompt text, when the workload has one (the real engine uses it)

    def __post_init__(self) -> None:
        if self.cls not in CLASSES:
            raise ValueError(f"request {self.id}: class {self.cls!r} is not one of {CLASSES}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.id}: prompt and output need at least one token")


@dataclass(slots=True, weakref_slot=True)  # slots: read once per token
class Sequence:
    """A request's execution state, owned by the scheduler while it is in the system."""

    request: Request
    generated: int = 0  # tokens produced so far (the prefill produces the first)
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0  # times a batch holding it was suspended inside an iteration
    scheduled_s: float | None = None  # first time the sequence entered an executing batch
    recomputes: int = 0  # times its KV was freed, to be recomputed (paged memory's preemption)
    swaps: int = 0  # times its KV was swapped out to host memory (paged memory's other way)
    evicted: bool = False  # its KV left the device: the next iteration re-prefills what is not
    # in KV (prompt + generated after a recompute, the last generated token after a swap)
    admission: int = -1  # order of its latest admission from a waiting queue (vLLM's running)
    eviction: int = -1  # order of its latest eviction (vLLM V1 fcfs re-queues the latest first)
    prefilled_tokens: int = 0  # of its prefill (prompt + generated), in KV so far when chunked
    chunk_tokens: int = 0  # the next iteration's prefill chunk (0: all that remains)
    last_token_s: float | None = None
    # the gap before each token after the first (inter-token latency), float32: 4 bytes a token
    # rather than a list of times (32 bytes a token), since 1M requests x 500 tokens is common
    token_gaps_s: array = field(default_factory=lambda: array("f"))

    def record_token(self, now: float) -> None:
        """Note that a token was produced at ``now`` (``Scheduler.complete_iteration`` does it
        inline: it runs once per token)."""
        if self.last_token_s is not None:
            self.token_gaps_s.append(now - self.last_token_s)
        self.last_token_s = now

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def cls(self) -> str:
        return self.request.cls

    @property
    def is_ls(self) -> bool:
        return self.request.cls == LS

    @property
    def phase(self) -> Phase:
        return Phase.PREFILL if self.generated == 0 or self.evicted else Phase.DECODE

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV cache before the next iteration runs."""
        if self.generated == 0 or self.evicted:
            return self.prefilled_tokens
        return self.request.prompt_tokens + self.generated - 1

    @property
    def new_tokens(self) -> int:
        """Tokens the next iteration feeds through the model for this sequence: the prompt,
        plus the tokens generated before an eviction when it is recomputed (or the chunk of
        them a chunked prefill takes)."""
        if self.generated == 0 or self.evicted:
            return self.chunk_tokens or self.prefill_left_tokens
        return 1

    @property
    def prefill_left_tokens(self) -> int:
        """What its prefill still has to feed (meaningful in the prefill phase)."""
        return self.request.prompt_tokens + self.generated - self.prefilled_tokens

    @property
    def reserved_tokens(self) -> int:
        """KV tokens reserved on admission: prompt plus every token it will generate."""
        return self.request.prompt_tokens + self.request.output_tokens

    @property
    def done(self) -> bool:
        return self.generated >= self.request.output_tokens


_batch_ids = itertools.count()


@dataclass
class Batch:
    """Sequences that run one iteration together: all prefill, all decode, or mixed (decode
    tokens and prefill chunks, each sequence with its own ``new_tokens``).

    ``cursor`` is the number of stages of the current iteration already executed; the executor
    maps it to (layer, stage, expert). ``plan`` is the executor's private state for the
    iteration in progress (stage times in the simulator; hidden states, routing and partial
    expert outputs in the real engine); it survives a preemption, so a resumed batch loses no
    work.
    """

    sequences: list[Sequence]
    phase: Phase
    id: int = field(default_factory=lambda: next(_batch_ids))
    cursor: int = 0
    plan: Any = None
    swap_tokens: int = 0  # KV tokens copied between host and device before it runs

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("a batch needs at least one sequence")
        if self.phase is Phase.MIXED:
            return
        decode = self.phase is Phase.DECODE  # Sequence.phase, inlined: once per token
        wrong = [s.id for s in self.sequences if (s.generated == 0 or s.evicted) is decode]
        if wrong:
            raise ValueError(f"sequences {wrong} are not in phase {self.phase.value}")

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def new_tokens(self) -> int:
        if self.phase is Phase.DECODE:  # one token each (the phase was checked on creation)
            return len(self.sequences)
        return sum(s.new_tokens for s in self.sequences)

    @property
    def has_ls(self) -> bool:
        return any(s.is_ls for s in self.sequences)

    def __repr__(self) -> str:
        ids = ",".join(str(s.id) for s in self.sequences[:6])
        more = "..." if self.size > 6 else ""
        return f"Batch#{self.id}({self.phase.value}, n={self.size}, ids={ids}{more})"
