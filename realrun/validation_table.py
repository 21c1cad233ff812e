"""``python -m realrun.validation_table DIR``: one markdown table over every validation under DIR
(``<DIR>/<model>-<device>/validation.json``, as ``make validate`` writes them): per model (and
workload, where it is not the default synthetic one) and load level, the clock the real runs
were timed on (wall, or cpu: ``clock=cpu``) and how their engine waited when idle (sleep, or
spin: ``idle_wait``; every run before 2026-12-05 slept), the worst and median per-class mean
error, how many are within 10%, the throughput error, the real engine's own spread (the
replays' worst CV), the host-normalized comparison (how many per-class means are within 10%
once the profile is scaled by the host's speed during each real run as the probe between its
iterations measured it, ``profiler.probe``; "-" for validations written before it, 2026-12-03),
the speed-adjusted diagnostic (how many per-class means are within 10% once each real run's
measured speed scales the profile; "-" for validations written before it), and how many
per-class means are ill-conditioned (the simulator's figure moves more than 10% with every
iteration ``sensitivity_pct`` faster or slower; "-" for validations written before it), and how
many per-class means the simulator puts within the real replays' own min-max range (below it,
above it): a simulator exact on a point's real median would be in that range with probability
1 - 2^(1 - replays), 75% at 3 replays ("-" with one replay).

Beside the simulator's count within 10%, what the real engine's own spread allows
(``noise_floor``): how many per-class means a simulator exact on each point's true mean would
put within 10% of the replays' mean (expected, for replays spread normally with their sample
standard deviation: an estimate, three replays measure a spread roughly), and how many a real
replay puts within 10% of the other replays' mean, scored as the simulator is (measured); at
overload, beside the throughput error, how many points are within 5% and how many an exact
simulator would be expected to get there."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from statistics import NormalDist

LOADS = ("light", "knee", "overload", "loaded")
# A per-class mean that moves more than this (in %) when every iteration runs qllm-validate's
# ``sensitivity_pct`` faster or slower is ill-conditioned: the goal's 10% bound.
ILL_CONDITIONED_PCT = 10.0
# The bounds (in %): a per-class mean's error, and throughput's at overload.
GOAL_PCT = 10.0
THROUGHPUT_GOAL_PCT = 5.0


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


def replay_values(record: dict) -> list[float] | None:
    """A point's replays' values (each replay's mean): ``real_values``, or for records written
    before it (2026-12-03) two or three replays rebuilt from ``real_min``, ``real`` (their
    mean) and ``real_max``. None: one replay, more than three without ``real_values``, or a
    replay without a value."""
    values = record.get("real_values")
    if values is None:
        lo, mean, hi, n = record["real_min"], record["real"], record["real_max"], record["replays"]
        values = {2: [lo, hi], 3: [lo, 3 * mean - lo - hi, hi]}.get(n)
    if values is None or len(values) < 2 or not all(math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]


def exact_chance(values: list[float], bound_pct: float = GOAL_PCT) -> float:
    """The chance that a simulator exact on a point's true mean has an error within
    ``bound_pct`` against the mean of ``values`` (its replays), for replays drawn normally
    about it with their sample standard deviation (the true mean taken as theirs). The
    error (sim - mean) / mean is within +-b where the replays' mean lies within
    [mu / (1 + b), mu / (1 - b)]."""
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    if sd == 0:
        return 1.0
    b = bound_pct / 100
    se = sd / math.sqrt(len(values))
    hi = mean / (1 - b) - mean if b < 1 else math.inf
    return NormalDist().cdf(hi / se) - NormalDist().cdf((mean / (1 + b) - mean) / se)


def replay_within(values: list[float], bound_pct: float = GOAL_PCT) -> float:
    """The share of the replays whose value is within ``bound_pct`` of the other replays'
    mean, each scored as the simulator is: (replay - others' mean) / others' mean."""
    total, n = sum(values), len(values)
    hits = []
    for x in values:
        others = (total - x) / (n - 1)
        hits.append(abs(100 * (x - others) / others) <= bound_pct if others else x == 0)
    return statistics.fmean(hits)


def noise_floor(records: list[dict], bound_pct: float = GOAL_PCT, throughput: bool = False
                ) -> tuple[float, float, int] | None:  # fmt: skip
    """What the real engine's own spread allows, over the per-class means (``throughput``:
    the throughput rows instead) whose replays measure one (``replay_values``): how many a
    simulator exact on each point's true mean would put within ``bound_pct`` (expected: the
    sum of ``exact_chance``), how many a real replay puts within it of the other replays'
    mean (``replay_within``, averaged over the replays), and of how many. None: no such
    rows."""
    found = [v for r in records
             if (r["metric"] == "throughput_jobs" if throughput else r["cls"] != "all")
             and (v := replay_values(r)) is not None]  # fmt: skip
    if not found:
        return None
    return (sum(exact_chance(v, bound_pct) for v in found),
            sum(replay_within(v, bound_pct) for v in found), len(found))  # fmt: skip


def _top_key(directory: Path, key: str, before: str) -> str:
    """A top-level key of the validation's config.yaml in ``directory``; ``before`` where it
    has none (a run from before the key existed), "?" without a config.yaml."""
    config = directory / "config.yaml"
    if not config.is_file():
        return "?"
    for line in config.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return before


def clock_of(directory: Path) -> str:
    """The clock of the validation in ``directory`` (its config.yaml; runs before ``clock``
    existed were on the wall clock)."""
    return _top_key(directory, "clock", "wall")


def idle_wait_of(directory: Path) -> str:
    """How the validation's real engine waited when idle (``idle_wait``; runs before it
    existed, 2026-12-05, slept)."""
    return _top_key(directory, "idle_wait", "sleep")


# qllm-validate's own workload (conf/validate.yaml): the table names any other
DEFAULT_WORKLOAD = "synthetic"


def workload_of(directory: Path) -> str | None:
    """The workload's name in the validation in ``directory`` (its config.yaml's
    ``workload.name``), or None where it has none."""
    config = directory / "config.yaml"
    if not config.is_file():
        return None
    inside = False
    for line in config.read_text().splitlines():
        if not line.startswith(" "):
            inside = line.rstrip() == "workload:"
        elif inside and line.startswith("  name:"):
            return line.split(":", 1)[1].strip() or None
    return None


def label_of(directory: Path) -> str:
    """The table's name for the validation in ``directory``: its folder's name, and its
    workload's where that is not qllm-validate's default and the name does not say it."""
    workload = workload_of(directory)
    name = directory.name
    if workload in (None, DEFAULT_WORKLOAD) or workload in name:
        return name
    return f"{name} ({workload})"


def meets_goal(point: list[dict], key: str = "error_pct") -> bool | None:
    """Whether one row's records (a model at a load) meet issue 10's whole goal on ``key``
    (``error_pct``, or ``host_normalized_error_pct``): every per-class mean within
    ``GOAL_PCT``, their median within half of it, and at overload every throughput within
    ``THROUGHPUT_GOAL_PCT``. None: a record without ``key`` (written before it)."""
    if any(key not in r for r in point):
        return None
    errors = [abs(r[key]) for r in point if r["cls"] != "all"]
    if not errors or not all(math.isfinite(e) for e in errors):
        return False
    thr = [abs(r[key]) for r in point if r["metric"] == "throughput_jobs"]
    overload = point[0]["load"] == "overload"
    return (max(errors) <= GOAL_PCT and statistics.median(errors) <= GOAL_PCT / 2
            and not (overload and not all(e <= THROUGHPUT_GOAL_PCT for e in thr)))  # fmt: skip


def rows_of(name: str, records: list[dict], clock: str = "?", digits: int = 0) -> list[str]:
    """The table's rows of ``records`` (one validation's, or several's for the totals, whose
    expected counts are printed with ``digits`` decimals)."""
    rows = []
    loads = sorted({r["load"] for r in records}, key=_load_order)
    for load in loads:
        point = [r for r in records if r["load"] == load]
        errors = [abs(r["error_pct"]) for r in point
                  if r["cls"] != "all" and math.isfinite(r["error_pct"])]  # fmt: skip
        thr = [r["error_pct"] for r in point if r["metric"] == "throughput_jobs"]
        thr_floor = None if load != "overload" else noise_floor(
            point, THROUGHPUT_GOAL_PCT, throughput=True)  # fmt: skip
        thr_allowed = ("" if thr_floor is None else
                       f" (within {THROUGHPUT_GOAL_PCT:g}%: "
                       f"{sum(abs(e) <= THROUGHPUT_GOAL_PCT for e in thr)} of {len(thr)}, "
                       f"exact ~{thr_floor[0]:.1f})")  # fmt: skip
        cvs = [cv for r in point if (cv := r["real_cv_pct"]) is not None]
        within = sum(e <= GOAL_PCT for e in errors)
        floor = noise_floor(point)
        # over the means whose replays measure a spread (one replay: none), said where fewer
        of = "" if floor is None or floor[2] == len(errors) else f"of the {floor[2]} with replays: "
        allowed = (
            ""
            if floor is None
            else f" ({of}exact ~{floor[0]:.{digits}f}, a replay ~{floor[1]:.{digits}f})"
        )
        adjusted = [abs(r["speed_adjusted_error_pct"]) for r in point if r["cls"] != "all"
                    and math.isfinite(r.get("speed_adjusted_error_pct", math.nan))]  # fmt: skip
        adj = (f"{sum(e <= GOAL_PCT for e in adjusted)} of {len(adjusted)}, median "
               f"{statistics.median(adjusted):.1f}%" if adjusted else "-")  # fmt: skip
        normal = [abs(r["host_normalized_error_pct"]) for r in point if r["cls"] != "all"
                  and math.isfinite(r.get("host_normalized_error_pct", math.nan))]  # fmt: skip
        norm = (f"{sum(e <= GOAL_PCT for e in normal)} of {len(normal)}, median "
                f"{statistics.median(normal):.1f}%, worst {max(normal):.1f}%" if normal
                else "-")  # fmt: skip
        moved = [r["sim_sensitivity_pct"] for r in point if r["cls"] != "all"
                 and math.isfinite(r.get("sim_sensitivity_pct", math.nan))]  # fmt: skip
        ill = (f"{sum(m > ILL_CONDITIONED_PCT for m in moved)} of {len(moved)}" if moved
               else "-")  # fmt: skip
        inside = within_replays(point)
        ranged = ("-" if inside is None else
                  f"{inside[0]} of {inside[3]} ({inside[1]} below, {inside[2]} above; exact "
                  f"{100 * inside[4]:.0f}%)")  # fmt: skip
        rows.append(f"| {name} | {load} | {clock} | {max(errors):.1f}% "
                    f"| {statistics.median(errors):.1f}% "
                    f"| {within} of {len(errors)}{allowed} "
                    f"| {min(thr):+.1f}% .. {max(thr):+.1f}%{thr_allowed} "
                    f"| {f'{max(cvs):.1f}%' if cvs else '-'} | {norm} | {adj} | {ill} "
                    f"| {ranged} |")  # fmt: skip
    return rows


def table(root: Path) -> str:
    found = sorted(root.glob("*/validation.json"))
    if not found:
        raise FileNotFoundError(f"no */validation.json under {root}")
    lines = ["| model | load | clock, idle wait | worst per-class error | median "
             "| within 10% (an exact sim, expected; a real replay against the others) "
             "| throughput error | real replays' worst CV "
             "| host-normalized within 10% "
             "| speed-adjusted within 10% (diagnostic) "
             "| ill-conditioned (sim moves >10%) "
             "| sim within the replays' min-max (an exact sim's chance) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    every, goal = [], {"error_pct": [], "host_normalized_error_pct": []}
    for path in found:
        records = json.loads(path.read_text())
        if not records or "load" not in records[0]:
            raise ValueError(f"{path}: written by an older qllm-validate (no load field)")
        name = label_of(path.parent)
        lines += rows_of(name, records, f"{clock_of(path.parent)}, {idle_wait_of(path.parent)}")
        every += records
        for load in sorted({r["load"] for r in records}, key=_load_order):
            for key, met in goal.items():
                met.append(
                    (
                        f"{name} at {load}",
                        meets_goal([r for r in records if r["load"] == load], key),
                    )
                )
    if len(found) > 1:  # the totals per load, so that no reader sums rounded row figures
        lines += rows_of(f"all {len(found)}", every, "-", digits=1)
    lines.append("")
    for key, label in (("error_pct", "the simulator"),
                       ("host_normalized_error_pct", "host-normalized")):  # fmt: skip
        rows = goal[key]
        if any(m is None for _, m in rows):
            continue
        met = [name for name, m in rows if m]
        lines.append(f"Rows meeting the whole goal ({label}: every per-class mean within "
                     f"{GOAL_PCT:g}%, their median within {GOAL_PCT / 2:g}%, throughput at "
                     f"overload within {THROUGHPUT_GOAL_PCT:g}%): {len(met)} of {len(rows)}"
                     + (f" ({', '.join(met)})" if met else "") + ".")  # fmt: skip
    return "\n".join(lines).rstrip("\n")


def _load_order(load: str) -> int:
    return LOADS.index(load) if load in LOADS else 9


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
