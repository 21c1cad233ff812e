"""Request traces: CSV rows ``arrived_at,num_prefill_tokens,num_decode_tokens`` (Splitwise)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from sim.config import UserError
from sim.workloads.cache import Pool

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


def read_trace(path: Path) -> tuple[np.ndarray, Pool]:
    """Arrival timestamps (seconds) and lengths of every row, validated strictly: any bad row
    stops the run with one line naming the file, the line and what was expected."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"workload.path={path}: file not found")

    def fail(line: int, expected: str) -> UserError:
        return UserError(f"workload.path={path}, line {line}: expected {expected}")

    arrived, prompt, output = [], [], []
    with path.open(newline="", encoding="utf-8-sig") as f:  # tolerate a BOM
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise fail(1, f"a header with columns {','.join(COLUMNS)} (missing {missing})")
        where = [header.index(c) for c in COLUMNS]
        for row in reader:
            if not row:
                continue
            line = reader.line_num
            if len(row) != len(header):
                raise fail(line, f"{len(header)} values like the header, got {len(row)}")
            t, p, o = (row[i].strip() for i in where)
            try:
                t = float(t)
            except ValueError:
                raise fail(line, f"a number for arrived_at, got {t!r}") from None
            if not math.isfinite(t) or t < 0:
                raise fail(line, f"arrived_at >= 0 seconds, got {t}")
            if arrived and t < arrived[-1]:
                raise fail(line, f"arrived_at >= the previous row's {arrived[-1]}, got {t}")
            arrived.append(t)
            for name, value, out in ((COLUMNS[1], p, prompt), (COLUMNS[2], o, output)):
                try:
                    tokens = int(value)
                except ValueError:
                    raise fail(line, f"an integer for {name}, got {value!r}") from None
                if tokens < 1:
                    raise fail(line, f"{name} >= 1, got {tokens}")
                out.append(tokens)
    if not arrived:
        raise fail(2, "at least one request after the header")
    return np.array(arrived), Pool(np.array(prompt), np.array(output))
