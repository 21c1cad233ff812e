"""Decode-step times of one model against the host page faults each step takes: is the slow
mode of the H200 validation (steps 1.5-1.9x the profile's) host memory mapped in mid-step?

    python -m gpu.modes --model mixtral-8x7b --device cuda --steps 300 --json modes.json

Run 3 on the H200 (2026-12-04, results/gpu/h200/run3) answered the first question this script
asked: pinning the host thread to one core does not remove the slow mode (14% of free steps
slow, 30% pinned, 10% free again). Its validation found instead that each real run's speed
against the profile followed the host page faults it took per iteration (1.12x at 70, 1.90x
at 318), while the host-speed probe, the same decode step repeated, ran at the profile's
speed beside it. So the phases now are, ``--steps`` decode steps of ``--batch`` sequences
each, under glibc's default allocator first:

- ``rewound``: the very same step again and again (the cache rewound after each), as the
  profile and the probe time it;
- ``growing``: steps that keep their token (the context grows by one each step, every shape
  new, as in the real engine), rewound every ``--grow`` steps;
- ``growing-retained``: the same after ``profiler.ops.retain_freed_memory`` (process-wide and
  for good, so last), as every ``ModelRunner`` now runs.

Run 4 read its third phase wrongly: it fed the very context lengths that the second phase
had fed after its first rewind, so cuDNN's attention plans for them were already built and
cached, and that, not the allocator, is why it took no faults (runs 5 and 6, gpu/faults.py).
Every ``ModelRunner`` on CUDA now turns that backend off, this script's too.

Per phase: median, p10, p90 (ms), the share of steps slower than 1.25x the run's overall p10
("slow"), the minor page faults per step (median, mean) and the correlation of a step's time
with its faults; a pure-Python probe timed before each step (``cpu_probe_ms``) and its
correlation with the step's time, the host's steal time over the phase (/proc/stat), to tell
a machine-wide slow state of the host CPU (the second machine of run 3 profiled 1.5x slow
throughout) from the GPU's; and the GPU's SM clock before and after (nvidia-smi, when
present).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import time

import numpy as np
import torch

from profiler.models import build_model
from profiler.ops import ModelRunner, retain_freed_memory

PHASES = ("rewound", "growing", "growing-retained")


def sm_clock_mhz() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout.strip()  # fmt: skip
    return int(out.splitlines()[0]) if out and out.splitlines()[0].isdigit() else None


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


CPU_PROBE_ITERATIONS = 20_000  # about 0.5-1 ms of pure Python


def cpu_probe_ms() -> float:
    """A fixed piece of pure-Python work, timed: the host CPU's own speed beside each step
    (a machine-wide slow state of the host shows here; one of the GPU does not)."""
    t = time.perf_counter()
    x = 0
    for i in range(CPU_PROBE_ITERATIONS):
        x += i
    return 1e3 * (time.perf_counter() - t)


def steal_ticks() -> int | None:
    """The host's steal time so far (/proc/stat, clock ticks): a virtual CPU held off its core
    by the hypervisor; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def corr(a: np.ndarray, b: np.ndarray) -> float | None:
    return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else None


def shown(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def summarize(name: str, ms: list[float], faults: list[int], cpu_ms: list[float],
              fast_ms: float) -> dict:  # fmt: skip
    t, f, c = np.array(ms), np.array(faults, dtype=float), np.array(cpu_ms)
    return {"phase": name, "median_ms": float(np.median(t)),
            "p10_ms": float(np.percentile(t, 10)), "p90_ms": float(np.percentile(t, 90)),
            "slow_share": float(np.mean(t > 1.25 * fast_ms)),
            "faults_median": float(np.median(f)), "faults_mean": float(f.mean()),
            "corr_ms_faults": corr(t, f),
            "cpu_probe_median_ms": float(np.median(c)), "corr_ms_cpu_probe": corr(t, c),
            "series_ms": [round(float(x), 3) for x in t], "series_faults": faults,
            "series_cpu_probe_ms": [round(float(x), 4) for x in c]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gpu.modes")
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--grow", type=int, default=48, help="growing steps between two rewinds")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.steps < 2 or args.grow < 1:
        ap.error("--steps must be >= 2 and --grow >= 1")
    t0 = time.perf_counter()
    model, info = build_model({"name": args.model}, device=args.device)
    runner = ModelRunner(model, retain_memory=False)  # the default allocator, until the last
    gen = torch.Generator().manual_seed(0)
    seqs = [runner.new_sequence(torch.randint(0, runner.config.vocab_size, (args.context,),
                                              generator=gen).tolist())
            for _ in range(args.batch)]  # fmt: skip
    runner.run(runner.begin(seqs))  # the prefill: one token left to feed
    marks = [(len(s.token_ids), s.num_cached) for s in seqs]
    print(f"model={args.model} device={args.device} built in {time.perf_counter() - t0:.1f} s")

    def rewind() -> None:
        for s, (n, c) in zip(seqs, marks, strict=True):
            s.truncate(n, c)

    raw, clocks = [], []
    for name in PHASES:
        if name == "growing-retained":
            retained = retain_freed_memory()
            print(f"retain_freed_memory: {retained}")
        clock_before, steal_before = sm_clock_mhz(), steal_ticks()
        ms, faults, cpu_ms = [], [], []
        for i in range(args.steps):
            cpu_ms.append(cpu_probe_ms())  # the host CPU's speed right before the step
            f = minor_faults()
            t = time.perf_counter()
            runner.run(runner.begin(seqs))  # returns tokens: the device has finished
            ms.append(1e3 * (time.perf_counter() - t))
            faults.append(minor_faults() - f)
            if name == "rewound" or (i + 1) % args.grow == 0:
                rewind()
        rewind()
        steal_after = steal_ticks()
        raw.append((name, ms, faults, cpu_ms))
        clocks.append((clock_before, sm_clock_mhz(), None if steal_before is None
                       or steal_after is None else steal_after - steal_before))  # fmt: skip
    fast = float(np.percentile([x for _, ms, _, _ in raw for x in ms], 10))
    phases = []
    for (name, ms, faults, cpu_ms), (before, after, steal) in zip(raw, clocks, strict=True):
        p = summarize(name, ms, faults, cpu_ms, fast)
        p.update(sm_clock_before_mhz=before, sm_clock_after_mhz=after, steal_ticks=steal)
        phases.append(p)
        print(f"phase={name} median_ms={p['median_ms']:.2f} p10_ms={p['p10_ms']:.2f} "
              f"p90_ms={p['p90_ms']:.2f} slow_share={p['slow_share']:.2f} "
              f"faults_per_step={p['faults_median']:.0f} (mean {p['faults_mean']:.1f}) "
              f"corr(ms, faults)={shown(p['corr_ms_faults'])} "
              f"cpu_probe_ms={p['cpu_probe_median_ms']:.3f} "
              f"corr(ms, cpu_probe)={shown(p['corr_ms_cpu_probe'])} steal_ticks={steal} "
              f"sm_clock_mhz={before}->{after}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fast_p10_ms": fast, "phases": phases}, f, indent=1)


if __name__ == "__main__":
    main()
