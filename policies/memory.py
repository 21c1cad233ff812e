"""KV-cache memory models: what a sequence holds, and whether it may be admitted or grow.

The Scheduler asks the model; a policy chooses victims when the answer is no. Both models count
in tokens, so that a policy's arithmetic (room = capacity - used) reads the same under either.

- ``reserve`` (TGI): a sequence reserves prompt + every output token when it is admitted, so a
  running sequence never runs out of KV cache.
- ``paged`` (vLLM, SGLang): KV is allocated in blocks of ``block_size_tokens`` as a sequence's
  tokens are written; admission also keeps ``watermark`` of the capacity free, so the running
  sequences have room to grow (vLLM V0's block-manager watermark, 0.01; V1 keeps none:
  ``memory.watermark=0`` follows it). When a sequence cannot grow,
  the scheduler preempts one (see ``Scheduler.evict``), by ``preemption``: ``recompute`` (its
  blocks are freed) or ``swap`` (vLLM V0's swap preemption: the blocks of its written KV are
  copied to ``swap_capacity_tokens`` of host memory and back before it runs again; when the
  host space is full, or the sequence has no KV written yet, it is recomputed instead).
  The tokens copied either way are counted in ``transfer_tokens`` for the executor to cost.

A suspended batch's saved activations are charged as tokens (``hold``/``release``) under both.
"""

from __future__ import annotations

import math

from policies.core import Sequence


class Memory:
    """The interface the Scheduler calls. ``admit_tokens``/``admit`` charge a sequence taken
    from a waiting queue (a fresh prompt, or one re-prefilled after recompute); ``can_grow``/
    ``grow`` charge what a running sequence's next iteration writes; ``free`` releases all a
    sequence holds and returns it."""

    name = "base"
    grows = False  # whether running sequences need memory beyond their admission charge

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be >= 1")
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self.peak_used_tokens = 0
        self.admission_limit_tokens = capacity_tokens  # admission may not fill beyond this
        self.transfer_tokens = 0  # KV tokens swapped out or in since the executor last took them

    def max_tokens(self, seq: Sequence) -> int:
        """What the sequence holds at its largest (compared with the capacity on arrival)."""
        raise NotImplementedError

    def admit_tokens(self, seq: Sequence) -> int:
        raise NotImplementedError

    def admit(self, seq: Sequence) -> None:
        raise NotImplementedError

    def can_grow(self, seq: Sequence) -> bool:
        return True

    def grow(self, seq: Sequence) -> None:
        """Nothing to charge unless the model grows."""

    def try_grow(self, seq: Sequence) -> bool:
        """``can_grow``, and if so ``grow``, in one call."""
        return True

    def grow_tokens(self, seq: Sequence) -> int:
        """What ``grow`` would charge a running sequence for its next iteration."""
        return 0

    def free(self, seq: Sequence) -> int:
        raise NotImplementedError

    def swap_out(self, seq: Sequence) -> bool:
        """Move a preempted sequence's KV to host memory, if this model swaps and has room;
        False: the caller frees it (recompute)."""
        return False

    def take_transfer_tokens(self) -> int:
        """The KV tokens swapped since the last call (the iteration about to run pays them)."""
        tokens, self.transfer_tokens = self.transfer_tokens, 0
        return tokens

    def held_tokens(self, seq: Sequence) -> int:
        """What preempting an admitted sequence would free."""
        raise NotImplementedError

    def fits(self, tokens: int) -> bool:
        """Whether an admission charge of ``tokens`` fits (the watermark kept free)."""
        return self.used_tokens + tokens <= self.admission_limit_tokens

    def hold(self, tokens: int) -> None:
        self.used_tokens += tokens
        if self.used_tokens > self.peak_used_tokens:
            self.peak_used_tokens = self.used_tokens

    def release(self, tokens: int) -> None:
        self.used_tokens -= tokens


class ReserveMemory(Memory):
    """TGI's reservation: prompt + output tokens on admission, released on finish."""

    name = "reserve"

    def max_tokens(self, seq: Sequence) -> int:
        return seq.reserved_tokens

    def admit_tokens(self, seq: Sequence) -> int:
        return seq.reserved_tokens

    def admit(self, seq: Sequence) -> None:
        self.hold(seq.reserved_tokens)

    def free(self, seq: Sequence) -> int:
        self.release(seq.reserved_tokens)
        return seq.reserved_tokens

    def held_tokens(self, seq: Sequence) -> int:
        return seq.reserved_tokens


class PagedMemory(Memory):
    """Blocks of ``block_size_tokens`` allocated as a sequence's KV is written: before an
    iteration, a sequence holds the blocks for its context plus the tokens the iteration
    feeds (``context_tokens + new_tokens``)."""

    name = "paged"
    grows = True

    def __init__(
        self,
        capacity_tokens: int,
        block_size_tokens: int = 16,
        watermark: float = 0.01,
        preemption: str = "recompute",
        swap_capacity_tokens: int = 0,
    ) -> None:
        super().__init__(capacity_tokens)
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption={preemption}: must be one of {', '.join(PREEMPTIONS)}")
        if isinstance(swap_capacity_tokens, bool) or not isinstance(swap_capacity_tokens, int) \
                or swap_capacity_tokens < 0:  # fmt: skip
            raise ValueError(f"swap_capacity_tokens={swap_capacity_tokens}: must be an integer "
                             ">= 0")  # fmt: skip
        if isinstance(block_size_tokens, bool) or not isinstance(block_size_tokens, int):
            raise ValueError(f"block_size_tokens={block_size_tokens}: must be an integer >= 1")
        if not 1 <= block_size_tokens <= capacity_tokens:
            raise ValueError(
                f"block_size_tokens={block_size_tokens}: must be in [1, the KV capacity "
                f"{capacity_tokens}]"
            )
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark}: must be in [0, 1) (a fraction of blocks)")
        self.block_size_tokens = block_size_tokens
        self.num_blocks = capacity_tokens // block_size_tokens
        self.capacity_tokens = self.num_blocks * block_size_tokens  # a partial block is unusable
        self.watermark_blocks = math.ceil(watermark * self.num_blocks)
        self.admission_limit_tokens = (self.num_blocks - self.watermark_blocks) * block_size_tokens
        self.blocks: dict[int, int] = {}  # sequence id -> blocks it holds
        self.swap = preemption == "swap"
        self.swap_capacity_tokens = swap_capacity_tokens
        self.host_used_tokens = 0
        self.host_blocks: dict[int, int] = {}  # sequence id -> its blocks swapped out to host

    def _tokens(self, n_tokens: int) -> int:
        """Tokens' worth of whole blocks that hold ``n_tokens``."""
        return -(-n_tokens // self.block_size_tokens) * self.block_size_tokens

    def max_tokens(self, seq: Sequence) -> int:
        # with the watermark: a request alone must be admissible, again after a recompute,
        # and grow to its end; at most prompt + output - 1 tokens are written (the last
        # token's KV never is)
        spare = self.capacity_tokens - self.admission_limit_tokens
        return self._tokens(seq.reserved_tokens - 1) + spare

    def _need(self, seq: Sequence) -> int:
        held = self.blocks.get(seq.id, 0) * self.block_size_tokens
        return self._tokens(seq.context_tokens + seq.new_tokens) - held

    def admit_tokens(self, seq: Sequence) -> int:
        return self._need(seq)

    def admit(self, seq: Sequence) -> None:
        """A swapped-out sequence's blocks come back from host first (the ``admit_tokens``
        charge counts them: it holds no device block while swapped out)."""
        host = self.host_blocks.pop(seq.id, 0) * self.block_size_tokens
        if host:
            self.host_used_tokens -= host
            self.transfer_tokens += host
        self.grow(seq)

    def can_grow(self, seq: Sequence) -> bool:
        return self.used_tokens + self._need(seq) <= self.capacity_tokens

    def grow(self, seq: Sequence) -> None:
        need = self._need(seq)
        if need > 0:
            self.blocks[seq.id] = self.blocks.get(seq.id, 0) + need // self.block_size_tokens
            self.hold(need)

    def grow_tokens(self, seq: Sequence) -> int:
        return max(self._need(seq), 0)

    def add_blocks(self, seq: Sequence, blocks: int) -> None:
        """Charge ``blocks`` more blocks to a sequence that holds some (a fast-forwarded run's
        growth, ``Scheduler.grow_run``)."""
        self.blocks[seq.id] += blocks
        self.hold(blocks * self.block_size_tokens)

    def try_grow(self, seq: Sequence) -> bool:
        """``can_grow`` and ``grow`` with one count of the blocks, a decode's inlined: the
        scheduler asks for every sequence of every fresh decode batch."""
        if seq.generated == 0 or seq.evicted:
            tokens = seq.context_tokens + seq.new_tokens
        else:  # a decode: its context and the one token it feeds
            tokens = seq.request.prompt_tokens + seq.generated
        block = self.block_size_tokens
        blocks = -(-tokens // block)
        seq_id = seq.request.id
        held = self.blocks.get(seq_id, 0)
        need = (blocks - held) * block
        if self.used_tokens + need > self.capacity_tokens:
            return False
        if need > 0:
            self.blocks[seq_id] = blocks
            self.hold(need)
        return True

    def free(self, seq: Sequence) -> int:
        tokens = self.blocks.pop(seq.id, 0) * self.block_size_tokens
        self.release(tokens)
        return tokens

    def swap_out(self, seq: Sequence) -> bool:
        """The blocks of its context (the KV written before its next iteration; none for a
        prefill not begun) go to host; the blocks grown for the next iteration are freed."""
        kept = self._tokens(seq.context_tokens)
        if not self.swap or kept == 0 or self.host_used_tokens + kept > self.swap_capacity_tokens:
            return False
        self.release(self.blocks.pop(seq.id) * self.block_size_tokens)
        self.host_blocks[seq.id] = kept // self.block_size_tokens
        self.host_used_tokens += kept
        self.transfer_tokens += kept
        return True

    def held_tokens(self, seq: Sequence) -> int:
        return self.blocks.get(seq.id, 0) * self.block_size_tokens


PREEMPTIONS = ("recompute", "swap")

MODELS = {"reserve": ReserveMemory, "paged": PagedMemory}


def build_memory(
    model: str,
    capacity_tokens: int,
    block_size_tokens: int = 16,
    watermark: float = 0.01,
    preemption: str = "recompute",
    swap_capacity_tokens: int = 0,
) -> Memory:
    """A memory model by name; ValueError names the setting that is wrong."""
    if model == "reserve":
        if preemption != "recompute":
            raise ValueError(f"preemption={preemption}: needs memory.model=paged (a reserving "
                             "model never preempts for memory)")  # fmt: skip
        return ReserveMemory(capacity_tokens)
    if model == "paged":
        return PagedMemory(capacity_tokens, block_size_tokens, watermark, preemption,
                           swap_capacity_tokens)  # fmt: skip
    raise ValueError(f"model={model}: must be one of {', '.join(MODELS)}")
