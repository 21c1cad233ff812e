"""The GPU machine's Python, simulated in this one (``make gpu-check-dry``): a top-level module
of an installed distribution that the GPU machine lacks imports only if the bundle, installed
at $QLLM_BUNDLE_SITE, provides it; otherwise it is absent (``find_spec`` gives None and
``import`` fails), as it would be there. Loaded at start-up because gpu/dry is first on
PYTHONPATH."""

import importlib.metadata
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repo, for gpu.machine
from gpu.machine import PROJECT, machine_packages, normalize  # noqa: E402

del sys.path[0]
_site = Path(os.environ["QLLM_BUNDLE_SITE"])
_machine = machine_packages()
for _top, _dists in importlib.metadata.packages_distributions().items():
    if _top in PROJECT or _top.startswith("_") or any(normalize(d) in _machine for d in _dists):
        continue
    if not ((_site / _top).exists() or (_site / f"{_top}.py").exists()):
        sys.modules[_top] = None
