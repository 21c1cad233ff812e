"""Simulator cost: the paper workload (1,000 requests, rate 5/s) under each policy.

Prints one line per policy: ``policy=<name> memory=<model> requests_per_s=<float>
events_per_request=<float>``
where requests_per_s is simulated requests per wall-clock second of the executor (the
workload is built once, outside the timing; the median of --repeats runs is reported).

``--trace <csv>``: instead, every request of a trace at its own timestamps on one H200
(Mixtral bf16, batch 32), under ``iteration`` and ``qllm`` (--policies; vllm, vllm-chunked and
sglang with their paged memory, as above), with fast-forward on and off: simulated requests
per CPU second and per wall-clock second of the simulation loop
(``Cluster.run``: workload, setup and outputs excluded), medians of --repeats runs with their
spread (min-max). CPU time is what one core does when the machine is shared. Then one more
run per policy with ``Scheduler.next_batch`` (the policy's selection and its bookkeeping) and
``Scheduler.complete_iteration`` timed: their microseconds per request, the pure-Python
scheduler's share of the loop (every policy plugs in there), against the 20 us a request that
the goal leaves for everything.
``--cluster-requests N`` then adds one run of N requests of that trace, repeated and rescaled
to ``--cluster-rate``, on ``--replicas`` replicas (least_outstanding), with its CPU and wall
time and peak memory (RSS); ``--cluster-only`` runs just that. The cluster run streams its
requests and keeps only columnar records of the finished ones, as ``qllm-sim`` does; a
progress bar goes to stderr. A last line each says where issue 13's goals stand: simulated
requests per CPU second (fast-forward on) as a share of 50,000; the loop's wall time for 1 M
requests on the replicas (60 s), extrapolated linearly from this run's when it has fewer.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import simpy
from hydra import compose, initialize_config_dir
from tqdm import tqdm

from sim import profiles
from sim.app import CONF_DIR
from sim.cluster import ROUTERS, Cluster
from sim.engine import Simulation
from sim.metrics import Records
from sim.run import build_latency, build_scheduler, simulate
from sim.workloads import Workload, build_workload, stream_workload

POLICIES = ("fcfs", "iteration", "priority", "layer", "qllm", "vllm", "vllm-chunked", "sglang")
# the engines run their own paged memory; the others reserve (TGI's)
VARIANTS = {  # name -> (policy file, overrides)
    "vllm": ("vllm", ["memory.model=paged"]),
    "vllm-chunked": ("vllm", ["policy.enable_chunked_prefill=true", "memory.model=paged"]),
    "sglang": ("sglang", ["memory.model=paged"]),
}


TRACE_SETUP = ["workload=trace", "profile=h200-mixtral-bf16"]
# issue 13's goals: simulated requests per CPU second on the trace at its own rate, fast-forward
# on; and the loop time of 1 M requests on 16 replicas
GOAL_REQUESTS_PER_CPU_S = 50_000
GOAL_MILLION_S = 60.0


def run_loop(cfg, requests, progress: bool = False) -> tuple[float, float, int]:
    """(wall s, CPU s, events) of the simulation loop alone (``Cluster.run``, as ``simulate``
    builds it: finished requests folded into records, streamed requests when ``requests`` is
    a ``Workload``): CPU time says what one core does when the machine is shared."""
    profile = profiles.load(cfg.profile.name, cfg.profile.path)
    if cfg.core == "compiled":
        return _run_compiled(cfg, profile, requests, progress)
    env, n = simpy.Environment(), cfg.cluster.replicas
    replicas = [Simulation([], build_scheduler(cfg, profile), build_latency(cfg, profile, i),
                           env=env, fast_forward=cfg.fast_forward, keep_sequences=False)
                for i in range(n)]  # fmt: skip
    router = ROUTERS[cfg.cluster.router](n, cfg.cluster.ls_replicas)
    records = Records(replica_order=True)
    bar = tqdm(total=len(requests), desc="simulating", unit="req", disable=not progress)

    def finished(seq, replica):
        records.add(seq, replica)
        bar.update()

    cluster = Cluster(requests, replicas, router, env, on_finish=finished,
                      ordered=isinstance(requests, Workload))  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    result = cluster.run().result
    bar.close()
    return time.perf_counter() - wall, time.process_time() - cpu, result.events


def _run_compiled(cfg, profile, requests, progress: bool) -> tuple[float, float, int]:
    """``run_loop`` with ``core=compiled``: its setup (the requests as columns, the
    loop's arrays) and loop (``CompiledCluster.run``), finished requests folded into records
    as ``simulate`` does; the events it counts are those its loop took off its heap. The
    first run in a process also loads the compiled code (about a second; some 40 s the first
    time on a machine, to compile it). ``cfg.fast_forward``: its decode runs, on or off."""
    from sim.compiled import CompiledCluster, unsupported

    n = cfg.cluster.replicas
    scheds = [build_scheduler(cfg, profile) for _ in range(n)]
    latencies = [build_latency(cfg, profile, i) for i in range(n)]
    why = unsupported(scheds, latencies)
    if why:  # else it is timed on the loop's rules, not its own (or dies in the loop)
        raise SystemExit(f"sim_speed: error: --core compiled does not run {why}")
    bar = tqdm(total=len(requests), desc="simulating", unit="req", disable=not progress)
    wall, cpu = time.perf_counter(), time.process_time()
    cluster = CompiledCluster(requests, scheds, latencies, cfg.cluster.router,
                              cfg.cluster.ls_replicas, Records(replica_order=True),
                              ordered=isinstance(requests, Workload),
                              on_finished=bar.update,
                              decode_runs=cfg.fast_forward)  # fmt: skip
    cluster.run()
    bar.close()
    return time.perf_counter() - wall, time.process_time() - cpu, cluster.heap_events


def scheduler_share(cfg, requests) -> tuple[float, float, float]:
    """(loop CPU s, next_batch s, complete_iteration s) of one run with those two timed (a
    wrapper's perf_counter pair adds well under a microsecond a call)."""
    from policies.scheduler import Scheduler

    spent = {"next_batch": 0.0, "complete_iteration": 0.0}
    originals = {name: getattr(Scheduler, name) for name in spent}

    def timed(name):
        inner, clock = originals[name], time.perf_counter

        def call(self, now):
            t = clock()
            out = inner(self, now)
            spent[name] += clock() - t
            return out

        return call

    try:
        for name in spent:
            setattr(Scheduler, name, timed(name))
        _, cpu, _ = run_loop(cfg, requests)
    finally:
        for name, fn in originals.items():
            setattr(Scheduler, name, fn)
    return cpu, spent["next_batch"], spent["complete_iteration"]


def trace_speed(args) -> None:
    with open(args.trace) as f:
        rows = sum(1 for _ in f) - 1  # the header
    base = [*TRACE_SETUP, f"workload.path={args.trace}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        reached = {}
        for policy in [] if args.cluster_only else args.policies:
            name, extra = VARIANTS.get(policy, (policy, []))
            cfg = compose("config", overrides=[*base, f"policy={name}", *extra,
                                               f"workload.num_requests={rows}"])  # fmt: skip
            requests = build_workload(cfg.workload, seed=cfg.seed)
            compiled = args.core == "compiled"
            cfg.core = args.core
            if compiled:
                run_loop(cfg, requests)  # loads (or compiles) the loop's code, untimed
            for fast_forward in (True, False):
                cfg.fast_forward = fast_forward
                runs = [run_loop(cfg, requests) for _ in range(args.repeats)]
                n = len(requests)
                wall = sorted(n / r[0] for r in runs)
                cpu = sorted(n / r[1] for r in runs)
                # the compiled loop's fast-forward is its decode runs; its events, those it
                # took off its heap (its results count stepping's, as SimPy's do)
                mode = "decode_runs" if compiled else "fast_forward"
                print(f"trace={args.trace} requests={n} policy={policy} "
                      f"memory={cfg.memory.model} core={args.core} "
                      f"{mode}={str(fast_forward).lower()} "
                      f"requests_per_cpu_s={statistics.median(cpu):.1f} "
                      f"spread={cpu[0]:.1f}-{cpu[-1]:.1f} "
                      f"requests_per_s={statistics.median(wall):.1f} "
                      f"spread={wall[0]:.1f}-{wall[-1]:.1f} "
                      f"{'heap_' if compiled else ''}events_per_request={runs[0][2] / n:.2f}",
                      flush=True)  # fmt: skip
                if fast_forward:
                    reached[policy] = statistics.median(cpu)
            if compiled:
                continue
            cfg.fast_forward = True
            loop_s, select_s, complete_s = scheduler_share(cfg, requests)
            us = 1e6 / len(requests)
            print(f"policy={policy} scheduler_us_per_request={(select_s + complete_s) * us:.1f} "
                  f"next_batch_us={select_s * us:.1f} "
                  f"complete_iteration_us={complete_s * us:.1f} "
                  f"loop_us={loop_s * us:.1f} "
                  f"goal_us={1e6 / GOAL_REQUESTS_PER_CPU_S:.0f}", flush=True)  # fmt: skip
        if reached:
            print(f"goal_requests_per_cpu_s={GOAL_REQUESTS_PER_CPU_S} " + " ".join(
                f"{p}={r / GOAL_REQUESTS_PER_CPU_S:.0%}" for p, r in reached.items()))  # fmt: skip
        if args.cluster_requests:
            name, extra = VARIANTS.get(args.policies[0], (args.policies[0], []))
            cfg = compose("config", overrides=[
                *base, f"policy={name}", *extra, f"workload.rate={args.cluster_rate}",
                f"workload.num_requests={args.cluster_requests}",
                f"cluster.replicas={args.replicas}",
                "cluster.router=least_outstanding",
                f"fast_forward={args.cluster_fast_forward}",
                f"core={args.core}"])  # fmt: skip
            built = time.process_time()
            requests = stream_workload(cfg.workload, seed=cfg.seed)
            built_s = time.process_time() - built
            wall_s, cpu_s, _ = run_loop(cfg, requests, progress=True)
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"cluster requests={len(requests)} replicas={args.replicas} "
                  f"core={args.core} fast_forward={args.cluster_fast_forward} "
                  f"rate={args.cluster_rate} policy={args.policies[0]} "
                  f"memory={cfg.memory.model} "
                  f"workload_cpu_s={built_s:.1f} loop_cpu_s={cpu_s:.1f} "
                  f"loop_wall_s={wall_s:.1f} peak_rss_mb={rss_mb:.0f}")  # fmt: skip
            million_s = wall_s * 1e6 / len(requests)
            print(f"goal_million_requests_s={GOAL_MILLION_S:.0f} replicas={args.replicas} "
                  f"million_requests_s={million_s:.0f} "
                  f"extrapolated={str(len(requests) != 1_000_000).lower()}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--trace", help="trace CSV: its own timestamps, all its requests")
    ap.add_argument("--cluster-requests", type=int, default=0)
    ap.add_argument("--cluster-rate", type=float, default=30.0)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--cluster-only", action="store_true", help="skip the one-replica runs")
    ap.add_argument("--cluster-fast-forward", choices=["true", "false"], default="true")
    ap.add_argument(
        "--core",
        choices=["simpy", "compiled"],
        default="simpy",
        help="--trace: the SimPy executor or the compiled loop (iteration, qllm)",
    )
    args = ap.parse_args()
    if args.trace:
        args.policies = args.policies or ["iteration", "qllm"]
        return trace_speed(args)
    args.policies = args.policies or list(POLICIES)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for policy in args.policies:
            name, extra = VARIANTS.get(policy, (policy, []))
            cfg = compose("config", overrides=[
                f"policy={name}", "workload=paper", f"workload.rate={args.rate}",
                f"workload.num_requests={args.num_requests}", *extra])  # fmt: skip
            requests = build_workload(cfg.workload, seed=cfg.seed)
            walls, events = [], []
            for _ in range(args.repeats):
                executor = simulate(cfg, requests=requests).summary["executor"]
                walls.append(executor["wall_s"])
                events.append(executor["events"])
            wall = statistics.median(walls)
            print(f"policy={policy} memory={cfg.memory.model} "
                  f"requests_per_s={len(requests) / wall:.1f} "
                  f"events_per_request={events[0] / len(requests):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
