"""The console scripts' entry points (pyproject.toml). Each imports its tool inside a guard:
Python spends seconds importing pandas, Hydra and torch before the tool's own Ctrl-C handling
(``sim.cli.run``) is in place, and an interrupt there printed Python's traceback. Here it
prints one line, as an interrupt later does, and exits 130."""

from __future__ import annotations

import importlib
import os
import sys


def start(module: str) -> None:
    """Import ``module`` and call its ``cli``; Ctrl-C while it imports: one line, exit 130."""
    try:
        cli = importlib.import_module(module).cli
    except KeyboardInterrupt:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else module
        print(f"{prog}: interrupted: nothing ran (it was starting)", file=sys.stderr, flush=True)
        sys.exit(130)
    cli()


def sim() -> None:
    start("sim.app")


def report() -> None:
    start("sim.report")


def plan() -> None:
    start("sim.plan")


def profile() -> None:
    start("profiler.app")


def realrun() -> None:
    start("realrun.app")


def validate() -> None:
    start("realrun.validate")
