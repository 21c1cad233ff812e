"""The SimPy executor driving the shared scheduler: completion, preemption points, queueing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import linear_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Granularity, Request, Scheduler
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.priority import Priority
from policies.qllm import QLLM
from profiler.schema import OpPoint
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.metrics import requests_frame

POLICIES = [FCFS, IterationFCFS, Priority, LayerPreemptive, QLLM]


class RecordingLatency(LatencyModel):
    """Keeps every plan it makes, to check the executor's times against the latency model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plans = []

    def plan(self, batch, bind=False):
        p = super().plan(batch, bind)
        self.plans.append((batch.id, p))
        return p


def run(requests, policy, profile, capacity=1_000_000, mode="lookup", seed=0, trace=False):
    m = profile.model
    latency = RecordingLatency(
        profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=seed)
    )
    sched = Scheduler(policy, kv_capacity_tokens=capacity, activation_tokens_per_token=0.125)
    result = Simulation(requests, sched, latency, mode=mode, record_trace=trace).run()
    return result, latency


def poisson_requests(n, rate, seed, ls_fraction=0.3, max_prompt=300, max_output=40):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [
        Request(
            i,
            "LS" if rng.random() < ls_fraction else "BE",
            float(arrivals[i]),
            int(rng.integers(1, max_prompt)),
            int(rng.integers(1, max_output)),
        )  # fmt: skip
        for i in range(n)
    ]


request_lists = st.lists(
    st.tuples(
        st.floats(0, 5, allow_nan=False),
        st.sampled_from(["LS", "BE"]),
        st.integers(1, 400),
        st.integers(1, 30),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=request_lists,
    policy_cls=st.sampled_from(POLICIES),
    batch=st.integers(1, 8),
    capacity=st.integers(450, 5000),
    budget=st.integers(1, 600),
)
def test_every_arrived_request_completes(rows, policy_cls, batch, capacity, budget):
    requests = [Request(i, c, t, p, o) for i, (t, c, p, o) in enumerate(sorted(rows))]
    policy = policy_cls(max_batch_size=batch, max_batch_prefill_tokens=budget)
    result, _ = run(requests, policy, linear_profile(num_layers=2, num_experts=4), capacity)
    df = requests_frame(result.sequences)
    assert len(result.sequences) == len(requests)
    assert df["finish_s"].notna().all()
    assert (df["first_token_s"] >= df["arrival_s"]).all()
    assert (df["finish_s"] >= df["first_token_s"]).all()
    assert result.peak_kv_used_tokens <= capacity
    for seq in result.sequences:
        assert seq.generated == seq.request.output_tokens


@pytest.mark.parametrize("policy_cls", [LayerPreemptive, QLLM, IterationFCFS])
def test_boundary_lookup_matches_stepping_every_boundary(policy_cls):
    requests = poisson_requests(120, rate=4, seed=3)
    profile = linear_profile(num_layers=6, attn_ms=5, expert_ms=1, overhead_ms=5)
    frames, preemptions = [], []
    for mode in ("lookup", "step"):
        result, _ = run(requests, policy_cls(), profile, mode=mode)
        frames.append(requests_frame(result.sequences))
        preemptions.append(result.preemptions)
    lookup, step = frames
    assert preemptions[0] == preemptions[1]
    if policy_cls is not IterationFCFS:
        assert preemptions[0] > 0  # the comparison must cover preemptions
    assert (lookup["preemptions"] == step["preemptions"]).all()
    for col in ("first_token_s", "finish_s"):
        np.testing.assert_allclose(lookup[col], step[col], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("policy_cls", [LayerPreemptive, QLLM])
def test_an_arrival_during_a_switch_preempts_as_stepping_does(policy_cls):
    """Nothing interrupts a resumed batch's switch: an LS request that arrived during it was
    not asked about until the iteration's end (lookup), where stepping preempts at the next
    boundary. BE decodes; LS 1 preempts it; LS 2 arrives 10 ms into BE's 40 ms switch."""
    base = linear_profile(num_layers=6, attn_ms=5, expert_ms=1, overhead_ms=5)
    switch = [OpPoint("preempt_switch", num_tokens=n, median_ms=40.0) for n in (1, 4096)]
    profile = replace(base, points=base.points + switch)
    first = [Request(0, "BE", 0.0, 100, 30), Request(1, "LS", 0.2, 100, 1)]
    result, _ = run(first, policy_cls(), profile, trace=True)
    assert result.preemptions == 1
    # the trace: BE's segments, LS 1's prefill, then BE resumed (its switch first)
    ls1_end = next(end for start, end, bid, kind, size in result.trace
                   if kind == "prefill" and start > 0.2)  # fmt: skip
    requests = [*first, Request(2, "LS", ls1_end + 0.010, 100, 1)]
    out = {}
    for mode in ("lookup", "step"):
        r, _ = run(requests, policy_cls(), profile, mode=mode)
        out[mode] = requests_frame(r.sequences).set_index("id")
    assert out["step"].loc[0, "preemptions"] == 2  # stepping preempts the resumed BE batch
    assert (out["lookup"]["preemptions"] == out["step"]["preemptions"]).all()
    for col in ("first_token_s", "finish_s"):
        np.testing.assert_allclose(out["lookup"][col], out["step"][col], rtol=1e-9, atol=1e-9)


def _ls_interrupting_be(policy, arrive_frac):
    """A BE prefill starts at t=0; an LS request arrives a fraction into that iteration."""
    profile = linear_profile(num_layers=4, num_experts=8, attn_ms=4, expert_ms=2, overhead_ms=1)
    m = profile.model
    probe = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0))
    be = Request(0, "BE", 0.0, prompt_tokens=64, output_tokens=3)
    from policies.core import Batch, Phase, Sequence

    be_plan = probe.plan(Batch([Sequence(be)], Phase.PREFILL))
    t_ls = arrive_frac * be_plan.total_s
    ls = Request(1, "LS", t_ls, prompt_tokens=16, output_tokens=1)
    result, latency = run([be, ls], policy, profile, trace=True)
    return result, latency, t_ls


@pytest.mark.parametrize("frac", [0.13, 0.37, 0.61, 0.88])
def test_qllm_ls_arrival_starts_at_next_expert_boundary(frac):
    result, latency, t_ls = _ls_interrupting_be(QLLM(), frac)
    be_plan = latency.plans[0][1]
    expert_bounds = be_plan.preemptible(Granularity.EXPERT)
    times = be_plan.offsets[expert_bounds]
    expected = times[np.searchsorted(times, t_ls)]
    first, second = result.trace[0], result.trace[1]
    assert first[3] == "preempted"
    assert first[1] == pytest.approx(expected, abs=1e-12)
    assert expected - t_ls <= be_plan.durations.max() + 1e-12  # within one stage
    assert second[0] == pytest.approx(expected) and second[3] == "prefill"
    ls = next(s for s in result.sequences if s.id == 1)
    ls_plan = latency.plans[1][1]
    assert ls.first_token_s == pytest.approx(expected + ls_plan.total_s, abs=1e-12)
    be = next(s for s in result.sequences if s.id == 0)
    assert be.preemptions == 1 and ls.preemptions == 0


@pytest.mark.parametrize("frac", [0.13, 0.61])
def test_layer_policy_waits_for_the_next_attention_or_router_boundary(frac):
    result, latency, t_ls = _ls_interrupting_be(LayerPreemptive(), frac)
    be_plan = latency.plans[0][1]
    bounds = be_plan.preemptible(Granularity.LAYER)
    times = be_plan.offsets[bounds]
    expected = times[np.searchsorted(times, t_ls)]
    assert result.trace[0][1] == pytest.approx(expected, abs=1e-12)
    # a layer boundary is never earlier than the expert boundary qllm would use
    qllm_result, _, _ = _ls_interrupting_be(QLLM(), frac)
    assert qllm_result.trace[0][1] <= expected + 1e-12


@pytest.mark.parametrize("frac", [0.13, 0.61])
def test_iteration_policy_ls_waits_for_end_of_iteration(frac):
    result, latency, t_ls = _ls_interrupting_be(IterationFCFS(), frac)
    be_plan = latency.plans[0][1]
    ls = next(s for s in result.sequences if s.id == 1)
    assert result.preemptions == 0
    assert ls.scheduled_s == pytest.approx(be_plan.total_s, abs=1e-12)


def test_mean_wait_matches_md1_formula():
    """Single class, batch 1, FCFS, Poisson arrivals, fixed lengths: an M/D/1 queue."""
    profile = linear_profile(num_layers=2, num_experts=4, top_k=1, expert_ms=0.0,
                             expert_per_token_ms=0.01)  # fmt: skip
    m = profile.model
    latency = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k))
    from policies.core import Batch, Phase, Sequence

    probe = Sequence(Request(0, "BE", 0.0, 32, 2))
    service = latency.plan(Batch([probe], Phase.PREFILL)).total_s
    probe.generated = 1
    service += latency.plan(Batch([probe], Phase.DECODE)).total_s
    rho, n = 0.6, 40_000
    rate = rho / service
    arrivals = np.cumsum(np.random.default_rng(7).exponential(1 / rate, n))
    requests = [Request(i, "BE", float(t), 32, 2) for i, t in enumerate(arrivals)]
    sched = Scheduler(FCFS(max_batch_size=1), kv_capacity_tokens=10_000)
    result = Simulation(requests, sched, latency).run()
    waits = np.array([s.scheduled_s - s.request.arrival_s for s in result.sequences])
    md1 = rho * service / (2 * (1 - rho))
    assert waits.mean() == pytest.approx(md1, rel=0.05)


def test_events_do_not_grow_with_layers_and_experts():
    """One timeout per iteration segment, plus arrivals, wake-ups and interrupts: no term in
    layers x experts (a 32 x 64 model has 2,114 stages per iteration)."""
    requests = poisson_requests(200, rate=2, seed=5)
    for layers, experts in ((2, 4), (32, 64)):
        profile = linear_profile(num_layers=layers, num_experts=experts, attn_ms=0.5)
        result, _ = run(requests, QLLM(), profile)
        assert result.preemptions > 0
        bound = result.iterations + 2 * result.preemptions + 3 * len(requests)
        assert result.events <= bound


class ChargeRecorder(Scheduler):
    """Records KV used around every preemption and resumption."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.charges, self.releases = [], []  # (KV change, tokens in flight)

    def preempt(self, now):
        before, tokens = self.kv_used_tokens, self.running.new_tokens
        batch = super().preempt(now)
        self.charges.append((self.kv_used_tokens - before, tokens))
        return batch

    def next_batch(self, now):
        before, suspended = self.kv_used_tokens, list(self.suspended)
        batch = super().next_batch(now)
        if batch is not None and batch in suspended:
            self.releases.append((self.kv_used_tokens - before, batch.new_tokens))
        return batch


def test_kv_capacity_is_enforced_and_suspended_state_is_charged():
    # rate 8: memory binds (peak = capacity) and LS arrivals still find BE-only batches
    requests = poisson_requests(200, rate=8, seed=11, max_prompt=200, max_output=60)
    capacity = 1200
    m = linear_profile().model
    latency = LatencyModel(linear_profile(), RoutingModel(m.num_layers, m.num_experts, m.top_k))
    sched = ChargeRecorder(QLLM(max_batch_size=16), capacity, activation_tokens_per_token=0.125)
    result = Simulation(requests, sched, latency).run()
    assert result.peak_kv_used_tokens == capacity
    assert all(s.finish_s is not None for s in result.sequences)
    # a suspended batch holds ceil(0.125 x its tokens in flight) until it resumes
    assert len(sched.charges) == result.preemptions >= 5
    assert all(kv == -(-tokens // 8) for kv, tokens in sched.charges)
    assert sorted(sched.releases) == sorted((-kv, tokens) for kv, tokens in sched.charges)
    assert sched.kv_used_tokens == 0


def test_request_larger_than_kv_cache_is_rejected_with_its_id():
    from policies.scheduler import CapacityError

    with pytest.raises(CapacityError, match="request 0"):
        run([Request(0, "BE", 0.0, 900, 200)], QLLM(), linear_profile(), capacity=1000)


def test_latency_curves_never_extrapolate_downwards():
    from profiler.schema import OpPoint
    from sim.latency import Curve1D, Curve2D

    noisy = [
        OpPoint("expert", num_tokens=n, median_ms=t) for n, t in ((1, 1.0), (4, 8.0), (16, 2.0))
    ]
    curve = Curve1D(noisy, "num_tokens")
    assert curve.scalar(64) == pytest.approx(2e-3)  # flat beyond a falling last segment
    assert curve.scalar(2) == pytest.approx(1e-3 + 7e-3 / 3)
    grid = [
        OpPoint("attn_decode", batch_size=b, kv_tokens=8, median_ms=t)
        for b, t in ((1, 8.0), (3, 0.3))
    ]
    assert Curve2D(grid)(32, 8) == pytest.approx(0.3e-3)
    rising = [
        OpPoint("attn_decode", batch_size=b, kv_tokens=8, median_ms=t)
        for b, t in ((1, 1.0), (3, 2.0))
    ]
    assert Curve2D(rising)(5, 8) == pytest.approx(3e-3)


def test_the_first_batch_after_an_idle_stretch_pays_the_profiles_wake_up():
    """wake_up 0 ms at 0, 20 ms from 100 ms of idle time on: a request arriving at 5 s on an
    idle server starts 20 ms late (held at the grid's last point); one arriving at 0 and one
    arriving while the server is busy run as they would without the op."""
    base = linear_profile()
    wake = [OpPoint("wake_up", idle_ms=0), OpPoint("wake_up", median_ms=20.0, idle_ms=100)]
    woken = replace(base, points=base.points + wake)
    reqs = [Request(0, "BE", 0.0, 20, 3), Request(1, "BE", 0.001, 20, 3),
            Request(2, "BE", 5.0, 20, 3)]  # fmt: skip
    plain = {s.id: s for s in run(reqs, IterationFCFS(), base)[0].sequences}
    slow = {s.id: s for s in run(reqs, IterationFCFS(), woken)[0].sequences}
    assert slow[0].first_token_s == plain[0].first_token_s  # idle for 0 s at its arrival
    assert slow[1].finish_s == plain[1].finish_s  # arrived while the server ran request 0
    assert slow[2].first_token_s == pytest.approx(plain[2].first_token_s + 0.020, abs=1e-12)
    assert slow[2].finish_s == pytest.approx(plain[2].finish_s + 0.020, abs=1e-12)
    latency = LatencyModel(woken)
    assert latency.wake_s(0.05) == pytest.approx(0.010)  # interpolated
    assert latency.wake_s(60.0) == pytest.approx(0.020) and latency.wake_s(0.0) == 0.0


def test_a_wake_up_without_an_idle_0_row_costs_nothing_after_no_idle_time():
    """A hand-made wake_up with rows from 100 ms of idle only: below it the cost falls
    linearly to 0 at 0 ms (its first row was charged whole after a gap of 1 ms), as with
    the idle 0 row the profiler writes."""
    base = linear_profile()
    wake = [OpPoint("wake_up", median_ms=20.0, idle_ms=100)]
    latency = LatencyModel(replace(base, points=base.points + wake))
    assert latency.wake_s(0.001) == pytest.approx(0.0002)
    assert latency.wake_s(0.05) == pytest.approx(0.010)
    assert latency.wake_s(0.0) == 0.0 and latency.wake_s(5.0) == pytest.approx(0.020)
    with_zero = LatencyModel(replace(base, points=base.points + wake
                                     + [OpPoint("wake_up", idle_ms=0)]))  # fmt: skip
    assert with_zero.wake_s(0.05) == latency.wake_s(0.05)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_wake_up_measured_by_busy_time_is_shared_by_the_batches_it_spans(fast_forward):
    """After 5 s idle, wake_up leaves 20 ms at 0 ms of work, 6 ms after 30 ms, none after 50
    ms. The prefill (27.4 ms warm) pays 20 - 12.79 (what is left at 27.4 ms: 7.21 ms); the
    first decode step (13.88 ms) 7.21 - 2.62; the second the last 2.62 ms; later steps, which
    may then be fast-forwarded, nothing."""
    base = linear_profile()
    wake = [OpPoint("wake_up", idle_ms=0),
            *(OpPoint("wake_up", median_ms=m, idle_ms=100, busy_ms=b)
              for b, m in ((0.0, 20.0), (30.0, 6.0), (50.0, 0.0)))]  # fmt: skip
    woken = replace(base, points=base.points + wake)
    reqs = [Request(0, "BE", 5.0, 20, 12)]

    def tokens(profile):
        latency = LatencyModel(profile, RoutingModel(4, 8, 2))
        sched = Scheduler(IterationFCFS(), 1_000_000)
        sim = Simulation(reqs, sched, latency, fast_forward=fast_forward, record_trace=False)
        seq = sim.run().sequences[0]
        return seq.first_token_s, np.cumsum(seq.token_gaps_s), seq.finish_s  # token times

    (plain_first, plain_gaps, plain_end), (first, gaps, end) = tokens(base), tokens(woken)
    left_at_prefill = 20 - 14 * 27.4 / 30
    left_after_one = 6 - 6 * (27.4 + 13.88 - 30) / 20
    assert first - plain_first == pytest.approx((20 - left_at_prefill) / 1e3, abs=1e-9)
    assert gaps[0] - plain_gaps[0] == pytest.approx((left_at_prefill - left_after_one) / 1e3,
                                                    abs=1e-6)  # float32 gaps  # fmt: skip
    assert gaps[1] - plain_gaps[1] == pytest.approx(left_at_prefill / 1e3, abs=1e-6)  # + the last
    assert gaps[2:] == pytest.approx(plain_gaps[2:] + gaps[1] - plain_gaps[1], abs=1e-6)
    assert end - plain_end == pytest.approx(0.020, abs=1e-9)


def bind_profile(extra_ms: float = 5.0):
    """The linear profile whose decode attention costs ``extra_ms`` more per layer when the
    step binds a new padded KV (a new decode batch)."""
    base = linear_profile()
    bind = [replace(p, op="attn_decode_bind", median_ms=p.median_ms + extra_ms,
                    p90_ms=p.p90_ms + extra_ms)
            for p in base.points if p.op == "attn_decode"]  # fmt: skip
    return replace(base, points=base.points + bind)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_new_decode_batch_pays_the_bind_once_and_again_when_its_sequences_change(
    fast_forward,
):
    """Requests 0 and 1 arrive together: one prefill, then decode steps of [0, 1] (one bind,
    then reused), then of [1] alone once 0 has finished (a second bind). Each bind costs
    4 layers x 5 ms; a step of an unchanged batch costs what it costs without the op."""
    reqs = [Request(0, "BE", 0.0, 20, 3), Request(1, "BE", 0.0, 20, 6)]

    def finishes(profile):
        latency = LatencyModel(profile, RoutingModel(4, 8, 2))
        sched = Scheduler(IterationFCFS(), 1_000_000)
        sim = Simulation(reqs, sched, latency, fast_forward=fast_forward)
        return {s.id: s.finish_s for s in sim.run().sequences}

    plain, bound = finishes(linear_profile()), finishes(bind_profile())
    assert bound[0] == pytest.approx(plain[0] + 0.020, abs=1e-12)
    assert bound[1] == pytest.approx(plain[1] + 0.040, abs=1e-12)
