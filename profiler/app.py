"""``qllm-profile``: the profiler's Hydra app (also ``python -m profiler``). See conf/profiler.yaml.

User errors (unknown model, bad path, no CUDA, bad setting) print one line and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from profiler.models import ModelError
from profiler.schema import ProfileError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PROG = "qllm-profile"


def fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def unknown_model(argv: list[str], conf_dir: Path = CONF_DIR) -> str | None:
    """Hydra reports an unknown group option with a page of text; we say it in one line."""
    options = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "model" and value not in options:
            return f"model={value}: unknown model; choose one of {', '.join(options)}"
    return None


def compose_config(overrides: list[str] = ()) -> DictConfig:
    """The app's config for in-process use (tests, benchmarks), Hydra overrides applied."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("profiler", overrides=list(overrides))


@hydra.main(config_path=str(CONF_DIR), config_name="profiler", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from profiler.measure import SettingsError, run  # torch loads only once the config is valid
    from profiler.ops import RunnerError

    try:
        profile, directory = run(cfg, progress=cfg.progress)
    except (ModelError, RunnerError, SettingsError, ProfileError) as e:
        fail(str(e))
    n = len(profile.points)
    print(f"profile {profile.name}: {n} points, {profile.device}, {profile.dtype} -> {directory}")
    spread = profile.spread()
    if spread is not None and spread.noisy:
        print(spread.warning(profile.name), file=sys.stderr)


def cli() -> None:
    problem = unknown_model(sys.argv[1:])
    if problem:
        fail(problem)
    main()
