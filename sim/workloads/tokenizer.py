"""Mixtral's SentencePiece tokenizer (32,000 tokens), as shipped by the mistral-common package."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import sentencepiece

from sim.config import UserError


def package_file(module: str, distribution: str, *parts: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package
    (only its data is needed, not its heavy imports). Looked up only when a workload needs it,
    so that without the package (as on the GPU machine) everything else still imports."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise UserError(
            f"package={distribution}: not installed, and this workload reads its data; install "
            "it, or use workload=synthetic or workload=trace"
        )
    return Path(spec.origin).parent.joinpath(*parts)


def tokenizer_file() -> Path:
    return package_file("mistral_common", "mistral-common", "data", "tokenizer.model.v1")


@cache
def _processor() -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_file()))


def count_tokens(texts: Sequence[str]) -> list[int]:
    """Token count of each text, without the BOS token."""
    return [len(ids) for ids in _processor().encode(list(texts))]
