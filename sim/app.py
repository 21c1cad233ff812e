"""``qllm-sim``: the Hydra app (also ``python -m sim``).

Examples::

    qllm-sim policy=qllm workload=paper workload.rate=5 workload.num_requests=500 seed=1
    qllm-sim -m policy=iteration,qllm workload.rate=1,3,5
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from sim.config import SimConfig, UserError
from sim.metrics import write_outputs
from sim.run import simulate

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("workload", "profile", "policy", "slo")

ConfigStore.instance().store(name="base_config", node=SimConfig)


def fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR, groups=GROUPS) -> str | None:
    """Hydra reports an unknown group option with a page of text; we say it in one line."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in groups:
            continue
        options = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in options:
                return f"{key}={choice}: unknown {key}; choose one of {', '.join(options)}"
    return None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    run_dir = HydraConfig.get().runtime.output_dir
    finished = Path(run_dir) / "summary.json"
    if cfg.resume and finished.is_file():
        # a rerun of an interrupted sweep: this job finished before (summary.json is written
        # last and atomically), so keep its results
        print(f"skipping finished run {run_dir}", flush=True)
        return json.loads(finished.read_text())["classes"]["LS"]["ttft_s"]["mean"]
    try:
        out = simulate(cfg)
    except UserError as e:
        fail("qllm-sim", str(e))
    write_outputs(run_dir, out.requests, out.summary, {"replicas": out.timeline})
    ls, be = out.summary["classes"]["LS"], out.summary["classes"]["BE"]
    jobs_per_s = out.summary["throughput"]["jobs_per_s"]
    print(
        f"policy={cfg.policy.name} rate={cfg.workload.rate} "
        f"ls_ttft_mean_s={_fmt(ls['ttft_s']['mean'])} be_ttft_mean_s={_fmt(be['ttft_s']['mean'])} "
        f"ls_slo={_fmt(ls['slo_attainment'])} jobs_per_s={jobs_per_s:.3f} -> {run_dir}",
        flush=True,  # joblib workers share the terminal: print each line whole, now
    )
    return ls["ttft_s"]["mean"]


def _fmt(x) -> str:
    return "nan" if x is None else f"{x:.3f}"


def cli() -> None:
    problem = check_group_choices(sys.argv[1:])
    if problem:
        fail("qllm-sim", problem)
    main()
