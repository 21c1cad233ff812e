"""Running the experiments' grids: one task per grid point, all arms on one shared workload."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import cache

import numpy as np
import pandas as pd
from hydra import compose, initialize_config_dir
from tqdm import tqdm

from sim.app import CONF_DIR  # registers the structured config
from sim.report import run_settings, summary_rows, tidy
from sim.reproduce.experiments import PAPER_SETUP, Experiment
from sim.run import simulate
from sim.workloads import build_workload

REFERENCE_PROFILE = PAPER_SETUP["profile"]
CDF_EXPERIMENT = "paper"  # per-request TTFTs are kept for this experiment's CDF figure only


def point_seed(replicate: int, base_rate: float) -> int:
    """The workload seed of one grid point: independent across rates and replicates, the same
    for every arm and experiment at that point (paired comparisons)."""
    return int(np.random.SeedSequence([replicate, round(base_rate * 1000)]).generate_state(1)[0])


@cache
def decode_step_s(profile: str) -> float:
    """The mean time of a batch-32 decode iteration at 512 tokens of context (uniform routing),
    by profile."""
    from policies.core import Batch, Phase, Request, Sequence
    from sim import profiles
    from sim.latency import LatencyModel

    latency = LatencyModel(profiles.load(profile))
    seqs = []
    for i in range(32):
        seq = Sequence(Request(i, "BE", 0.0, 256, 512))
        seq.generated = 256
        seqs.append(seq)
    batch = Batch(seqs, Phase.DECODE)
    return float(np.mean([latency.plan(batch).total_s for _ in range(64)]))


def rate_scale(profile: str) -> float:
    """How much faster than the paper's profile a profile decodes (loads scale with it)."""
    return decode_step_s(REFERENCE_PROFILE) / decode_step_s(profile)


def points(exp: Experiment, seeds: int | None):
    """(axis values, base rate, rate, replicate) of every grid point of an experiment."""
    keys = list(exp.axes)
    for values in itertools.product(*exp.axes.values()):
        axis = dict(zip(keys, values, strict=True))
        scale = rate_scale(axis.get("profile", REFERENCE_PROFILE)) if exp.scale_rates else 1.0
        for base in exp.rates:
            for rep in range(seeds or exp.seeds):
                yield axis, base, base * scale, rep


def run_task(exp_name: str, axis: dict, base_rate: float, replicate: int, cfgs: list):
    """All arms of one grid point, on one shared workload."""
    requests = build_workload(cfgs[0][1].workload, seed=cfgs[0][1].seed)
    rows, frames = [], []
    for label, cfg in cfgs:
        out = simulate(cfg, requests=requests)
        settings = {"experiment": exp_name, **run_settings(cfg), "policy": label,
                    "replicate": replicate, "base_rate": base_rate}  # fmt: skip
        settings.update({k.split(".")[-1]: v for k, v in axis.items() if k != "profile"})
        last_arrival_s = float(out.requests["arrival_s"].max())  # where the drain starts
        merges = out.summary["executor"]["merges"]  # batches joined (policy.merge)
        rows += [{**row, "last_arrival_s": last_arrival_s, "merges": merges}
                 for row in summary_rows(settings, out.summary)]  # fmt: skip
        if exp_name == CDF_EXPERIMENT:
            frames.append(out.requests[["cls", "ttft_s"]].assign(**settings))
    return rows, frames


def run_grid(experiments: list[Experiment], seeds: int | None = None, rates=None,
             num_requests: int | None = None, jobs: int = 2):  # fmt: skip
    """The tidy table (experiment x arm x point x class) and per-request TTFTs of the paper
    experiment."""
    tasks = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for exp in experiments:
            extra = []
            if num_requests:  # an experiment of its own length (jobs1000) keeps its ratio to
                own = exp.changes.get("workload.num_requests")  # the paper's (it overrode
                paper = int(PAPER_SETUP["workload.num_requests"])  # it to the paper's)
                n = num_requests if own is None else max(1, round(int(own) * num_requests / paper))
                if own is not None:
                    print(f"note: --num-requests {num_requests}: experiment {exp.name}'s {own} "
                          f"requests per run scaled to {n} (the paper setup's {paper} to "
                          f"{num_requests})", file=sys.stderr)  # fmt: skip
                extra = [f"workload.num_requests={n}"]
            if rates:
                kept = tuple(r for r in exp.rates if r in rates) or tuple(rates)
                dropped = [r for r in rates if r not in kept]
                if dropped:  # --rates keeps an experiment's own rates: say which it left out
                    print(f"warning: --rates {' '.join(f'{r:g}' for r in dropped)}: not among "
                          f"experiment {exp.name}'s rates ({', '.join(f'{r:g}' for r in exp.rates)}"
                          f"): not run there", file=sys.stderr)  # fmt: skip
                exp = dataclasses.replace(exp, rates=kept)
            bases = {}
            for axis, base, rate, rep in points(exp, seeds):
                key = tuple(axis.items())
                if key not in bases:
                    setup = {**PAPER_SETUP, **exp.changes, **{k: str(v) for k, v in axis.items()}}
                    common = [f"{k}={v}" for k, v in setup.items() if v is not None] + extra
                    bases[key] = [(arm.label, compose("config", overrides=common + arm.args()))
                                  for arm in exp.arms]  # fmt: skip
                cfgs = []
                for label, base_cfg in bases[key]:
                    cfg = copy.deepcopy(base_cfg)
                    cfg.workload.rate, cfg.seed = float(rate), point_seed(rep, base)
                    cfgs.append((label, cfg))
                tasks.append((exp.name, axis, base, rep, cfgs))
    rows, frames = [], []
    bar = tqdm(total=len(tasks), desc="simulating", unit="point", mininterval=1.0)
    if jobs <= 1:
        results = (run_task(*t) for t in tasks)
        for r, f in results:
            rows += r
            frames += f
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(run_task, *t) for t in tasks]):
                r, f = future.result()
                rows += r
                frames += f
                bar.update()
    bar.close()
    requests = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return tidy(pd.DataFrame(rows)), requests
