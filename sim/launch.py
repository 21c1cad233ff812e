"""The console scripts' entry points (pyproject.toml). Each imports its tool inside a guard:
Python spends seconds importing pandas, Hydra and torch before the tool's own Ctrl-C handling
(``sim.cli.run``) is in place, and an interrupt there printed Python's traceback. Here it
prints one line, as an interrupt later does, and exits 130."""

from __future__ import annotations

import functools
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


# one per console script
sim = functools.partial(start, "sim.app")
report = functools.partial(start, "sim.report")
plan = functools.partial(start, "sim.plan")
profile = functools.partial(start, "profiler.app")
realrun = functools.partial(start, "realrun.app")
validate = functools.partial(start, "realrun.validate")
