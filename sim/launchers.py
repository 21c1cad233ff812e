"""Checks of a sweep's Hydra launcher before the sweep starts. Sweeps on a cluster never run on
the GPU machine (tests/test_gpu_machine.py leaves this module out), so ``ray`` is imported
here, lazily, and only when the launcher is Ray's."""

from __future__ import annotations

import socket

from omegaconf import DictConfig, OmegaConf

from sim.config import UserError


def check_ray_cluster(launcher: DictConfig) -> None:
    """A Ray launcher that connects to a running cluster (``hydra/launcher=ray_cluster``) finds
    one before the sweep starts: the plugin's own error is a page of traceback."""
    address = OmegaConf.select(launcher, "ray.init.address")
    if not str(launcher.get("_target_", "")).endswith("RayLauncher") or address in (None, "local"):
        return
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # another ray: the plugin says it at launch
        return
    hint = "start one (ray start --head) or sweep on a throwaway local Ray: hydra/launcher=ray"
    try:
        host, port = canonicalize_bootstrap_address(address).rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
    except (ConnectionError, OSError, ValueError) as e:
        raise UserError(f"hydra/launcher: no Ray cluster at address={address} "
                        f"({str(e).splitlines()[0]}); {hint}") from None  # fmt: skip
