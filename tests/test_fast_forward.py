"""Fast-forwarded runs of decode iterations (sim.engine, ``fast_forward``) give every request
exactly the results of the iteration-by-iteration path.

Exact, not approximate: a run's iteration ends are accumulated left to right from the same
durations (each computed by the same float operations as ``Plan.total_s``), SimPy's clock is
made to land on each of them, and the routing picks are the same numbers in the same order, so
the two paths see the very same floats. Any difference is a bug.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import linear_profile
from hydra import compose, initialize_config_dir

from policies import Request, Scheduler
from policies.alg1 import Algorithm1
from policies.core import Sequence
from policies.fcfs import FCFS
from policies.iteration import IterationFCFS
from policies.memory import PagedMemory
from policies.priority import Priority
from policies.scheduler import Policy
from policies.sglang import SGLang
from policies.vllm import VLLM
from profiler.schema import OpPoint
from sim import profiles
from sim.app import CONF_DIR
from sim.engine import Simulation, delay_to
from sim.latency import Curve2D, LatencyModel, RoutingModel
from sim.run import simulate

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "splitwise_conv.csv"

WORKLOADS = {
    # the conversation trace at its own rate: overloads one replica, long uncapped outputs
    "conv": ["workload=trace", f"workload.path={TRACE}", "workload.num_requests=160"],
    # short outputs, many arrivals per completion
    "paper": ["workload=paper", "workload.num_requests=150", "workload.rate=6"],
}
POLICIES = {  # name -> overrides
    "fcfs": ["policy=fcfs"],
    "iteration": ["policy=iteration"],
    "tgi-0.3": ["policy=tgi-0.3"],  # joins on a smaller ratio: more runs cut by the join rule
    "priority": ["policy=priority"],
    "alg1": ["policy=alg1"],
    "alg1-guard": ["policy=alg1", "policy.be_max_wait_s=2.0"],  # reads the clock: no runs
    "alg1-literal": ["policy=alg1", "policy.refill_be=false", "policy.fill_be_prefill=false"],
    "layer": ["policy=layer"],
    "qllm": ["policy=qllm"],
    "qllm-in-flight": ["policy=qllm", "policy.max_in_flight=32"],
    "qllm-router": ["policy=qllm", "policy.preempt_prefill=false"],
    "qllm-merge": ["policy=qllm", "policy.merge=true"],
    "vllm": ["policy=vllm"],
    "vllm-chunked": ["policy=vllm", "policy.enable_chunked_prefill=true"],
    "vllm-priority": ["policy=vllm", "policy.scheduling_policy=priority"],
    "sglang": ["policy=sglang"],
}


# the policies whose runs fast-forward under paged memory too (``Policy.decode_run_grows``)
PAGED = ("fcfs", "priority", "vllm", "vllm-priority", "sglang")
# a KV cache of 8,000 tokens for the conversation trace: paged policies preempt every few runs
TIGHT = ["profile.kv_capacity_tokens=8000", "memory.model=paged", "memory.swap_space_gib=4"]


def run(overrides, fast_forward):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"fast_forward={fast_forward}"])
    return simulate(cfg, keep_sequences=True)  # assert_same compares every gap


def assert_same(ff, ref):
    assert ff.requests.equals(ref.requests)  # ttft, tpot, itl_max, finish, preemptions, ...
    a = {s.id: s for s in ff.result.sequences}
    for s in ref.result.sequences:  # every gap between tokens, bit for bit
        assert a[s.id].token_gaps_s.tobytes() == s.token_gaps_s.tobytes(), s.id
        assert a[s.id].generated == s.generated
    for key in ("makespan_s", "iterations", "preemptions", "peak_kv_used_tokens"):
        assert getattr(ff.result, key) == getattr(ref.result, key), key
    assert ff.summary["cluster"] == ref.summary["cluster"]  # utilisation: busy time, summed
    assert ff.timeline.equals(ref.timeline)


@pytest.mark.parametrize("memory", ["reserve", "paged"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_fast_forward_gives_every_request_the_results_of_stepping(policy, workload, memory):
    overrides = [*POLICIES[policy], *WORKLOADS[workload], "profile=h200-mixtral-bf16",
                 f"memory.model={memory}"]  # fmt: skip
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    if policy in ("layer", "qllm", "qllm-router") and memory == "reserve":
        assert ref.result.preemptions > 0  # the comparison covers runs cut by a preemption
    # the fast path must really have run (where it may), or the comparison proves nothing
    may = policy not in ("alg1-guard", "vllm-chunked") and (memory == "reserve" or policy in PAGED)
    fewer = ff.result.events < ref.result.events
    assert fewer == may, (ff.result.events, ref.result.events)


def extra_points(term: str, base) -> list:
    if term == "wake_up":
        return [OpPoint("wake_up", idle_ms=0), OpPoint("wake_up", median_ms=30.0, idle_ms=200)]
    return [replace(p, op="attn_decode_bind", median_ms=1.5 * p.median_ms,
                    p90_ms=1.5 * p.p90_ms)
            for p in base.points if p.op == "attn_decode"]  # fmt: skip


@pytest.mark.parametrize("term", ["wake_up", "attn_decode_bind"])
@pytest.mark.parametrize("policy", ["iteration", "qllm", "qllm-merge"])
def test_fast_forward_with_a_wake_up_or_a_bind_term(tmp_path, policy, term):
    """A profile with a wake-up term, at a rate that leaves the server idle between requests:
    the wake-up is charged once per idle stretch on both paths, busy time included; or with a
    cost of binding a new decode batch's KV, charged at every change of the decode batch."""
    base = profiles.load("h200-mixtral-bf16")
    path = replace(base, points=base.points + extra_points(term, base)).save(tmp_path / "p")
    overrides = [*POLICIES[policy], "workload=paper", "workload.num_requests=80",
                 "workload.rate=0.5", f"profile.path={path}"]  # fmt: skip
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    assert ff.result.events < ref.result.events
    plain = run([*overrides[:-1], "profile=h200-mixtral-bf16"], True)
    assert ff.result.makespan_s > plain.result.makespan_s  # the term was charged


@pytest.mark.parametrize("policy", ["iteration", "qllm"])
def test_fast_forward_in_a_cluster(policy):
    overrides = [*POLICIES[policy], *WORKLOADS["conv"], "profile=h200-mixtral-bf16",
                 "cluster.replicas=3", "cluster.router=least_outstanding"]  # fmt: skip
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    assert ff.result.events < ref.result.events


def test_one_vectorised_draw_is_the_single_draws_it_replaces():
    """DecodeRun relies on it: numpy's ``integers(n, size=k)`` draws what k calls of
    ``integers(n)`` draw and leaves the generator where they leave it."""
    for seed in range(20):
        one, many = np.random.default_rng(seed), np.random.default_rng(seed)
        k = 1 + seed
        singles = [int(one.integers(64)) for _ in range(k)]
        assert many.integers(64, size=k).tolist() == singles
        assert one.bit_generator.state == many.bit_generator.state


def test_attention_of_a_run_at_once_is_the_attention_of_each_iteration():
    """``Curve2D.within`` (a run's attention, vectorised) gives the floats ``Curve2D`` gives one
    point at a time: on and between grid points, below the grid and at its end, on a measured
    profile and on a grid whose steps are no powers of two (where the order of operations
    shows in the last bit)."""
    rng = np.random.default_rng(0)
    odd = []
    for b in (1, 3, 10, 50):
        times_ms = np.sort(rng.uniform(0.1, 9, 4))
        for kv, ms in zip((0, 100, 1000, 3000), times_ms, strict=True):
            odd.append(OpPoint("attn_decode", batch_size=b, kv_tokens=kv, median_ms=float(ms),
                               p90_ms=float(ms)))  # fmt: skip
    measured = LatencyModel(profiles.load("h200-mixtral-bf16", None)).attn_decode
    for curve in (measured, Curve2D(odd)):
        end = min(row.xs[-1] for row in curve.rows)
        keys = np.concatenate([np.arange(0, 3000), np.arange(end - 2000, end + 1)])
        for batch_size in (1, 2, 3, 7, 24, 32, 49, 100, 256, 300):
            at_once = curve.within(batch_size, keys)
            one_by_one = [curve(batch_size, int(k)) for k in keys]
            assert at_once.tolist() == one_by_one, batch_size


def test_delay_lands_exactly_on_the_target_time():
    """now + (t - now) can miss t (the first case below does, and no delay lands on t from
    there: the sum steps over it); ``delay_to`` never passes t, and lands on it or close
    enough that the second timeout of ``Simulation._until`` does."""
    assert 8.537615059367454e-14 + (1.546262608947606 - 8.537615059367454e-14) != 1.546262608947606
    rng = np.random.default_rng(1)
    cases = [(8.537615059367454e-14, 1.546262608947606)]
    for _ in range(2000):  # floats of few significant bits, where ties are common
        now = float(np.ldexp(rng.integers(1, 2**12), rng.integers(-70, -40)))
        cases.append((now, float(np.ldexp(rng.integers(2**52, 2**53), -52))))
    for _ in range(2000):
        now = float(rng.uniform(0, 10 ** rng.uniform(-3, 6)))
        cases.append((now, now + float(rng.exponential(10 ** rng.uniform(-4, 3)))))
    exact = 0
    for now, t in cases:
        reached = now + delay_to(now, t)
        assert reached <= t and reached + (t - reached) == t
        exact += reached == t
    assert 0 < len(cases) - exact < len(cases) / 10  # the second timeout is seldom needed


def test_a_lone_request_decodes_in_one_event():
    """Events grow with arrivals and completions: a request alone is one prefill and one run
    of 299 decode iterations, ending on the float that stepping reaches."""
    profile = linear_profile(attn_ms=1.3, expert_ms=0.37, overhead_ms=2.9)
    m = profile.model
    for seed in range(10):
        finishes = []
        for fast_forward in (True, False):
            routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=seed)
            sched = Scheduler(IterationFCFS(), kv_capacity_tokens=100_000)
            req = Request(0, "BE", 0.0, prompt_tokens=17 + seed, output_tokens=300)
            sim = Simulation([req], sched, LatencyModel(profile, routing),
                             fast_forward=fast_forward)  # fmt: skip
            result = sim.run()
            finishes.append(result.sequences[0].finish_s)
            assert result.events == (2 if fast_forward else 300)
        assert finishes[0] == finishes[1]


@pytest.mark.parametrize("hint", [True, False])
def test_a_run_that_the_next_arrival_will_end_is_planned_only_up_to_it(hint, monkeypatch):
    """vLLM with room in its batch admits every arrival at the next step, so each arrival ends
    the run in progress: planned to the end of its decoding, a run threw away most of its plan
    (fast-forward ran slower than stepping on the conversation trace). Planned up to the next
    arrival (``Policy.arrival_ends_run``), it keeps most of what it plans; the results are
    stepping's either way."""
    if not hint:
        monkeypatch.setattr(VLLM, "arrival_ends_run", Policy.arrival_ends_run)
    profile = linear_profile(attn_ms=1.3, expert_ms=0.37, overhead_ms=2.9)
    m = profile.model
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.4, 150))
    reqs = [Request(i, "LS" if i % 3 else "BE", float(t), int(rng.integers(20, 200)),
                    int(rng.integers(50, 400))) for i, t in enumerate(arrivals)]  # fmt: skip
    results = []
    for fast_forward in (True, False):
        routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=1)
        sched = Scheduler(VLLM(), kv_capacity_tokens=0, memory=PagedMemory(400_000, 16))
        sim = Simulation(reqs, sched, LatencyModel(profile, routing), fast_forward=fast_forward)
        results.append(sim.run())
        if fast_forward:
            planned, kept = sim.run_planned, sim.run_kept
    for a, b in zip(*(sorted(r.sequences, key=lambda q: q.id) for r in results), strict=True):
        assert a.finish_s == b.finish_s and a.token_gaps_s.tobytes() == b.token_gaps_s.tobytes()
    assert results[0].events < results[1].events
    if hint:
        assert planned < 1.1 * kept, (planned, kept)  # 3,077 for 3,072 kept
    else:
        assert planned > 1.8 * kept, (planned, kept)  # 6,854 for 3,091


ARRIVAL_HOOKS = {  # policy -> (its class, memory overrides)
    "iteration": (IterationFCFS, []),
    "qllm": (Algorithm1, []),
    "fcfs": (FCFS, []),
    "priority": (Priority, []),
    "priority-paged": (Priority, TIGHT),
    "vllm": (VLLM, TIGHT),
    "vllm-priority": (VLLM, TIGHT),
    "sglang": (SGLang, TIGHT),
}


@pytest.mark.parametrize("policy", list(ARRIVAL_HOOKS))
def test_a_run_goes_on_through_arrivals_that_cannot_change_the_selection(policy, monkeypatch):
    """On the overloaded trace most arrivals only join a queue that is not served before the
    run's end (``Policy.decode_run_on_arrival``): runs go on through them, with the results of
    stepping, in fewer events than when every arrival cuts the run (the default answer)."""
    klass, memory = ARRIVAL_HOOKS[policy]
    overrides = [*POLICIES[policy.removesuffix("-paged")], *WORKLOADS["conv"],
                 "profile=h200-mixtral-bf16", *memory]  # fmt: skip
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    monkeypatch.setattr(klass, "decode_run_on_arrival", Policy.decode_run_on_arrival)
    cut = run(overrides, True)
    assert_same(cut, ref)
    assert ff.result.events < 0.9 * cut.result.events, (ff.result.events, cut.result.events)


def test_a_runs_attention_from_blocks_is_the_attention_of_each_iteration():
    """``LatencyModel.decode_attention_s`` slices cached blocks of contexts: the floats of
    ``attn_decode`` point by point, across block boundaries and up to the grid's end."""
    model = LatencyModel(profiles.load("h200-mixtral-bf16", None))
    block, end = model.ATTENTION_BLOCK_TOKENS, model._decode_grid_kv
    for size in (1, 3, 32, 300):
        model.attn_decode(size, 0)  # as the run's first plan does
        for kv, n in ((0, 1), (5, 40), (block - 3, 7), (2 * block - 1, 2 * block + 5),
                      (end - 10, 11), (end, 1)):  # fmt: skip
            expected = [model.attn_decode(size, k) for k in range(kv, kv + n)]
            assert model.decode_attention_s(size, kv, n).tolist() == expected, (size, kv, n)


class DirectPicks(RoutingModel):
    """The picks drawn one call at a time when needed, and a run's picks given back by
    rewinding the generator (as before picks were drawn ahead): the reference."""

    def pick(self) -> int:
        return int(self.rng.integers(self.pool_size))

    def picks(self, k: int) -> np.ndarray:
        self._before, self._taken = self.rng.bit_generator.state, k
        return self.rng.integers(self.pool_size, size=k)

    def unpick(self, k: int) -> None:
        self.rng.bit_generator.state = self._before
        if self._taken - k:
            self.rng.integers(self.pool_size, size=self._taken - k)


@pytest.mark.parametrize("seed", range(6))
def test_picks_drawn_ahead_are_the_picks_drawn_when_needed(seed):
    """``RoutingModel`` draws its pool picks ``PICK_BLOCK`` at a time: single picks, a run's
    picks (some given back), prefill sums, pools built and fresh draws in between (which use
    the generator otherwise) see the numbers of drawing each pick when it is needed."""
    ahead, direct = (cls(32, 8, 2, seed=seed, pool_size=16) for cls in (RoutingModel, DirectPicks))
    ops = np.random.default_rng(100 + seed)
    for step in range(400):
        op = int(ops.integers(5))
        if op == 0:
            assert ahead.pick() == direct.pick(), step
        elif op == 1:  # a fast-forwarded run: k picks, the last m of them not run
            k = int(ops.integers(1, 3 * RoutingModel.PICK_BLOCK // 2))
            m = int(ops.integers(0, k + 1))
            assert ahead.picks(k).tolist() == direct.picks(k).tolist(), step
            ahead.unpick(m)
            direct.unpick(m)
        elif op == 2:  # a prefill of more tokens than a pool holds
            tokens = int(ops.integers(65, 700))
            assert (ahead.summed(tokens) == direct.summed(tokens)).all(), step
        elif op == 3:  # a pool built (nested pools: the next token count up)
            n = len(direct._pools) + 1
            if n <= RoutingModel.POOLED_MAX_TOKENS:
                assert (ahead.pool(n) == direct.pool(n)).all(), step
        else:
            assert (ahead.draw(3) == direct.draw(3)).all(), step
    ahead._sync()
    assert ahead.rng.bit_generator.state == direct.rng.bit_generator.state


def count_runs_cut_by_memory(monkeypatch) -> dict:
    """Counts the runs that ``Scheduler._blocks_run`` shortens (blocks would run out)."""
    counts = {"runs": 0, "cut": 0}
    blocks_run = Scheduler._blocks_run

    def counted(self, batch, n):
        m = blocks_run(self, batch, n)
        counts["runs"] += 1
        counts["cut"] += m < n
        return m

    monkeypatch.setattr(Scheduler, "_blocks_run", counted)
    return counts


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("policy", PAGED)
def test_paged_runs_stop_before_blocks_run_out(policy, preemption, monkeypatch):
    """Under paged memory a run goes on up to the iteration before the first whose new blocks
    would not fit; stepping preempts there (by recompute or swap) and so must the fast path,
    with the same victims, blocks and peak."""
    overrides = [*POLICIES[policy], *WORKLOADS["conv"], "profile=h200-mixtral-bf16", *TIGHT,
                 f"memory.preemption={preemption}"]  # fmt: skip
    counts = count_runs_cut_by_memory(monkeypatch)
    ff = run(overrides, True)
    ref = run(overrides, False)
    assert_same(ff, ref)
    assert ff.result.events < ref.result.events / 5, (ff.result.events, ref.result.events)
    if policy != "fcfs":  # a static batch of 32 never fills the cache
        kind = "recomputes" if preemption == "recompute" else "swaps"
        assert ref.requests[kind].sum() > 0
        assert counts["cut"] > 0, counts


@pytest.mark.parametrize("policy", ["vllm", "sglang"])
def test_paged_runs_in_a_least_kv_cluster(policy):
    """The least_kv router reads every replica's memory at each arrival: during a run it must
    see the blocks stepping has allocated by then (``Simulation.sync_run``)."""
    overrides = [*POLICIES[policy], *WORKLOADS["conv"], "profile=h200-mixtral-bf16", *TIGHT,
                 "cluster.replicas=3", "cluster.router=least_kv"]  # fmt: skip
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    assert ff.result.events < ref.result.events


def test_an_arrival_in_a_paged_run_sees_the_blocks_allocated_by_then(monkeypatch):
    """An arrival during a run is judged on the memory stepping has by then
    (``Simulation.sync_run``): judged on the run's first iteration's memory (more free), the
    head that no longer fits looks admissible and cuts the run, with the same results but more
    events. (Without the hint that plans a run only up to an arrival that would end it: with
    it, such runs end at that arrival either way.)"""
    monkeypatch.setattr(VLLM, "arrival_ends_run", Policy.arrival_ends_run)
    # a queue often empty, a cache that fills
    overrides = [*POLICIES["vllm-priority"], *WORKLOADS["conv"], "profile=h200-mixtral-bf16",
                 "memory.model=paged", "profile.kv_capacity_tokens=20000",
                 "workload.rate=2"]  # fmt: skip
    synced, ref = run(overrides, True), run(overrides, False)
    monkeypatch.setattr(Simulation, "sync_run", lambda self: None)
    unsynced = run(overrides, True)
    assert_same(synced, ref)
    assert_same(unsynced, ref)
    assert synced.result.events < unsynced.result.events


def test_try_grow_is_can_grow_then_grow():
    """``PagedMemory.try_grow`` (one count of the blocks, a decode's inlined), which both paths
    use, charges what ``can_grow`` and ``grow`` did: sequences at every phase (prefill, chunk,
    decode, evicted), block sizes that divide their tokens or not, a cache that fills up."""
    rng = np.random.default_rng(3)
    for block in (1, 3, 16):
        one, two = (PagedMemory(240, block) for _ in range(2))
        answers = set()
        seqs = [Sequence(Request(i, "BE", 0.0, int(rng.integers(1, 40)), 50)) for i in range(12)]
        for step in range(400):
            seq = seqs[int(rng.integers(len(seqs)))]
            what = int(rng.integers(4))
            if what == 0:
                seq.generated += 1
            elif what == 1:
                seq.evicted = not seq.evicted
                seq.prefilled_tokens = int(rng.integers(0, seq.request.prompt_tokens + 1))
            elif what == 2:
                seq.chunk_tokens = int(rng.integers(0, 5))
            can = one.can_grow(seq)
            if can:
                one.grow(seq)
            assert two.try_grow(seq) == can, (block, step)
            answers.add(can)
            assert (one.blocks, one.used_tokens, one.peak_used_tokens) == (
                two.blocks, two.used_tokens, two.peak_used_tokens), (block, step)  # fmt: skip
            if rng.integers(10) == 0:
                assert one.free(seq) == two.free(seq)
        assert answers == {True, False}  # the cache filled up


def sglang_decay_runs(arrival_s: float, runs_before=None, on_decodes=None, monkeypatch=None):
    """A (8 prompt + 150 out) runs alone in 200 KV tokens; B (8 + 100 out) arrives at
    ``arrival_s`` and waits for SGLang's budget (8 + 100 against 200 less A's blocks and its
    149 tokens to come x 0.7: 87.7), which only the ratio's decay (40 steps from 0.7 to
    0.098, 0.01505 a step) opens while A decodes: the selection after 12 decodes leaves
    200 - 20 - 137 x 0.5194 = 108.8 > 108 (after 11: 200 - 20 - 138 x 0.5345 = 106.2).
    Returns (fast-forward, stepping) results."""
    if runs_before is not None:
        monkeypatch.setattr(SGLang, "_runs_before", runs_before)
    if on_decodes is not None:
        monkeypatch.setattr(SGLang, "on_decodes", on_decodes)
    profile = linear_profile(attn_ms=1.3, expert_ms=0.37, overhead_ms=2.9)
    m = profile.model
    reqs = [Request(0, "BE", 0.0, 8, 150), Request(1, "BE", arrival_s, 8, 100)]
    results = []
    for fast_forward in (True, False):
        routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=1)
        sched = Scheduler(SGLang(new_token_ratio_decay_steps=40), kv_capacity_tokens=0,
                          memory=PagedMemory(200, 4, watermark=0.0))  # fmt: skip
        sim = Simulation(reqs, sched, LatencyModel(profile, routing), fast_forward=fast_forward)
        results.append(sim.run())
    return results


def same_tokens(a, b) -> bool:
    pairs = zip(*(sorted(r.sequences, key=lambda q: q.id) for r in (a, b)), strict=True)
    return all(p.finish_s == q.finish_s and p.token_gaps_s.tobytes() == q.token_gaps_s.tobytes()
               for p, q in pairs)  # fmt: skip


@pytest.mark.parametrize("arrival_s", [0.0, 0.05])
def test_sglang_runs_end_where_the_ratios_decay_admits_the_head(arrival_s, monkeypatch):
    """SGLang's ``decode_run`` bounds a run by the selection at which the waiting head could
    pass the budget as the ratio decays, and ``on_decodes`` decays the ratio by the decodes
    applied at once: fast-forward gives stepping's results, with B admitted long before A
    ends. A run that ignored the decay (no bound) admits B only when A finishes, and one
    whose ratio skipped the bulk decodes admits it later: both differ from stepping."""
    ff, ref = sglang_decay_runs(arrival_s)
    assert same_tokens(ff, ref)
    assert ff.events < ref.events
    a, b = sorted(ref.sequences, key=lambda q: q.id)
    assert b.first_token_s < a.finish_s / 5  # the decay, not A's end, let B in
    assert a.generated == 150 and len(a.token_gaps_s) == 149
    unbounded, ref2 = sglang_decay_runs(arrival_s, lambda self, s, batch, head: math.inf,
                                        monkeypatch=monkeypatch)  # fmt: skip
    assert same_tokens(ref2, ref) and not same_tokens(unbounded, ref)
    monkeypatch.undo()
    stale, _ = sglang_decay_runs(arrival_s, on_decodes=lambda self, s, batch, ends_s: None,
                                 monkeypatch=monkeypatch)  # fmt: skip
    assert not same_tokens(stale, ref)


def admit_points(per_ms: float) -> list:
    return [OpPoint("engine_admit", batch_size=k, median_ms=per_ms * k, p90_ms=per_ms * k)
            for k in (1, 32)]  # fmt: skip


def test_the_engines_admission_of_arrivals_is_charged_before_the_next_batch():
    """``engine_admit``: a lone request starts (and ends) its admission later than without the
    term; two arriving together, twice that; an arrival in the middle of a decode run delays
    the rest of the run by its admission, on both paths alike."""
    profile = linear_profile(attn_ms=1.3, expert_ms=0.37, overhead_ms=2.9)
    admitting = replace(profile, points=profile.points + admit_points(0.25))
    m = profile.model

    def finishes(prof, reqs, fast_forward=True):
        routing = RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0)
        sched = Scheduler(IterationFCFS(), kv_capacity_tokens=100_000)
        sim = Simulation(reqs, sched, LatencyModel(prof, routing), fast_forward=fast_forward)
        return [s.finish_s for s in sorted(sim.run().sequences, key=lambda s: s.id)]

    lone = [Request(0, "BE", 0.0, prompt_tokens=17, output_tokens=20)]
    assert finishes(admitting, lone)[0] - finishes(profile, lone)[0] == pytest.approx(0.25e-3)
    pair = [Request(i, "BE", 0.0, prompt_tokens=17, output_tokens=20) for i in range(2)]
    assert np.subtract(finishes(admitting, pair), finishes(profile, pair)) == pytest.approx(
        [0.5e-3, 0.5e-3])  # fmt: skip
    # the second arrives while the first decodes: one admission each, the second's delaying
    # the first's remaining iterations too
    later = [lone[0], Request(1, "BE", 0.1, prompt_tokens=17, output_tokens=5)]
    moved = np.subtract(finishes(admitting, later), finishes(profile, later))
    assert moved == pytest.approx([0.5e-3, 0.5e-3])
    assert finishes(admitting, later, False) == finishes(admitting, later, True)


@pytest.mark.parametrize("policy", ["iteration", "qllm", "vllm", "sglang"])
def test_fast_forward_with_an_admission_term(tmp_path, policy):
    """Every arrival's admission (``engine_admit``) is paid before the next iteration: an
    arrival ends a fast-forwarded run there, so both paths pay it at the same boundary."""
    base = profiles.load("h200-mixtral-bf16")
    path = replace(base, points=base.points + admit_points(0.2)).save(tmp_path / "p")
    overrides = [*POLICIES[policy], *WORKLOADS["paper"], f"profile.path={path}"]
    ff, ref = run(overrides, True), run(overrides, False)
    assert_same(ff, ref)
    assert ff.result.events < ref.result.events
    plain = run([*overrides[:-1], "profile=h200-mixtral-bf16"], True)
    first = [r.requests.sort_values("arrival_s").iloc[0] for r in (ff, plain)]
    assert first[0].ttft_s - first[1].ttft_s == pytest.approx(0.2e-3)  # the term was charged
