"""On-disk cache of tokenized data sets, so that only the first run pays for tokenizing."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sim.workloads.tokenizer import tokenizer_file

FORMAT_VERSION = 2  # bump when what a cached table means changes
_META_KEY = b"qllm_meta"


@dataclass(frozen=True)
class Pool:
    """Request lengths (and prompt texts, when known) that a workload draws from."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    text: list[str] | None = None
    meta: dict[str, str] = field(default_factory=dict)  # facts about the source, kept in the cache

    def __len__(self) -> int:
        return len(self.prompt_tokens)


def cache_dir() -> Path:
    return Path(os.environ.get("QLLM_CACHE_DIR") or Path.home() / ".cache" / "qllm-sim")


def _file_id(path: Path) -> list:
    # the change time too: an edit that keeps the size and restores the modification time
    # (cp -p, rsync -a, tar) still changes it, and no user can set it back
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


@functools.cache
def builders_digest() -> str:
    """The sources of this package (the code that reads, salvages and tokenizes data sets):
    a table cached by other code is not today's, whether or not FORMAT_VERSION was bumped."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_file(source: Path, params: dict) -> Path:
    """Where the pool built from ``source`` with ``params`` is cached; any change to the source
    file, the tokenizer, the parameters or the code that builds pools gives a new key."""
    key = json.dumps(
        {
            "version": FORMAT_VERSION,
            "code": builders_digest(),
            "source": _file_id(source),
            "tokenizer": _file_id(tokenizer_file()),
            "params": params,
        },
        sort_keys=True,
    )
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.parquet"


def cached_pool(source: Path, params: dict, build: Callable[[], Pool]) -> Pool:
    """The cached pool for (source, params), built and stored on a miss."""
    path = cache_file(source, params)
    try:
        return _read(path)
    except (OSError, ValueError, KeyError):
        pass  # missing, or not a table this version wrote: rebuild it
    pool = build()
    try:
        _write(pool, path)
    except OSError as e:  # a read-only cache costs time on every run, but breaks nothing
        print(f"warning: cannot write the token cache {path}: {e}", file=sys.stderr)
    return pool


def _read(path: Path) -> Pool:
    table = pq.read_table(path)
    return Pool(
        prompt_tokens=table["prompt_tokens"].to_numpy(),
        output_tokens=table["output_tokens"].to_numpy(),
        text=table["text"].to_pylist(),
        meta=json.loads((table.schema.metadata or {})[_META_KEY]),
    )


def _write(pool: Pool, path: Path) -> None:
    table = pa.table(
        {
            "prompt_tokens": pa.array(pool.prompt_tokens, pa.int32()),
            "output_tokens": pa.array(pool.output_tokens, pa.int32()),
            "text": pa.array(pool.text, pa.string()),
        },
        metadata={_META_KEY: json.dumps(pool.meta).encode()},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: a concurrent run never reads half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
