"""The compiled executor (``core=compiled``) against the SimPy executor stepping every iteration
(``fast_forward=false``) on configurations tests/test_compiled.py does not reach: edge
settings of the policies, hand-made profiles (tiny or odd grids, interference, a wide expert
set routed by Gumbel-top-k, dense layers, a measured expert load), arrivals at one instant,
one-token outputs and runs of one to three requests; and what it must refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import linear_profile
from test_compiled import CONV, assert_same, run

from profiler.schema import OpPoint
from sim import profiles
from sim.config import UserError


def switch(profile, ms: float = 1.0):
    """``profile`` with a ``preempt_switch`` (a resume costs time) and an idle expert point."""
    pts = [*profile.points, OpPoint("expert", num_tokens=0, median_ms=0.1, p90_ms=0.1)]
    pts += [OpPoint("preempt_switch", num_tokens=n, median_ms=ms * (1 + n / 500), p90_ms=ms)
            for n in (1, 1000)]  # fmt: skip
    return dataclasses.replace(profile, points=pts)


def odd_grids(profile):
    """Grids the latency model clamps below (overhead one point at batch 4, experts from 8
    tokens), extrapolates soon (lm_head to batch 2, attn_decode one row to 300 tokens) or whose
    last segment falls (router: slope clamped to 0)."""
    keep = ("attn_prefill",)
    pts = [p for p in profile.points if p.op in keep]
    pts += [OpPoint("step_overhead", batch_size=4, median_ms=3.0, p90_ms=3.0)]
    pts += [OpPoint("lm_head", batch_size=b, median_ms=m, p90_ms=m) for b, m in ((1, 2), (2, 2.5))]
    pts += [OpPoint("attn_decode", batch_size=8, kv_tokens=k, median_ms=1 + k / 1e3,
                    p90_ms=1 + k / 1e3) for k in (16, 300)]  # fmt: skip
    pts += [OpPoint("expert", num_tokens=n, median_ms=0.5 + n / 1e2, p90_ms=0.5 + n / 1e2)
            for n in (8, 20, 37)]  # fmt: skip
    pts += [OpPoint("router", num_tokens=n, median_ms=m, p90_ms=m)
            for n, m in ((1, 0.2), (50, 0.4), (100, 0.3))]  # fmt: skip
    pts += [OpPoint("preempt_switch", num_tokens=5, median_ms=0.7, p90_ms=0.7)]
    return dataclasses.replace(profile, points=pts)


def dense_first_layer(profile):
    """Measured prompts in which layer 0 routes nothing (a dense MLP): under the default
    uniform routing only the dense layer is taken from them."""
    rng = np.random.default_rng(0)
    m = profile.model

    def prompt(tokens):
        return [[] if layer == 0 else
                [int(e) for _ in range(tokens) for e in rng.choice(m.num_experts, m.top_k,
                                                                   replace=False)]
                for layer in range(m.num_layers)]  # fmt: skip

    return dataclasses.replace(profile, prompt_experts=[prompt(5), prompt(9)])


PROFILES = {
    "linear": lambda: linear_profile(),  # grids end at 4,096 tokens: the trace extrapolates
    "linear-interference": lambda: dataclasses.replace(linear_profile(), interference=1.37),
    "odd-grids": lambda: odd_grids(linear_profile()),
    # 16 experts, top 4: beyond MAX_TUPLES, so routing draws Gumbel-top-k
    "wide": lambda: switch(linear_profile(num_layers=3, num_experts=16, top_k=4, expert_ms=3)),
    # one layer of two experts, both taken by every token: long expert stages
    "one-layer": lambda: switch(linear_profile(num_layers=1, num_experts=2, top_k=2,
                                               expert_ms=30)),  # fmt: skip
    "dense-layer": lambda: dense_first_layer(switch(linear_profile(expert_ms=30))),
    "h200-load": lambda: dataclasses.replace(
        profiles.load("h200-mixtral-bf16"),
        expert_load=[[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]] * 32),
}  # fmt: skip

PAPER = ["workload=paper", "workload.num_requests=200", "workload.rate=1",
         "workload.ls_fraction=0.2"]  # fmt: skip
TRACE = [*CONV[:3], "workload.num_requests=200", "workload.ls_fraction=0.3"]

CASES = {
    # TGI: every prompt over the prefill budget runs alone; joins at any size, every step
    "iteration-prefill-64": (None, [*TRACE, "policy=iteration",
                                    "policy.max_batch_prefill_tokens=64"]),
    "iteration-join-always": (None, [*TRACE, "policy=iteration", "policy.max_waiting_tokens=1",
                                     "policy.waiting_served_ratio=0",
                                     "policy.max_batch_size=null"]),
    "iteration-batch-1": (None, [*TRACE, "workload.num_requests=100", "policy=iteration",
                                 "policy.max_batch_size=1"]),
    # Algorithm 1: few slots in flight, the literal reading, a tight cache
    "qllm-in-flight-3": (None, [*TRACE, "policy=qllm", "policy.max_in_flight=3",
                                "workload.rate=2"]),
    "alg1-literal": (None, [*TRACE, "policy=alg1", "policy.refill_be=false",
                            "policy.fill_be_prefill=false"]),
    "qllm-small-cache": (None, [*TRACE, "workload.num_requests=300", "workload.rate=3",
                                "policy=qllm", "profile.kv_capacity_tokens=9000"]),
    # hand-made profiles
    "linear-qllm": ("linear", [*TRACE, "policy=qllm", "workload.rate=20"]),
    "interference-layer": ("linear-interference", [*TRACE, "policy=layer",
                                                   "workload.rate=20"]),
    "odd-grids-qllm": ("odd-grids", [*TRACE, "policy=qllm", "workload.rate=20"]),
    "odd-grids-iteration": ("odd-grids", [*TRACE, "policy=iteration", "workload.rate=20"]),
    "wide-layer-router": ("wide", [*PAPER, "policy=layer", "policy.preempt_prefill=false"]),
    "wide-qllm-batch-2": ("wide", [*PAPER, "policy=qllm", "policy.max_batch_size=2",
                                   "policy.max_in_flight=3"]),
    "one-layer-qllm": ("one-layer", [*PAPER, "policy=qllm"]),
    "dense-layer-qllm": ("dense-layer", [*PAPER, "policy=qllm"]),
    "expert-load-qllm": ("h200-load", [*TRACE, "policy=qllm", "workload.rate=3",
                                       "profile.routing=profile"]),
}  # fmt: skip

# a few more cases use a trace of arrivals at one instant (groups of 1-11), one-token outputs
# and prompts over the prefill budget


def tie_trace(path):
    rng = np.random.default_rng(5)
    rows, t = [], 0.0
    for _ in range(40):
        for _ in range(int(rng.integers(1, 12))):
            rows.append((t, int(rng.choice([1, 5, 300, 2000, 5000, 9000])),
                         int(rng.choice([1, 1, 2, 30, 200]))))  # fmt: skip
        t += float(rng.choice([0.0, 0.05, 0.5, 2.0]))
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{a},{p},{o}\n" for a, p, o in rows))  # fmt: skip
    return len(rows)


TIES = {
    "iteration-3-least-outstanding": ["policy=iteration", "cluster.replicas=3",
                                      "cluster.router=least_outstanding"],
    "qllm-ls-dedicated-2": ["policy=qllm", "cluster.replicas=3",
                            "cluster.router=ls_dedicated", "cluster.ls_replicas=2"],
    "layer-ls-first": ["policy=layer", "cluster.replicas=2", "cluster.router=ls_first"],
    "alg1-small-cache": ["policy=alg1", "profile.kv_capacity_tokens=12000",
                         "policy.max_batch_size=null"],
    "tgi-0.3-token-budget": ["policy=tgi-0.3", "policy.max_batch_total_tokens=12000",
                             "policy.max_batch_prefill_tokens=100"],
}  # fmt: skip


def compare(overrides):
    fast = run(overrides)
    assert fast.summary["executor"]["core"] == "compiled"
    stepping = run([*overrides, "fast_forward=false"], "simpy")
    assert_same(fast, stepping, stepping)
    assert fast.summary["completed"] == len(fast.requests) > 0
    return fast


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_matches_stepping(case, tmp_path):
    profile, overrides = CASES[case]
    if profile is not None:
        path = PROFILES[profile]().save(tmp_path / profile)
        overrides = [*overrides, f"profile.path={path}"]
    fast = compare(overrides)
    if case in ("wide-layer-router", "wide-qllm-batch-2", "one-layer-qllm"):
        assert fast.result.preemptions > 5  # the comparison covers many suspended batches


@pytest.mark.parametrize("case", list(TIES))
def test_arrivals_at_one_instant(case, tmp_path):
    n = tie_trace(tmp_path / "ties.csv")
    trace = ["workload=trace", f"workload.path={tmp_path / 'ties.csv'}", "workload.rate=null",
             f"workload.num_requests={n}", "profile=h200-mixtral-bf16"]  # fmt: skip
    fast = compare([*trace, "workload.ls_fraction=0.4", *TIES[case]])
    assert (fast.requests["output_tokens"] == 1).any()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_few_requests_on_more_replicas_than_requests(n):
    for policy, router in (("qllm", "round_robin"), ("iteration", "least_kv")):
        compare([*CONV[:3], f"workload.num_requests={n}", f"policy={policy}",
                 "cluster.replicas=4", f"cluster.router={router}"])  # fmt: skip


def test_what_the_loop_does_not_model_is_refused(tmp_path):
    base = switch(linear_profile())
    wake = [OpPoint("wake_up", idle_ms=i, busy_ms=b, median_ms=m, p90_ms=m)
            for i, b, m in ((100, 0, 5.0), (100, 10, 0.0))]  # fmt: skip
    bind = [OpPoint("attn_decode_bind", batch_size=b, kv_tokens=k, median_ms=1.5, p90_ms=1.5)
            for b in (1, 64) for k in (0, 4096)]  # fmt: skip
    staged = [OpPoint(op, **{key: x}, median_ms=0.1, p90_ms=0.1)
              for op, key in (("prepare_decode", "batch_size"), ("prepare_prefill", "num_tokens"),
                              ("lm_head_prefill", "num_tokens"))
              for x in (1, 4096)]  # fmt: skip
    measured = dataclasses.replace(dense_first_layer(base), expert_load=[[1 / 8] * 8] * 4)
    for name, profile, extra, what in (
        ("wake", dataclasses.replace(base, points=[*base.points, *wake]), [], "wake_up"),
        ("staged", dataclasses.replace(base, points=[*base.points, *staged]), [],
         "prepare_prefill"),
        ("bind", dataclasses.replace(base, points=[*base.points, *bind]), [],
         "attn_decode_bind"),
        ("measured", measured, ["profile.routing=profile"], "prompt_experts"),
    ):  # fmt: skip
        path = profile.save(tmp_path / name)
        with pytest.raises(UserError, match=f"core=compiled: does not run .*{what}"):
            run([*PAPER, "policy=qllm", f"profile.path={path}", *extra])
