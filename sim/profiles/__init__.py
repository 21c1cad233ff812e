"""Built-in profiles (one directory each, in the schema of profiler/schema.py) and lookup."""

from __future__ import annotations

import sys
from pathlib import Path

from profiler.schema import Profile, ProfileError
from sim.config import UserError

BUILTIN_DIR = Path(__file__).resolve().parent
MEASURED_DIR = Path("results") / "profiles"  # where qllm-profile writes, relative to the cwd
_warned: set[Path] = set()  # noisy profiles already reported: once per process is enough
_warned_shadow: set[str] = set()  # names whose measured profile a built-in shadows, reported


def available() -> list[str]:
    names = {p.parent.name for p in BUILTIN_DIR.glob("*/profile.json")}
    names |= {p.parent.name for p in MEASURED_DIR.glob("*/profile.json")}
    return sorted(names)


def directory(name: str, path: str | None = None) -> Path:
    """The directory of a profile by directory (``path``) or by name: built-in first, then
    results/profiles/."""
    if path:
        found = Path(path).expanduser()
        if not found.is_dir():
            raise UserError(f"profile.path={path}: not a directory")
        return found
    found = BUILTIN_DIR / name
    if not (found / "profile.json").is_file():
        found = MEASURED_DIR / name
    elif (MEASURED_DIR / name / "profile.json").is_file() and name not in _warned_shadow:
        _warned_shadow.add(name)
        print(f"warning: profile.name={name} is the built-in profile; {MEASURED_DIR / name} "
              f"(a measured one of the same name) is not read: profile.path="
              f"{MEASURED_DIR / name} reads it", file=sys.stderr)  # fmt: skip
    if not (found / "profile.json").is_file():
        raise UserError(f"profile.name={name}: unknown profile; available: {available()}")
    return found


def builtin(name: str) -> bool:
    """Whether a built-in profile has this name (it shadows a measured one of the same)."""
    return (BUILTIN_DIR / name / "profile.json").is_file()


def load(name: str, path: str | None = None) -> Profile:
    """A profile by directory (``path``) or by name: built-in first, then results/profiles/."""
    folder = directory(name, path)
    try:
        profile = Profile.load(folder)
    except ProfileError as e:
        raise UserError(str(e)) from None
    if not path and profile.name != name:  # a run labelled with it would load the other one
        raise UserError(f"profile.name={name}: {folder}/profile.json names it {profile.name!r} "
                        "(a renamed or copied directory): make the two agree, or load it by "
                        f"profile.path={folder}")  # fmt: skip
    spread = profile.spread()
    if spread is not None and spread.noisy and folder.resolve() not in _warned:
        _warned.add(folder.resolve())
        print(spread.warning(profile.name), file=sys.stderr)
    return profile
