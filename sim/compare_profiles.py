"""Op-by-op comparison of two profiles: how far a reference (e.g. the analytic
``h200-mixtral-bf16``) is from a measured one, at the measured profile's own points.

    python -m sim.compare_profiles MEASURED REFERENCE [--json PATH]

MEASURED and REFERENCE are profile directories or names (built-in, then results/profiles/).
Each measured point is predicted from the reference the way the simulator reads a profile
(``sim.latency``'s piecewise-linear curves); error_pct = 100 (reference - measured) / measured.
Prints one line per op (points, median and mean error, worst absolute error), a note when the
two profiles' ``interference`` differ (the simulator scales every op by it; the errors are of
the medians), and writes every point's error to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from profiler.schema import OPS, PROMPT_COUNT_OPS, Profile
from sim import profiles
from sim.config import UserError
from sim.latency import Curve1D, Curve2D, PromptCurve, WakeUp

PROG = "sim.compare_profiles"


def load(spec: str) -> Profile:
    return profiles.load("", spec) if Path(spec).is_dir() else profiles.load(spec)


# two-key ops as the latency model reads them: (key, row_key) of their Curve2D
CURVES_2D = {
    "attn_decode": ("kv_tokens", "batch_size"),
    "attn_decode_bind": ("kv_tokens", "batch_size"),
    "attn_prefill_batch": ("num_tokens", "batch_size"),
    "attn_chunk": ("num_tokens", "kv_tokens"),
}


def _predictor(points: list, op: str):
    """Seconds at a point's coordinates, interpolated in ``points`` as the simulator does
    (``sim.latency.LatencyModel``: each op on its own axes)."""
    if op == "wake_up":
        wake = WakeUp(points)
        return lambda p: wake.left_ms(p.idle_ms, p.busy_ms) / 1e3
    if op in PROMPT_COUNT_OPS:  # by tokens, and what more prompts add (PromptCurve)
        stage = PromptCurve(points)
        return lambda p: stage.scalar(p.batch_size, p.num_tokens)
    if op in CURVES_2D:
        key, row_key = CURVES_2D[op]
        curve = Curve2D(points, key, row_key=row_key)
        return lambda p: curve(getattr(p, row_key), getattr(p, key))
    (key,) = OPS[op]
    line = Curve1D(points, key)
    return lambda p: line.scalar(getattr(p, key))


def _beyond(p, theirs: list, keys: tuple[str, ...]) -> bool:
    """Whether a point lies outside the reference's range on any key (extrapolated, or held
    at the grid's first value, rather than interpolated)."""
    return any(not min(getattr(q, k) for q in theirs) <= getattr(p, k)
               <= max(getattr(q, k) for q in theirs) for k in keys)  # fmt: skip


def compare(measured: Profile, reference: Profile) -> dict:
    """Per op: the measured points with the reference's prediction and its error, plus a
    summary. Ops missing from either profile are listed under ``missing``; a point outside
    the reference's grid is marked ``beyond`` (its prediction is an extrapolation)."""
    ops, missing, zeros = {}, [], {}
    for op, keys in OPS.items():
        mine = [p for p in measured.points if p.op == op and p.median_ms > 0]
        theirs = [p for p in reference.points if p.op == op]
        # a measured 0 has no relative error: left out, and said so (step_overhead's residual
        # is clipped at 0 where the stages' medians summed to more than the iteration's
        # mean); wake_up's zeros are its definition (no idle time, nothing left)
        zero = sum(p.op == op and p.median_ms <= 0 for p in measured.points)
        if zero and op != "wake_up":
            zeros[op] = zero
        if not mine or not theirs:
            missing.append(op)
            continue
        predict = _predictor(theirs, op)
        points = []
        for p in mine:
            ref_ms = 1e3 * predict(p)
            points.append({**{k: getattr(p, k) for k in keys}, "measured_ms": p.median_ms,
                           "reference_ms": ref_ms,
                           "error_pct": 100 * (ref_ms - p.median_ms) / p.median_ms,
                           "beyond": _beyond(p, theirs, keys)})  # fmt: skip
        errors = [q["error_pct"] for q in points]
        ops[op] = {"points": len(points), "median_error_pct": statistics.median(errors),
                   "mean_error_pct": statistics.fmean(errors),
                   "max_abs_error_pct": max(abs(e) for e in errors),
                   "beyond": sum(q["beyond"] for q in points), "detail": points}  # fmt: skip
    same_shape = measured.model == reference.model
    return {"measured": measured.name, "reference": reference.name, "same_shape": same_shape,
            "ops": ops, "missing": missing, "measured_zero": zeros,
            "interference": [measured.interference, reference.interference]}  # fmt: skip


def table(result: dict) -> str:
    lines = [f"{result['reference']} against {result['measured']} (error = reference - measured)",
             f"{'op':<18} {'points':>6} {'median%':>9} {'mean%':>9} {'max|%|':>9}"]  # fmt: skip
    for op, r in result["ops"].items():
        lines.append(f"{op:<18} {r['points']:>6} {r['median_error_pct']:>9.1f} "
                     f"{r['mean_error_pct']:>9.1f} {r['max_abs_error_pct']:>9.1f}")  # fmt: skip
    if result["missing"]:
        lines.append(f"not in both: {', '.join(result['missing'])}")
    if zeros := result.get("measured_zero"):
        lines.append("note: measured points of 0 ms left out (no relative error): "
                     + ", ".join(f"{op} ({n})" for op, n in zeros.items()))  # fmt: skip
    beyond = [f"{op} ({r['beyond']} of {r['points']})" for op, r in result["ops"].items()
              if r["beyond"]]  # fmt: skip
    if beyond:
        lines.append("warning: points outside the reference's grid, their reference figures "
                     f"extrapolated: {', '.join(beyond)}")  # fmt: skip
    if not result["same_shape"]:
        lines.append("warning: the two profiles describe different model shapes")
    mine, theirs = result["interference"]
    if mine != theirs:  # the simulator scales every op but wake_up by it
        lines.append(f"note: the errors are of the op medians; the simulator also scales each "
                     f"op by its profile's interference ({mine:g} measured, {theirs:g} "
                     f"reference): its predictions from the two differ by a further factor "
                     f"of {theirs / mine:.4g}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("measured")
    ap.add_argument("reference")
    ap.add_argument("--json", help="write the per-point comparison here")
    args = ap.parse_args(argv)
    try:
        result = compare(load(args.measured), load(args.reference))
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
