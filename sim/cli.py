"""What every Hydra entry point does before and around ``hydra.main``.

Hydra answers a bad override with a page of text and exit 1, after it has made the run
directory. ``run`` composes the config first, the way Hydra will, and turns every problem into
one line ``prog: error: key=value: what is allowed`` (exit 2), so a bad command writes nothing.
It pins the run (or sweep) directory on the command line Hydra then reads, and claims a single
run's directory: one that holds a finished run, or that another process is writing, is refused.
Ctrl-C during a sweep prints one line: what finished, and the command that resumes the sweep.
Hydra 1.3 turns an interrupt that lands while it reads a config file into an
UnboundLocalError, which it reports as a traceback and exit 1 (between a sweep's jobs, as it
composes the next one's config; the Ctrl-C test met it in CI): ``run`` defers such an
interrupt to the next job's start or the sweep's end (``Interrupts``), and a task function
decorated with ``job`` turns an error an interrupt caused into the interrupt.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, IntervalSweep, Override, OverrideType
from hydra.errors import CompactHydraException, HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sim.config import UserError
from sim.launchers import check_ray_cluster

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
FINISHED = "summary.json"  # written last and atomically: its presence means the run finished
TYPE_WORDS = {"Float": "a number", "Integer": "an integer", "Boolean": "true or false",
              "String": "a string"}  # fmt: skip


@dataclass(frozen=True)
class App:
    prog: str
    config_name: str
    groups: tuple[str, ...]  # the config groups this app reads (group=option)
    free_keys: tuple[str, ...] = ()  # dict nodes that take new keys (+node.key=value)
    check: Callable[[DictConfig], None] | None = None  # range checks; raise UserError
    run_dir_per_run: bool = True  # hydra.run.dir is the run's own directory (not ".")
    resumable: bool = False  # a rerun of a sweep skips its finished runs


@dataclass
class Plan:
    """The command Hydra will run: argv with the directory pinned, and its jobs."""

    argv: list[str]
    multirun: bool = False
    directory: str | None = None  # the sweep dir (multirun) or the run dir
    jobs: list[list[str]] = field(default_factory=list)  # each job's overrides (multirun)
    ray: bool = False  # a sweep on Ray's launcher


def fail(prog: str, message: str) -> None:
    FAILED.append(message)
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


FAILED: list[str] = []  # the messages ``fail`` gave in this process (``job``: a Ray worker's)


class JobFailed(CompactHydraException):
    """A job's one-line error (its message) where a Ray worker ran it (``job``): raised, not
    exited, so that Hydra's ``run_job`` returns it to the sweep's driver, which ``run``
    reports in one line; a Ray worker that exits is retried (3 times), and the sweep then
    ended in a page of ``WorkerCrashedError`` traceback (until 2026-12-05)."""


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (a job of ``hydra/launcher=ray`` or ``ray_cluster``)."""
    # not imported here: Ray is a sweep's, absent where no sweep runs (the GPU machine)
    worker = getattr(getattr(sys.modules.get("ray"), "_private", None), "worker", None)
    mode = getattr(getattr(worker, "global_worker", None), "mode", None)
    return mode is not None and mode == getattr(worker, "WORKER_MODE", object())


# Where an interrupt is deferred: code that reads configs (Hydra's, OmegaConf's, PyYAML's)
# among the few innermost frames when the signal lands (the file read itself is the stdlib's:
# codecs under pathlib under Hydra's _read_config); not deeper, so that a sweep that waits on
# its launcher's workers (joblib, Ray: not config code) is interrupted at once, as before.
CONFIG_CODE = re.compile(r"[/\\](hydra[/\\](_internal|core)|omegaconf|yaml)[/\\]")
CONFIG_FRAMES = 4


def in_config_code(frame) -> bool:
    """Whether one of the innermost ``CONFIG_FRAMES`` frames from ``frame`` is config code."""
    for _ in range(CONFIG_FRAMES):
        if frame is None:
            return False
        if CONFIG_CODE.search(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def interrupted_by(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised while handling, a KeyboardInterrupt."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class Interrupts:
    """The SIGINT handler while ``run`` runs an app: a KeyboardInterrupt at once in a job
    (``job``) or anywhere but config code; in config code outside a job (Hydra composing a
    sweep's next job), only noted, and raised at the next job's start or the app's end."""

    def __init__(self) -> None:
        self.in_job = False
        self.pending = False

    def __call__(self, signum: int, frame) -> None:
        if self.in_job or not in_config_code(frame):
            raise KeyboardInterrupt
        self.pending = True


INTERRUPTS = Interrupts()


def job(task: Callable[[DictConfig], object]) -> Callable[[DictConfig], object]:
    """Decorates an app's task function (under ``hydra.main``): it starts with an interrupt
    that came while Hydra was composing its config, and an error that an interrupt caused
    inside it (Hydra's compose in a job) leaves it as the interrupt."""

    @functools.wraps(task)
    def wrapper(cfg: DictConfig) -> object:
        if INTERRUPTS.pending:
            raise KeyboardInterrupt
        INTERRUPTS.in_job = True
        ray = in_ray_worker()
        try:
            return task(cfg)
        except Exception as e:
            if interrupted_by(e):
                raise KeyboardInterrupt from None
            raise
        except SystemExit as e:
            if not ray or e.code in (0, None):
                raise

            from sim.cli import FAILED as failed  # the module's (Ray pickles this closure)
            from sim.cli import JobFailed as failure

            raise failure(failed[-1] if failed else f"exit code {e.code}") from None
        finally:
            INTERRUPTS.in_job = False

    return wrapper


def run(app: App, main: Callable[[], object], argv: Sequence[str] | None = None) -> None:
    """Check the command line, then run ``main`` (a ``hydra.main`` function) on it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Ctrl-C's own handler only: an ignored SIGINT (a background job) stays ignored
    handled = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if handled:
        signal.signal(signal.SIGINT, INTERRUPTS)
    plan = None
    try:
        try:
            plan = prepare(app, argv)
        except UserError as e:
            if not INTERRUPTS.pending:  # else: an error the interrupt made
                fail(app.prog, str(e))
        if INTERRUPTS.pending:  # while the command line was checked: nothing ran
            raise KeyboardInterrupt
        sys.argv = [sys.argv[0], *plan.argv]
        # a Ray job's JobFailed, raised to here (Hydra's own report of it adds its traceback
        # hint), after Hydra's line naming the job's overrides: one line of ours
        full_error = os.environ.get("HYDRA_FULL_ERROR")
        if plan.ray:
            os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            main()
        except JobFailed as e:
            fail(app.prog, str(e))
        finally:
            if plan.ray:
                os.environ.pop("HYDRA_FULL_ERROR", None)
                if full_error is not None:
                    os.environ["HYDRA_FULL_ERROR"] = full_error
        if INTERRUPTS.pending:  # it came after the last job started
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        what = ("nothing ran (the command line was being checked)" if plan is None
                else interrupted(app, plan))  # fmt: skip
        print(f"{app.prog}: interrupted: {what}", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        INTERRUPTS.pending = INTERRUPTS.in_job = False
        if handled:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def prepare(app: App, argv: list[str]) -> Plan:
    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return Plan(argv)
    overrides = []
    for line in args.overrides:
        try:
            parsed = OverridesParser.create().parse_overrides([line])
        except HydraException as e:
            raise UserError(
                f"{line}: not an override ({str(e).splitlines()[0]}); see "
                "https://hydra.cc/docs/advanced/override_grammar/basic"
            ) from None
        expanded = expand_sweep(app, parsed[0])
        if expanded != line:  # glob(): its options listed, for the checks and for Hydra
            argv[argv.index(line)] = expanded
            parsed = OverridesParser.create().parse_overrides([expanded])
        overrides += parsed
        if parsed[0].key_or_group == "hydra.mode" and not args.multirun:
            raise UserError(f"{line}: give -m (--multirun) for a sweep instead; qllm-sim plans "
                            "its runs from -m")  # fmt: skip
    check_group_choices(app, overrides)
    combos = [[o.input_line for o in overrides]]
    if args.multirun:
        combos = value_combinations(overrides)
    for combo in combos:
        cfg = compose_or_explain(app, combo)
        check_added_keys(app, overrides)
        if app.check is not None:
            app.check(cfg)
    if args.cfg:  # --cfg job|hydra|all prints the config and runs nothing
        return Plan(argv)
    hydra_cfg = compose_or_explain(app, combos[0], with_hydra=True).hydra
    given = {o.key_or_group for o in overrides}
    if args.multirun:
        sweep_dir = str(hydra_cfg.sweep.dir)
        if "hydra.sweep.dir" not in given:
            argv = [*argv, f"hydra.sweep.dir={sweep_dir}"]  # resolved once, stated in messages
        check_ray_cluster(hydra_cfg.launcher)
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        if len(jobs) > len(combos) and app.check is not None:
            check_jobs(app, jobs)
        ray = str(hydra_cfg.launcher.get("_target_", "")).endswith("RayLauncher")
        return Plan(argv, multirun=True, directory=sweep_dir, jobs=jobs, ray=ray)
    if not app.run_dir_per_run:
        return Plan(argv)
    run_dir = str(hydra_cfg.run.dir)
    if "hydra.run.dir" not in given:
        argv = [*argv, f"hydra.run.dir={run_dir}"]  # ${now:...} fixed here, before it is claimed
    claim_run_dir(Path(run_dir))
    return Plan(argv, directory=run_dir)


def group_options(group: str) -> list[str]:
    """A config group's options: its YAML files' names."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def expand_sweep(app: App, o: Override) -> str:
    """The override's line, a config group's ``glob()`` as the list of the options it
    matches; ``interval()`` refused (checking the jobs needs their values: Hydra's own check
    of them crashed with a traceback)."""
    value = o.value() if o.is_sweep_override() else None
    if isinstance(value, IntervalSweep):
        raise UserError(f"{o.input_line}: interval() needs a sweeper that samples (Optuna, "
                        "Nevergrad); the basic sweeper runs lists, range() and glob()")  # fmt: skip
    if not isinstance(value, Glob):
        return o.input_line
    if o.key_or_group not in app.groups:
        raise UserError(f"{o.input_line}: glob() picks options of a config group "
                        f"({', '.join(app.groups)}); {o.key_or_group} is none")  # fmt: skip
    options = group_options(o.key_or_group)
    matched = value.filter(options)
    if not matched:
        raise UserError(f"{o.input_line}: matches no {o.key_or_group}; choose among "
                        f"{', '.join(options)}")  # fmt: skip
    return _line(o, ",".join(matched))


def check_group_choices(app: App, overrides: list[Override]) -> None:
    """Hydra reports an unknown group option with a page of text; we say it in one line."""
    for o in overrides:
        if o.key_or_group not in app.groups or o.is_delete():
            continue
        options = group_options(o.key_or_group)
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for choice in values:
            if choice not in options:
                raise UserError(f"{o.key_or_group}={choice}: unknown {o.key_or_group}; "
                                f"choose one of {', '.join(options)}")  # fmt: skip


def value_combinations(overrides: list[Override]) -> list[list[str]]:
    """Every value of every swept key, each once (the others at their first value): what a
    single value can get wrong, checked without composing the whole product."""
    lines = [o.input_line for o in overrides]
    swept = {i: [_line(o, v) for v in o.sweep_string_iterator()]
             for i, o in enumerate(overrides) if o.is_sweep_override()}  # fmt: skip
    first = [swept[i][0] if i in swept else line for i, line in enumerate(lines)]
    combos = [first]
    for i, values in swept.items():
        combos += [[*first[:i], v, *first[i + 1 :]] for v in values[1:]]
    return combos


def check_jobs(app: App, jobs: list[list[str]]) -> None:
    """The cross-field checks on every job of a sweep's product (``value_combinations``
    checks each value once; a combination such as ``cluster.router=ls_dedicated`` with
    ``cluster.replicas=1`` is wrong only together): one composition per distinct choice of
    config groups, each job's plain values set on a copy of it."""
    parser = OverridesParser.create()
    base: dict[tuple[str, ...], DictConfig] = {}
    for job in jobs:
        parsed = parser.parse_overrides(job)
        groups = tuple(line for line, o in zip(job, parsed, strict=True)
                       if o.key_or_group in app.groups or o.type != OverrideType.CHANGE
                       or o.is_hydra_override())  # fmt: skip
        if groups not in base:
            base[groups] = compose_or_explain(app, list(groups))
        cfg = base[groups].copy()
        try:
            for line, o in zip(job, parsed, strict=True):
                if line not in groups:
                    OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
        except OmegaConfBaseException:  # a value only Hydra's composition applies: at launch
            continue
        try:
            app.check(cfg)
        except UserError as e:
            raise UserError(f"{e} (in the sweep's run {' '.join(job)})") from None


def _line(o: Override, value: str) -> str:
    prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}.get(o.type, "")
    return f"{prefix}{o.get_key_element().lstrip('+')}={value}"


def _compose(app: App, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(app.config_name, overrides=overrides, return_hydra_config=with_hydra)


def compose_or_explain(app: App, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    try:
        return _compose(app, overrides, with_hydra)
    except HydraException as e:
        raise UserError(explain(app, e, overrides)) from None


def explain(app: App, e: Exception, overrides: list[str]) -> str:
    """One line for a composition error: the key, its value and what is allowed."""
    cause = e.__cause__ if e.__cause__ is not None else e
    text = str(cause)
    first = text.splitlines()[0] if text else type(cause).__name__
    found = re.search(r"full_key: (\S+)", text)
    key = error_key = found[1] if found else None
    value = None
    for line in overrides:  # the override that set full_key, or one below it
        k, _, v = line.lstrip("+~").partition("=")
        k = k.partition("@")[0]
        if key is not None and (k == key or k.startswith(key + ".")):
            key, value = k, v
    said = f"{key}={value}" if key else " ".join(overrides)
    if "is not a valid bool" in first:
        return f"{said}: must be true or false"
    if m := re.search(r"could not be converted to (\w+)", first):
        return f"{said}: must be {TYPE_WORDS.get(m[1], m[1])}"
    if m := re.search(r"expected one of \[(.*)\]", first):
        return f"{said}: must be one of {m[1]}"
    if m := re.search(r"is not a subclass of (\w+)", first):
        return f"{said}: {key} is a group of keys ({', '.join(keys_of(app, key, overrides))}); " \
               f"set them one by one ({key}.<key>=<value>)"  # fmt: skip
    if "not in struct" in first or re.search(r"Key '.*' not in '", first):
        parent = error_key.rpartition(".")[0]
        allowed = ", ".join(keys_of(app, parent, overrides))
        return f"{said}: unknown key; {parent or 'the config'} has {allowed}"
    if "does not support deletion" in first:
        return f"~{key}: cannot be removed; set a value instead"
    if m := re.search(r"Ambiguous value for argument '(.*)'", first):
        return f"{m[1]}: several values sweep only with -m (--multirun); a list is [a,b]"
    if m := re.search(r"Could not append to config. An item is already at '(.*)'", first):
        return f"+{m[1]}: {m[1]} exists already; set it without '+'"
    return f"{said}: {first}"


def keys_of(app: App, node: str, overrides: Sequence[str] = ()) -> list[str]:
    """The keys under ``node`` with the config groups ``overrides`` choose (``policy=vllm``:
    vllm's keys, not the default policy's)."""
    groups = [line for line in overrides
              if line.lstrip("+~").partition("=")[0].partition("@")[0] in app.groups]  # fmt: skip
    try:
        cfg = _compose(app, groups)
    except HydraException:  # a choice that does not compose: the defaults' keys
        cfg = _compose(app, [])
    sub = OmegaConf.select(cfg, node) if node else cfg
    return sorted(str(k) for k in sub.keys()) if isinstance(sub, DictConfig) else []


def check_added_keys(app: App, overrides: list[Override]) -> None:
    """``+key=value`` adds a key Hydra would carry and nobody read, ``~key`` removes one a run
    needs; only dict nodes that take free keys (``model.config``, a policy's settings) may."""
    for o in overrides:
        if o.is_hydra_override() or o.type == OverrideType.CHANGE:
            continue
        key = o.key_or_group
        parent = key.rpartition(".")[0]
        if key in app.groups or any(parent == f or parent.startswith(f + ".")
                                    for f in app.free_keys):  # fmt: skip
            continue
        if o.is_delete():
            raise UserError(f"~{key}: cannot be removed; set a value instead")
        value = "..." if o.is_sweep_override() else o.get_value_element_as_str()
        groups = [g.input_line for g in overrides
                  if g.key_or_group in app.groups and not g.is_sweep_override()]  # fmt: skip
        allowed = keys_of(app, parent, groups)
        if o.type == OverrideType.FORCE_ADD and key.rpartition(".")[2] in allowed:
            continue  # ++key=value sets a key the config has (adds it only where it has not)
        raise UserError(f"{o.get_key_element()}={value}: unknown key; "
                        f"{parent or 'the config'} has {', '.join(allowed)}")  # fmt: skip


# ------------------------------------------------------------------------------ run directories
_held: list[int] = []  # directory locks held until the process ends
_created: list[Path] = []  # directories claim_run_dir made, deepest first
_logs_before: dict[Path, set[Path]] = {}  # a claimed directory's *.log files before the run


def lock(directory: Path) -> int | None:
    """An exclusive lock on the directory (released when the process ends, even killed)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim_run_dir(run_dir: Path) -> None:
    """A single run's directory holds one run: not a finished one, not one being written."""
    if (run_dir / FINISHED).exists():
        raise UserError(f"hydra.run.dir={run_dir}: already holds a finished run; choose another "
                        "directory")  # fmt: skip
    _logs_before[run_dir] = set(run_dir.glob("*.log")) if run_dir.is_dir() else set()
    missing = run_dir
    while not missing.exists():
        _created.append(missing)
        missing = missing.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = lock(run_dir)
    if fd is None:
        raise UserError(f"hydra.run.dir={run_dir}: another run is writing this directory; "
                        "choose another directory")  # fmt: skip
    if (run_dir / FINISHED).exists():  # finished while we took the lock
        raise UserError(f"hydra.run.dir={run_dir}: already holds a finished run; choose another "
                        "directory")  # fmt: skip
    _held.append(fd)


def discard_unfinished(run_dir: Path) -> None:
    """After a run failed: remove what Hydra wrote for it, and the directory if that leaves it
    empty, so that no directory names a run that produced nothing."""
    if (run_dir / FINISHED).exists():
        return
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    before = _logs_before.get(run_dir, set())
    for leftover in run_dir.glob("*.log"):  # Hydra's log of this run, not a file of the user's
        if leftover not in before:
            leftover.unlink()
    for directory in _created if run_dir in _created else [run_dir]:
        try:
            directory.rmdir()
        except OSError:
            return  # it holds other files: not ours to remove


# ------------------------------------------------------------------------------ interruption
def interrupted(app: App, plan: Plan) -> str:
    if not plan.multirun:
        where = f" in {plan.directory}" if plan.directory else ""
        return f"the run did not finish{where}; nothing was written to summary.json"
    done = sum(finished_job(app, plan, job) for job in plan.jobs)
    argv = [a for a in plan.argv if not a.startswith("resume=")]  # a resume must skip
    verb = "resume" if app.resumable else "rerun"
    return (f"{done} of {len(plan.jobs)} runs finished in {plan.directory}; {verb} with: "
            f"{app.prog} {shlex.join(argv)}")  # fmt: skip


def finished_job(app: App, plan: Plan, job: list[str]) -> bool:
    hydra_cfg = _compose(app, [*job, f"hydra.sweep.dir={plan.directory}"], with_hydra=True).hydra
    return (Path(plan.directory) / str(hydra_cfg.sweep.subdir) / FINISHED).is_file()
