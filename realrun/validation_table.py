"""``python -m realrun.validation_table DIR``: one markdown table over every validation under
DIR (``<DIR>/<model>-<device>/validation.json``, as ``make validate`` writes them): per model
and load level, the clock the real runs were timed on (wall, or cpu: ``clock=cpu``), the worst
and median per-class mean error, how many are within 10%, the throughput error, the real
engine's own spread (the replays' worst CV), the speed-adjusted diagnostic (how many
per-class means are within 10% once each real run's measured speed scales the profile; "-"
for validations written before it), and how many per-class means are ill-conditioned (the
simulator's figure moves more than 10% with every iteration ``sensitivity_pct`` faster or
slower; "-" for validations written before it), and how many per-class means the simulator
puts within the real replays' own min-max range (below it, above it): a simulator exact on a
point's real median would be in that range with probability 1 - 2^(1 - replays), 75% at 3
replays ("-" with one replay)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

LOADS = ("light", "knee", "overload", "loaded")
# A per-class mean that moves more than this (in %) when every iteration runs qllm-validate's
# ``sensitivity_pct`` faster or slower is ill-conditioned: the goal's 10% bound.
ILL_CONDITIONED_PCT = 10.0


def within_replays(records: list[dict]) -> tuple[int, int, int, int, float] | None:
    """Of the per-class means of points with two replays or more: how many the simulator puts
    within the replays' min-max, below it and above it, of how many; and the share an exact
    simulator would put within (1 - 2^(1 - replays), the fewest replays of them: the chance
    that the replays' range holds their distribution's median). None: no such means."""
    means = [r for r in records if r["cls"] != "all" and r.get("replays", 1) >= 2
             and math.isfinite(r["sim"])]  # fmt: skip
    if not means:
        return None
    below = sum(r["sim"] < r["real_min"] for r in means)
    above = sum(r["sim"] > r["real_max"] for r in means)
    exact = 1 - 2.0 ** (1 - min(r["replays"] for r in means))
    return len(means) - below - above, below, above, len(means), exact


def clock_of(directory: Path) -> str:
    """The clock of the validation in ``directory`` (its config.yaml; runs before ``clock``
    existed were on the wall clock)."""
    config = directory / "config.yaml"
    if not config.is_file():
        return "?"
    for line in config.read_text().splitlines():
        if line.startswith("clock:"):
            return line.split(":", 1)[1].strip()
    return "wall"


def rows_of(name: str, records: list[dict], clock: str = "?") -> list[str]:
    rows = []
    loads = sorted({r["load"] for r in records}, key=lambda x: LOADS.index(x) if x in LOADS else 9)
    for load in loads:
        point = [r for r in records if r["load"] == load]
        errors = [abs(r["error_pct"]) for r in point
                  if r["cls"] != "all" and math.isfinite(r["error_pct"])]  # fmt: skip
        thr = [r["error_pct"] for r in point if r["metric"] == "throughput_jobs"]
        cvs = [cv for r in point if (cv := r["real_cv_pct"]) is not None]
        within = sum(e <= 10 for e in errors)
        adjusted = [abs(r["speed_adjusted_error_pct"]) for r in point if r["cls"] != "all"
                    and math.isfinite(r.get("speed_adjusted_error_pct", math.nan))]  # fmt: skip
        adj = (f"{sum(e <= 10 for e in adjusted)} of {len(adjusted)}, median "
               f"{statistics.median(adjusted):.1f}%" if adjusted else "-")  # fmt: skip
        moved = [r["sim_sensitivity_pct"] for r in point if r["cls"] != "all"
                 and math.isfinite(r.get("sim_sensitivity_pct", math.nan))]  # fmt: skip
        ill = (f"{sum(m > ILL_CONDITIONED_PCT for m in moved)} of {len(moved)}" if moved
               else "-")  # fmt: skip
        inside = within_replays(point)
        ranged = ("-" if inside is None else
                  f"{inside[0]} of {inside[3]} ({inside[1]} below, {inside[2]} above)")  # fmt: skip
        rows.append(f"| {name} | {load} | {clock} | {max(errors):.1f}% "
                    f"| {statistics.median(errors):.1f}% "
                    f"| {within} of {len(errors)} | {min(thr):+.1f}% .. {max(thr):+.1f}% "
                    f"| {f'{max(cvs):.1f}%' if cvs else '-'} | {adj} | {ill} "
                    f"| {ranged} |")  # fmt: skip
    return rows


def table(root: Path) -> str:
    found = sorted(root.glob("*/validation.json"))
    if not found:
        raise FileNotFoundError(f"no */validation.json under {root}")
    lines = ["| model | load | clock | worst per-class error | median | within 10% "
             "| throughput error | real replays' worst CV "
             "| speed-adjusted within 10% (diagnostic) "
             "| ill-conditioned (sim moves >10%) "
             "| sim within the replays' min-max (exact: 75% at 3) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path in found:
        records = json.loads(path.read_text())
        if not records or "load" not in records[0]:
            raise ValueError(f"{path}: written by an older qllm-validate (no load field)")
        lines += rows_of(path.parent.name, records, clock_of(path.parent))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m realrun.validation_table")
    ap.add_argument("dir", nargs="?", default="results/validation")
    args = ap.parse_args(argv)
    try:
        print(table(Path(args.dir)))
    except (FileNotFoundError, ValueError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
