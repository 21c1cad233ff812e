"""Build the Hugging Face MoE models the profiler and the real engine run.

Models come from a transformers config class with deterministic random weights (a preset
below, optionally with config overrides), or from a local checkpoint directory. Nothing is
ever downloaded: ``from_pretrained`` runs with ``local_files_only=True``.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from profiler.schema import ModelShape

_TINY = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, max_position_embeddings=4096)

# name -> (transformers config class, keyword arguments). The tiny ones run on a CPU in seconds;
# eos/bos are unset so generation never stops early (the engine decides output lengths).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-mixtral": (
        "MixtralConfig",
        dict(_TINY, num_hidden_layers=4, intermediate_size=256, num_key_value_heads=2,
             num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    ),
    "tiny-qwen2-moe": (
        "Qwen2MoeConfig",
        dict(_TINY, num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=128,
             shared_expert_intermediate_size=256, num_key_value_heads=2, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=False),
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        dict(_TINY, num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=128,
             num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, use_sliding_window=False),
    ),
    "tiny-olmoe": (
        "OlmoeConfig",
        dict(_TINY, num_hidden_layers=3, intermediate_size=128, num_key_value_heads=4,
             num_experts=8, num_experts_per_tok=2),
    ),
    "tiny-deepseek-v3": (
        "DeepseekV3Config",
        dict(_TINY, num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=64,
             num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
             q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
             v_head_dim=32),
    ),
    # The full Mixtral-8x7B shape (46.7B parameters): random bf16 weights, for a large GPU.
    "mixtral-8x7b": (
        "MixtralConfig",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=32768,
             sliding_window=None),
    ),
}  # fmt: skip
DEFAULT_MODEL = "tiny-mixtral"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}  # fmt: skip
# Head-room over the weights for activations, KV cache and the allocator.
MEMORY_MARGIN = 1.15


class ModelError(Exception):
    """The model cannot be built as asked (unknown name, bad path, not enough memory)."""


@dataclass
class ModelInfo:
    name: str
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    num_params: int
    source: str  # "preset" or the checkpoint directory

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype.itemsize


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is a user error. A CUDA
    device becomes the current one: CUDA events record on the current device's stream, and
    synchronize waits for it, so ``cuda:1`` timed device 0's idle stream (each stage the host's
    gap between two records) while its kernels ran on device 1."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device={device} asked for, but torch sees no CUDA device")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelError(f"unknown device {device!r}; expected auto, cpu or cuda")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:<index>") \
            from None  # fmt: skip
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ModelError(f"device={device}: torch sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")  # fmt: skip
        if dev.index is not None:
            torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def build_model(
    cfg: Any = DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
) -> tuple[PreTrainedModel, ModelInfo]:
    """A model in eval mode and its description.

    ``cfg`` is a preset name or a mapping ``{name, path, config}`` (the Hydra ``model`` group):
    ``path`` loads a local checkpoint, ``config`` overrides preset config fields.
    """
    if isinstance(cfg, str):
        cfg = {"name": cfg}
    name = _get(cfg, "name") or DEFAULT_MODEL
    path = _get(cfg, "path")
    overrides = dict(_get(cfg, "config") or {})
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if path:  # named after its directory, not after the group's default preset
        if overrides:  # they went nowhere, and the run's config said they had applied
            raise ModelError(f"model.config {sorted(overrides)} with model.path={path}: the "
                             "overrides apply to a preset only (a checkpoint's config.json "
                             "is its own); drop them, or edit the checkpoint's config")  # fmt: skip
        model, source = _load_local(str(path), dev, dt), str(path)
        name = os.path.basename(os.path.normpath(str(path)))
    else:
        model, source = _build_preset(name, overrides, dev, dt, seed), "preset"
    model.eval()
    info = ModelInfo(
        name=name,
        shape=model_shape(model, name),
        device=dev,
        dtype=dt,
        num_params=sum(p.numel() for p in model.parameters()),
        source=source,
    )
    return model, info


def _build_preset(
    name: str, overrides: dict, device: torch.device, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    if name not in PRESETS:
        raise ModelError(f"unknown model {name!r}; expected one of {sorted(PRESETS)} or model.path")
    class_name, kwargs = PRESETS[name]
    config_class = getattr(transformers, class_name)
    # transformers keeps an unknown key as a plain attribute: a misspelt override
    # (num_local_expert=4) built the preset as it is, recorded as overridden, without a word.
    # A warning, not an error: a model may read a key its config class does not declare
    # (tiny-qwen3-moe's head_dim), which the preset's own keys show
    known = {*config_class().to_dict(), *getattr(config_class, "attribute_map", {}), *kwargs,
             *inspect.signature(config_class.__init__).parameters}  # fmt: skip
    for key in sorted(set(overrides) - known):
        print(f"warning: model.config.{key} is not a field of {class_name}: transformers "
              "keeps it, but the model may read nothing of it (a misspelt key?); the preset's "
              f"fields include {', '.join(sorted(kwargs))}", file=sys.stderr)  # fmt: skip
    try:
        config = config_class(**{**kwargs, "bos_token_id": None, "eos_token_id": None, **overrides})
    except (TypeError, ValueError) as e:
        raise ModelError(f"model {name}: bad config override ({e})") from None
    _check_memory(name, config, device, dtype)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    # Build directly on the target device: the full-size shapes would not fit in host memory.
    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa", **_experts_kwargs(dtype)
        )


def _experts_kwargs(dtype: torch.dtype) -> dict:
    # transformers' default experts kernel (grouped_mm) has no float64 version.
    return {"experts_implementation": "eager"} if dtype == torch.float64 else {}


def _load_local(path: str, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    if not os.path.isdir(path):
        raise ModelError(f"model.path={path} is not a directory")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"model.path={path}: no loadable config ({str(e).splitlines()[0]})"
        ) from None
    _check_memory(path, config, device, dtype)
    # Loaded on the host, then moved: placing weights at load time (device_map) needs the
    # accelerate package, which this project does not depend on.
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            dtype=dtype,
            attn_implementation="sdpa",
            **_experts_kwargs(dtype),
        )
    except (OSError, ValueError) as e:  # no weights, or weights of another shape
        raise ModelError(f"model.path={path}: no loadable weights ({str(e).splitlines()[0]})") \
            from None  # fmt: skip
    return model.to(device)


def count_params(config: Any) -> int:
    """Parameter count of a config's model, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # and what torch's caching allocator holds unused (freed tensors: a decode batch's
        # padded KV, finished sequences' caches), which the driver counts as taken
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:  # MemAvailable counts reclaimable page cache, unlike the free page count
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_memory(name: str, config: Any, device: torch.device, dtype: torch.dtype) -> None:
    need = count_params(config) * dtype.itemsize * MEMORY_MARGIN
    have = available_bytes(device)
    if need > have:
        raise ModelError(
            f"model {name} needs about {need / 2**30:.0f} GiB on {device} ({dtype}), "
            f"only {have / 2**30:.0f} GiB free; use a tiny model or a larger GPU"
        )


def model_shape(model: PreTrainedModel, name: str) -> ModelShape:
    """The profile's description of a model, read from its config and its first MoE block."""
    c = model.config.get_text_config(decoder=True)
    moe = next((layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")), None)
    if moe is None:
        raise ModelError(f"model {name}: no MoE layer (no .mlp.experts) found")
    experts = moe.experts
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if hasattr(c, "qk_nope_head_dim"):  # multi-head latent attention (DeepSeek)
        head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    return ModelShape(
        name=name,
        num_layers=c.num_hidden_layers,
        num_experts=experts.num_experts,
        top_k=c.num_experts_per_tok,
        hidden_size=c.hidden_size,
        intermediate_size=experts.intermediate_dim,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=head_dim,
        vocab_size=c.vocab_size,
    )
