"""The host-speed probe: one fixed piece of the model's own work, timed again and again between
other work, so that a profile and the real runs that it predicts can be told how fast the
machine ran while each of them ran.

The probe is a decode step of one sequence of ``PROBE_KV`` cached tokens, rewound after every
call so that every call runs the very same step (the same token, so the same experts), run
``PROBE_WARM_STEPS`` times untimed and then once timed: a single step read the caches that the
work before it left, not the host's speed (tiny-qwen2-moe, 2026-12-03, medians of about 100
each: 4.01 ms after a decode step of 32 sequences, 3.88 after a prefill of 1,024 tokens, 3.34
after a step of one sequence and 3.12 after another probe; the timed step after one untimed:
3.33, 3.34, 3.29 and 3.21). In the first `make validate` with a single step (2026-12-03 12:14),
tiny-qwen2-moe's runs at light load (small steps before each probe) took 1.10x the time their
probes implied, at overload (large ones) 0.93x. One untimed step was not enough either: in one
process (2026-12-05, 40 rounds in a random order, medians over the timed step after a probe),
the timed step after one untimed ran 1.11x and 1.14x after a decode step of 32 sequences and
1.18x and 1.16x after a prefill of 1,024 tokens (tiny-qwen2-moe, tiny-mixtral), 0.99x-1.02x
after a step of one sequence; after two untimed 1.04x-1.10x; after three 1.00x-1.06x
(tiny-qwen2-moe twice, tiny-mixtral, tiny-olmoe). So an overload run's probes (after large
steps) read the host slower than a light run's, and slower than the profile's (after shapes of
every size): in the `make validate` runs of that day the probe read the overload runs 3-10%
slower than their own iterations ran, and the host-normalized figures at overload fell to 16-29
of 60 means within 10%. So it runs three untimed steps. The real engine tells it how much work
has run (``work``); every ``every_s`` of that, ``maybe()`` runs it once, between iterations
(its time left out of the run's clock). The profiler runs it at the start of each pass and
after each shape's visit, and files the visit's samples divided by the probe around them
(``Profiler.normalize``): the profile is held in probe steps and read at the mean probe's
speed. So both sample the machine's speed at the moments they ran, not a minute before or
after.

Why: on this project's 2-vCPU VM the same work ran up to 1.3x slower from one run of a few
seconds to the next, and a probe after each run did not follow that (correlation 0.32 with the
runs' speeds against their profile, 2026-12-02); the host's speed over 0.5 s windows keeps only
0.4-0.7 of itself into the next window. The same step interleaved within the runs every 50 ms
of work followed it: over 24 real runs of tiny-qwen3-moe near the knee and at overload
(2026-12-03), the runs' mean probe time correlated 0.97 and 0.99 with their speed against the
profile, whose spread (CV 7.6% and 13.7%) fell to 2.0% and 3.3% divided by it. The probe (four
steps of 2.7-3.7 ms on the tiny presets every 100 ms of work; two until 2026-12-05) costs some
10-15% more work, which the run's clock does not count.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable

import torch

from profiler.ops import ModelRunner

PROBE_KV = 64  # the probe sequence's cached tokens
PROBE_EVERY_S = 0.1  # other work between two probes (seconds on the owner's clock)
PROBE_WARM_STEPS = 3  # untimed steps before the timed one (see above: one left 11-18%)
# The real engine runs the probe only this many segments or more after an idle gap: the first
# steps after one run slower (the wake-up, which the profile measures and the simulator
# charges), and a probe among them would read that as the host's speed.
PROBE_AFTER_IDLE = 4


class SpeedProbe:
    """``runner``'s decode step of one sequence of ``token_ids`` (all but the last cached by a
    prefill now), timed by ``timer`` (seconds: the runs' clock), every ``every_s`` of work."""

    def __init__(
        self,
        runner: ModelRunner,
        token_ids: list[int],
        timer: Callable[[], float],
        every_s: float = PROBE_EVERY_S,
    ) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be > 0")
        self.runner, self.timer, self.every_s = runner, timer, every_s
        self.seq = runner.new_sequence(list(token_ids))
        runner.run(runner.begin([self.seq]))  # the prefill: the ids cached, a token to feed
        self.mark = (len(self.seq.token_ids), self.seq.num_cached)
        self.cuda = runner.device.type == "cuda"
        self.owed = 0.0  # work since the last probe
        self.times: list[float] = []  # every probe's seconds, in order

    def identity(self) -> dict:
        """What the probe runs (``extra.probe`` keeps it): a profile's probe times are a
        reference only for runs of the same probe (another token, context or warm-up runs
        other work)."""
        ids = ",".join(map(str, self.seq.token_ids[: self.mark[1]]))
        return {"kv": self.mark[1], "warm_steps": PROBE_WARM_STEPS,
                "ids_sha256": hashlib.sha256(ids.encode()).hexdigest()[:16]}  # fmt: skip

    def work(self, seconds: float) -> None:
        """Count ``seconds`` of the owner's work."""
        self.owed += max(seconds, 0.0)

    @property
    def due(self) -> bool:
        return self.owed >= self.every_s

    def maybe(self) -> float | None:
        """Run the probe when due (its seconds, also appended to ``times``), else None."""
        if not self.due:
            return None
        self.owed = 0.0
        return self()

    def __call__(self) -> float:
        """One probe now: its seconds."""
        for _ in range(PROBE_WARM_STEPS):  # its weights and cache back in, untimed
            self.runner.run(self.runner.begin([self.seq]))
            self.seq.truncate(*self.mark)
        if self.cuda:
            torch.cuda.synchronize()
        start = self.timer()
        self.runner.run(self.runner.begin([self.seq]))  # returns the token: the device is done
        seconds = self.timer() - start
        self.seq.truncate(*self.mark)
        self.times.append(seconds)
        return seconds


def probe_speed(times: list[float], reference_s: float | None) -> float | None:
    """How slow the machine ran over ``times`` (a run's probes) against ``reference_s`` (the
    profile's mean probe): their mean over it (1.1: 10% slower), None without either."""
    if not times or not reference_s:
        return None
    return statistics.fmean(times) / reference_s
