"""What the GPU machine has and what the bundle adds (read by the tests and the dry run)."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The project's own top-level packages: they travel with the working tree.
PROJECT = {"policies", "sim", "profiler", "realrun", "gpu", "benchmarks", "tests", "conftest"}


def normalize(distribution: str) -> str:
    """A distribution's canonical name (PEP 503): ``PyYAML`` and ``pyyaml`` are one package."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _names(path: Path) -> set[str]:
    words = (w for line in path.read_text().splitlines() for w in line.partition("#")[0].split())
    return {normalize(w.partition("==")[0]) for w in words}


def machine_packages() -> set[str]:
    return _names(HERE / "machine-packages.txt")


def bundle_packages() -> set[str]:
    return _names(HERE / "bundle.txt")
