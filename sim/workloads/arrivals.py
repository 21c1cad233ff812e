"""Arrival times: Poisson, gamma (burstier or smoother than Poisson), or a trace's own."""

from __future__ import annotations

import numpy as np


def poisson(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Exponential gaps with mean 1/rate; the first request arrives after the first gap."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


def gamma(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Gamma gaps with mean 1/rate and coefficient of variation ``cv`` (cv=1 is Poisson)."""
    shape = 1.0 / cv**2
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))


def replay(timestamps: np.ndarray, n: int, rate: float | None) -> np.ndarray:
    """The first ``n`` trace timestamps shifted to start at 0, the trace repeated when it is
    shorter (one mean gap between repeats), and time scaled so that the mean rate is ``rate``."""
    gaps = np.diff(timestamps)
    if n > len(timestamps):
        gaps = np.resize(np.append(gaps, gaps.mean() if gaps.size else 0.0), n - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[: n - 1])])
    if rate is not None and arrivals[-1] > 0:  # a burst at one instant has no rate to scale
        arrivals *= (n - 1) / (arrivals[-1] * rate)
    return arrivals
