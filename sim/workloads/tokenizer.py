"""Mixtral's SentencePiece tokenizer (32,000 tokens), as shipped by the mistral-common package."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import sentencepiece

# Found without importing mistral_common: only its data file is needed, not its heavy imports.
TOKENIZER_FILE = (
    Path(importlib.util.find_spec("mistral_common").origin).parent / "data" / "tokenizer.model.v1"
)


@cache
def _processor() -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(TOKENIZER_FILE))


def count_tokens(texts: Sequence[str]) -> list[int]:
    """Token count of each text, without the BOS token."""
    return [len(ids) for ids in _processor().encode(list(texts))]
