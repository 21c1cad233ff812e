"""Where the real engine's host page faults come from, under which allocator settings.

    python -m gpu.faults --json faults.json model=mixtral-8x7b device=cuda workload.rate=2.7

On the H200 (2026-12-04, results/gpu/h200/run4) the real runs took 113-266 minor page faults a
segment with glibc keeping freed memory (``profiler.ops.retain_freed_memory``), in streaks:
decode steps of one sequence faulting ~205 times each for tens of steps, then none for tens,
and the segments with 50 faults or more ran a median 1.70x their prediction (p10-p90
1.45x-2.42x, 522 segments), the others 1.14x (0.85x-1.58x, 365). The last phase of
``gpu/modes.py``'s decode loop, the same runner, took none (on lengths it had already fed,
as it turned out). So this runs the real engine itself
(``realrun``'s pipeline: the model, the scheduler, a synthetic workload in wall-clock time)
and charges each fault to where it happened:

- per stage kind (``prepare``, ``attention``, ``router``, ``expert``, ``lm_head``): the
  process's faults and the main thread's (``RUSAGE_THREAD``) over each ``ModelRunner.step``;
  what a segment took outside its stages is the engine's own bookkeeping;
- per segment: its faults, time, the process's resident memory after it (a steady climb is
  memory kept, a flat line with faults is memory mapped and unmapped again), the count of its
  memory mappings, and CPython's small-object arenas allocated and reclaimed so far
  (``sys._debugmallocstats``: an arena unmapped and mapped again at every step faults its
  pages in each time, and glibc's settings do not hold it).

Each ``--env`` runs the whole thing again in a fresh process with those variables set (e.g.
``PYTHONMALLOC=malloc``: Python's small objects from glibc's heap instead of its own
arenas; ``MALLOC_ARENA_MAX=1``: every thread on glibc's main heap;
``GPU_FAULTS_CUDNN_SDPA=1``, read here: cuDNN's attention back on after the runner turned it
off, ``profiler.ops.no_per_shape_attention_plans``), so the variants are compared on one
machine in one call. Extra arguments are ``qllm-realrun`` overrides, after the defaults
below (the GPU check's validation workload: 24 requests, prompts ~128 tokens, outputs ~16,
iteration-level scheduling).

Run 5 (results/gpu/h200/run5) answered it: every fault was the main thread's, in the
attention stage, with resident memory climbing ~1 MB a faulting step and none given back, the
same under all three allocator settings: cuDNN's attention plans, one built and cached for
each new shape (``no_per_shape_attention_plans``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from gpu.modes import cpu_probe_ms

ROOT = Path(__file__).resolve().parent.parent

DEFAULTS = [
    "workload=synthetic", "workload.num_requests=24", "workload.rate=2.7",
    "workload.prompt.tokens=128", "workload.prompt.sigma=0.6", "workload.prompt.min=16",
    "workload.prompt.max=512", "workload.output.tokens=16", "workload.output.sigma=0.5",
    "workload.output.min=4", "workload.output.max=48", "max_prompt_tokens=512",
    "policy=iteration", "progress=false", "trace=off", "clock=wall",
]  # fmt: skip

# a segment "faults" from this many faults on (run 4's streaks: ~200-330 a segment, or 0-1)
FAULTING = 50


def process_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def arenas() -> dict[str, int]:
    """CPython's small-object arena counters (empty when PYTHONMALLOC bypasses them)."""
    fd, path = tempfile.mkstemp()
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    text = Path(path).read_text()
    os.unlink(path)
    out = {}
    for line in text.splitlines():
        if line.startswith("# arenas") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip("# ").strip().replace(" ", "_")] = int(value.strip().replace(",", ""))
    return out


def run_once(overrides: list[str]) -> dict:
    """The engine once in this process, its faults charged as the module says."""
    from hydra import compose, initialize_config_dir

    import realrun.app  # noqa: F401  (registers the config schema)
    from profiler.ops import ModelRunner
    from realrun.engine import RealEngine
    from realrun.run import realrun

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("realrun", overrides=DEFAULTS + overrides)
    stages: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # calls, process, thread
    seg_stage = [0, 0]  # this segment's faults inside stages: process, main thread
    segments: list[dict] = []
    runner_seen: list = []
    step, record = ModelRunner.step, RealEngine._record

    def counted_step(self, state):
        if not runner_seen:
            runner_seen.append(self)
            if os.environ.get("GPU_FAULTS_CUDNN_SDPA") == "1":  # the variant with it back on
                torch.backends.cuda.enable_cudnn_sdp(True)
        p, t = process_faults(), thread_faults()
        ref = step(self, state)
        dp, dt = process_faults() - p, thread_faults() - t
        entry = stages[ref.stage]
        entry[0] += 1
        entry[1] += dp
        entry[2] += dt
        seg_stage[0] += dp
        seg_stage[1] += dt
        return ref

    def counted_record(self, batch, start_cursor, end_cursor, start_s, end_s, *args, **kw):
        record(self, batch, start_cursor, end_cursor, start_s, end_s, *args, **kw)
        seg = self.segments[-1]
        a, probe = arenas(), cpu_probe_ms()  # after the segment, outside its clock
        segments.append({"phase": seg.phase, "size": len(seg.shape),
                         "tokens": sum(n for _, n, _ in seg.shape),
                         "ms": round(1e3 * (seg.end_s - seg.start_s), 3),
                         "faults": seg.faults, "stage_faults": seg_stage[0],
                         "stage_thread_faults": seg_stage[1], "rss_kib": rss_kib(),
                         "mappings": mappings(), "cpu_probe_ms": round(probe, 4),
                         "arenas_total": a.get("arenas_allocated_total"),
                         "arenas_reclaimed": a.get("arenas_reclaimed")})  # fmt: skip
        seg_stage[0] = seg_stage[1] = 0

    ModelRunner.step, RealEngine._record = counted_step, counted_record
    rss0, arenas0, t0 = rss_kib(), arenas(), time.perf_counter()
    try:
        out = realrun(cfg)
    finally:
        ModelRunner.step, RealEngine._record = step, record
    return {"overrides": DEFAULTS + overrides, "wall_s": time.perf_counter() - t0,
            "run_faults": out.result.page_faults, "rss_kib_before": rss0,
            "arenas_before": arenas0, "arenas_after": arenas(),
            "retains_memory": bool(runner_seen and runner_seen[0].retains_memory),
            "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(),
            "stages": {k: {"calls": v[0], "faults": v[1], "thread_faults": v[2]}
                       for k, v in sorted(stages.items())},
            "segments": segments}  # fmt: skip


def median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def summarize(result: dict) -> dict:
    segs = result["segments"]
    faults = np.array([s["faults"] or 0 for s in segs], dtype=float)
    inside = np.array([s["stage_faults"] for s in segs], dtype=float)
    thread = np.array([s["stage_thread_faults"] for s in segs], dtype=float)
    # a decode segment's time per sequence, faulting against not (batch sizes mixed: compare
    # variants by the segments themselves, not by these medians)
    dec = [s for s in segs if s["phase"] == "decode"]
    ms_seq = np.array([s["ms"] / max(s["size"], 1) for s in dec])
    faulting = np.array([(s["faults"] or 0) >= FAULTING for s in dec], dtype=bool)
    probe = np.array([s["cpu_probe_ms"] for s in dec])
    corr = (float(np.corrcoef(ms_seq, probe)[0, 1])
            if len(dec) > 2 and probe.std() > 0 and ms_seq.std() > 0 else None)  # fmt: skip
    reclaimed = [s["arenas_reclaimed"] for s in segs if s["arenas_reclaimed"] is not None]
    return {"segments": len(segs), "faults_per_segment": float(faults.mean()) if segs else 0.0,
            "faulting_share": float(np.mean(faults >= FAULTING)) if segs else 0.0,
            "inside_stages_share": float(inside.sum() / faults.sum()) if faults.sum() else None,
            "main_thread_share": float(thread.sum() / inside.sum()) if inside.sum() else None,
            "arenas_reclaimed": (reclaimed[-1] - reclaimed[0]) if reclaimed else None,
            "rss_growth_kib": (segs[-1]["rss_kib"] - segs[0]["rss_kib"]) if segs else 0,
            "decode_ms_per_seq_faulting": median(ms_seq[faulting].tolist()),
            "decode_ms_per_seq_quiet": median(ms_seq[~faulting].tolist()),
            "cpu_probe_median_ms": float(np.median(probe)) if len(dec) else None,
            "corr_decode_ms_cpu_probe": corr}  # fmt: skip


def choose(results: list[dict], ratio: float = 0.25, floor: float = 20.0) -> dict | None:
    """The variant to validate under: the one with the fewest faults a segment, if under
    ``ratio`` of the first (the default's) and the first took ``floor`` or more; else None.
    A variant that sets a ``GPU_FAULTS_*`` variable is never chosen: only this script reads
    those, so the validation would not run as that variant did."""
    others = [r for r in results[1:] if not any(k.startswith("GPU_FAULTS_") for k in r["env"])]
    if not others or results[0]["summary"]["faults_per_segment"] < floor:
        return None
    base = results[0]["summary"]["faults_per_segment"]
    best = min(others, key=lambda r: r["summary"]["faults_per_segment"])
    return best if best["summary"]["faults_per_segment"] < ratio * base else None


def shown(x) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gpu.faults")
    ap.add_argument("--json", help="write every variant's result here")
    ap.add_argument("--env", action="append", default=None, metavar="VAR=VALUE[,VAR=VALUE]",
                    help="a variant: run again in a fresh process with these set ('' for none);"
                    " repeatable (default: one run in this process)")  # fmt: skip
    ap.add_argument("--choose", metavar="JSON", help="print the env (VAR=VALUE,...) of the "
                    "variant to validate under (see choose), or nothing, and exit")  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a variant's result file
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if o.startswith("-") or "=" not in o]
    if bad:
        ap.error(f"not a qllm-realrun override: {bad[0]}")
    if args.choose:
        best = choose(json.loads(Path(args.choose).read_text())["variants"])
        print(",".join(f"{k}={v}" for k, v in best["env"].items()) if best else "")
        return
    if args.child:
        Path(args.child).write_text(json.dumps(run_once(overrides)))
        return
    variants = args.env if args.env is not None else [None]
    results = []
    for spec in variants:
        env_vars = dict(kv.split("=", 1) for kv in spec.split(",") if kv) if spec else {}
        if spec is None:
            result = run_once(overrides)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                child = Path(tmp) / "result.json"
                cmd = [sys.executable, "-m", "gpu.faults", "--child", str(child), *overrides]
                done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env_vars})
                if done.returncode != 0:
                    sys.exit(f"gpu.faults: the variant {spec!r} failed (rc {done.returncode})")
                result = json.loads(child.read_text())
        result.update(env=env_vars, summary=summarize(result), python=platform.python_version(),
                      libc=" ".join(platform.libc_ver()))  # fmt: skip
        results.append(result)
        s = result["summary"]
        print(f"env={spec or '-'} segments={s['segments']} "
              f"faults_per_segment={s['faults_per_segment']:.1f} "
              f"faulting_share={s['faulting_share']:.2f} "
              f"in_stages={shown(s['inside_stages_share'])} "
              f"main_thread={shown(s['main_thread_share'])} "
              f"arenas_reclaimed={shown(s['arenas_reclaimed'])} "
              f"rss_growth_kib={s['rss_growth_kib']} "
              f"decode_ms_per_seq faulting={shown(s['decode_ms_per_seq_faulting'])} "
              f"quiet={shown(s['decode_ms_per_seq_quiet'])} "
              f"cpu_probe_ms={shown(s['cpu_probe_median_ms'])} "
              f"corr(decode_ms, cpu_probe)={shown(s['corr_decode_ms_cpu_probe'])} "
              f"retains_memory={result['retains_memory']}", flush=True)  # fmt: skip
        for name, st in result["stages"].items():
            print(
                f"  stage={name} calls={st['calls']} faults={st['faults']} "
                f"thread_faults={st['thread_faults']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": results}, indent=1))


if __name__ == "__main__":
    main()
