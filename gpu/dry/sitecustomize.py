"""The GPU machine's Python, simulated in this one (``make gpu-check-dry``): a top-level module
of an installed distribution that the GPU machine lacks imports only if the bundle, installed
at $QLLM_BUNDLE_SITE, provides it; otherwise it is absent (``find_spec`` gives None and
``import`` fails), as it would be there. Loaded at start-up because gpu/dry is first on
PYTHONPATH."""

import importlib.abc
import importlib.metadata
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repo, for gpu.machine
from gpu.machine import PROJECT, machine_packages, normalize  # noqa: E402

del sys.path[0]


class _Absent(importlib.abc.MetaPathFinder):
    """Refuses the top-level modules in ``names`` (a ``sys.modules`` entry of None would do the
    same but breaks pytest's plugin scan)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ModuleNotFoundError(
                f"No module named {name!r} (not on the GPU machine)", name=name
            )
        return None


_site = Path(os.environ["QLLM_BUNDLE_SITE"])
_machine = machine_packages()
_absent = set()
for _top, _dists in importlib.metadata.packages_distributions().items():
    if _top in PROJECT or _top.startswith("_") or any(normalize(d) in _machine for d in _dists):
        continue
    if not ((_site / _top).exists() or (_site / f"{_top}.py").exists()):
        _absent.add(_top)
# Modules looked up with find_spec must be answered None there, as on the machine: the data
# packages, and whatever transformers probes for (transformers 5.25 installs `kernels`, which
# 5.17's hub_kernels then found here and failed to import: every import of transformers broke,
# 2026-12-03). A None in sys.modules answers so; but a pytest plugin's module (a pytest11
# entry point) left None breaks pytest's plugin scan, so those the finder refuses instead.
_plugins = {ep.value.split(":")[0].split(".")[0]
            for ep in importlib.metadata.entry_points(group="pytest11")}  # fmt: skip
for _top in _absent - _plugins:
    sys.modules[_top] = None
sys.meta_path.insert(0, _Absent(_absent))
