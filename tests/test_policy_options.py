"""The policies' options for a like-for-like comparison (issues 12 and 15): TGI's router rules
as its source states them, the alg1 ablation, Algorithm 1's in-flight cap, BE fill switch,
starvation guard and the authors' preemption rule (router boundaries, in both executors)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from conftest import ids, linear_profile, step
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from policies import BE, LS, Granularity, Phase, Request, Scheduler
from policies.alg1 import Algorithm1
from policies.iteration import IterationFCFS
from policies.layer import LayerPreemptive
from policies.qllm import QLLM
from policies.scheduler import CapacityError
from sim.app import CONF_DIR
from sim.config import UserError, validate
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel, preemptible_boundaries
from sim.run import build_policy, policy_options

ALG1_FAMILY = [Algorithm1, LayerPreemptive, QLLM]


def req(i, cls=BE, t=0.0, prompt=10, out=100):
    return Request(i, cls, t, prompt, out)


def drive(policy, requests, iteration_s=1.0, capacity=1_000_000):
    """Runs a policy with every iteration taking ``iteration_s`` and no preemption; returns
    each request's token times and the most admitted, unfinished sequences seen."""
    s = Scheduler(policy, kv_capacity_tokens=capacity)
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    now, tokens, peak = 0.0, defaultdict(list), 0
    while pending or s.in_system:
        while pending and pending[0].arrival_s <= now:
            s.arrive(pending.pop(0), now)
        batch = s.next_batch(now)
        if batch is None:
            now = pending[0].arrival_s
            continue
        peak = max(peak, s.in_system - sum(len(q) for q in s.waiting.values()))
        now += iteration_s
        s.complete_iteration(now)
        for q in batch.sequences:
            tokens[q.id].append(now)
    return tokens, peak


def mixed_requests():
    """20 BE jobs first, then short LS jobs arriving one by one while BE decodes run."""
    be = [req(i, BE, t=0.0, prompt=20 + 7 * i, out=20 + i % 5) for i in range(20)]
    return be + [req(20 + j, LS, t=0.013 + 0.151 * j, prompt=5 + j, out=2) for j in range(12)]


def longest_wait_s(requests, tokens, cls=BE) -> float:
    """The longest a job of the class waited: for its first token or between two tokens."""
    waits = []
    for r in requests:
        if r.cls == cls:
            times = [r.arrival_s, *tokens[r.id]]
            waits.append(float(np.diff(times).max()))
    return max(waits)


# ------------------------------------------------------------------------------- TGI's router
def tgi_state(running, waiting, steps, ratio, max_waiting_tokens=20):
    """``running`` sequences prefilled together, ``steps`` decode steps, then ``waiting``
    requests arrive: the scheduler about to choose."""
    pol = IterationFCFS(waiting_served_ratio=ratio, max_waiting_tokens=max_waiting_tokens)
    s = Scheduler(pol, kv_capacity_tokens=1_000_000)
    for i in range(running):
        s.arrive(req(i), 0)
    assert step(s).size == running
    for _ in range(steps):
        assert step(s).phase is Phase.DECODE
    for i in range(waiting):
        s.arrive(req(running + i), 0)
    return s


# Cases where floor(running x ratio) (TGI), ceil(running x ratio), floor(running / ratio) and
# ceil(running / ratio) disagree, and TGI's timer (counter 1 after a prefill, join once it
# reaches max_waiting_tokens = 20, i.e. after 19 decode steps, not 20).
# (running, waiting, decode steps since the prefill, ratio) -> TGI joins?
TGI_TABLE = [
    (4, 4, 0, 1.2, True),  # floor(4.8) = 4 <= 4; ceil(4.8) = 5 would wait
    (4, 3, 0, 1.2, False),  # 3 < 4; floor(4 / 1.2) = 3 would join
    (6, 6, 0, 1.2, False),  # floor(7.2) = 7 > 6; ceil(6 / 1.2) = 5 would join
    (7, 2, 0, 0.3, True),  # floor(2.1) = 2 <= 2; ceil(2.1) = 3 would wait
    (7, 1, 0, 0.3, False),  # 1 < 2
    (10, 3, 0, 0.3, True),  # floor(3.0) = 3; running / ratio = 33 would wait
    (3, 1, 0, 0.3, True),  # floor(0.9) = 0: any waiting request joins; 3 / 0.3 = 10 would not
    (4, 1, 18, 1.2, False),  # counter 19 < 20
    (4, 1, 19, 1.2, True),  # counter 20: the timer lets it join after 19 decode steps
    (7, 1, 19, 0.3, True),
]


@pytest.mark.parametrize("running,waiting,steps,ratio,joins", TGI_TABLE)
def test_tgi_join_rule_table(running, waiting, steps, ratio, joins):
    batch = tgi_state(running, waiting, steps, ratio).next_batch(0)
    assert batch.phase is (Phase.PREFILL if joins else Phase.DECODE)
    if joins:
        assert batch.size == waiting


def test_tgi_decodes_after_a_join_but_may_join_right_after_a_first_prefill():
    # a prefill budget of two prompts: TGI's loop prefills an empty batch, tries a join at
    # once, and after every join decodes the merged batch before it tries again
    pol = IterationFCFS(waiting_served_ratio=0.3, max_batch_prefill_tokens=20)
    s = Scheduler(pol, kv_capacity_tokens=1_000_000)
    for i in range(7):
        s.arrive(req(i), 0)
    phases = "".join(step(s).phase.value[0] for _ in range(7))
    assert phases == "ppdpdpd"


def test_tgi_token_budget_and_unbounded_batch_size():
    # max_batch_size null: memory (here max_batch_total_tokens) bounds the batch, not 32
    pol = IterationFCFS(max_batch_size=None, max_batch_total_tokens=40 * 25,
                        max_batch_prefill_tokens=100_000)  # fmt: skip
    s = Scheduler(pol, kv_capacity_tokens=1_000_000)
    for i in range(45):
        s.arrive(req(i, prompt=10, out=15), 0)  # 25 KV tokens reserved each
    assert step(s).size == 40
    # the whole batch's reservation counts: nobody joins until a member finishes
    pol = IterationFCFS(max_batch_total_tokens=100, waiting_served_ratio=0.0)
    s = Scheduler(pol, kv_capacity_tokens=1_000_000)
    s.arrive(req(0, prompt=10, out=2), 0)
    for i in range(1, 5):
        s.arrive(req(i, prompt=10, out=15), 0)
    assert ids(step(s)) == [0, 1, 2, 3]  # 4 x 25 = 100
    assert step(s).phase is Phase.DECODE  # request 4 does not fit beside them
    assert ids(step(s)) == [4]  # request 0 finished with that decode: its 12 tokens are free
    with pytest.raises(CapacityError) as refused:
        s2 = Scheduler(IterationFCFS(max_batch_total_tokens=100), kv_capacity_tokens=1_000)
        s2.arrive(req(0, prompt=60, out=50), 0)
        s2.next_batch(0)
    assert refused.value.key == "policy.max_batch_total_tokens=100"


def test_unbounded_batch_size_composes_and_validates():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["policy=tgi-0.3", "policy.max_batch_size=null",
                                           "policy.max_batch_total_tokens=20000"])  # fmt: skip
    validate(cfg)
    pol = build_policy(cfg.policy)
    assert pol.max_batch_size == float("inf") and pol.max_batch_total_tokens == 20000
    assert pol.waiting_served_ratio == 0.3


def test_every_policy_option_is_a_key_of_its_config_file():
    """A Hydra key exists for every constructor argument (so ``policy.<key>=...`` works
    without ``+``), and each file's name field is its stem (so group choices validate)."""
    for path in sorted(CONF_DIR.glob("policy/*.yaml")):
        cfg = OmegaConf.load(path)
        assert cfg.name == path.stem
        pol = build_policy(cfg)
        assert policy_options(type(pol)) <= set(cfg), path.name


@pytest.mark.parametrize(
    "name,key,value",
    [
        ("qllm", "max_in_flight", 0),
        ("alg1", "max_in_flight", "abc"),
        ("layer", "be_max_wait_s", -1),
        ("tgi-0.3", "max_batch_total_tokens", 0),
        ("priority", "max_batch_size", 0),
        # a string where a flag or a number goes (Hydra passes `no` and `abc` through as
        # strings): evict_be_for_ls=no evicted, as any non-empty string is true
        ("qllm", "evict_be_for_ls", "no"),
        ("qllm", "merge", "off"),
        ("vllm", "enable_chunked_prefill", "no"),
        ("sglang", "ls_priority", "abc"),
        ("sglang", "schedule_conservativeness", "high"),
        ("tgi-0.3", "max_waiting_tokens", "abc"),
        ("layer", "preempt_prefill", 1),
    ],
)
def test_bad_option_values_fail_in_one_line_naming_the_key(name, key, value):
    cfg = OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml")
    cfg[key] = value
    with pytest.raises(UserError, match=f"^policy={name}: {key}={value}: must"):
        build_policy(cfg)


def test_non_numeric_batch_limits_fail_in_one_line():
    for key in ("max_batch_size", "max_batch_prefill_tokens"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"policy.{key}=abc"])
        with pytest.raises(UserError, match=f"^policy.{key}=abc: must be an integer >= 1"):
            validate(cfg)


# -------------------------------------------------------------------------- Algorithm 1
@pytest.mark.parametrize("policy_cls", ALG1_FAMILY)
def test_no_be_prompt_is_admitted_while_an_ls_prompt_waits_for_memory(policy_cls):
    """BE 0 holds 700 of 1,000 KV tokens; LS 1 (500) waits for it; BE 2 (250), which came
    later, would fit: it waits too (until 2026-12-04 it went first, and every later BE prompt
    that fitted: qllm's mean LS TTFT was 51.7 s on the paper workload with 4,000 KV tokens,
    priority's 3.4 s)."""
    s = Scheduler(policy_cls(max_batch_size=4), kv_capacity_tokens=1000)
    s.arrive(req(0, BE, prompt=100, out=600), 0)
    step(s)
    s.arrive(req(1, LS, t=1.0, prompt=100, out=400), 1.0)
    s.arrive(req(2, BE, t=1.5, prompt=50, out=200), 1.5)
    b = step(s, 2.0)
    assert b.phase is Phase.DECODE and ids(b) == [0]
    assert [q.id for q in s.waiting[BE]] == [2]
    # a batch with an LS prompt admitted is not filled with BE prompts while the next LS
    # prompt waits for memory; with the memory, it is
    for capacity, batch in ((1000, [3]), (10_000, [3, 4, 5])):
        s = Scheduler(policy_cls(max_batch_size=4), kv_capacity_tokens=capacity)
        s.arrive(req(3, LS, prompt=100, out=100), 0)
        s.arrive(req(4, LS, prompt=600, out=300), 0)  # 200 + 900 > 1000
        s.arrive(req(5, BE, prompt=10, out=10), 0)
        assert ids(s.next_batch(0)) == batch


def test_the_guard_finds_an_overdue_be_job_behind_an_evicted_one():
    """An evicted BE job goes back to the front of its queue, waiting since its last token:
    the overdue job behind it is still served as LS (the guard took a prefix of the queue)."""
    s = Scheduler(Algorithm1(max_batch_size=1, fill_be_prefill=False, be_max_wait_s=2.0),
                  kv_capacity_tokens=10_000)  # fmt: skip
    evicted = s.arrive(req(0, BE, t=0.0), 0.0)
    evicted.last_token_s = 1.0  # waiting since its last token, 1.5 s at 2.5
    s.arrive(req(1, BE, t=0.1), 0.1)  # waiting since 0.1: overdue at 2.5
    assert ids(s.next_batch(2.5)) == [1]


def test_the_guard_does_not_preempt_for_an_ls_job_that_an_overdue_one_keeps_out():
    """BE 1 does not fit and becomes overdue, so it queues before LS 2, which would fit
    alone: preempting BE 0 for LS 2 admits nothing (BE 1 goes first and does not fit), so the
    batch is not preempted (it was, at every boundary: 28,495 times)."""
    requests = [req(0, BE, t=0.0, prompt=100, out=300), req(1, BE, t=0.1, prompt=300, out=400),
                req(2, LS, t=2.0, prompt=100, out=100)]  # fmt: skip
    plain = simulate(requests, LayerPreemptive(), capacity=1000)
    assert plain.preemptions == 1  # LS 2 preempts BE 0 without the guard
    guarded = simulate(requests, LayerPreemptive(be_max_wait_s=1.0), capacity=1000)
    assert guarded.preemptions == 0
    assert all(q.finish_s is not None for q in guarded.sequences)


def test_eviction_for_an_ls_job_frees_memory_before_the_suspended_batch_holds_any():
    """Memory in use never exceeds the capacity: the running BE prefill's activations are
    charged once the BE KV evicted for the LS job has been freed (it went to 1,050 of 1,000)."""
    s = Scheduler(LayerPreemptive(max_batch_size=4, evict_be_for_ls=True),
                  kv_capacity_tokens=1000, activation_tokens_per_token=0.1)  # fmt: skip
    be0 = s.arrive(req(0, BE, prompt=100, out=300), 0)
    step(s)  # BE 0 decode-ready, 400 held
    s.arrive(req(1, BE, prompt=500, out=100), 0.5)
    assert ids(s.next_batch(0.5)) == [1] and s.kv_used_tokens == 1000
    s.arrive(req(2, LS, t=0.9, prompt=100, out=100), 0.9)  # 200 + 50 held: evict BE 0
    assert s.should_preempt(0.9)
    s.preempt(0.9)
    assert ids(s.next_batch(0.9)) == [2] and be0.recomputes == 1
    assert s.peak_kv_used_tokens <= 1000


def test_alg1_selects_as_algorithm1_and_never_preempts():
    s = Scheduler(Algorithm1(max_batch_size=3), kv_capacity_tokens=10_000)
    assert s.granularity is Granularity.ITERATION and not s.preemptible
    for i, c in enumerate([BE, BE, BE, LS]):
        s.arrive(req(i, c, out=4), 0)
    assert ids(step(s)) == [3, 0, 1]  # step 2: LS prefill filled from BE prefill
    # in the simulator, on a workload where layer and qllm preempt, alg1 never does
    requests = mixed_requests()
    for cls, preempts in [(Algorithm1, False), (LayerPreemptive, True)]:
        result = simulate(requests, cls(max_batch_size=4))
        assert all(q.done for q in result.sequences)
        assert (result.preemptions > 0) is preempts


@pytest.mark.parametrize("policy_cls", ALG1_FAMILY)
def test_fill_be_prefill_switch(policy_cls):
    for fill, expected in [(True, [3, 0, 1]), (False, [3])]:
        s = Scheduler(policy_cls(max_batch_size=3, fill_be_prefill=fill), 10_000)
        for i, c in enumerate([BE, BE, BE, LS]):
            s.arrive(req(i, c, out=4), 0)
        assert ids(step(s)) == expected


@pytest.mark.parametrize("policy_cls", ALG1_FAMILY)
def test_max_in_flight_caps_admitted_sequences(policy_cls):
    # a BE backlog and a steady LS stream: every LS prefill fills up with BE prompts, so
    # without a cap the sequences in flight grow far past the batch size
    requests = [req(i, BE, t=0.0, out=30) for i in range(60)]
    requests += [req(60 + j, LS, t=2.0 * j, out=5) for j in range(20)]
    _, peak = drive(policy_cls(max_batch_size=4), requests)
    assert peak > 20
    tokens, peak = drive(policy_cls(max_batch_size=4, max_in_flight=4), requests)
    assert peak == 4
    assert all(len(tokens[r.id]) == r.output_tokens for r in requests)


def test_max_in_flight_blocks_a_preemption_that_could_not_admit_the_ls_job():
    for cap, preempts in [(None, True), (2, False), (3, True)]:
        s = Scheduler(LayerPreemptive(max_in_flight=cap), kv_capacity_tokens=10_000)
        s.arrive(req(0, BE), 0)
        s.arrive(req(1, BE), 0)
        assert s.next_batch(0).size == 2
        s.arrive(req(2, LS), 1)
        assert s.should_preempt(1) is preempts


# -------------------------------------------------------------------------- starvation
def starving_workload():
    """3 long LS jobs and 5 BE jobs in a batch of 4: the LS decodes take 3 slots of every
    batch, so BE prompts beyond the first are never prefilled until the LS jobs finish."""
    ls = [req(i, LS, t=0.0, out=60) for i in range(3)]
    be = [req(3 + i, BE, t=0.0, out=10) for i in range(5)]
    return ls + be


@pytest.mark.parametrize("policy_cls", ALG1_FAMILY)
def test_be_max_wait_bounds_the_longest_be_wait(policy_cls):
    requests = starving_workload()
    tokens, _ = drive(policy_cls(max_batch_size=4), requests)
    assert longest_wait_s(requests, tokens) >= 60  # BE prompts wait for every LS token
    tokens, _ = drive(policy_cls(max_batch_size=4, be_max_wait_s=5.0), requests)
    assert longest_wait_s(requests, tokens) <= 5.0 + 2  # overdue, then the next batch or so
    assert all(len(tokens[r.id]) == r.output_tokens for r in requests)
    assert longest_wait_s(requests, tokens, LS) <= 5.0 + 2  # LS still served


def test_be_served_as_ls_is_not_preempted_for_an_ls_arrival():
    pol = QLLM(max_batch_size=4, fill_be_prefill=False, be_max_wait_s=1.0)
    s = Scheduler(pol, kv_capacity_tokens=10_000)
    s.arrive(req(0, BE), 0)
    for i in range(1, 4):
        s.arrive(req(i, LS, out=50), 0)
    assert ids(step(s, 0)) == [1, 2, 3]
    # at 3 s BE 0 is overdue: it goes first in the LS-prefill queue
    batch = s.next_batch(3.0)
    assert ids(batch) == [0]
    s.arrive(req(5, LS), 3.0)
    assert not s.should_preempt(3.0)


# --------------------------------------------------------------------- authors' preemption
def test_preempt_prefill_false_preempts_only_be_decodes_after_a_router():
    layers, spl = 4, 10
    assert preemptible_boundaries(layers, spl, Granularity.ROUTER) == [3, 13, 23, 33]
    for policy_cls in (LayerPreemptive, QLLM):
        pol = policy_cls(preempt_prefill=False)
        assert pol.granularity is Granularity.ROUTER
        s = Scheduler(pol, kv_capacity_tokens=10_000)
        s.arrive(req(0, BE, out=3), 0)
        assert s.next_batch(0).phase is Phase.PREFILL
        s.arrive(req(1, LS, out=1), 0.5)
        assert not s.should_preempt(0.5)  # prefills pass straight through
        s.complete_iteration(1)
        assert ids(step(s, 1)) == [1]  # the LS job, done with its first token
        assert s.next_batch(2).phase is Phase.DECODE  # BE 0 alone
        s.arrive(req(2, LS), 2.5)
        assert s.should_preempt(2.5)
    # the default (the paper's Algorithm 1) preempts a BE prefill
    s = Scheduler(QLLM(), kv_capacity_tokens=10_000)
    s.arrive(req(0, BE), 0)
    s.next_batch(0)
    s.arrive(req(1, LS), 0.5)
    assert s.should_preempt(0.5)


class RecordingScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursors: list[tuple[int, str]] = []

    def preempt(self, now):
        self.cursors.append((self.running.cursor, self.running.phase.value))
        return super().preempt(now)


def simulate(requests, policy, mode="lookup", scheduler_cls=Scheduler, capacity=1_000_000):
    profile = linear_profile()
    m = profile.model
    latency = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0))
    sched = scheduler_cls(policy, kv_capacity_tokens=capacity, activation_tokens_per_token=0.1)
    result = Simulation(requests, sched, latency, mode=mode).run()
    result.sched = sched
    return result


def test_simulator_preempts_at_router_boundaries_only_and_lookup_equals_stepping():
    requests = mixed_requests()
    spl = linear_profile().model.num_experts + 2
    runs = []
    for mode in ("lookup", "step"):
        r = simulate(requests, QLLM(max_batch_size=4, preempt_prefill=False), mode,
                     RecordingScheduler)  # fmt: skip
        assert r.preemptions > 0
        assert all(phase == "decode" for _, phase in r.sched.cursors)
        assert all((c - 1) % spl == 2 for c, _ in r.sched.cursors)  # after a router
        runs.append(np.array([(q.id, q.first_token_s, q.finish_s, q.preemptions)
                              for q in r.sequences]))  # fmt: skip
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-9, atol=1e-9)


def test_real_engine_preempts_at_router_boundaries_only_and_generates_greedy_tokens():
    torch = pytest.importorskip("torch")
    from profiler.models import build_model
    from profiler.ops import ModelRunner
    from realrun.clock import VirtualClock
    from realrun.engine import RealEngine
    from realrun.prompts import build_prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = build_model({"name": "tiny-mixtral", "config": {"initializer_range": 0.2}},
                               dtype="float64", seed=3)  # fmt: skip
        runner = ModelRunner(model)
        be = [req(i, BE, t=0.01 * i, prompt=3 + (7 * i) % 37, out=6 + i % 7) for i in range(12)]
        ls = [req(12 + j, LS, t=0.15 + 0.133 * j, prompt=2 + (5 * j) % 23, out=1 + j % 3)
              for j in range(10)]  # fmt: skip
        requests, prompts = build_prompts(be + ls, 512, max_prompt_tokens=64, seed=0)
        sched = RecordingScheduler(
            QLLM(max_batch_size=6, preempt_prefill=False),
            kv_capacity_tokens=100_000,
            activation_tokens_per_token=1.0,
        )
        result = RealEngine(requests, prompts, sched, runner, VirtualClock(1e-3)).run()
        for r in requests:
            expected = model.generate(
                torch.tensor([prompts[r.id]]), do_sample=False, max_new_tokens=r.output_tokens
            )[0, r.prompt_tokens :]
            assert result.tokens[r.id] == expected.tolist()
    finally:
        torch.set_num_threads(threads)
    assert result.preemptions > 0
    assert all(phase == "decode" for _, phase in sched.cursors)
    where = [runner.locate(c) for c, _ in sched.cursors]
    assert all(ref.stage == "expert" and ref.expert == 0 for ref in where)  # after a router


def test_the_starvation_guard_and_eviction_for_ls_do_not_make_be_work_evict_itself():
    """With be_max_wait_s, overdue BE requests queue with LS ones; evict_be_for_ls then
    evicted other BE work for them, each victim soon overdue in turn: 2,042 recomputes for 150
    requests of the conversation trace (81 of one request), against 18 with the eviction
    alone. Eviction now makes room only for a real LS request (and the overdue BE requests
    queued before it, which select admits first: since the guard also finds an evicted BE
    request overdue at the front of its queue, 161 recomputes, at most 4 of one request,
    where missing them made 24)."""
    from pathlib import Path

    from sim.run import simulate

    trace = Path(__file__).resolve().parents[1] / "data" / "traces" / "splitwise_conv.csv"
    base = ["workload=trace", f"workload.path={trace}", "workload.num_requests=150",
            "profile.kv_capacity_tokens=20000", "policy=alg1", "progress=false"]  # fmt: skip
    recomputes = {}
    evict = "policy.evict_be_for_ls=true"
    for name, extra in (("evict", [evict]), ("both", [evict, "policy.be_max_wait_s=1.0"])):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*base, *extra])
        out = simulate(cfg, warn=False)
        recomputes[name] = out.requests["recomputes"]
        assert out.requests["finish_s"].notna().all()
    assert recomputes["evict"].sum() > 0  # the case at hand evicts at all
    assert recomputes["both"].sum() <= 1.5 * len(recomputes["both"])
    assert recomputes["both"].max() <= 5
