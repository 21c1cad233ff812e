"""The engine's sense of time: the wall clock for real runs, a virtual clock for tests.

Both count seconds from ``start()``. The engine reads ``now()`` at every stage boundary, calls
``tick()`` after every stage it executes and ``sleep_until()`` when it has nothing to run.
"""

from __future__ import annotations

import time


class WallClock:
    """Real time: arrivals are replayed as they would happen, idle waits sleep."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def tick(self) -> None:
        """Real stages take the time they take."""

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


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

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
