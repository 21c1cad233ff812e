"""``qllm-profile``: the profiler's Hydra app (also ``python -m profiler``). See conf/profiler.yaml.

User errors (unknown model, bad path, no CUDA, bad setting) print one line and exit 2.
"""

from __future__ import annotations

import sys

import hydra
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from profiler.models import ModelError
from profiler.schema import ProfileError, SettingsError
from profiler.settings import Settings
from sim.cli import CONF_DIR, App, job, run
from sim.cli import fail as fail_as
from sim.config import UserError

PROG = "qllm-profile"


def check(cfg: DictConfig) -> None:
    """conf/profiler.yaml has no typed schema: the settings read before torch loads."""
    for key, ok, allowed in (
        ("seed", isinstance(cfg.seed, int), "must be an integer"),
        ("threads", cfg.threads is None or (isinstance(cfg.threads, int) and cfg.threads >= 1),
         "must be an integer >= 1 or null"),
        ("device", cfg.device in ("auto", "cpu") or str(cfg.device).startswith("cuda"),
         "must be auto, cpu, cuda or cuda:<index>"),
        ("progress", isinstance(cfg.progress, bool), "must be true or false"),
        ("routing", isinstance(cfg.get("routing"), DictConfig), "must be a mapping (its keys: "
         "prompts, prompt_tokens, text_file)"),
        ("output.dir", isinstance(cfg.get("output"), DictConfig) and bool(cfg.output.get("dir")),
         "must be a directory to write the profile under"),
    ):  # fmt: skip
        if not ok:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)}: {allowed}")
    try:  # every rule of the profiler's settings (profiler.settings: torch-free)
        Settings.from_config(cfg)
    except SettingsError as e:
        raise UserError(str(e)) from None


APP = App(PROG, "profiler", ("model",), free_keys=("model.config",), check=check,
          run_dir_per_run=False)  # fmt: skip


def fail(message: str) -> None:
    fail_as(PROG, message)


def compose_config(overrides: list[str] = ()) -> DictConfig:
    """The app's config for in-process use (tests, benchmarks), Hydra overrides applied."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("profiler", overrides=list(overrides))


@hydra.main(config_path=str(CONF_DIR), config_name="profiler", version_base="1.3")
@job
def main(cfg: DictConfig) -> None:
    # torch loads only once the config is valid
    from profiler.measure import SettingsError, run, self_check_line
    from profiler.ops import RunnerError

    try:
        profile, directory = run(cfg, progress=cfg.progress)
    except (ModelError, RunnerError, SettingsError, ProfileError) as e:
        fail(str(e))
    n = len(profile.points)
    print(f"profile {profile.name}: {n} points, {profile.device}, {profile.dtype} -> {directory}")
    if profile.extra.get("self_check"):
        print(self_check_line(profile.extra["self_check"]))
    spread = profile.spread()
    if spread is not None and spread.noisy:
        print(spread.warning(profile.name), file=sys.stderr)


def cli() -> None:
    run(APP, main)
