"""The stepped model executor shared by the profiler and the real engine.

An iteration of a batch runs as a flat list of stages, the same list ``sim.latency.Plan``
times::

    index 0                      prepare: embeddings, positions, rotary tables, masks
    1 + l*(2+E) + 0              attention(l): input norm + self-attention + residual
    1 + l*(2+E) + 1              router(l): post-attention norm + gate + per-expert queues
                                 (+ the shared expert, or the whole MLP of a dense layer)
    1 + l*(2+E) + 2 + e          expert(l, e): expert e's FFN on its queue, scatter-added
    1 + L*(2+E)                  lm_head: final norm + lm_head + greedy token per sequence

All of an iteration's intermediate results live in an ``IterationState`` (the residual
stream, the per-expert queues with their gathered inputs and routing weights, the partial
expert sum), so the iteration can stop at any boundary and resume later without recomputing
anything: the preemption points. Sequences keep their KV caches between iterations.

The layer's combine (residual + expert sum + shared expert) has no stage of its own: it runs at
the start of the next stage that reads the residual stream (the next layer's attention or the
lm_head), so the flat list above needs no extra index.

Every sequence owns its KV cache (a ``DynamicCache`` of ``GrowingLayer``s): sequences join and
leave batches freely.
Prefill attention runs sequence by sequence (pad-free, the profile's ``attn_prefill`` is per
sequence); decode attention runs once for the whole batch, on the batch's caches stacked (and
right-padded when their lengths differ) by ``_BatchKV``. Norms, router, experts and lm_head
always run once on all the batch's tokens. The model's own modules do the work (norms,
attention, gate, expert weights), so the runner matches ``model.generate`` token for token.
"""

from __future__ import annotations

import inspect
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
    up to 2x slower than ``generate`` (whose one batched cache is copied once). Here ``keys`` and
    ``values`` are views of a buffer that grows by a quarter (64 tokens at least) when full, or
    that is sized once from a capacity hint (prompt + output tokens, when the caller knows).
    """

    GROW_MIN = 64

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if not self.is_initialized or end > self._keys.shape[-2]:
            self._grow(key_states, value_states, end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        size = max(end + max(self.GROW_MIN, end // 4), self.capacity)
        keys = key_states.new_empty(*key_states.shape[:2], size, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], size, value_states.shape[-1])
        if self.is_initialized:
            keys[:, :, : self.length] = self.keys
            values[:, :, : self.length] = self.values
        self._keys, self._values = keys, values
        self.device, self.is_initialized = key_states.device, True

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        if self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self.length = 0


class KVSequence:
    """One sequence's tokens and KV cache (its own, for its whole life).

    ``token_ids`` holds the prompt and every generated token; ``num_cached`` of them are in the
    cache. The next iteration feeds ``token_ids[num_cached:]``: the whole prompt for a prefill,
    the last generated token for a decode step.
    """

    def __init__(self, token_ids: list[int], cache: DynamicCache, key: object = None) -> None:
        if not token_ids:
            raise RunnerError("a sequence needs at least one token")
        self.token_ids = list(token_ids)
        self.cache = cache
        self.num_prompt = len(token_ids)
        self.num_cached = 0
        self.key = key  # the caller's handle (e.g. a policies.core.Sequence)

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

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (layer.keys, layer.values) if t is not None)  # fmt: skip


@dataclass
class Routing:
    """One layer's per-expert queues, sorted by expert: expert e's entries are rows
    ``bounds[e]:bounds[e+1]`` of ``token_idx`` (the token's row in the batch), ``inputs`` (the
    token's MoE input, gathered once for all experts) and ``weights`` (its routing weight)."""

    token_idx: torch.Tensor  # [T*k]
    inputs: torch.Tensor  # [T*k, H]
    weights: torch.Tensor  # [T*k, 1]
    bounds: list[int]

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]

    @classmethod
    def build(
        cls, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int
    ) -> Routing:
        k = top_idx.shape[-1]
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        token_idx = order // k
        # The one host sync of the MoE block: queue sizes decide the experts' work.
        bounds = [0, *counts.cumsum(0).tolist()]
        return cls(token_idx, x[token_idx], top_w.reshape(-1)[order, None], bounds)


class StageRef(NamedTuple):
    index: int
    stage: str  # "prepare", "attention", "router", "expert", "lm_head"
    layer: int  # -1 for prepare and lm_head
    expert: int  # -1 unless stage == "expert"


@dataclass
class IterationState:
    """Everything an unfinished iteration holds; survives any pause at a stage boundary."""

    sequences: list[KVSequence]
    cursor: int = 0  # stages executed so far (flat index of the next stage)
    offsets: list[int] = field(default_factory=list)  # sequence i's tokens: [o[i], o[i+1])
    is_decode: bool = False  # every sequence feeds exactly one token: batched attention
    hidden: torch.Tensor | None = None  # residual stream [T, H]
    moe_out: torch.Tensor | None = None  # expert sum so far [T, H]
    shared_out: torch.Tensor | None = None  # shared expert output [T, H]
    routing: Routing | None = None
    pending_layer: int = -1  # layer whose MoE output is not yet in ``hidden``
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    masks: list | None = None  # per sequence (prefill) or one batch mask (decode)
    next_tokens: list[int] | None = None  # set by lm_head

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] if self.offsets else sum(s.num_new for s in self.sequences)

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


class _BatchKV:
    """Presents the batch's per-sequence caches as one cache to a decode attention call.

    The attention module calls ``update`` with the batch's new keys and values; each row goes
    to its own sequence's cache, and the batch gets back all sequences' keys and values stacked
    (right-padded to the longest, the padding masked out). This is the paper's Unified Dynamic
    Cache: no sequence is ever re-padded in storage.
    """

    def __init__(self, sequences: list[KVSequence], lengths: list[int]) -> None:
        self.sequences = sequences
        self.lengths = lengths
        self.max_len = max(lengths)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        per_seq = [
            s.cache.layers[layer_idx].update(keys[i : i + 1], values[i : i + 1])
            for i, s in enumerate(self.sequences)
        ]
        return self._stack([k for k, _ in per_seq]), self._stack([v for _, v in per_seq])

    def _stack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if all(p.shape[-2] == self.max_len for p in parts):
            return torch.cat(parts, dim=0)
        b, (_, h, _, d) = len(parts), parts[0].shape
        out = parts[0].new_zeros(b, h, self.max_len, d)
        for i, p in enumerate(parts):
            out[i, :, : p.shape[-2]] = p[0]
        return out


class ModelRunner:
    """Runs iterations of a Hugging Face MoE causal LM stage by stage.

    Typical use (the real engine)::

        seqs = [runner.new_sequence(prompt_ids) for prompt_ids in prompts]
        state = runner.begin(seqs)          # one iteration of this batch
        while not state.done:
            runner.step(state)              # may stop after any step, resume later
        state.next_tokens                   # also appended to each sequence's token_ids
    """

    def __init__(self, model: PreTrainedModel) -> None:
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

    def begin(self, sequences: list[KVSequence]) -> IterationState:
        """A new iteration for these sequences (nothing runs until the first ``step``)."""
        if not sequences:
            raise RunnerError("an iteration needs at least one sequence")
        if any(s.num_new < 1 for s in sequences):
            raise RunnerError("every sequence needs a new token to feed")
        return IterationState(sequences=list(sequences))

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
        for s in seqs:
            ids += s.token_ids[s.num_cached :]
            positions += range(s.num_cached, len(s.token_ids))
            offsets.append(len(ids))
        state.offsets = offsets
        state.is_decode = offsets[-1] == len(seqs)
        input_ids = torch.tensor(ids, device=self.device)
        state.hidden = self.embed(input_ids)
        pos = torch.tensor(positions, device=self.device)[None]
        cos, sin = self.rotary(state.hidden, pos)
        if state.is_decode:  # [1, B, d] -> [B, 1, d]: one query per sequence
            state.rope = (cos.transpose(0, 1), sin.transpose(0, 1))
            state.masks = [self._decode_mask([s.num_cached + 1 for s in seqs])]
        else:
            state.rope = (cos, sin)
            state.masks = [self._prefill_mask(state, i) for i in range(len(seqs))]

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

    def _decode_mask(self, lengths: list[int]) -> torch.Tensor | None:
        """Padding mask for right-padded stacked caches (None when all lengths agree)."""
        longest = max(lengths)
        if min(lengths) == longest:
            return None
        cols = torch.arange(longest, device=self.device)
        keep = cols[None, :] < torch.tensor(lengths, device=self.device)[:, None]
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
        cos, sin = state.rope
        if state.is_decode:
            lengths = [s.num_cached + 1 for s in state.sequences]
            out, _ = block.self_attn(
                hidden_states=x[:, None],
                position_embeddings=(cos, sin),
                attention_mask=state.masks[0],
                **{self._attn_cache_kw: _BatchKV(state.sequences, lengths)},
            )
            out = out[:, 0]
        else:
            parts = []
            for i, s in enumerate(state.sequences):
                a, b = state.offsets[i], state.offsets[i + 1]
                o, _ = block.self_attn(
                    hidden_states=x[None, a:b],
                    position_embeddings=(cos[:, a:b], sin[:, a:b]),
                    attention_mask=state.masks[i],
                    **{self._attn_cache_kw: s.cache},
                )
                parts.append(o[0])
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        state.hidden = state.hidden + out

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
        state.moe_out = torch.zeros_like(x)
        if hasattr(mlp, "shared_expert"):  # Qwen2-MoE: a sigmoid-gated shared expert
            state.shared_out = F.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
        elif hasattr(mlp, "shared_experts"):  # DeepSeek-V3
            state.shared_out = mlp.shared_experts(x)

    def expert(self, layer: int, e: int, state: IterationState) -> None:
        """Expert e's FFN on its queued tokens, weighted and scatter-added into the layer's
        output (the same arithmetic, in the same order, as transformers' eager experts)."""
        r = state.routing
        a, b = (0, 0) if r is None else (r.bounds[e], r.bounds[e + 1])
        if a == b:
            return
        gate_up, down, apply_gate = self._experts[layer]
        h = apply_gate(F.linear(r.inputs[a:b], gate_up[e]))
        h = F.linear(h, down[e]) * r.weights[a:b]
        state.moe_out.index_add_(0, r.token_idx[a:b], h.to(state.moe_out.dtype))

    def finish_layer(self, state: IterationState) -> None:
        """Combine: residual + (expert sum + shared expert). A no-op when nothing is pending."""
        if state.pending_layer < 0:
            return
        out = state.moe_out if state.shared_out is None else state.moe_out + state.shared_out
        state.hidden = state.hidden + out
        state.moe_out = state.shared_out = state.routing = None
        state.pending_layer = -1

    def lm_head(self, state: IterationState) -> None:
        """Final norm + lm_head + greedy argmax at each sequence's last position; the tokens
        are appended to the sequences, whose caches now hold everything they were fed."""
        self.finish_layer(state)
        self.check_kv(state)
        last = state.hidden if state.is_decode else state.hidden[[o - 1 for o in state.offsets[1:]]]
        logits = self.lm_head_module(self.norm(last))
        # generate() takes the argmax of float32 logits: the same cast gives the same ties.
        tokens = logits.float().argmax(dim=-1).tolist()
        for s, t in zip(state.sequences, tokens, strict=True):
            s.num_cached = len(s.token_ids)
            s.token_ids.append(t)
        state.next_tokens = tokens
        state.hidden = None

    def check_kv(self, state: IterationState) -> None:
        """Every sequence's cache must now hold every token it was fed, in its first and last
        layers: a few integer compares per iteration make a KV write that never happened
        (e.g. a cache argument the attention module ignored) fail at once instead of producing
        wrong tokens and decode attention timed over one token."""
        first, last = 0, self.num_layers - 1
        for s in state.sequences:
            fed = len(s.token_ids)
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
