"""Preemption in the simulator, checked against figures worked out by hand from the design
(docs/ARCHITECTURE "Execution model"), not against the code's own tables.

The hand-made model: 2 layers x 4 experts, every token visits every expert, so every iteration
of a one-sequence batch has the same stages (ms):

    stage      overhead | attn router e0 e1 e2 e3 | attn router e0 e1 e2 e3 | lm_head
    duration       1    |  4    1     2  2  2  2  |  4    1     2  2  2  2  |    3
    boundary   0     1     2     3    4  5  6  7     8     9   10 11 12 13      14
    time (ms)  0     1     5     6    8 10 12 14    18    19   21 23 25 27      30

Boundary i is where stage i starts (a batch's cursor). Preemptible inner boundaries:
- ``layer``: the start of each layer, after its attention, after its router, and after the last
  layer: 1, 2, 3, 7, 8, 9, 13 (never between two experts);
- ``qllm``: every inner boundary, 1 to 13 (also between experts).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import linear_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Granularity, Request, Scheduler
from policies.core import LS
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.priority import Priority
from policies.qllm import QLLM
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel, preemptible_boundaries

MS = 1e-3
LAYER_BOUNDARIES = [1, 2, 3, 7, 8, 9, 13]
QLLM_BOUNDARIES = list(range(1, 14))
BOUNDARY_MS = [0, 1, 5, 6, 8, 10, 12, 14, 18, 19, 21, 23, 25, 27, 30]
ITERATION_MS = 30
MODES = ("lookup", "step")


class EveryExpert(RoutingModel):
    """Every token visits every expert: all expert stages take the same, known time."""

    def draw(self, num_tokens, size=None):
        shape = self.load.shape if size is None else (size, *self.load.shape)
        return np.full(shape, num_tokens)


def hand_profile():
    return linear_profile(
        num_layers=2, num_experts=4, top_k=4, attn_ms=4, router_ms=1, expert_ms=2,
        expert_per_token_ms=0, lm_head_ms=3, overhead_ms=1,
    )  # fmt: skip


class CheckingScheduler(Scheduler):
    """Checks the scheduler's promises after every call an executor makes:
    an LS batch is never preempted, and KV used is always the reservations of the admitted,
    unfinished sequences plus the activation charge of the suspended batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursors: list[int] = []  # where each preempted batch was suspended

    def admitted(self):
        batches = self.suspended + ([self.running] if self.running else [])
        seqs = [s for b in batches for s in b.sequences]
        return seqs + [s for q in self.ready.values() for s in q]

    def check_kv(self):
        reserved = sum(s.request.prompt_tokens + s.request.output_tokens for s in self.admitted())
        charge = sum(
            math.ceil(sum(s.new_tokens for s in b.sequences) * self.activation_tokens_per_token)
            for b in self.suspended
        )
        assert self.kv_used_tokens == reserved + charge
        assert self.kv_used_tokens <= self.kv_capacity_tokens

    def next_batch(self, now):
        batch = super().next_batch(now)
        self.check_kv()
        return batch

    def preempt(self, now):
        assert not self.running.has_ls, f"LS batch {self.running} preempted"
        self.cursors.append(self.running.cursor)
        batch = super().preempt(now)
        self.check_kv()
        return batch

    def complete_iteration(self, now):
        finished = super().complete_iteration(now)
        self.check_kv()
        return finished

    def check_drained(self):
        assert self.kv_used_tokens == 0
        assert self.running is None and not self.suspended and not self._held
        assert not any(self.waiting.values()) and not any(self.ready.values())


class RecordingLatency(LatencyModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plans = {}

    def plan(self, batch, bind=False):
        self.plans[batch.id] = p = super().plan(batch, bind)
        return p


def simulate(requests, policy, profile, mode, routing_cls=RoutingModel, capacity=1_000_000):
    m = profile.model
    latency = RecordingLatency(profile, routing_cls(m.num_layers, m.num_experts, m.top_k))
    sched = CheckingScheduler(policy, capacity, activation_tokens_per_token=0.25)
    result = Simulation(requests, sched, latency, mode=mode, record_trace=True).run()
    sched.check_drained()
    return result, sched, latency


def test_boundary_lists_written_out_for_two_layers_of_four_experts():
    assert preemptible_boundaries(2, 6, LayerPreemptive().granularity) == LAYER_BOUNDARIES
    assert preemptible_boundaries(2, 6, QLLM().granularity) == QLLM_BOUNDARIES
    for policy in (FCFS(), IterationFCFS(), Priority()):
        assert preemptible_boundaries(2, 6, policy.granularity) == []


def test_hand_profile_has_the_stage_times_of_the_table():
    profile = hand_profile()
    m = profile.model
    latency = LatencyModel(profile, EveryExpert(m.num_layers, m.num_experts, m.top_k))
    from policies.core import Batch, Phase, Sequence

    plan = latency.plan(Batch([Sequence(Request(0, "BE", 0.0, 8, 1))], Phase.PREFILL))
    np.testing.assert_allclose(plan.offsets, np.array(BOUNDARY_MS) * MS, atol=1e-12)


# (LS arrival ms, boundary where qllm suspends the BE batch, where layer does); None: the BE
# iteration is past its last preemptible boundary (in lm_head) and finishes first.
ARRIVALS = [
    (0.5, 1, 1),  # in the step overhead: both stop at the start of layer 0
    (2.0, 2, 2),  # in layer 0's attention: both stop after it
    (5.5, 3, 3),  # in layer 0's router
    (9.0, 5, 7),  # in expert 1 of layer 0: qllm after it, layer at the end of the layer
    (13.0, 7, 7),  # in the last expert of layer 0: both at the layer's end
    (15.0, 8, 8),  # in layer 1's attention
    (22.0, 11, 13),  # in expert 1 of layer 1
    (28.0, None, None),  # in lm_head
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arrival_ms, qllm_at, layer_at", ARRIVALS)
@pytest.mark.parametrize("name", ["qllm", "layer"])
def test_preempted_batch_resumes_from_its_cursor_losing_and_repeating_nothing(
    name, arrival_ms, qllm_at, layer_at, mode
):
    """A one-token BE prefill starts at 0; a one-token LS request arrives mid-iteration. The BE
    batch is suspended at the boundary of the table, the LS prefill runs its 30 ms, and the BE
    batch resumes at the suspension time + 30 ms and finishes after the rest of its iteration,
    30 ms - offset(cursor): at 60 ms, the total work of both (nothing lost or repeated)."""
    policy, at = (QLLM(), qllm_at) if name == "qllm" else (LayerPreemptive(), layer_at)
    be = Request(0, "BE", 0.0, prompt_tokens=8, output_tokens=1)
    ls = Request(1, "LS", arrival_ms * MS, prompt_tokens=8, output_tokens=1)
    result, sched, _ = simulate([be, ls], policy, hand_profile(), mode, EveryExpert)
    be_seq, ls_seq = sorted(result.sequences, key=lambda s: s.id)
    segments = [(round(a / MS, 9), round(b / MS, 9), kind) for a, b, _, kind, _ in result.trace]
    if at is None:
        assert sched.cursors == [] and result.preemptions == 0
        assert segments == [(0, 30, "prefill"), (30, 60, "prefill")]
        assert be_seq.finish_s == pytest.approx(30 * MS)
        assert ls_seq.first_token_s == pytest.approx(60 * MS)
        assert result.events == (29 if mode == "step" else 4)
        return
    suspend_ms = BOUNDARY_MS[at]
    resume_ms = suspend_ms + ITERATION_MS
    assert sched.cursors == [at]
    assert segments == [
        (0, suspend_ms, "preempted"),
        (suspend_ms, resume_ms, "prefill"),  # the LS request
        (resume_ms, resume_ms + ITERATION_MS - suspend_ms, "prefill"),  # BE, from the cursor
    ]
    assert ls_seq.first_token_s == pytest.approx(resume_ms * MS, abs=1e-12)
    assert be_seq.finish_s == pytest.approx(60 * MS, abs=1e-12)
    assert be_seq.preemptions == 1 and ls_seq.preemptions == 0
    # step: one event per stage run (5 + 14 + 9) and the LS arrival; lookup: the arrival, the
    # interrupt, and one timeout each for the run to the boundary, the LS and the rest of BE
    assert result.events == (29 if mode == "step" else 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy_cls", [FCFS, IterationFCFS, Priority])
def test_policies_without_preemption_let_the_be_iteration_finish(policy_cls, mode):
    be = Request(0, "BE", 0.0, prompt_tokens=8, output_tokens=1)
    ls = Request(1, "LS", 9 * MS, prompt_tokens=8, output_tokens=1)
    result, sched, _ = simulate([be, ls], policy_cls(), hand_profile(), mode, EveryExpert)
    be_seq, ls_seq = sorted(result.sequences, key=lambda s: s.id)
    assert result.preemptions == 0
    assert be_seq.finish_s == pytest.approx(30 * MS)
    assert ls_seq.first_token_s == pytest.approx(60 * MS)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_preempted_twice_still_runs_each_stage_once(mode):
    """Two LS arrivals in one BE iteration (qllm): suspended at boundary 5 (10 ms), resumed at
    40 ms, suspended again at boundary 11 (LS arrives at 52 ms, in expert 1 of layer 1 which
    the resumed batch runs 51..53 ms), resumed at 83 ms, done at 83 + 30 - 23 = 90 ms."""
    be = Request(0, "BE", 0.0, prompt_tokens=8, output_tokens=1)
    ls1 = Request(1, "LS", 9 * MS, prompt_tokens=8, output_tokens=1)
    ls2 = Request(2, "LS", 52 * MS, prompt_tokens=8, output_tokens=1)
    result, sched, _ = simulate([be, ls1, ls2], QLLM(), hand_profile(), mode, EveryExpert)
    assert sched.cursors == [5, 11]
    be_segments = [(round(a / MS, 9), round(b / MS, 9)) for a, b, bid, _, _ in result.trace
                   if bid == result.trace[0][2]]  # fmt: skip
    assert be_segments == [(0, 10), (40, 53), (83, 90)]
    assert result.sequences[0].finish_s == pytest.approx(90 * MS)
    assert result.preemptions == 2 and result.sequences[0].preemptions == 2


def poisson(n, rate, seed, ls_fraction=0.3):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    cls = [LS if rng.random() < ls_fraction else "BE" for _ in range(n)]
    prompts, outputs = rng.integers(1, 200, n), rng.integers(1, 20, n)
    return [Request(i, cls[i], float(t[i]), int(prompts[i]), int(outputs[i])) for i in range(n)]


def check_busy_time_per_batch(result, latency):
    """Each batch's segments add up to exactly its plan's total: no stage lost or repeated."""
    busy: dict[int, float] = {}
    for start, end, batch_id, _, _ in result.trace:
        busy[batch_id] = busy.get(batch_id, 0.0) + (end - start)
    assert busy.keys() == latency.plans.keys()
    for batch_id, plan in latency.plans.items():
        assert busy[batch_id] == pytest.approx(plan.total_s, rel=1e-9, abs=1e-12), batch_id


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy_cls", [QLLM, LayerPreemptive])
def test_busy_time_of_every_preempted_batch_equals_its_plan(policy_cls, mode):
    profile = linear_profile(num_layers=4, num_experts=8, attn_ms=3, expert_ms=1)
    result, sched, latency = simulate(poisson(150, 5, seed=1), policy_cls(), profile, mode)
    assert result.preemptions >= 10  # the check must cover many resumptions
    check_busy_time_per_batch(result, latency)
    layer_stops = {1 + layer * 10 + k for layer in range(4) for k in (0, 1, 2)} | {41}
    if policy_cls is LayerPreemptive:  # 4 layers x 8 experts: 10 stages a layer
        assert set(sched.cursors) <= layer_stops
    else:
        assert set(sched.cursors) - layer_stops  # some qllm stops fall between experts


request_rows = st.lists(
    st.tuples(st.floats(0, 0.5, allow_nan=False), st.sampled_from(["LS", "BE"]),
              st.integers(1, 300), st.integers(1, 12)),
    min_size=1, max_size=25,
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=request_rows,
    policy_cls=st.sampled_from([FCFS, IterationFCFS, Priority, LayerPreemptive, QLLM]),
    mode=st.sampled_from(MODES),
    batch=st.integers(1, 6),
    capacity=st.integers(700, 3000),
)
def test_ls_never_preempted_kv_accounted_and_nothing_held_after_a_run(
    rows, policy_cls, mode, batch, capacity
):
    """CheckingScheduler asserts at every call: no LS batch is preempted, KV used equals the
    reservations plus the suspended batches' activation charge; after the run KV used is 0 and
    no queue, running or suspended batch is left. Each batch's busy time equals its plan's."""
    requests = [Request(i, c, t, p, o) for i, (t, c, p, o) in enumerate(sorted(rows))]
    profile = linear_profile(num_layers=2, num_experts=4)
    result, _, latency = simulate(requests, policy_cls(max_batch_size=batch), profile, mode,
                                  capacity=capacity)  # fmt: skip
    assert all(s.done for s in result.sequences) and len(result.sequences) == len(requests)
    check_busy_time_per_batch(result, latency)


class QLLMWithoutPreemption(QLLM):
    """Algorithm 1's batch order, decided only between iterations."""

    granularity = Granularity.ITERATION


def test_preemption_itself_cuts_ls_ttft():
    """The same order with and without mid-iteration preemption, on the same requests: only
    preemption separates them, and it must shorten LS waits (measured: 97 vs 111 ms)."""
    profile = linear_profile(num_layers=4, num_experts=8, attn_ms=3, expert_ms=1)
    ttft_ms, preemptions = {}, {}
    for policy in (QLLM(), QLLMWithoutPreemption()):
        result, _, _ = simulate(poisson(300, 8, seed=2), policy, profile, "lookup")
        ls = [s.first_token_s - s.request.arrival_s for s in result.sequences if s.is_ls]
        ttft_ms[policy.granularity] = 1e3 * float(np.mean(ls))
        preemptions[policy.granularity] = result.preemptions
    assert preemptions[Granularity.ITERATION] == 0 and preemptions[Granularity.EXPERT] >= 10
    assert ttft_ms[Granularity.EXPERT] < 0.95 * ttft_ms[Granularity.ITERATION], ttft_ms


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("second_ms", [9.0, 9.5])
def test_ls_arrivals_while_the_be_batch_runs_to_its_boundary_join_one_prefill(second_ms, mode):
    """Two LS arrivals before the boundary at 10 ms (together, or the second while the BE
    batch runs on to the boundary): one suspension, then one LS prefill of both. Its
    attention costs 4 ms per sequence: 1 + 2 x (8 + 1 + 4 x 2) + 3 = 38 ms, 10..48 ms; BE
    resumes at 48 ms for its last 20 ms."""
    be = Request(0, "BE", 0.0, prompt_tokens=8, output_tokens=1)
    ls1 = Request(1, "LS", 9 * MS, prompt_tokens=8, output_tokens=1)
    ls2 = Request(2, "LS", second_ms * MS, prompt_tokens=8, output_tokens=1)
    result, sched, _ = simulate([be, ls1, ls2], QLLM(), hand_profile(), mode, EveryExpert)
    assert sched.cursors == [5]
    be_seq, *ls_seqs = sorted(result.sequences, key=lambda s: s.id)
    assert [s.first_token_s for s in ls_seqs] == pytest.approx([48 * MS, 48 * MS])
    assert be_seq.finish_s == pytest.approx(68 * MS)


def test_simulation_options():
    requests = [Request(i, "BE", 0.0, 8, 2) for i in range(3)]
    finished = []
    latency = LatencyModel(hand_profile(), EveryExpert(2, 4, 4))
    sim = Simulation(requests, Scheduler(QLLM(), 10_000), latency, on_finish=finished.append)
    result = sim.run()
    assert finished == result.sequences and all(s.done for s in finished)
    assert result.trace == []  # recorded only when asked
    # one prefill of all three (attention 3 x 4 ms a layer): 1 + 2 x (12 + 1 + 8) + 3 = 46 ms,
    # then one decode of all three (decode attention 4 ms): 30 ms
    assert result.makespan_s == pytest.approx(76 * MS) and result.iterations == 2
    assert 0 <= result.wall_s < 60
    with pytest.raises(ValueError, match=r"^mode must be lookup or step, not 'every'$"):
        Simulation(requests, Scheduler(QLLM(), 10_000), latency, mode="every")


@pytest.mark.parametrize("policy_cls", [FCFS, IterationFCFS, Priority])
def test_policies_without_preemption_never_ask_for_the_processor(policy_cls):
    s = Scheduler(policy_cls(), 10_000)
    s.arrive(Request(0, "BE", 0.0, 8, 4), 0)
    s.next_batch(0)
    s.arrive(Request(1, "LS", 0.0, 8, 4), 0)
    assert not s.preemptible and not s.should_preempt(0)
