"""Decode-step times of one model, free and pinned to one CPU core: are the two speed modes the
H200 validation saw (results/gpu/h200/run2) the host thread moving between cores?

    python -m gpu.modes --model mixtral-8x7b --device cuda --steps 250 --json modes.json

Three phases of ``--steps`` decode steps of ``--batch`` sequences each (the cache rewound after
each step, so every step has the same shape): free, pinned to the core the process is on, free
again. Per phase: median, p10, p90 (ms), the share of steps slower than 1.25x the run's overall
p10 ("slow mode"), and the GPU's SM clock before and after (nvidia-smi, when present).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time

import numpy as np
import torch

from profiler.models import build_model
from profiler.ops import ModelRunner


def sm_clock_mhz() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout.strip()  # fmt: skip
    return int(out.splitlines()[0]) if out and out.splitlines()[0].isdigit() else None


def current_cpu(allowed: set[int]) -> int:
    """The core this process runs on now (field 39 of /proc/self/stat: Python has no
    sched_getcpu), or the lowest allowed one where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name
        core = int(fields[36])  # field 39 of the whole line; fields[0] is field 3
    except (OSError, ValueError, IndexError):
        return min(allowed)
    return core if core in allowed else min(allowed)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gpu.modes")
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, info = build_model({"name": args.model}, device=args.device)
    runner = ModelRunner(model)
    gen = torch.Generator().manual_seed(0)
    seqs = [runner.new_sequence(torch.randint(0, runner.config.vocab_size, (args.context,),
                                              generator=gen).tolist())
            for _ in range(args.batch)]  # fmt: skip
    runner.run(runner.begin(seqs))  # the prefill: one token left to feed
    marks = [(len(s.token_ids), s.num_cached) for s in seqs]
    print(f"model={args.model} device={args.device} built in {time.perf_counter() - t0:.1f} s; "
          f"cpus {sorted(os.sched_getaffinity(0))}")  # fmt: skip
    allowed = os.sched_getaffinity(0)
    phases, all_ms = [], []
    for name in ("free", "pinned", "free-again"):
        if name == "pinned":
            core = current_cpu(allowed)
            os.sched_setaffinity(0, {core})
        else:
            os.sched_setaffinity(0, allowed)
        clock_before = sm_clock_mhz()
        ms = []
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.run(runner.begin(seqs))  # returns tokens: the device has finished
            ms.append(1e3 * (time.perf_counter() - t))
            for s, (n, c) in zip(seqs, marks, strict=True):
                s.truncate(n, c)
        phases.append({"phase": name, "pinned_to": sorted(os.sched_getaffinity(0)),
                       "ms": ms, "sm_clock_before_mhz": clock_before,
                       "sm_clock_after_mhz": sm_clock_mhz()})  # fmt: skip
        all_ms += ms
    os.sched_setaffinity(0, allowed)
    fast = float(np.percentile(all_ms, 10))
    for p in phases:
        ms = np.array(p.pop("ms"))
        p.update(median_ms=float(np.median(ms)), p10_ms=float(np.percentile(ms, 10)),
                 p90_ms=float(np.percentile(ms, 90)), slow_share=float(np.mean(ms > 1.25 * fast)),
                 series_ms=[round(float(x), 3) for x in ms])  # fmt: skip
        print(f"phase={p['phase']} pinned_to={p['pinned_to'][:4]} median_ms={p['median_ms']:.2f} "
              f"p10_ms={p['p10_ms']:.2f} p90_ms={p['p90_ms']:.2f} slow_share={p['slow_share']:.2f}"
              f" sm_clock_mhz={p['sm_clock_before_mhz']}->{p['sm_clock_after_mhz']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fast_p10_ms": fast, "phases": phases}, f, indent=1)


if __name__ == "__main__":
    main()
