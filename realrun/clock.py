"""The engine's sense of time: the wall clock for real runs, this process's CPU time for real
runs on a shared CPU, a virtual clock for tests.

Both count seconds from ``start()``. The engine reads ``now()`` at every stage boundary, calls
``tick()`` after every stage it executes and ``sleep_until()`` when it has nothing to run, and
``exclude(s)`` after work that is not the run's (the host-speed probe): the clock then reads
as if those seconds had not passed. An idle wait sleeps or spins (``idle_wait``:
``profiler.settings.IDLE_WAITS``; the config's ``idle_wait``, sleep by default: an engine
that sleeps gives its core, and its caches, to whatever else runs on the machine).
"""

from __future__ import annotations

import time

from profiler.settings import IDLE_WAITS, wait_idle


def _checked(idle_wait: str) -> str:
    if idle_wait not in IDLE_WAITS:
        raise ValueError(f"idle_wait={idle_wait}: expected one of {', '.join(IDLE_WAITS)}")
    return idle_wait


class WallClock:
    """Real time: arrivals are replayed as they would happen, idle waits sleep or spin."""

    def __init__(self, idle_wait: str = "sleep") -> None:
        self.t0 = time.perf_counter()
        self.idle_wait = _checked(idle_wait)

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def tick(self) -> None:
        """Real stages take the time they take."""

    def exclude(self, seconds: float) -> None:
        self.t0 += seconds

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            wait_idle(delay, self.idle_wait)


class CpuClock:
    """This process's CPU time while the engine works, the arrivals' own gaps while it waits.

    On a machine shared with other processes, wall time counts the time they take the core
    away; CPU time counts what the engine itself did (with one torch thread, the wall time the
    work takes on a core of its own). Idle waits still take their wall time (slept or spun, as
    ``idle_wait`` says), so that whatever slows down when idle (clocks, caches) does so here
    too; the clock then jumps to the arrival, whatever CPU time the wait took. CPU only: a
    GPU's work is not this process's CPU time.
    """

    def __init__(self, idle_wait: str = "sleep") -> None:
        self.t0 = time.process_time()  # now() = CPU time since t0 + the idle waits
        self.waited = 0.0
        self.idle_wait = _checked(idle_wait)

    def start(self) -> None:
        self.t0, self.waited = time.process_time(), 0.0

    def now(self) -> float:
        return time.process_time() - self.t0 + self.waited

    def tick(self) -> None:
        """Stages take the CPU time they take."""

    def exclude(self, seconds: float) -> None:
        self.t0 += seconds

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            wait_idle(delay, self.idle_wait)
            self.waited += t - self.now()  # the gap, not the CPU time spent while waiting


class VirtualClock:
    """Every executed stage costs ``stage_s``; idle waits take no time.

    A run is then as fast as the model allows and fully deterministic: the same arrivals land
    at the same stage boundaries every time, so preemptions happen (and are counted) the same
    way on any machine. Token exactness tests use it.
    """

    def __init__(self, stage_s: float) -> None:
        if stage_s <= 0:
            raise ValueError("stage_s must be > 0")
        self.stage_s = stage_s
        self.t = 0.0

    def start(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.stage_s

    def exclude(self, seconds: float) -> None:
        """Nothing but stages takes virtual time."""

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
