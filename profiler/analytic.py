"""Analytic latency model of one MoE transformer layer (roofline + fixed costs), and the
built-in analytic and calibrated profiles it generates. Torch-free.

Every op of a layer is a short list of kernels. A kernel's device time is a roofline::

    t = softmax_p(flops / (peak * eff.compute), bytes / (bandwidth * eff.memory)) + eff.overhead_s

where ``softmax_p(a, b) = (a**p + b**p) ** (1/p)`` is a smooth maximum (p -> inf gives the plain
max; a finite p models the imperfect overlap of compute and memory traffic near the ridge
point) and ``overhead_s`` is a fixed per-kernel cost (launch, tail of the last wave). GEMMs pad
their token count to the tile size the GEMM library uses (wave quantisation): ``tile_tokens``
for narrow GEMMs, ``wide_tile_tokens`` (then ``wide_tile_tokens_large`` above
``wide_large_from`` tokens) for GEMMs with at least ``wide_out_features`` outputs; a GEMM on at
most one tile of tokens is not padded.

An :class:`Execution` says how the kernels are issued. ``ENGINE`` (an optimised serving engine,
vLLM-like: fp16/bf16 weights, CUDA graphs, no host cost per kernel) adds only a per-iteration
host cost. ``HF_EAGER_NF4`` (Hugging Face transformers in PyTorch eager mode with 4-bit NF4
bitsandbytes weights and fp16 compute, the QLLM paper's setting) also charges the host time
to issue each kernel and each quantised Linear call, host-device synchronisations and a
per-layer framework cost; an op then takes ``max(host, device_exposed * device)``, where
``device_exposed`` < 1 is the part of the device time that asynchronous kernel queues do not
hide behind neighbouring ops' host work. A 4-bit Linear on one token
runs bitsandbytes' gemv kernel on the packed weights; on more tokens it dequantises the weight
to fp16 (one streaming kernel) and runs an fp16 GEMM.

A :class:`LayerModel` with ``tp`` > 1 splits the weights over tp GPUs (tensor parallelism) and
adds the all-reduces over a stated interconnect; the built-in 16-bit profiles on 80 GB GPUs use
2, since their 93.4 GB of weights fit no single one. Besides the per-layer ops, each profile
carries a batched prefill-attention term (one call over all prompts of a batch) and the cost of
a context switch (``preempt_switch``).

The A100 efficiency factors are fitted (see ``A100_FIT``) to measured A100 op times from the
Vidur project's profiling data (Microsoft, MIT licence), shipped in ``data/a100-measured/``;
``python -m profiler.analytic --check [csv]`` compares the model with that file (or another),
``--fit [csv]`` refits, ``--write`` regenerates the built-in profiles in ``sim/profiles``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from profiler.schema import SWAP_BYTES_PER_S, Memory, ModelShape, OpPoint, Profile

FP16_BYTES = 2
# bitsandbytes NF4 with double quantisation (blocksize 64): 4 bits per weight, an 8-bit absmax per
# block of 64 weights and an fp32 scale per 256 blocks. Mixtral-8x7B then needs 24.5e9 bytes
# = 22.8 GiB, the "about 22.9 GB" the QLLM paper reports.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
CREATED = "2026-11-30"  # fixed, so that --write is reproducible byte for byte
PROFILES_DIR = Path(__file__).resolve().parents[1] / "sim" / "profiles"
# The A100 measurements the fit uses, shipped in the repository with their licence.
MEASURED_CSV = Path(__file__).resolve().parents[1] / "data/a100-measured/llama3-8b-shape-mlp.csv"


# ------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak a family of kernels reaches, and its fixed cost per kernel."""

    compute: float = 1.0
    memory: float = 1.0
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s (no sparsity)
    mem_bw: float  # HBM bytes/s
    memory_bytes: float  # device memory, as nvidia-smi reports it (MiB x 2**20)
    gemm: Efficiency  # MLP-sized GEMMs: expert up/down projections, router gate, lm_head
    proj: Efficiency  # attention projections (fused q/k/v, o)
    elementwise: Efficiency  # memory-bound kernels: norms, activation, rope, gathers, adds
    attention: Efficiency  # the fused attention kernel that reads the KV cache
    overlap: float = 3.0  # p of the smooth maximum of the compute and memory times
    tile_tokens: int = 64
    wide_out_features: int = 16384
    wide_tile_tokens: int = 128
    wide_tile_tokens_large: int = 192
    wide_large_from: int = 512
    # GPU-to-GPU link for tensor parallelism: bytes/s per direction per GPU, and the fixed
    # cost of one all-reduce (NCCL's small-message latency).
    link_bw: float = 0.0
    allreduce_latency_s: float = 0.0
    # host <-> GPU copies (KV swapped out and in): bytes/s per direction per GPU, PCIe
    host_bw: float = SWAP_BYTES_PER_S


# Fitted to the Vidur project's A100 profiling data (github.com/microsoft/vidur, MIT licence):
# one NVIDIA A100 80GB, a Llama-3-8B-shaped layer (hidden 4096, gated MLP intermediate 14336,
# 32 query / 8 KV heads), tensor parallel 1, 1..4096 tokens. `gemm` and `overlap` by minimax
# relative error of mlp_up_proj + mlp_act + mlp_down_proj (one Mixtral expert), `proj` on
# attn_pre_proj and attn_post_proj, `elementwise` on mlp_act. Refit: --fit <csv>.
A100_FIT = {
    "gemm": Efficiency(compute=0.7215, memory=0.7345, overhead_s=0.76e-06),
    "proj": Efficiency(compute=0.6353, memory=0.9416, overhead_s=10.89e-06),
    "elementwise": Efficiency(compute=1.0, memory=0.6774, overhead_s=8.94e-06),
    "overlap": 2.9,
}
# The attention kernel is not in the measured data: FlashAttention-2 reaches about half of the
# A100's dense peak in the forward pass; its KV reads stream like the GEMMs' weight reads.
ATTENTION_EFF = Efficiency(compute=0.5, memory=0.75, overhead_s=5e-06)


def _hardware(
    name: str, peak_flops: float, mem_bw: float, memory_mib: float, link_bw: float, host_bw: float
) -> Hardware:
    """A GPU with the A100-fitted efficiencies (an assumption for other GPUs)."""
    return Hardware(
        name=name,
        peak_flops=peak_flops,
        mem_bw=mem_bw,
        memory_bytes=memory_mib * MIB,
        link_bw=link_bw,
        host_bw=host_bw,
        allreduce_latency_s=ALLREDUCE_LATENCY_S,
        gemm=A100_FIT["gemm"],
        proj=A100_FIT["proj"],
        elementwise=A100_FIT["elementwise"],
        attention=ATTENTION_EFF,
        overlap=A100_FIT["overlap"],
    )


# NVLink bandwidth per direction per GPU (NVLink 3: 600 GB/s both directions, NVLink 4: 900),
# of which an all-reduce reaches LINK_EFFICIENCY (NCCL's bus bandwidth on large messages), and
# a fixed cost per all-reduce: assumptions, not measured here.
LINK_EFFICIENCY = 0.8
ALLREDUCE_LATENCY_S = 10e-6
# Host link for KV swaps: PCIe Gen4 x16 on the A100 (32 GB/s raw per direction), Gen5 x16 on
# the H100 and H200 (64 GB/s raw); ~80% of raw reaches pinned-memory copies (assumed).
# Device memory as nvidia-smi reports it: a "141 GB" H200 has 143,771 MiB (150.8e9 bytes;
# measured on this project's H200, results/gpu/h200/env.log), an "80 GB" A100 81,920 MiB and an
# H100 SXM 81,559 MiB. Taking the marketed GB as 1e9 bytes left the H200's KV cache 21% short.
MIB = 2**20
A100 = _hardware("NVIDIA A100 80GB SXM", 312e12, 2.039e12, 81_920, 300e9, 25e9)
H100 = _hardware("NVIDIA H100 SXM 80GB", 989e12, 3.35e12, 81_559, 450e9, 50e9)
H200 = _hardware("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 143_771, 450e9, 50e9)
HARDWARE = {"a100": A100, "h100": H100, "h200": H200}

MIXTRAL_8X7B = ModelShape(
    name="mixtral-8x7b",
    num_layers=32,
    num_experts=8,
    top_k=2,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
)


# ------------------------------------------------------------------------------ execution
@dataclass(frozen=True)
class Execution:
    """How kernels are issued. Host costs are zero for an engine that replays CUDA graphs."""

    name: str
    weights: str = "fp16"  # "fp16" (also bf16) or "nf4"
    host_kernel_s: float = 0.0  # PyTorch eager dispatch of one kernel
    host_linear_s: float = 0.0  # extra host time of one quantised Linear call (bitsandbytes)
    host_sync_s: float = 0.0  # one host-device synchronisation (nonzero, .tolist(), .item())
    host_layer_s: float = 0.0  # per-layer framework and control-loop cost (router stage)
    host_seq_s: float = 0.0  # per sequence in an attention stage (per-sequence KV caches)
    host_token_s: float = 0.0  # per token-to-expert assignment (per-expert queues), router stage
    step_s: float = 0.0  # per iteration: scheduling, input preparation, sampling
    step_seq_s: float = 0.0  # per sequence in the iteration
    dequant_memory_eff: float = 0.9  # bandwidth fraction of the NF4 -> fp16 dequantise kernel
    # Fraction of an op's device time not hidden behind host work of neighbouring ops: kernels
    # are queued asynchronously, so a host-bound eager engine overlaps part of the GPU's work
    # with its own Python (the per-op max(host, device) alone cannot express that).
    device_exposed: float = 1.0
    # Attention as Hugging Face eager runs it: per-sequence caches stacked into one batch tensor
    # and repeat_kv before SDPA (extra KV traffic); False: one fused kernel reading the cache.
    eager_attention: bool = False
    # Host side of a context switch (preempt_switch): stopping the iteration at a boundary,
    # keeping its state and re-entering the stage loop later. An assumption.
    switch_host_s: float = 0.0
    # Where the MoE block's loop cost (host_layer_s plus one synchronisation per expert) is
    # charged: the fraction 1 - loop_in_experts to the router stage, loop_in_experts spread
    # evenly over the layer's expert stages, every expert's stage, with tokens or not (Hugging
    # Face's eager loop visits each expert: a torch.where and a synchronisation), added after
    # the op's max(host, device) (a synchronisation drains the queue: no overlap). Per-layer
    # totals do not depend on it; what preempting between experts can save does.
    loop_in_experts: float = 0.0


# Kernels and quantised Linear calls per op in Hugging Face eager Mixtral (approximate counts:
# RMSNorm is 7 kernels, rotary 10, the cache update and repeat_kv 4, SDPA 1-3, ...).
EAGER_KERNELS = {"attention": 28, "router": 20, "expert": 7, "lm_head": 10, "step": 12}
EAGER_LINEARS = {"attention": 4, "router": 1, "expert": 3, "lm_head": 0, "step": 0}

ENGINE = Execution(
    name="engine", weights="fp16", step_s=1.5e-3, step_seq_s=10e-6, switch_host_s=50e-6
)

# Calibrated to the QLLM paper (the profile's `calibration` text says how): the host costs per
# kernel, per Linear4bit call, per synchronisation, per sequence and per token are typical
# PyTorch eager / bitsandbytes figures; device_exposed = 0.8 keeps a decode iteration at batch 32
# within the paper's 400 ms (without any overlap it would take ~0.42 s); host_layer_s was then
# solved so that a decode iteration at batch 1 (context ~300 tokens) takes ~0.305 s.
HF_EAGER_NF4 = Execution(
    name="hf-eager-nf4",
    weights="nf4",
    host_kernel_s=15e-6,
    host_linear_s=100e-6,
    host_sync_s=50e-6,
    host_layer_s=6.835e-3,
    host_seq_s=2e-6,
    host_token_s=1e-6,
    step_s=8e-3,
    step_seq_s=20e-6,
    dequant_memory_eff=0.9,
    device_exposed=0.8,
    eager_attention=True,
    switch_host_s=200e-6,
)


# ------------------------------------------------------------------------------ the model
ArrayLike = float | np.ndarray


class LayerModel:
    """Per-op times (seconds) of one layer of ``shape`` on ``hw`` under ``execution``.

    With tensor parallelism over ``tp`` GPUs (Megatron-style, as vLLM runs Mixtral) every GPU
    holds 1/tp of the attention heads, of every expert's intermediate dimension and of the
    vocabulary (the norms, the router gate and the residual stream are replicated), so each op
    runs on that shard, and each layer adds two all-reduces of the hidden states (after the
    attention's o_proj and after the MoE block), both charged to the attention stage (the MoE
    combine runs at the start of the next layer's attention, as in profiler/ops.py); the
    lm_head adds an all-gather of the logits. A ring all-reduce of S bytes takes
    2 (tp - 1) / tp x S / (link_bw x LINK_EFFICIENCY) + allreduce_latency_s.

    Methods accept scalars or numpy arrays of token counts."""

    def __init__(
        self, shape: ModelShape, hw: Hardware, execution: Execution = ENGINE, tp: int = 1
    ) -> None:
        if tp > 1 and (shape.num_key_value_heads % tp or shape.intermediate_size % tp):
            raise ValueError(f"tp={tp} does not divide the KV heads and the intermediate size")
        self.full, self.hw, self.ex, self.tp = shape, hw, execution, tp
        self.m = replace(
            shape,
            num_attention_heads=shape.num_attention_heads // tp,
            num_key_value_heads=shape.num_key_value_heads // tp,
            intermediate_size=shape.intermediate_size // tp,
            vocab_size=shape.vocab_size // tp,
        )

    def _collective(self, nbytes, ring_factor: float):
        if self.tp == 1:
            return 0.0
        hw = self.hw
        wire = ring_factor * np.asarray(nbytes, dtype=float) / (hw.link_bw * LINK_EFFICIENCY)
        return wire + hw.allreduce_latency_s

    def allreduce(self, tokens):
        """One all-reduce of ``tokens`` hidden states over the tp GPUs (0 without TP)."""
        nbytes = FP16_BYTES * np.asarray(tokens, dtype=float) * self.m.hidden_size
        return self._collective(nbytes, 2 * (self.tp - 1) / self.tp)

    # -- kernels ---------------------------------------------------------------------------
    def _roofline(self, flops, nbytes, eff: Efficiency):
        c = np.asarray(flops, dtype=float) / (self.hw.peak_flops * eff.compute)
        b = np.asarray(nbytes, dtype=float) / (self.hw.mem_bw * eff.memory)
        p = self.hw.overlap
        return (c**p + b**p) ** (1.0 / p) + eff.overhead_s

    def elementwise(self, nbytes) -> ArrayLike:
        eff = self.hw.elementwise
        return np.asarray(nbytes, dtype=float) / (self.hw.mem_bw * eff.memory) + eff.overhead_s

    def padded_tokens(self, n, out_features: int):
        n = np.asarray(n, dtype=float)
        hw = self.hw
        if out_features >= hw.wide_out_features:
            tile = np.where(n > hw.wide_large_from, hw.wide_tile_tokens_large, hw.wide_tile_tokens)
        else:
            tile = np.full_like(n, hw.tile_tokens)
        return np.where(n <= tile, n, np.ceil(n / tile) * tile)

    def gemm(self, n, k: int, out: int, eff: Efficiency, weight_bytes: float = FP16_BYTES):
        """y[n, out] = x[n, k] @ W[k, out] with fp16 activations."""
        n = np.asarray(n, dtype=float)
        flops = 2.0 * self.padded_tokens(n, out) * k * out
        nbytes = weight_bytes * k * out + FP16_BYTES * n * (k + out)
        return self._roofline(flops, nbytes, eff)

    def linear(self, n, k: int, out: int, eff: Efficiency, quantised: bool = True):
        """A Linear layer in the execution's weight format."""
        if self.ex.weights != "nf4" or not quantised:
            return self.gemm(n, k, out, eff)
        n = np.asarray(n, dtype=float)
        gemv = self.gemm(n, k, out, eff, weight_bytes=NF4_BYTES_PER_PARAM)
        deq_bytes = k * out * (NF4_BYTES_PER_PARAM + FP16_BYTES)
        dequant = deq_bytes / (self.hw.mem_bw * self.ex.dequant_memory_eff)
        dequant += self.hw.elementwise.overhead_s
        return np.where(n <= 1, gemv, dequant + self.gemm(n, k, out, eff))

    def _op(self, host, device):
        """An op's time: the host issues its kernels while the device runs them."""
        return np.maximum(host, self.ex.device_exposed * np.asarray(device, dtype=float))

    def _host(self, op: str, syncs: int = 0, extra=0.0):
        ex = self.ex
        return (
            EAGER_KERNELS[op] * ex.host_kernel_s
            + EAGER_LINEARS[op] * ex.host_linear_s
            + syncs * ex.host_sync_s
            + extra
        )

    # -- ops (one layer) -------------------------------------------------------------------
    def qkv(self, n):
        m = self.m
        out = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
        return self.linear(n, m.hidden_size, out, self.hw.proj)

    def o_proj(self, n):
        m = self.m
        return self.linear(n, m.num_attention_heads * m.head_dim, m.hidden_size, self.hw.proj)

    def _attention_common(self, tokens):
        """Device time of everything in the attention stage but the attention kernel."""
        m = self.m
        tokens = np.asarray(tokens, dtype=float)
        h, kvd = m.hidden_size, m.num_key_value_heads * m.head_dim
        qd = m.num_attention_heads * m.head_dim
        norm = self.elementwise(2 * FP16_BYTES * tokens * h)
        rope = self.elementwise(2 * FP16_BYTES * tokens * (qd + kvd))
        cache_write = self.elementwise(2 * FP16_BYTES * tokens * 2 * kvd)
        residual = self.elementwise(3 * FP16_BYTES * tokens * h)
        layer = norm + self.qkv(tokens) + rope + cache_write + self.o_proj(tokens) + residual
        return layer + 2 * self.allreduce(tokens)

    def _kv_copies(self, seqs, ctx):
        """Eager attention's extra KV traffic for ``seqs`` sequences of ``ctx`` cached tokens:
        stacking the per-sequence caches into one batch tensor (read + write) and repeat_kv
        expanding the KV heads to the query heads (read + write); 0 for a fused kernel."""
        if not self.ex.eager_attention:
            return 0.0
        m = self.m
        qd, kvd = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        kv = FP16_BYTES * seqs * ctx * 2 * kvd  # one copy of the batch's K and V
        expanded = FP16_BYTES * seqs * ctx * 2 * qd
        return self.elementwise(2 * kv) + self.elementwise(kv + expanded)

    def _kv_heads_read(self) -> int:
        """Heads whose K and V the attention kernel reads (query heads after repeat_kv)."""
        m = self.m
        return m.num_attention_heads if self.ex.eager_attention else m.num_key_value_heads

    def attn_prefill(self, n):
        """One sequence's prefill of n tokens through the attention stage (causal)."""
        return self.attn_prefill_batch(1, n)

    def attn_prefill_batch(self, batch, n):
        """A prefill batch of ``batch`` prompts, n tokens in all, through the attention stage
        in ONE call (norm and projections on all n tokens, one variable-length causal
        attention kernel), the prompts equally long: the kernel's work is batch x (n/batch)^2.
        """
        m = self.m
        b, n = np.asarray(batch, dtype=float), np.asarray(n, dtype=float)
        qd, kvd = m.num_attention_heads * m.head_dim, self._kv_heads_read() * m.head_dim
        flops = 2.0 * qd * n * n / b  # QK^T and PV, 2*s*s*d each per prompt, causal: halved
        nbytes = FP16_BYTES * n * (2 * qd + 2 * kvd)
        device = self._attention_common(n) + self._roofline(flops, nbytes, self.hw.attention)
        if self.ex.eager_attention:  # repeat_kv of the new keys and values (nothing cached)
            kv_in = m.num_key_value_heads * m.head_dim
            device = device + self.elementwise(FP16_BYTES * n * 2 * (kv_in + kvd))
        return self._op(self._host("attention", extra=self.ex.host_seq_s * b), device)

    def attn_decode(self, batch, kv_tokens):
        """A decode batch (one new token per sequence, kv_tokens cached per sequence)."""
        m = self.m
        b = np.asarray(batch, dtype=float)
        ctx = np.asarray(kv_tokens, dtype=float) + 1
        qd, kvd = m.num_attention_heads * m.head_dim, self._kv_heads_read() * m.head_dim
        flops = 4.0 * b * qd * ctx
        nbytes = FP16_BYTES * b * (2 * kvd * ctx + 2 * qd)
        device = self._attention_common(b) + self._roofline(flops, nbytes, self.hw.attention)
        device = device + self._kv_copies(b, ctx)
        return self._op(self._host("attention", extra=self.ex.host_seq_s * b), device)

    def _loop_s(self) -> float:
        """The MoE block's loop cost per layer: framework cost + a synchronisation per expert."""
        return self.ex.host_layer_s + self.m.num_experts * self.ex.host_sync_s

    def router(self, n):
        """Post-attention norm, gate, softmax and top-k; in eager mode also the per-expert
        queues and the share of the loop cost not charged to the experts."""
        m = self.m
        n = np.asarray(n, dtype=float)
        norm = self.elementwise(2 * FP16_BYTES * n * m.hidden_size)
        gate = self.linear(n, m.hidden_size, m.num_experts, self.hw.gemm)
        topk = 3 * self.elementwise(4 * n * m.num_experts)
        device = norm + gate + topk
        loop = (1 - self.ex.loop_in_experts) * self._loop_s()
        queue = loop + self.ex.host_token_s * m.top_k * n
        return self._op(self._host("router", extra=queue), device)

    def expert_idle(self) -> float:
        """An expert stage whose expert received no token: its share of the loop cost."""
        return self.ex.loop_in_experts * self._loop_s() / self.m.num_experts

    def expert_ffn(self, n):
        """One expert's FFN on n tokens: up (gate+up) projection, SiLU*mul, down projection:
        what the measured data's mlp_up_proj + mlp_act + mlp_down_proj cover."""
        m = self.m
        n = np.asarray(n, dtype=float)
        h, i = m.hidden_size, m.intermediate_size
        act = self.elementwise(3 * FP16_BYTES * n * i)
        if self.ex.weights == "nf4":  # w1 and w3 are separate Linear4bit modules
            up = 2 * self.linear(n, h, i, self.hw.gemm)
        else:
            up = self.linear(n, h, 2 * i, self.hw.gemm)
        return up + act + self.linear(n, i, h, self.hw.gemm)

    def expert(self, n):
        """expert_ffn plus gathering its tokens and the weighted scatter-add of its output."""
        n = np.asarray(n, dtype=float)
        h = self.m.hidden_size
        gather = self.elementwise(2 * FP16_BYTES * n * h)
        scatter = self.elementwise(3 * FP16_BYTES * n * h)
        device = gather + self.expert_ffn(n) + scatter
        return self._op(self._host("expert"), device) + self.expert_idle()

    def lm_head(self, batch):
        """Final norm, lm_head (kept in fp16 by bitsandbytes), greedy token per sequence."""
        m = self.m
        b = np.asarray(batch, dtype=float)
        norm = self.elementwise(2 * FP16_BYTES * b * m.hidden_size)
        head = self.linear(b, m.hidden_size, m.vocab_size, self.hw.gemm, quantised=False)
        gather = self._collective(FP16_BYTES * b * m.vocab_size * self.tp, (self.tp - 1) / self.tp)
        argmax = self.elementwise(FP16_BYTES * b * m.vocab_size * self.tp)
        return self._op(self._host("lm_head", syncs=1), norm + head + gather + argmax)

    def step_overhead(self, batch):
        """Embeddings plus the per-iteration host cost."""
        b = np.asarray(batch, dtype=float)
        embed = self.elementwise(2 * FP16_BYTES * b * self.m.hidden_size)
        host = self._host("step") + self.ex.step_s + self.ex.step_seq_s * b
        return host + embed

    def preempt_switch(self, n):
        """Saving a suspended batch's in-flight state (n new tokens: the residual stream, the
        experts' partial sums and queues, ACTIVATION_FACTOR hidden vectors per token) to a
        side buffer and copying it back on resume (two copies, each reading and writing the
        bytes at HBM bandwidth; every GPU copies its own replica in parallel), plus the
        execution's host cost of stopping and re-entering the stage loop. For the whole
        model, paid once per resume."""
        nbytes = ACTIVATION_FACTOR * self.m.hidden_size * FP16_BYTES * np.asarray(n, float)
        return 2 * self.elementwise(2 * nbytes) + self.ex.switch_host_s


# ------------------------------------------------------------------------------- profiles
# The grids reach Mixtral's 32,768-token context window (the conversation trace's longest
# prompt has 14,050 tokens) and batches of 256, so that the simulator interpolates the
# roofline, quadratic attention term included, instead of extrapolating it linearly.
PREFILL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                  3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)  # fmt: skip
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_KV = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
EXPERT_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576,
                 32768)  # fmt: skip
BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
SWITCH_TOKENS = (1, 64, 4096, 32768)  # preempt_switch is affine in its tokens

KV_UTILISATION = 0.9
ACTIVATION_FACTOR = 3  # saved hidden state + the top-2 experts' partial outputs


def weight_params(m: ModelShape) -> tuple[int, int]:
    """(parameters in Linear layers of the decoder, embedding + lm_head parameters)."""
    h, qd = m.hidden_size, m.num_attention_heads * m.head_dim
    kvd = m.num_key_value_heads * m.head_dim
    attn = h * qd + 2 * h * kvd + qd * h
    experts = m.num_experts * 3 * h * m.intermediate_size
    gate = h * m.num_experts
    return m.num_layers * (attn + experts + gate), 2 * m.vocab_size * h


def memory_for(
    m: ModelShape,
    memory_bytes: float,
    weight_bytes: float,
    tp: int = 1,
    host_bw: float = SWAP_BYTES_PER_S,
) -> Memory:
    """KV capacity: what KV_UTILISATION of the tp GPUs' memory leaves after the weights (split
    over the GPUs, as is each token's KV cache). Each GPU swaps its share of a token's KV over
    its own host link, so a swap moves at tp x ``host_bw``."""
    kv = m.kv_bytes_per_token_fp16
    free = tp * memory_bytes * KV_UTILISATION - weight_bytes
    if free < kv:
        raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights leave no room for a KV cache "
                         f"on {tp} x {memory_bytes / 1e9:.1f} GB")  # fmt: skip
    return Memory(
        kv_capacity_tokens=int(free // kv),
        kv_bytes_per_token=kv,
        activation_bytes_per_token=ACTIVATION_FACTOR * m.hidden_size * FP16_BYTES,
        swap_bytes_per_s=tp * host_bw,
    )


def op_points(model: LayerModel) -> list[OpPoint]:
    """The profile table of a layer model (medians; an analytic model has no spread, so p90 is
    the median)."""
    pts: list[OpPoint] = []

    def add(op: str, t: float, **key: int) -> None:
        ms = float(t) * 1e3
        pts.append(OpPoint(op, median_ms=ms, p90_ms=ms, **key))

    for n in PREFILL_TOKENS:
        add("attn_prefill", model.attn_prefill(n), num_tokens=n)
        for b in (b for b in PREFILL_BATCHES if b <= n):
            add("attn_prefill_batch", model.attn_prefill_batch(b, n), batch_size=b, num_tokens=n)
    for b in DECODE_BATCHES:
        for kv in DECODE_KV:
            add("attn_decode", model.attn_decode(b, kv), batch_size=b, kv_tokens=kv)
    if model.expert_idle() > 0:
        add("expert", model.expert_idle(), num_tokens=0)
    for n in EXPERT_TOKENS:
        add("router", model.router(n), num_tokens=n)
        add("expert", model.expert(n), num_tokens=n)
    for b in BATCHES:
        add("lm_head", model.lm_head(b), batch_size=b)
        add("step_overhead", model.step_overhead(b), batch_size=b)
    for n in SWITCH_TOKENS:
        add("preempt_switch", model.preempt_switch(n), num_tokens=n)
    return pts


def weight_bytes_fp16(m: ModelShape) -> float:
    linear, embed = weight_params(m)
    return (linear + embed) * FP16_BYTES


def analytic_profile(name: str, hw: Hardware, dtype: str, tp: int = 1) -> Profile:
    m = MIXTRAL_8X7B
    weights = weight_bytes_fp16(m)
    mem = memory_for(m, hw.memory_bytes, weights, tp, hw.host_bw)
    gpus = f"one {hw.name}" if tp == 1 else f"{tp} x {hw.name}"
    parallel = (
        ""
        if tp == 1
        else f" Tensor parallel over {tp} GPUs ({weights / tp / 1e9:.1f} GB of weights each; "
        f"NVLink {hw.link_bw / 1e9:g} GB/s per direction at {LINK_EFFICIENCY:.0%}, "
        f"{hw.allreduce_latency_s * 1e6:g} us per all-reduce; two all-reduces per layer)."
    )
    description = (
        f"Analytic roofline profile: Mixtral-8x7B ({dtype} weights, {weights / 1e9:.1f} GB) on "
        f"{gpus} ({hw.peak_flops / 1e12:.0f} TFLOP/s dense, {hw.mem_bw / 1e12:.2f} TB/s, "
        f"{hw.memory_bytes / MIB:,.0f} MiB per GPU), served by an optimised engine (fused "
        "attention, one attention call over a whole prefill batch, no per-kernel host cost, "
        f"a fixed per-iteration host cost).{parallel} KV capacity = ({tp} x "
        f"{hw.memory_bytes / MIB:,.0f} MiB x "
        f"{KV_UTILISATION} - weights) / kv_bytes_per_token. KV swapped to host memory moves at "
        f"{mem.swap_bytes_per_s / 1e9:g} GB/s ({tp} x {hw.host_bw / 1e9:g} GB/s over PCIe, "
        "assumed). p90 equals the median (the model has no spread)."
    )
    calibration = (
        "Roofline per kernel: smooth max(flops / (peak x eff_compute), bytes / (bandwidth x "
        "eff_memory)) + a fixed per-kernel overhead, GEMM tokens padded to the tile size. "
        "Efficiencies fitted to measured A100 op times (Vidur project profiling data, "
        "Microsoft, MIT licence): one Mixtral expert (mlp_up_proj + mlp_act + mlp_down_proj) "
        "within 10% at every token count 1..4096; attention projections fitted separately. "
        "The same efficiencies are assumed on the H100 and H200. The attention kernel "
        "(50% of peak compute, 75% of peak bandwidth), the per-iteration host cost "
        f"({ENGINE.step_s * 1e3:g} ms + {ENGINE.step_seq_s * 1e6:g} us per sequence) and the "
        f"context switch's host cost ({ENGINE.switch_host_s * 1e6:g} us) are assumptions. "
        "attn_prefill_batch assumes equally long prompts. Generated by "
        "`python -m profiler.analytic --write`."
    )
    return Profile(
        name=name,
        source="analytic",
        description=description,
        calibration=calibration,
        device=gpus,
        dtype=dtype,
        model=replace(m),
        memory=mem,
        points=op_points(LayerModel(m, hw, ENGINE, tp)),
        created=CREATED,
        extra=_extra(ENGINE, hw, tp, weights),
        prefill_attention="batched",
    )


def _extra(ex: Execution, hw: Hardware, tp: int, weights: float) -> dict:
    """What the profile's physical claims rest on (tests check them)."""
    return {
        "generator": "profiler.analytic",
        "execution": ex.name,
        "tensor_parallel": tp,
        "gpu_memory_bytes": hw.memory_bytes,
        "gpu_mem_bw_bytes_per_s": hw.mem_bw,
        "weight_bytes": weights,
    }


# As reported by the QLLM paper ("about 22.9 GB"), read in GiB as nvidia-smi reports memory (and
# as the A100's "80 GB" is read: 81,920 MiB): 24.6e9 bytes, the 24.5e9 NF4_BYTES_PER_PARAM
# gives. Read as 1e9 bytes it left 3% more KV (415,110 tokens against 402,227).
NF4_WEIGHTS_GIB = 22.9
NF4_TARGET_S = (0.30, 0.40)


def nf4_profile(name: str = "a100-mixtral-nf4-hf", loop_in_experts: float = 0.0) -> Profile:
    """The paper's setting; ``loop_in_experts`` places the MoE loop cost (Execution)."""
    m, hw = MIXTRAL_8X7B, A100
    ex = replace(HF_EAGER_NF4, loop_in_experts=loop_in_experts)
    weights = NF4_WEIGHTS_GIB * 2**30
    mem = memory_for(m, hw.memory_bytes, weights, host_bw=hw.host_bw)
    description = (
        "Mixtral-8x7B on one NVIDIA A100 80GB with 4-bit NF4 bitsandbytes weights (double "
        "quantisation), fp16 compute and KV cache, Hugging Face transformers in PyTorch eager "
        "mode: the setting the QLLM paper (EuroMLSys 2025) measured. Execution model "
        f"'{ex.name}' of profiler/analytic.py: each op takes max(host, "
        f"{ex.device_exposed:g} x device); the host issues every kernel from Python, every "
        "Linear4bit call and every synchronisation; on the device a 4-bit Linear on one token "
        "is a gemv over the packed weights, on more tokens an NF4 -> fp16 dequantisation of the "
        "whole weight followed by an fp16 GEMM (A100-fitted roofline); attention stacks the "
        "per-sequence KV caches and expands the KV heads (repeat_kv) before SDPA, so decode "
        "attention grows with batch x context once that traffic outweighs the host cost. "
        "A prefill batch's attention is one call over all its prompts (prefill_attention "
        "'batched': Hugging Face runs one forward over the batch, TGI one variable-length "
        "call), so the stage's host cost is paid once per batch, not once per prompt. "
        "p90 equals the median."
    )
    calibration = (
        "Target: the QLLM paper's measurement that one decode iteration of Mixtral-8x7B (4-bit, "
        "HF eager, A100) at batch 1..32 takes 300-400 ms. Device side: the A100 roofline "
        "fitted to the Vidur measurements (fp16 GEMMs, elementwise kernels); NF4 dequantisation "
        f"streams at {ex.dequant_memory_eff:.0%} of peak bandwidth. Host side, fixed at "
        f"typical PyTorch eager / bitsandbytes figures: {ex.host_kernel_s * 1e6:g} us per "
        f"kernel, {ex.host_linear_s * 1e6:g} us per Linear4bit call, "
        f"{ex.host_sync_s * 1e6:g} us per synchronisation (one per expert in the MoE "
        f"loop), {ex.host_seq_s * 1e6:g} us per sequence per attention stage, "
        f"{ex.host_token_s * 1e6:g} us per token-to-expert assignment (per-expert queues), "
        f"{ex.step_s * 1e3:g} ms + {ex.step_seq_s * 1e6:g} us per sequence per iteration. "
        "Each op takes max(host, exposed device time); the exposed fraction "
        f"{ex.device_exposed:g} was chosen so that batch 32 stays within 400 ms (with no "
        "overlap it would take ~0.42 s: 8 active experts per layer, each dequantising its "
        "three matrices, against 2 at batch 1). The remaining per-layer framework cost, "
        f"{ex.host_layer_s * 1e3:g} ms (paid once per layer and batch), was then solved so "
        "that sim.latency.LatencyModel plans a decode iteration of 1 sequence with a "
        "300-token context at ~0.305 s; 32 sequences plan at ~0.393 s, increasing in between "
        "(checked by tests/test_analytic.py). Placement of the MoE loop cost (the framework "
        f"cost and the {m.num_experts} synchronisations, {_loop_ms(ex):.3g} ms per layer): "
        f"{1 - loop_in_experts:.0%} in the router stage, {loop_in_experts:.0%} spread evenly "
        "over the layer's expert stages (every expert's, with tokens or not), a stated "
        "assumption that does not change any iteration's total; it decides how much of a "
        "layer lies between expert boundaries, hence what expert-level preemption can gain "
        "over layer-level. A 128-token "
        "prefill of one sequence plans at ~0.40 s, 1024 tokens at ~0.50 s. Memory: 22.9 GiB of "
        "weights (the paper's 22.9 GB, as nvidia-smi reports it) on 80 GB (81,920 MiB); KV "
        "cache in fp16, "
        f"{mem.kv_bytes_per_token} bytes/token (2 x 32 layers x 8 KV heads x 128 x 2 bytes); "
        f"kv_capacity_tokens = (81,920 MiB x {KV_UTILISATION} - 22.9 GiB) / "
        f"{mem.kv_bytes_per_token} = {mem.kv_capacity_tokens}; activation_bytes_per_token = "
        f"hidden 4096 x 2 bytes x {ACTIVATION_FACTOR} (the saved hidden state and the top-2 "
        "experts' partial outputs of a suspended sequence); KV swapped to host memory moves at "
        f"{mem.swap_bytes_per_s / 1e9:g} GB/s (PCIe Gen4 x16, assumed). preempt_switch: those "
        "bytes copied out and back at HBM bandwidth plus an assumed "
        f"{ex.switch_host_s * 1e6:g} us of host time per resume."
    )
    return Profile(
        name=name,
        source="calibrated",
        description=description,
        calibration=calibration,
        device=hw.name,
        dtype="nf4-weights/fp16-compute",
        model=replace(m),
        memory=mem,
        points=op_points(LayerModel(m, hw, ex)),
        created=CREATED,
        extra=_extra(ex, hw, 1, weights),
        prefill_attention="batched",
    )


def _loop_ms(ex: Execution) -> float:
    return LayerModel(MIXTRAL_8X7B, A100, ex)._loop_s() * 1e3


def builtin_profiles() -> list[Profile]:
    return [
        analytic_profile("a100x2-mixtral-fp16", A100, "fp16", tp=2),
        analytic_profile("h100x2-mixtral-bf16", H100, "bf16", tp=2),
        analytic_profile("h200-mixtral-bf16", H200, "bf16"),
        nf4_profile(),
        nf4_profile("a100-mixtral-nf4-hf-expertcost", loop_in_experts=1.0),
    ]


def write_profiles(out: str | Path = PROFILES_DIR) -> list[Path]:
    return [p.save(Path(out) / p.name) for p in builtin_profiles()]


# ----------------------------------------------------------------------- measured A100 data
class DataError(ValueError):
    """The measured CSV is missing or malformed."""


MEASURED_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj")
CHECK_MAX_TOKENS = 4096


@dataclass
class Measured:
    num_tokens: np.ndarray
    median_ms: dict[str, np.ndarray]  # per op of MEASURED_OPS

    @property
    def expert_ms(self) -> np.ndarray:
        t = self.median_ms
        return t["mlp_up_proj"] + t["mlp_act"] + t["mlp_down_proj"]


def read_measured(path: str | Path, max_tokens: int = CHECK_MAX_TOKENS) -> Measured:
    """Rows with num_tensor_parallel_workers == 1 and num_tokens <= max_tokens (every row is a
    point: token counts measured twice count twice)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (or not a regular file)")
    cols = ["num_tokens", "num_tensor_parallel_workers"]
    cols += [f"time_stats.{op}.median" for op in MEASURED_OPS]
    tokens: list[float] = []
    med: dict[str, list[float]] = {op: [] for op in MEASURED_OPS}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in cols if c not in (reader.fieldnames or ())]
            if missing:
                raise DataError(f"{path}: missing columns {', '.join(missing)}")
            for lineno, row in enumerate(reader, start=2):
                try:
                    if int(float(row["num_tensor_parallel_workers"])) != 1:
                        continue
                    n = int(float(row["num_tokens"]))
                    values = [float(row[f"time_stats.{op}.median"]) for op in MEASURED_OPS]
                except (TypeError, ValueError):
                    raise DataError(f"{path}:{lineno}: malformed row") from None
                if not 1 <= n <= max_tokens:
                    continue
                if not all(math.isfinite(v) and v > 0 for v in values):
                    raise DataError(f"{path}:{lineno}: non-positive or non-finite time")
                tokens.append(n)
                for op, v in zip(MEASURED_OPS, values, strict=True):
                    med[op].append(v)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a text CSV file") from None
    if not tokens:
        wanted = f"num_tensor_parallel_workers == 1 and 1 <= num_tokens <= {max_tokens}"
        raise DataError(f"{path}: no rows with {wanted}")
    return Measured(np.array(tokens, dtype=float), {k: np.array(v) for k, v in med.items()})


def _vidur_layer(hw: Hardware) -> LayerModel:
    """The measured file's shape: one Mixtral expert / Mixtral's attention projections."""
    return LayerModel(MIXTRAL_8X7B, hw, ENGINE)


def compare(data: Measured, hw: Hardware = A100) -> dict[str, np.ndarray]:
    """Relative errors model/measured - 1 per compared op."""
    lm, n = _vidur_layer(hw), data.num_tokens
    return {
        "expert": lm.expert_ffn(n) * 1e3 / data.expert_ms - 1,
        "attn_pre_proj": lm.qkv(n) * 1e3 / data.median_ms["attn_pre_proj"] - 1,
        "attn_post_proj": lm.o_proj(n) * 1e3 / data.median_ms["attn_post_proj"] - 1,
    }


def check(path: str | Path, out=sys.stdout) -> float:
    data = read_measured(path)
    worst = 0.0
    lo, hi = int(data.num_tokens.min()), int(data.num_tokens.max())
    for op, err in compare(data).items():
        a = np.abs(err) * 100
        worst = max(worst, float(a.max()))
        at = int(data.num_tokens[int(np.argmax(a))])
        line = f"op={op} max_error_pct={a.max():.2f} median_error_pct={np.median(a):.2f}"
        print(f"{line} points={a.size} tokens={lo}..{hi} worst_at_tokens={at}", file=out)
    print(f"max_error_pct={worst:.2f}", file=out)
    return worst


# -------------------------------------------------------------------------------- fitting
def _search(f: Callable[[np.ndarray], float], lo, hi, grid=8, starts=8, iters=300):
    """Minimise f over a box (derivative-free; f may be a max of errors): the best points of a
    coarse grid, each refined by a pattern search along the axes and along seeded random
    directions with a shrinking step. Deterministic."""
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    axes = [np.linspace(a, b, grid) for a, b in zip(lo, hi, strict=True)]
    pts = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(lo))
    vals = np.array([f(x) for x in pts])
    rng = np.random.default_rng(0)
    best = (np.inf, pts[0])
    for i in np.argsort(vals)[:starts]:
        x, fx, step = pts[i], vals[i], (hi - lo) / grid
        dirs = np.vstack([np.eye(len(lo)), rng.standard_normal((8 * len(lo), len(lo)))])
        for _ in range(iters):
            improved = False
            for d in dirs:
                for sign in (1, -1):
                    y = np.clip(x + sign * d * step, lo, hi)
                    fy = f(y)
                    if fy < fx:
                        x, fx, improved = y, fy, True
            if not improved:
                step = step / 2
                if np.all(step < (hi - lo) * 1e-5):
                    break
        if fx < best[0]:
            best = (fx, x)
    return best[1], best[0]


def fit(data: Measured) -> dict:
    """Refit the A100 efficiencies by minimax relative error: ``elementwise`` on mlp_act,
    ``gemm`` and ``overlap`` on one expert (mlp_up_proj + mlp_act + mlp_down_proj, with the
    fitted elementwise model for the activation), ``proj`` on attn_pre_proj and
    attn_post_proj. Overheads are searched in microseconds."""
    n, act = data.num_tokens, data.median_ms["mlp_act"]
    i = MIXTRAL_8X7B.intermediate_size

    def act_err(x):
        lm = _vidur_layer(replace(A100, elementwise=Efficiency(1.0, x[0], x[1] * 1e-6)))
        return float(np.max(np.abs(lm.elementwise(3 * FP16_BYTES * n * i) * 1e3 / act - 1)))

    x, e_act = _search(act_err, [0.2, 0], [0.95, 30], grid=16)
    hw = replace(A100, elementwise=Efficiency(1.0, round(x[0], 4), round(x[1], 2) * 1e-6))

    def gemm_err(x):
        g = replace(hw, gemm=Efficiency(x[0], x[1], x[2] * 1e-6), overlap=x[3])
        t = _vidur_layer(g).expert_ffn(n) * 1e3
        return float(np.max(np.abs(t / data.expert_ms - 1)))

    x, e_gemm = _search(gemm_err, [0.4, 0.4, 0, 1.5], [1, 0.95, 30, 8], grid=6)
    gemm = Efficiency(round(x[0], 4), round(x[1], 4), round(x[2], 2) * 1e-6)
    hw = replace(hw, gemm=gemm, overlap=round(x[3], 2))

    def proj_err(x):
        err = compare(data, replace(hw, proj=Efficiency(x[0], x[1], x[2] * 1e-6)))
        return float(max(np.abs(err["attn_pre_proj"]).max(), np.abs(err["attn_post_proj"]).max()))

    x, e_proj = _search(proj_err, [0.4, 0.4, 0], [1, 0.95, 30], grid=8)
    hw = replace(hw, proj=Efficiency(round(x[0], 4), round(x[1], 4), round(x[2], 2) * 1e-6))
    return {
        "gemm": hw.gemm,
        "proj": hw.proj,
        "elementwise": hw.elementwise,
        "overlap": hw.overlap,
        "max_error": {"mlp_act": e_act, "expert": e_gemm, "attn_proj": e_proj},
    }


# ------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m profiler.analytic", description=summary)
    g = ap.add_mutually_exclusive_group(required=True)
    default = f"(default: {MEASURED_CSV.relative_to(MEASURED_CSV.parents[2])})"
    g.add_argument("--check", metavar="CSV", nargs="?", const=str(MEASURED_CSV),
                   help=f"compare the A100 model with measured op times {default}")  # fmt: skip
    g.add_argument("--fit", metavar="CSV", nargs="?", const=str(MEASURED_CSV),
                   help=f"refit the A100 efficiencies and print them {default}")  # fmt: skip
    g.add_argument("--write", action="store_true", help="write the built-in profiles")
    ap.add_argument("--out", default=str(PROFILES_DIR), help="directory for --write")
    args = ap.parse_args(argv)
    try:
        if args.check:
            check(args.check)
        elif args.fit:
            fitted = fit(read_measured(args.fit))
            for k, v in fitted.items():
                if isinstance(v, Efficiency):
                    v = f"Efficiency({v.compute:.4g}, {v.memory:.4g}, {v.overhead_s:.4g})"
                elif isinstance(v, dict):
                    v = " ".join(f"{op}={e * 100:.2f}%" for op, e in v.items())
                print(f"{k}: {v}")
        else:
            for path in write_profiles(args.out):
                print(f"wrote {path}")
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
