"""Synthetic request lengths drawn from a LengthConfig."""

from __future__ import annotations

import numpy as np

from sim.config import LengthConfig, LengthDist


def lengths(cfg: LengthConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` token counts: fixed (= tokens), uniform integers in [min, max], or lognormal with
    median ``tokens`` and shape ``sigma``, rounded and clipped to [min, max]."""
    dist = LengthDist(cfg.dist)
    if dist is LengthDist.fixed:
        return np.full(n, cfg.tokens, dtype=np.int64)
    if dist is LengthDist.uniform:
        return rng.integers(cfg.min, cfg.max, size=n, endpoint=True)
    drawn = np.rint(rng.lognormal(np.log(cfg.tokens), cfg.sigma, n))
    return np.clip(drawn, cfg.min, cfg.max).astype(np.int64)
