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


def diurnal(arrivals: np.ndarray, peak_to_trough: float, period_s: float = 86_400.0) -> np.ndarray:
    """Re-time arrivals of (roughly) constant rate so that the rate follows a day: a sinusoid
    with its trough at t=0 and its peak half a period later, ``peak_to_trough`` times the trough,
    and the same mean rate (so the same number of requests spans the same time).

    A time change: with f(t) = 1 - a cos(2 pi t / P) (mean 1) and F its integral, an arrival at
    t goes to F^-1(t); a process of rate r becomes one of rate r f(t)."""
    if peak_to_trough < 1:
        raise ValueError("peak_to_trough must be >= 1")
    if not len(arrivals) or arrivals[-1] <= 0 or peak_to_trough == 1:
        return arrivals
    a = (peak_to_trough - 1) / (peak_to_trough + 1)
    w = 2 * np.pi / period_s
    grid = np.linspace(0.0, arrivals[-1] * (1 + 2 * a) + period_s, 200_001)
    cumulative = grid - a * np.sin(w * grid) / w  # F(t), increasing since a < 1
    return np.interp(arrivals, cumulative, grid)
