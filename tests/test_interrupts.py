"""Ctrl-C while Hydra reads a config file: Hydra 1.3 turned the interrupt into an
UnboundLocalError that it printed as a traceback, exit 1 (the sweep's Ctrl-C test met it in
CI, the signal landing as the next job's config was composed). ``sim.cli`` defers an
interrupt in config code outside a job, and turns an error an interrupt caused in a job back
into the interrupt."""

from __future__ import annotations

import signal
import sys

import pytest
from omegaconf import OmegaConf

from sim import cli


def frame_in_omegaconf():
    """A frame whose caller is OmegaConf's, as a signal landing while it resolves a value."""
    frames = []
    OmegaConf.register_new_resolver("grab_frame", lambda: frames.append(sys._getframe()) or 1,
                                    replace=True)  # fmt: skip
    assert OmegaConf.create({"a": "${grab_frame:}"}).a == 1
    return frames[0]


def test_an_interrupt_in_config_code_outside_a_job_waits_for_the_next_job():
    handler = cli.Interrupts()
    handler(signal.SIGINT, frame_in_omegaconf())  # noted, not raised
    assert handler.pending
    with pytest.raises(KeyboardInterrupt):  # anywhere else: at once
        cli.Interrupts()(signal.SIGINT, sys._getframe())
    in_job = cli.Interrupts()
    in_job.in_job = True
    with pytest.raises(KeyboardInterrupt):  # in a job: at once, even in config code
        in_job(signal.SIGINT, frame_in_omegaconf())
    assert cli.in_config_code(frame_in_omegaconf()) and not cli.in_config_code(sys._getframe())


def test_a_job_starts_with_a_pending_interrupt_and_raises_one_that_an_error_hides(monkeypatch):
    monkeypatch.setattr(cli, "INTERRUPTS", cli.Interrupts())
    ran = []
    task = cli.job(lambda cfg: ran.append(cfg) or 7)
    assert task("cfg") == 7 and ran == ["cfg"] and not cli.INTERRUPTS.in_job
    cli.INTERRUPTS.pending = True
    with pytest.raises(KeyboardInterrupt):
        task("again")
    assert ran == ["cfg"]  # it did not start
    cli.INTERRUPTS.pending = False

    def hydra_read_config(cfg):  # what Hydra's _read_config does with an interrupt
        try:
            raise KeyboardInterrupt
        finally:
            raise UnboundLocalError("cannot access local variable 'f'")

    with pytest.raises(KeyboardInterrupt):
        cli.job(hydra_read_config)("cfg")
    assert not cli.INTERRUPTS.in_job

    def plain_error(cfg):
        raise UnboundLocalError("a bug of ours")

    with pytest.raises(UnboundLocalError):  # not caused by an interrupt: itself
        cli.job(plain_error)("cfg")
    assert cli.interrupted_by(KeyboardInterrupt()) and not cli.interrupted_by(ValueError())


def test_run_reports_an_interrupt_that_came_after_the_last_job_started(monkeypatch, capsys):
    """The sweep ended, but Ctrl-C was pressed: exit 130 and the line that says what
    finished; the default handler is back afterwards."""
    monkeypatch.setattr(cli, "prepare", lambda app, argv: cli.Plan(argv, directory="d"))
    monkeypatch.setattr(cli, "interrupted", lambda app, plan: "what finished")
    app = cli.App(prog="qllm-x", config_name="config", groups=())

    def main():
        cli.INTERRUPTS.pending = True  # the handler noted one in config code

    with pytest.raises(SystemExit) as e:
        cli.run(app, main, [])
    assert e.value.code == 130
    assert capsys.readouterr().err == "qllm-x: interrupted: what finished\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not cli.INTERRUPTS.pending
    cli.run(app, lambda: None, [])  # nothing pending: returns


def test_an_interrupt_while_the_command_line_is_checked_is_not_reported_as_a_bad_command(
    monkeypatch, capsys
):
    """Ctrl-C while ``prepare`` composed the configs once read as ``defaults=None: 'NoneType'
    object has no attribute ...``, a bad command (exit 2)."""
    app = cli.App(prog="qllm-x", config_name="config", groups=())

    def prepare(app, argv):
        cli.INTERRUPTS.pending = True  # the handler noted it in OmegaConf's code
        raise cli.UserError("defaults=None: 'NoneType' object has no attribute")

    monkeypatch.setattr(cli, "prepare", prepare)
    with pytest.raises(SystemExit) as e:
        cli.run(app, lambda: pytest.fail("ran"), [])
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "qllm-x: interrupted: nothing ran (the command line was being checked)\n")  # fmt: skip


def test_ctrl_c_while_a_tool_imports_prints_one_line_and_exits_130(monkeypatch, capsys):
    """Python imports pandas, Hydra and torch for seconds before the tool's own handling is in
    place: an interrupt there printed a traceback; now one line, exit 130."""
    from sim import launch

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.importlib, "import_module", interrupted)
    monkeypatch.setattr(sys, "argv", ["/somewhere/.venv/bin/qllm-sim", "policy=fcfs"])
    with pytest.raises(SystemExit) as e:
        launch.sim()
    assert e.value.code == 130
    assert capsys.readouterr().err == "qllm-sim: interrupted: nothing ran (it was starting)\n"


def test_every_console_script_starts_its_tools_cli_through_the_guard():
    import importlib
    import tomllib
    from pathlib import Path

    from sim import launch

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    started = []
    for name, target in scripts["project"]["scripts"].items():
        module, attr = target.split(":")
        entry = getattr(importlib.import_module(module), attr)
        assert module == "sim.launch" and entry.func is launch.start, name
        started.append(entry.args[0])
        assert callable(importlib.import_module(entry.args[0]).cli), name
    assert sorted(started) == sorted({"sim.app", "sim.report", "sim.plan", "profiler.app",
                                      "realrun.app", "realrun.validate"})  # fmt: skip
