"""The token ids each request feeds the model, and the request list both executors replay.

A request with text (ShareGPT, HumanEval) is tokenized by the model's own tokenizer when the
model has one (a checkpoint at ``model.path``). Otherwise (the random tiny presets, synthetic
and trace workloads) its prompt is ``prompt_tokens`` ids drawn from the model's vocabulary,
seeded by (seed, request id), so a request's prompt does not depend on the rest of the list.

Prompts longer than ``max_prompt_tokens`` are cut to it (keeping their start), and each
request is rewritten with its real prompt length: the scheduler, the simulator and the metrics
then all see the tokens the model actually runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from policies.core import Request

# the files that say a checkpoint has a tokenizer of its own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer, or None when there is no checkpoint or it has none."""
    if not path:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        files = [f for f in TOKENIZER_FILES if (Path(path) / f).is_file()]
        if files:  # it has one that did not load (a missing package, a broken file)
            print(f"warning: {path} has a tokenizer ({', '.join(files)}) that did not load "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the "
                  "prompts are random token ids", file=sys.stderr)  # fmt: skip
        return None


def random_ids(n: int, vocab_size: int, seed: int, request_id: int) -> list[int]:
    return np.random.default_rng([seed, request_id]).integers(0, vocab_size, n).tolist()


def build_prompts(
    requests: Sequence[Request],
    vocab_size: int,
    max_prompt_tokens: int,
    seed: int,
    tokenizer=None,
) -> tuple[list[Request], dict[int, list[int]]]:
    """(requests with their real prompt lengths, request id -> prompt token ids)."""
    if max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")
    out, prompts = [], {}
    for r in requests:
        ids = []
        if tokenizer is not None and r.text:
            ids = tokenizer(r.text)["input_ids"][:max_prompt_tokens]
        if not ids:
            ids = random_ids(min(r.prompt_tokens, max_prompt_tokens), vocab_size, seed, r.id)
        prompts[r.id] = ids
        out.append(dataclasses.replace(r, prompt_tokens=len(ids)))
    return out, prompts
