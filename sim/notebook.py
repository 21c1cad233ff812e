"""What the notebooks share: where their input lies."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def results_dir(default: Path | None) -> Path | None:
    """``$QLLM_RESULTS`` as the user meant it, else ``default``.

    A kernel runs in the notebook's directory, not where the user typed the command, so a
    relative path is looked up first from the directory the command was run in (``$PWD``: the
    shell sets it and Jupyter's kernel inherits it unchanged), then from the repository root.
    """
    value = os.environ.get("QLLM_RESULTS")
    if not value:
        return default
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    bases = [Path(os.environ["PWD"])] if os.environ.get("PWD") else []
    candidates = [base / path for base in [*bases, ROOT]]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    tried = " or ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"QLLM_RESULTS={value}: no such directory ({tried})")


def newest_sweep(root: Path = ROOT) -> Path:
    """The sweep under ``root``/results/sweeps/ (at any depth) whose multirun.yaml was written
    last. (By path, a folder named by hand sorted after every dated one, however old, and a
    sweep at another depth than <date>/<time> was never found.)"""
    sweeps = list((root / "results" / "sweeps").rglob("multirun.yaml"))
    if not sweeps:
        raise FileNotFoundError(
            "no sweep under results/sweeps/: run qllm-sim -m ... or set QLLM_RESULTS"
        )
    return max(sweeps, key=lambda p: p.stat().st_mtime).parent
