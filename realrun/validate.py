"""``qllm-validate``: the simulator against the real engine, on this machine.

1. Profile the model in-process (``profiler.measure.profile_model``, a grid sized to the
   workload) or read ``profile.path``.
2. Choose the rates: ``rate = utilization / S1``, S1 the time the profile predicts for serving
   the workload's mean request alone (its prefill and its decode steps at batch 1).
3. At each rate, build the request list once (prompts cut, token ids drawn) and, for each
   policy, replay it through the real engine (wall clock) and the simulator
   (``sim.run.simulate`` reading the fresh profile, routing from its measured expert load).
   Both get their scheduler from ``sim.run.build_scheduler`` with the same profile, so they
   differ only in how time passes.
4. Write ``<out_dir>/<name>/validation.json``, a list of records ``{policy, rate, cls,
   metric, sim, real, error_pct}`` (error_pct = 100 (sim - real) / real) for ttft_mean and
   turnaround_mean per class (LS, BE, all) and throughput_jobs (all), ``validation.png``
   (sim against real), the profile and the resolved config, and print a table.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from policies.core import BE, LS, Batch, Request, Sequence
from realrun.config import ValidateConfig, validate_engine, validate_shared
from sim.app import CONF_DIR  # registers the simulator's schema (base_config) that it composes
from sim.cli import App, fail, run
from sim.config import UserError

PROG = "qllm-validate"
CLASSES = (LS, BE, "all")
METRICS = {"ttft_mean": "ttft_s", "turnaround_mean": "turnaround_s"}

ConfigStore.instance().store(name="validate_schema", node=ValidateConfig)


def check(cfg: DictConfig) -> None:
    validate_engine(cfg)
    if not cfg.utilizations or min(cfg.utilizations) <= 0:
        raise UserError(f"utilizations={list(cfg.utilizations)}: need values > 0")
    if not cfg.policies:
        raise UserError("policies=[]: name at least one policy")
    known = sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))
    for name in cfg.policies:
        if name not in known:
            raise UserError(f"policies: {name} is not a policy; choose from {', '.join(known)}")
    # the workload and slo checks, before the minutes of profiling
    validate_shared(cfg, OmegaConf.load(CONF_DIR / "policy" / f"{cfg.policies[0]}.yaml"))


def sim_config(cfg: DictConfig, policy: str, profile_dir: Path) -> DictConfig:
    """The simulator's config for one policy, reading the profile at ``profile_dir``."""
    sim_cfg = hydra.compose("config", overrides=[
        f"policy={policy}", f"profile.path={profile_dir}", "profile.routing=profile",
        f"seed={cfg.seed}"])  # fmt: skip
    sim_cfg.slo = cfg.slo
    validate_shared(cfg, sim_cfg.policy)
    return sim_cfg


def obtain_profile(cfg: DictConfig, runner, info, out: Path):
    """(profile, its directory): read from ``profile.path``, or measured now into out/profile."""
    from profiler.measure import Settings, SettingsError, profile_model
    from sim import profiles

    path = cfg.profile.get("path")
    if path:
        profile, directory = profiles.load("", path), Path(path).resolve()
        shape = (profile.model.num_layers, profile.model.num_experts)
        if shape != (runner.num_layers, runner.num_experts):
            raise UserError(f"profile.path={path}: a profile of {profile.model.name}, not of "
                            f"this model ({info.name})")  # fmt: skip
        return profile, directory
    settings_cfg = {k: v for k, v in OmegaConf.to_container(cfg.profile).items() if k != "path"}
    try:
        settings = Settings.from_config({**settings_cfg, "seed": cfg.seed})
    except (SettingsError, KeyError) as e:
        raise UserError(f"profile: {e}") from None
    profile = profile_model(runner.model, info, settings, f"{out.name}-profile",
                            progress=cfg.progress)  # fmt: skip
    return profile, profile.save(out / "profile").resolve()


def solo_service_s(latency, prompt_tokens: int, output_tokens: int, draws: int = 20) -> float:
    """Predicted time to serve one request alone: its prefill, then each decode step."""
    seq = Sequence(Request(0, BE, 0.0, prompt_tokens, output_tokens))
    total = 0.0
    for generated in range(output_tokens):
        seq.generated = generated
        batch = Batch([seq], seq.phase)
        total += statistics.fmean(latency.plan(batch).total_s for _ in range(draws))
    return total


def records_of(policy: str, rate: float, real: dict, sim: dict) -> list[dict]:
    rows = []

    def add(cls: str, metric: str, s: float | None, r: float | None) -> None:
        s = math.nan if s is None else s
        r = math.nan if r is None else r
        err = 100 * (s - r) / r if r else math.nan
        rows.append({"policy": policy, "rate": rate, "cls": cls, "metric": metric, "sim": s,
                     "real": r, "error_pct": err})  # fmt: skip

    for cls in CLASSES:
        if real["classes"][cls]["count"] == 0:
            continue
        for metric, key in METRICS.items():
            s, r = sim["classes"][cls][key]["mean"], real["classes"][cls][key]["mean"]
            add(cls, metric, s, r)
    add("all", "throughput_jobs", sim["throughput"]["jobs_per_s"],
        real["throughput"]["jobs_per_s"])  # fmt: skip
    return rows


def run_validation(cfg: DictConfig) -> tuple[list[dict], Path]:
    """The whole comparison; needs Hydra initialized with CONF_DIR (the app or a test)."""
    check(cfg)
    from realrun.clock import WallClock
    from realrun.run import execute, load_model, prepare_requests, warm_up
    from sim.run import build_latency, build_scheduler, simulate
    from sim.workloads import build_workload

    runner, info = load_model(cfg)
    name = cfg.name or f"{info.name}-{info.device.type}"
    out = Path(cfg.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    profile, profile_dir = obtain_profile(cfg, runner, info, out)
    sims = {p: sim_config(cfg, p, profile_dir) for p in cfg.policies}

    # Lengths and classes do not depend on the rate (separate random streams): measure S1 once.
    nominal, _ = prepare_requests(cfg, runner, build_workload(cfg.workload, seed=cfg.seed))
    prompt = statistics.fmean(r.prompt_tokens for r in nominal)
    output = statistics.fmean(r.output_tokens for r in nominal)
    solo_s = solo_service_s(build_latency(sims[cfg.policies[0]], profile),
                            round(prompt), round(output))  # fmt: skip
    rates = [float(f"{u / solo_s:.3g}") for u in cfg.utilizations]
    print(f"S1={solo_s * 1e3:.1f} ms (prompt {prompt:.0f}, output {output:.0f} tokens): "
          f"rates {rates} req/s")  # fmt: skip

    if cfg.warmup:
        largest_batch = max(sim.policy.max_batch_size for sim in sims.values())
        warm_up(runner, max(r.prompt_tokens for r in nominal), min(largest_batch, len(nominal)))
    records = []
    cases = [(rate, policy) for rate in rates for policy in cfg.policies]
    for rate, policy in tqdm(cases, desc="validating", unit="run", disable=not cfg.progress):
        workload = OmegaConf.merge(cfg.workload, {"rate": rate})
        requests, prompts = prepare_requests(cfg, runner, build_workload(workload, cfg.seed))
        sim_cfg = sims[policy]
        real = execute(requests, prompts, build_scheduler(sim_cfg, profile), runner, cfg.slo,
                       WallClock())  # fmt: skip
        sim = simulate(sim_cfg, requests=requests)
        records += records_of(policy, rate, real.summary, sim.summary)
    (out / "validation.json").write_text(json.dumps(records, indent=1) + "\n")
    plot(records, out / "validation.png")
    return records, out


def table(records: list[dict]) -> str:
    lines = [f"{'policy':<10} {'rate':>7} {'cls':<4} {'metric':<16} {'sim':>10} {'real':>10} "
             f"{'error%':>8}"]  # fmt: skip
    for r in records:
        lines.append(f"{r['policy']:<10} {r['rate']:>7g} {r['cls']:<4} {r['metric']:<16} "
                     f"{r['sim']:>10.4f} {r['real']:>10.4f} {r['error_pct']:>8.1f}")  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """Sim against real per metric: points on the diagonal are exact, the band is +-10%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["ttft_mean", "turnaround_mean", "throughput_jobs"]
    policies = sorted({r["policy"] for r in records})
    markers = {LS: "o", BE: "s", "all": "^"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.5))
    for ax, metric in zip(axes, metrics, strict=True):
        rows = [r for r in records if r["metric"] == metric and math.isfinite(r["sim"])]
        for i, policy in enumerate(policies):
            for cls, marker in markers.items():
                pts = [(r["real"], r["sim"]) for r in rows if r["policy"] == policy
                       and r["cls"] == cls]  # fmt: skip
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.scatter(xs, ys, marker=marker, color=f"C{i}", label=f"{policy} {cls}")
        values = [v for r in rows for v in (r["sim"], r["real"]) if v > 0]
        if values:
            lo, hi = min(values) / 1.5, max(values) * 1.5
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey",
                            alpha=0.2, label="±10%")  # fmt: skip
        unit = "jobs/s" if metric == "throughput_jobs" else "s"
        if unit == "s" and values:  # latencies span decades between the light and loaded rates
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set(title=metric, xlabel=f"real ({unit})", ylabel=f"simulated ({unit})")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@hydra.main(config_path=str(CONF_DIR), config_name="validate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        records, out = run_validation(cfg)
    except UserError as e:
        fail(PROG, str(e))
    print(table(records))
    worst = max((abs(r["error_pct"]) for r in records if r["cls"] != "all"), default=math.nan)
    print(f"max |error_pct| over per-class means: {worst:.1f}% -> {out / 'validation.json'}")


def cli() -> None:
    app = App(PROG, "validate", ("workload", "slo", "model"), free_keys=("model.config",),
              check=check, run_dir_per_run=False)  # fmt: skip
    run(app, main)


if __name__ == "__main__":  # python -m realrun.validate, where no console script is installed
    cli()
