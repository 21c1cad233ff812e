"""The stepped model executor shared by the profiler and the real engine.

An iteration of a batch runs as a flat list of stages, the same list ``sim.latency.Plan``
times::

    index 0                      prepare: embeddings, positions, rotary tables, masks
    1 + l*(2+E) + 0              attention(l): input norm + self-attention + residual
    1 + l*(2+E) + 1              router(l): post-attention norm + gate + per-expert queues
                                 (+ the shared expert, or the whole MLP of a dense layer)
    1 + l*(2+E) + 2 + e          expert(l, e): expert e's FFN on its queue
    1 + L*(2+E)                  lm_head: final norm + lm_head + greedy token per sequence

All of an iteration's intermediate results live in an ``IterationState`` (the residual
stream, the per-expert queues with their gathered inputs and routing weights, the experts that
ran having written their outputs over their inputs), so the iteration can stop at any boundary
and resume later without recomputing anything: the preemption points. Sequences keep their KV
caches between iterations.

The layer's combine (residual + the experts' outputs, weighted and scatter-added + shared
expert) has no stage of its own: it runs at the start of the next stage that reads the residual
stream (the next layer's attention or the lm_head), so the flat list above needs no extra
index. Weighting and scatter-adding all experts' outputs there, in one op each, costs a
stepped layer 3 x E fewer small ops than doing it expert by expert.

Every sequence owns its KV cache (a ``DynamicCache`` of ``GrowingLayer``s): sequences join and
leave batches freely. A sequence feeds its uncached tokens, or only a chunk of them (chunked
prefill: ``begin``'s ``chunk_tokens``) on top of its cached prefix; a chunk that leaves tokens
uncached produces no token. One iteration may mix decode steps and prefill chunks.
A sequence feeding several tokens runs its attention on its own (pad-free, over its cached
prefix and causal within the chunk: the profile's ``attn_prefill`` and ``attn_chunk`` are per
sequence); the sequences feeding one token each (decode steps) run theirs once for all of
them, on one right-padded buffer per layer that holds their caches as rows (``_PaddedKV``,
kept while the same sequences decode on).
Norms, router, experts and lm_head always run once on all the batch's tokens. The model's own
modules do the work (norms, attention, gate, expert weights), so the runner matches
``model.generate`` token for token. No layer issues a tensor op per sequence in decode, and
each router reads the device once (its queue sizes).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import platform
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask

from policies.core import Stage


class RunnerError(ValueError):
    """The runner cannot execute this model or batch."""


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# Reserved host memory is kept below glibc's trim threshold (an int), or it would go back.
MAX_RESERVE_BYTES = 2**30


@functools.cache
def retain_freed_memory() -> bool:
    """Keep the host memory that tensors free in this process's heap, for the next tensors
    (glibc; False elsewhere, where nothing changes).

    By default glibc maps each block above its mmap threshold (128 KiB, rising as such blocks
    are freed) fresh from the OS and hands it back when freed: the next block of that size is
    page-faulted in again, page by page. The first decode step of every new batch allocates
    its padded KV buffer, so in the real engine each one paid that: about 2,400 minor faults,
    +4-5 ms (+60%) on a 32-sequence step of tiny-olmoe on a 2-core VM, absent from the
    profile, whose repeated shapes reuse their memory. It is the host allocator's cost, not the
    model's (serving engines preallocate their KV). Every ``ModelRunner`` calls it, whatever
    its device (harmless on CUDA, whose KV is the device's). The H200's page faults
    (results/gpu/h200/run3-run6) were not the heap's: they stayed under this setting and under
    ``PYTHONMALLOC=malloc``, and were cuDNN's attention plans
    (``no_per_shape_attention_plans``). Process-wide, and once, so the profile and the runs
    are timed under the same allocator."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # every block from the heap (no mmap), and the heap never trimmed below 2 GiB of free top
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def no_per_shape_attention_plans(device: torch.device) -> bool:
    """On CUDA, turn off PyTorch's cuDNN backend of ``scaled_dot_product_attention`` (for the
    whole process, as the setting is); True where it was on and now is off.

    That backend builds a cuDNN execution plan for each new attention shape and caches it
    (``MHAGraphCache``, unbounded). A decode step's keys have a new length at every step, so
    on the H200 (2026-12-04, results/gpu/h200/run5, gpu/faults.py) most decode steps of the
    real engine built one: some 200-330 host page faults and ~1 MB of resident memory a step,
    all in the attention stage, whatever the allocator, and such segments ran a median 1.70x
    their prediction (run 4; the others 1.14x); with this backend off (run 6), 2 of 133
    decode steps faulted. The profile, whose shapes repeat, never paid it, so no profile term
    can predict it; a serving engine's attention kernels (FlashAttention, FlashInfer) take any
    length without a plan. PyTorch then picks flash or memory-efficient attention, which take
    none either."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


class KVCacheError(RunnerError):
    """A stage did not write the KV cache it should have (a silent no-op, never tolerated)."""


def cache_keyword(fn) -> str:
    """The name under which ``fn`` takes the KV cache: ``past_key_values`` in transformers 5.17
    (the H200's version), ``cache`` in later 5.x releases. An attention forward takes
    ``**kwargs`` and silently drops a name it does not know (no KV written, wrong tokens), so the
    name is read from the signature rather than guessed."""
    params = inspect.signature(fn).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RunnerError(
        f"{fn.__qualname__} (transformers {transformers.__version__}) takes neither cache= nor "
        "past_key_values=; unsupported transformers version"
    )


_MASK_CACHE_KW = cache_keyword(create_causal_mask)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare capacity instead of concatenating.

    ``DynamicLayer`` copies a sequence's whole cache into a fresh tensor at every update: in a
    decode batch, one allocation and full copy per sequence and layer, which made batched decode
    up to 2x slower than ``generate`` (whose one batched cache is copied once). Here the storage
    is a buffer that grows by a quarter (64 tokens at least) when full, or that is sized once
    from a capacity hint (prompt + output tokens, when the caller knows); ``keys`` and
    ``values`` are its first ``length`` tokens. In a decode batch the storage is a row of the
    batch's padded buffer (``bound`` to that ``_PaddedKV``), written by the batch for all its
    sequences at once.
    """

    GROW_MIN = 64

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()  # assigns keys and values: empty storage, length 0, unbound
        self.capacity = capacity

    # Assigning keys (as DynamicLayer's own methods do) replaces the storage by that tensor.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys, self.bound = tensor, None
        self.length = 0 if tensor is None else tensor.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if not self.is_initialized or end > self._keys.shape[-2]:
            self._grow(key_states, value_states, end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        size = max(end + max(self.GROW_MIN, end // 4), self.capacity)
        keys = key_states.new_empty(*key_states.shape[:2], size, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], size, value_states.shape[-1])
        self._store(keys, values)

    def _store(self, keys: torch.Tensor, values: torch.Tensor, owner: _PaddedKV | None = None):
        """Move the cached tokens into new storage (a row of ``owner``'s buffer, or its own)."""
        if self.is_initialized and self.length:
            keys[:, :, : self.length] = self.keys
            values[:, :, : self.length] = self.values
        self._keys, self._values, self.bound = keys, values, owner
        self.device, self.is_initialized = keys.device, True

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self._keys = self._values = self.bound = None
        self.length, self.is_initialized = 0, False


class KVSequence:
    """One sequence's tokens and KV cache (its own, for its whole life).

    ``token_ids`` holds the prompt and every generated token; ``num_cached`` of them are in the
    cache. The next iteration feeds ``token_ids[num_cached:]`` (the whole prompt for a prefill,
    the last generated token for a decode step), or the first tokens of it (a prefill chunk).
    """

    def __init__(self, token_ids: list[int], cache: DynamicCache, key: object = None) -> None:
        if not token_ids:
            raise RunnerError("a sequence needs at least one token")
        self.token_ids = list(token_ids)
        self.cache = cache
        self.num_prompt = len(token_ids)
        self.num_cached = 0
        self.key = key  # the caller's handle (e.g. a policies.core.Sequence)
        self.host: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # swapped out
        self.host_device: torch.device | None = None  # where the swapped-out KV comes back to

    @property
    def num_new(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    def truncate(self, num_tokens: int, num_cached: int) -> None:
        """Forget everything after the first ``num_tokens`` tokens, keeping ``num_cached`` of
        them in the cache (undoes iterations; the profiler times the same step repeatedly)."""
        del self.token_ids[num_tokens:]
        self.num_cached = num_cached
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - num_cached
            if extra > 0:
                layer.crop(-extra)

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def to_host(self) -> None:
        """Swap out: copy every layer's cached keys and values to CPU memory and drop the
        layer's device storage (``GrowingLayer``s, as ``ModelRunner.new_sequence`` builds)."""
        self.host = [None if layer.keys is None else (layer.keys.to("cpu", copy=True),
                                                      layer.values.to("cpu", copy=True))
                     for layer in self.cache.layers]  # fmt: skip
        self.host_device = next((layer.keys.device for layer in self.cache.layers
                                 if layer.keys is not None), None)  # fmt: skip
        for layer in self.cache.layers:
            layer.reset()

    def to_device(self) -> None:
        """Swap in: copy the keys and values ``to_host`` saved back into device storage."""
        for layer, saved in zip(self.cache.layers, self.host, strict=True):
            if saved is not None:
                keys, values = saved
                layer._store(keys.to(self.host_device), values.to(self.host_device))
                layer.length = keys.shape[-2]
        self.host = None

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (layer.keys, layer.values) if t is not None)  # fmt: skip


@dataclass
class Routing:
    """One layer's per-expert queues, sorted by expert: expert e's entries are rows
    ``bounds[e]:bounds[e+1]`` of ``token_idx`` (the token's row in the batch), ``inputs`` (the
    token's MoE input, gathered once for all experts; once expert e has run, its rows hold its
    outputs) and ``weights`` (its routing weight)."""

    token_idx: torch.Tensor  # [T*k]
    inputs: torch.Tensor  # [T*k, H]: inputs, then outputs
    weights: torch.Tensor  # [T*k, 1]
    bounds: list[int]

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]

    @classmethod
    def join(cls, first: Routing, second: Routing, shift: int) -> Routing:
        """One layer's queues for the tokens of both, ``second``'s tokens after ``first``'s
        ``shift`` ones: expert e's queue is first's entries then second's, each row (its
        input, or the output of an expert that already ran) carried over unchanged."""
        n = len(first.token_idx)  # second's rows follow first's in the joined tensors
        rows, bounds = [], [0]
        for e in range(len(first.bounds) - 1):
            rows += range(first.bounds[e], first.bounds[e + 1])
            rows += range(n + second.bounds[e], n + second.bounds[e + 1])
            bounds.append(len(rows))
        order = torch.tensor(rows, device=first.inputs.device)
        token_idx = torch.cat([first.token_idx, second.token_idx + shift]).index_select(0, order)
        inputs = torch.cat([first.inputs, second.inputs]).index_select(0, order)
        weights = torch.cat([first.weights, second.weights]).index_select(0, order)
        return cls(token_idx, inputs, weights, bounds)

    @classmethod
    def build(
        cls, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int
    ) -> Routing:
        k = top_idx.shape[-1]
        experts, order = torch.sort(top_idx.reshape(-1), stable=True)
        token_idx = torch.div(order, k, rounding_mode="floor")
        # Expert e's queue starts where the sorted expert ids reach e. Reading these bounds is
        # the one host sync of the MoE block (queue sizes decide the experts' work); on CUDA,
        # bincount would add its own syncs (it reads the ids' min and max back).
        ids = torch.arange(num_experts + 1, device=experts.device)
        bounds = torch.searchsorted(experts, ids).tolist()
        weights = top_w.reshape(-1, 1).index_select(0, order)
        return cls(token_idx, x.index_select(0, token_idx), weights, bounds)


def _cat(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    return None if first is None else torch.cat([first, second])


class StageRef(NamedTuple):
    index: int
    stage: str  # "prepare", "attention", "router", "expert", "lm_head"
    layer: int  # -1 for prepare and lm_head
    expert: int  # -1 unless stage == "expert"


@dataclass
class IterationState:
    """Everything an unfinished iteration holds; survives any pause at a stage boundary."""

    sequences: list[KVSequence]
    # tokens each sequence feeds (all its uncached ones, or a chunk of them)
    feed: list[int] = field(default_factory=list)
    cursor: int = 0  # stages executed so far (flat index of the next stage)
    offsets: list[int] = field(default_factory=list)  # sequence i's tokens: [o[i], o[i+1])
    is_decode: bool = False  # every sequence feeds exactly one token: batched attention
    # sequences feeding one token in a batch where others feed more (a mixed iteration): their
    # attention runs batched, over these rows of the batch's tokens (None: no such sequence)
    decode_rows: torch.Tensor | None = None
    decode_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # those rows' [B, 1, d]
    hidden: torch.Tensor | None = None  # residual stream [T, H]
    moe_out: torch.Tensor | None = None  # a dense layer's MLP output [T, H]
    shared_out: torch.Tensor | None = None  # shared expert output [T, H]
    routing: Routing | None = None
    pending_layer: int = -1  # layer whose MoE output is not yet in ``hidden``
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    masks: list | None = None  # per sequence feeding several tokens; the decode rows' last
    batch_kv: _BatchKV | None = None  # the decode rows' caches for batched attention
    # its decode rows bind a new padded buffer (a new decode batch: each layer's attention
    # first copies their caches into it) rather than reuse the last iteration's
    bound: bool = False
    next_tokens: list[int | None] | None = None  # set by lm_head (None: a partial chunk)
    # a prefill's last attention stage, with ``ModelRunner.call_clock`` set: the clock read
    # before its first prompt's self-attention and after each prompt's (None: not read)
    call_marks: list | None = None
    # A merged iteration (``ModelRunner.merge``): the iterations it joined, in token order,
    # each keeping what its own attention needs (offsets, rope, masks, batch KV); the merged
    # state holds the token-wise tensors (residual stream, queues) of all of them.
    groups: list[IterationState] | None = None

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(self.feed)

    @property
    def done(self) -> bool:
        return self.next_tokens is not None

    def queue_size(self, expert: int) -> int:
        """Tokens in an expert's queue of the current layer (0 before routing or when the
        expert got none: its stage does nothing, and an executor may skip it)."""
        r = self.routing
        return 0 if r is None else r.bounds[expert + 1] - r.bounds[expert]

    def held_bytes(self) -> int:
        """Activation memory a suspended iteration keeps (the paper's cost of preemption)."""
        tensors = [self.hidden, self.moe_out, self.shared_out]
        if self.routing is not None:
            tensors += [self.routing.token_idx, self.routing.inputs, self.routing.weights]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _PaddedKV:
    """A decode batch's KV caches, right-padded into one ``[B, H, capacity, D]`` buffer per
    layer (zeros where no token was ever written: the padding must be finite to be masked).

    Binding copies each sequence's cache into its row once, and that row becomes the
    sequence's storage (its ``GrowingLayer``s are ``bound`` here); a layer binds at its first
    update, whose new keys give the shape (the caches may still be empty: one-token prompts).
    A decode step then writes the whole batch's new keys and values with one ``index_copy_``
    per layer and gives attention a view of the buffer, where updating B caches and stacking
    them again took 4 x B small copies per layer. While the same sequences decode together,
    step after step, the buffer is reused; a new batch, or one that outgrew the buffer, binds
    anew (the sequences keep their tokens).

    The bound layers reference this object and it references no sequence (by ``id`` only), so
    no reference cycle keeps a finished batch's buffers alive until the garbage collector runs.
    """

    def __init__(self, sequences: list[KVSequence], capacity: int) -> None:
        self.ids = [id(s) for s in sequences]  # row order; a reused id is caught by ``bound``
        self.capacity = capacity
        num_layers = len(sequences[0].cache.layers)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # Row of token 0 of (sequence i, head j) in a buffer viewed as [B * H * capacity, D].
        self.first_rows: torch.Tensor | None = None

    def buffers(self, layers: list[GrowingLayer], layer_idx: int, new_keys: torch.Tensor,
                new_values: torch.Tensor):  # fmt: skip
        """A layer's padded keys and values, bound at the first call (``layers``: the
        sequences' cache layers, in row order; new_*: [B, H, 1, D])."""
        if self.keys[layer_idx] is None:
            b, h, _, d = new_keys.shape
            keys = new_keys.new_zeros(b, h, self.capacity, d)
            values = new_values.new_zeros(b, h, self.capacity, new_values.shape[-1])
            for i, layer in enumerate(layers):
                layer._store(keys[i : i + 1], values[i : i + 1], self)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
            if self.first_rows is None:
                rows = torch.arange(b * h, device=keys.device) * self.capacity
                self.first_rows = rows.view(b, h)
        return self.keys[layer_idx], self.values[layer_idx]

    def holds(self, sequences: list[KVSequence], num_tokens: int) -> bool:
        """Whether these sequences, in this order, are bound here with room for num_tokens."""
        return (
            num_tokens <= self.capacity
            and self.ids == [id(s) for s in sequences]
            and all(layer.bound is self for s in sequences for layer in s.cache.layers)
        )


class _BatchKV:
    """Presents a decode iteration's ``_PaddedKV`` as one cache to the attention calls: each
    ``update`` writes the batch's new token (sequence i's at position ``lengths[i] - 1``) and
    returns every sequence's keys and values up to the longest (the padding masked out). This
    is the paper's Unified Dynamic Cache: no sequence is ever re-padded in storage.
    """

    def __init__(self, padded: _PaddedKV, sequences: list[KVSequence], lengths: list[int],
                 positions: torch.Tensor) -> None:  # fmt: skip
        self.padded = padded
        self.caches = [s.cache for s in sequences]
        self.lengths = lengths
        self.max_len = max(lengths)
        self.positions = positions  # the new tokens': lengths - 1
        self.rows: torch.Tensor | None = None  # their rows in the buffers viewed as [-1, D]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        p = self.padded
        layers = [c.layers[layer_idx] for c in self.caches]
        k, v = p.buffers(layers, layer_idx, keys, values)
        if self.rows is None:
            self.rows = (p.first_rows + self.positions[:, None]).view(-1)
        k.view(-1, k.shape[-1]).index_copy_(0, self.rows, keys.reshape(-1, keys.shape[-1]))
        v.view(-1, v.shape[-1]).index_copy_(0, self.rows, values.reshape(-1, values.shape[-1]))
        for layer, n in zip(layers, self.lengths, strict=True):
            layer.length = n
        return k[:, :, : self.max_len], v[:, :, : self.max_len]


class ModelRunner:
    """Runs iterations of a Hugging Face MoE causal LM stage by stage.

    Typical use (the real engine)::

        seqs = [runner.new_sequence(prompt_ids) for prompt_ids in prompts]
        state = runner.begin(seqs)          # one iteration of this batch
        while not state.done:
            runner.step(state)              # may stop after any step, resume later
        state.next_tokens                   # also appended to each sequence's token_ids
        runner.begin(seqs, [16, 0])         # seqs[0] feeds a chunk of 16 of its uncached
                                            # tokens over its cache (no token unless the last)
    """

    def __init__(self, model: PreTrainedModel, retain_memory: bool = True) -> None:
        # Inference only: frozen parameters build no autograd graph, so the stages need no
        # no_grad/inference_mode context (whose cost per stage would go unmeasured).
        model.requires_grad_(False)
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        body = model.model
        self.embed, self.norm, self.rotary = body.embed_tokens, body.norm, body.rotary_emb
        self.layers = list(body.layers)
        self.lm_head_module = model.lm_head
        self.attn_impl = self.config._attn_implementation
        if self.attn_impl not in ("sdpa", "eager"):
            raise RunnerError(f"attention {self.attn_impl!r} unsupported; use sdpa or eager")
        if getattr(self.config, "sliding_window", None):
            raise RunnerError("sliding-window attention is not supported by the stepped runner")
        moe = [layer.mlp for layer in self.layers if hasattr(layer.mlp, "experts")]
        if not moe:
            raise RunnerError("the model has no MoE layer (.mlp.experts)")
        ex = moe[0].experts
        if not ex.has_gate or ex.has_bias or ex.is_transposed or not ex.is_concatenated:
            raise RunnerError("experts must hold fused gate_up_proj [E, 2I, H], no bias")
        self.num_layers = len(self.layers)
        self.num_experts = ex.num_experts
        self.top_k = self.config.num_experts_per_tok
        self._attn_cache_kw = cache_keyword(type(self.layers[0].self_attn).forward)
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        # Per-expert weight views, made once: the expert stage is the hot loop. They alias the
        # parameters, so build the runner after the model has reached its device and dtype.
        self._experts = {
            i: (list(m.experts.gate_up_proj), list(m.experts.down_proj), m.experts._apply_gate)
            for i, m in ((i, layer.mlp) for i, layer in enumerate(self.layers))
            if hasattr(m, "experts")
        }
        self.moe_layers = sorted(self._experts)
        self._refs = [self.locate(i) for i in range(self.num_stages)]
        # The last decode batch's padded KV, reused while the same batch decodes on. Weak: the
        # bound sequences keep it alive, and it goes with them.
        self._padded: weakref.ref[_PaddedKV] | None = None
        # The profiler's clock, read around each prompt's self-attention in a prefill's
        # attention stage (``IterationState.call_marks``); None: nothing is read
        self.call_clock: Callable[[], object] | None = None
        # every device: a CUDA engine's host side page-faults too (``retain_freed_memory``);
        # False only for a diagnostic that times the default allocator (gpu/modes.py)
        self.retains_memory = retain_memory and retain_freed_memory()
        no_per_shape_attention_plans(self.device)

    def reserve(self, num_bytes: int) -> int:
        """Map ``num_bytes`` (at most ``MAX_RESERVE_BYTES``) of host memory into the heap now,
        so that the KV buffers a timed run allocates later reuse pages already mapped instead
        of page-faulting fresh ones in mid-run (the real engine's warm-up does it). A no-op
        (0) off the CPU or where freed memory is not retained; returns the bytes reserved."""
        if self.device.type != "cpu" or not self.retains_memory or num_bytes <= 0:
            return 0
        num_bytes = min(int(num_bytes), MAX_RESERVE_BYTES)
        block = torch.ones(num_bytes, dtype=torch.uint8)  # written: every page mapped
        del block  # back to the heap, which keeps it
        return num_bytes

    # ------------------------------------------------------------------------- layout
    @property
    def stages_per_layer(self) -> int:
        return 2 + self.num_experts

    @property
    def num_stages(self) -> int:
        return 2 + self.num_layers * self.stages_per_layer

    def flat_index(self, layer: int, stage: Stage, expert: int = 0) -> int:
        """The flat stage index of (layer, stage, expert), as ``sim.latency.Plan`` counts."""
        within = int(stage) + (expert if stage is Stage.EXPERT else 0)
        return 1 + layer * self.stages_per_layer + within

    def locate(self, index: int) -> StageRef:
        if index == 0:
            return StageRef(0, "prepare", -1, -1)
        if index == self.num_stages - 1:
            return StageRef(index, "lm_head", -1, -1)
        layer, within = divmod(index - 1, self.stages_per_layer)
        if within == 0:
            return StageRef(index, "attention", layer, -1)
        if within == 1:
            return StageRef(index, "router", layer, -1)
        return StageRef(index, "expert", layer, within - 2)

    def stage_list(self, state: IterationState | None = None) -> list[StageRef]:
        """Stages still to run (all of them without a state), in order."""
        start = state.cursor if state is not None else 0
        return [self.locate(i) for i in range(start, self.num_stages)]

    # ------------------------------------------------------------------------- driving
    def new_sequence(
        self, token_ids: list[int], key: object = None, capacity: int = 0
    ) -> KVSequence:
        """A sequence with its own empty cache; ``capacity`` (tokens it will ever hold, when
        known) sizes its KV buffers once."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [GrowingLayer(capacity) for _ in cache.layers]
        return KVSequence(token_ids, cache, key)

    def begin(
        self, sequences: list[KVSequence], chunk_tokens: list[int] | None = None
    ) -> IterationState:
        """A new iteration for these sequences (nothing runs until the first ``step``).
        ``chunk_tokens[i]``: the tokens sequence i feeds on top of its cache (0, or no list:
        all its uncached tokens); fewer than those is a prefill chunk, which yields no token."""
        if not sequences:
            raise RunnerError("an iteration needs at least one sequence")
        if chunk_tokens is None:
            chunk_tokens = [0] * len(sequences)
        if len(chunk_tokens) != len(sequences):
            raise RunnerError("chunk_tokens needs one entry per sequence")
        if any(s.num_new < 1 for s in sequences):
            raise RunnerError("every sequence needs a new token to feed")
        if any(not 0 <= c <= s.num_new for s, c in zip(sequences, chunk_tokens, strict=True)):
            raise RunnerError("a chunk must be 0 (all) up to the sequence's uncached tokens")
        feed = [c or s.num_new for s, c in zip(sequences, chunk_tokens, strict=True)]
        return IterationState(sequences=list(sequences), feed=feed)

    def next_stage(self, state: IterationState) -> StageRef:
        return self._refs[state.cursor]

    def step(self, state: IterationState) -> StageRef:
        """Run the next stage; returns which one ran."""
        ref = self._refs[state.cursor]
        self._run(ref, state)
        state.cursor += 1
        return ref

    def run(self, state: IterationState, until: int | None = None) -> IterationState:
        """Run stages until the cursor reaches ``until`` (default: the end of the iteration)."""
        stop = self.num_stages if until is None else until
        while state.cursor < stop:
            self._run(self._refs[state.cursor], state)
            state.cursor += 1
        return state

    def merge(self, first: IterationState, second: IterationState) -> IterationState:
        """One iteration of both batches' sequences (``first``'s first), from the boundary
        both have reached: the residual streams and the current layer's queues (with the
        outputs of the experts that already ran) are joined, so every later router, expert
        and lm_head runs once on all the tokens; attention stays per joined iteration, each
        with its own masks and caches (a decode batch's padded KV, a prefill's per sequence)."""
        if first.cursor != second.cursor or first.cursor < 1 or first.done or second.done:
            raise RunnerError(
                f"cannot merge iterations at stages {first.cursor} and {second.cursor}: "
                "both must be at the same inner boundary"
            )
        shift = first.num_tokens
        routing = first.routing and Routing.join(first.routing, second.routing, shift)
        groups = (first.groups or [first]) + (second.groups or [second])
        merged = IterationState(
            sequences=first.sequences + second.sequences,
            feed=first.feed + second.feed,
            cursor=first.cursor,
            offsets=first.offsets + [shift + o for o in second.offsets[1:]],
            is_decode=first.is_decode and second.is_decode,
            hidden=torch.cat([first.hidden, second.hidden]),
            moe_out=_cat(first.moe_out, second.moe_out),
            shared_out=_cat(first.shared_out, second.shared_out),
            routing=routing,
            pending_layer=first.pending_layer,
            groups=groups,
            bound=first.bound or second.bound,
        )
        for g in groups:  # their token-wise tensors now live in the merged state only
            g.hidden = g.moe_out = g.shared_out = g.routing = None
        return merged

    def _run(self, ref: StageRef, state: IterationState) -> None:
        if ref.stage == "expert":
            self.expert(ref.layer, ref.expert, state)
        elif ref.stage == "attention":
            self.attention(ref.layer, state)
        elif ref.stage == "router":
            self.router(ref.layer, state)
        elif ref.stage == "prepare":
            self.prepare(state)
        else:
            self.lm_head(state)

    # ------------------------------------------------------------------------- stages
    def prepare(self, state: IterationState) -> None:
        """Embeddings, positions, rotary tables and attention masks for the whole iteration."""
        seqs = state.sequences
        offsets, ids, positions = [0], [], []
        for s, n in zip(seqs, state.feed, strict=True):
            ids += s.token_ids[s.num_cached : s.num_cached + n]
            positions += range(s.num_cached, s.num_cached + n)
            offsets.append(len(ids))
        state.offsets = offsets
        state.is_decode = offsets[-1] == len(seqs)
        input_ids = torch.tensor(ids, device=self.device)
        state.hidden = self.embed(input_ids)
        pos = torch.tensor(positions, device=self.device)[None]
        cos, sin = self.rotary(state.hidden, pos)
        if state.is_decode:  # [1, B, d] -> [B, 1, d]: one query per sequence
            state.rope = (cos.transpose(0, 1), sin.transpose(0, 1))
            state.masks = [self._batch_kv(state, seqs, pos[0])]
            return
        state.rope = (cos, sin)
        state.masks = [self._prefill_mask(state, i) if n > 1 else None
                       for i, n in enumerate(state.feed)]  # fmt: skip
        ones = [i for i, n in enumerate(state.feed) if n == 1]
        if ones:  # a mixed iteration: the decode steps' attention still runs batched
            rows = torch.tensor([offsets[i] for i in ones], device=self.device)
            state.decode_rows = rows
            state.decode_rope = (cos[0, rows][:, None], sin[0, rows][:, None])
            decoders = [seqs[i] for i in ones]
            state.masks.append(self._batch_kv(state, decoders, pos[0].index_select(0, rows)))

    def _batch_kv(self, state: IterationState, seqs: list[KVSequence], positions: torch.Tensor):
        """Set up batched attention for sequences feeding one token each (at ``positions``,
        their cached lengths, on the device): ``state.batch_kv``; returns their padding mask."""
        lengths = [s.num_cached + 1 for s in seqs]
        last = None if self._padded is None else self._padded()
        padded = self._padded_kv(seqs, max(lengths))
        state.bound = padded is not last
        state.batch_kv = _BatchKV(padded, seqs, lengths, positions)
        return self._decode_mask(lengths, positions)

    def _padded_kv(self, seqs: list[KVSequence], num_tokens: int) -> _PaddedKV:
        """The batch's padded KV with room for ``num_tokens``: the last one, or a new one."""
        padded = None if self._padded is None else self._padded()
        if padded is None or not padded.holds(seqs, num_tokens):
            hint = max(s.cache.layers[0].capacity for s in seqs)
            capacity = max(num_tokens + max(GrowingLayer.GROW_MIN, num_tokens // 4), hint)
            padded = _PaddedKV(seqs, capacity)
            self._padded = weakref.ref(padded)
        return padded

    def _prefill_mask(self, state: IterationState, i: int):
        s, n = state.sequences[i], state.offsets[i + 1] - state.offsets[i]
        pos = torch.arange(s.num_cached, s.num_cached + n, device=self.device)[None]
        shape_only = state.hidden[None, state.offsets[i] : state.offsets[i + 1]]
        return create_causal_mask(
            config=self.config,
            inputs_embeds=shape_only,
            attention_mask=None,
            position_ids=pos,
            **{_MASK_CACHE_KW: s.cache},
        )

    def _decode_mask(self, lengths: list[int], positions: torch.Tensor) -> torch.Tensor | None:
        """Padding mask for right-padded stacked caches (None when all lengths agree);
        ``positions`` (the new tokens') are the lengths minus one, already on the device."""
        longest = max(lengths)
        if min(lengths) == longest:
            return None
        cols = torch.arange(longest, device=self.device)
        keep = cols[None, :] <= positions[:, None]
        keep = keep[:, None, None, :]  # [B, 1, 1, L]
        if self.attn_impl == "sdpa":
            return keep
        return torch.zeros(keep.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~keep, torch.finfo(self.dtype).min
        )

    def attention(self, layer: int, state: IterationState) -> None:
        """Input norm + self-attention (each sequence with its own cache) + residual."""
        self.finish_layer(state)
        block = self.layers[layer]
        x = block.input_layernorm(state.hidden)
        if state.groups is None:
            out = self._attend(block, x, state)
        else:
            parts, start = [], 0
            for g in state.groups:
                n = g.num_tokens
                parts.append(self._attend(block, x[start : start + n], g))
                start += n
            out = torch.cat(parts)
        state.hidden = state.hidden + out

    def _attend(self, block, x: torch.Tensor, state: IterationState) -> torch.Tensor:
        """Self-attention of one (unmerged) iteration's tokens ``x``, normed."""
        cos, sin = state.rope
        if state.is_decode:
            out, _ = block.self_attn(
                hidden_states=x[:, None],
                position_embeddings=(cos, sin),
                attention_mask=state.masks[0],
                **{self._attn_cache_kw: state.batch_kv},
            )
            out = out[:, 0]
        else:
            rows = state.decode_rows
            parts = []
            clock = self.call_clock if rows is None else None
            marks = None if clock is None else [clock()]
            for i, s in enumerate(state.sequences):
                a, b = state.offsets[i], state.offsets[i + 1]
                if rows is not None and b - a == 1:
                    continue  # a decode step of a mixed iteration: batched below
                o, _ = block.self_attn(
                    hidden_states=x[None, a:b],
                    position_embeddings=(cos[:, a:b], sin[:, a:b]),
                    attention_mask=state.masks[i],
                    **{self._attn_cache_kw: s.cache},
                )
                parts.append(o[0])
                if marks is not None:
                    marks.append(clock())
            state.call_marks = marks
            if rows is None:
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:  # the decode steps' rows in one copy, each chunk's into its own rows
                o, _ = block.self_attn(
                    hidden_states=x.index_select(0, rows)[:, None],
                    position_embeddings=state.decode_rope,
                    attention_mask=state.masks[-1],
                    **{self._attn_cache_kw: state.batch_kv},
                )
                out = torch.empty_like(x).index_copy_(0, rows, o[:, 0])
                chunks = [i for i, n in enumerate(state.feed) if n > 1]
                for i, part in zip(chunks, parts, strict=True):
                    out[state.offsets[i] : state.offsets[i + 1]] = part
        return out

    def router(self, layer: int, state: IterationState) -> None:
        """Post-attention norm + gate -> per-expert queues. The shared expert (Qwen2-MoE,
        DeepSeek-V3) runs here too: it sees every token, like the gate. A dense layer
        (DeepSeek-V3's first layers) runs its whole MLP here and leaves the queues empty."""
        block = self.layers[layer]
        mlp = block.mlp
        x = block.post_attention_layernorm(state.hidden)
        state.pending_layer = layer
        if not hasattr(mlp, "experts"):
            state.moe_out, state.routing = mlp(x), None
            return
        _, top_w, top_idx = mlp.gate(x)
        state.routing = Routing.build(x, top_idx, top_w, self.num_experts)
        if hasattr(mlp, "shared_expert"):  # Qwen2-MoE: a sigmoid-gated shared expert
            state.shared_out = F.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
        elif hasattr(mlp, "shared_experts"):  # DeepSeek-V3
            state.shared_out = mlp.shared_experts(x)

    def expert(self, layer: int, e: int, state: IterationState) -> None:
        """Expert e's FFN on its queued tokens, written over their inputs (which only this
        expert reads); the combine weights and sums the outputs."""
        r = state.routing
        a, b = (0, 0) if r is None else (r.bounds[e], r.bounds[e + 1])
        if a == b:
            return
        gate_up, down, apply_gate = self._experts[layer]
        rows = r.inputs[a:b]
        torch.mm(apply_gate(F.linear(rows, gate_up[e])), down[e].t(), out=rows)

    def finish_layer(self, state: IterationState) -> None:
        """Combine: residual + (the weighted sum of the experts' outputs, or a dense layer's
        output, + shared expert). The same arithmetic, in the same order, as transformers'
        experts: each output times its routing weight, cast back, added per token in expert
        order. A no-op when nothing is pending."""
        if state.pending_layer < 0:
            return
        r = state.routing
        if r is None:
            out = state.moe_out
        else:
            weighted = (r.inputs * r.weights).to(r.inputs.dtype)
            out = torch.zeros_like(state.hidden).index_add_(0, r.token_idx, weighted)
        if state.shared_out is not None:
            out = out + state.shared_out
        state.hidden = state.hidden + out
        state.moe_out = state.shared_out = state.routing = None
        state.pending_layer = -1

    def lm_head(self, state: IterationState) -> None:
        """Final norm + lm_head + greedy argmax at the last position of each sequence that fed
        all its uncached tokens; the tokens are appended to those sequences. Every cache now
        holds everything it was fed; a partial chunk's sequence gets no token (None)."""
        self.finish_layer(state)
        seqs = state.sequences
        for s, n in zip(seqs, state.feed, strict=True):
            s.num_cached += n
        self.check_kv(state)
        whole = [i for i, s in enumerate(seqs) if s.num_cached == len(s.token_ids)]
        next_tokens: list[int | None] = [None] * len(seqs)
        if whole:
            if len(whole) == len(seqs) and state.is_decode:
                last = state.hidden
            else:
                last = state.hidden[[state.offsets[i + 1] - 1 for i in whole]]
            logits = self.lm_head_module(self.norm(last))
            # generate() takes the argmax of float32 logits: the same cast gives the same ties.
            for i, t in zip(whole, logits.float().argmax(dim=-1).tolist(), strict=True):
                seqs[i].token_ids.append(t)
                next_tokens[i] = t
        state.next_tokens = next_tokens
        state.hidden = state.batch_kv = state.decode_rows = state.decode_rope = None
        state.groups = None

    def check_kv(self, state: IterationState) -> None:
        """Every sequence's cache must now hold every token it was fed, in its first and last
        layers: a few integer compares per iteration make a KV write that never happened
        (e.g. a cache argument the attention module ignored) fail at once instead of producing
        wrong tokens and decode attention timed over one token."""
        first, last = 0, self.num_layers - 1
        for s in state.sequences:
            fed = s.num_cached
            for layer in (first, last):
                held = s.cache.layers[layer].get_seq_length()
                if held != fed:
                    raise KVCacheError(
                        f"KV cache of layer {layer} holds {held} tokens after an iteration that "
                        f"fed {fed}: the attention did not write it (transformers "
                        f"{transformers.__version__}, cache argument {self._attn_cache_kw}=)"
                    )

    # ------------------------------------------------------------------------- convenience
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation: one prefill iteration of all prompts, then batched decode steps."""
        seqs = [self.new_sequence(p) for p in prompts]
        for _ in range(max_new_tokens):
            self.run(self.begin(seqs))
        return [s.generated for s in seqs]
