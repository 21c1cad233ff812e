"""The paper's merge (``qllm`` with ``policy.merge=true``): LS work that runs while a BE batch
is suspended merges with it when it reaches the BE batch's cursor, and the two finish the
iteration as one batch, costed at the merged size from there on.

The hand-made model: 2 layers x 4 experts, every token visits every expert; attention 4 ms per
prompt, router 1 ms, an expert 2 ms + 1 ms per token, lm_head 3 ms, overhead 1 ms. A one-token
prefill's boundaries then fall at (ms)

    boundary   0  1  2  3  4   5   6   7   8   9   10  11  12  13  14
    time       0  1  5  6  9   12  15  18  22  23  26  29  32  35  38
"""

from __future__ import annotations

import pytest
from conftest import linear_profile
from test_spec_preemption import MODES, CheckingScheduler, EveryExpert, poisson

from policies import Batch, Phase, Request, Scheduler, Sequence
from policies.core import BE, LS
from policies.qllm import QLLM
from profiler.schema import OpPoint
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel

MS = 1e-3


def merge_profile():
    return linear_profile(
        num_layers=2, num_experts=4, top_k=4, attn_ms=4, router_ms=1, expert_ms=2,
        expert_per_token_ms=1, lm_head_ms=3, overhead_ms=1,
    )  # fmt: skip


class MergeChecking(CheckingScheduler):
    """Also records the cursor of every merge and checks the KV accounting after it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.merge_cursors: list[int] = []

    def merge(self, partner, now):
        assert self.running.cursor == partner.cursor
        batch = super().merge(partner, now)
        self.merge_cursors.append(batch.cursor)
        self.check_kv()
        return batch


def simulate(requests, policy, profile, mode, routing_cls=RoutingModel):
    m = profile.model
    latency = LatencyModel(profile, routing_cls(m.num_layers, m.num_experts, m.top_k, seed=3))
    sched = MergeChecking(policy, 1_000_000, activation_tokens_per_token=0.25)
    result = Simulation(requests, sched, latency, mode=mode, record_trace=True).run()
    sched.check_drained()
    return result, sched


def two_requests():
    """A one-token BE prefill at 0; a one-token LS prompt arrives at 7 ms, in expert 0 of
    layer 0: qllm suspends the BE batch after that expert, at boundary 4 (9 ms)."""
    return [Request(0, BE, 0.0, prompt_tokens=1, output_tokens=2),
            Request(1, LS, 7 * MS, prompt_tokens=1, output_tokens=2)]  # fmt: skip


@pytest.mark.parametrize("switch_ms", [0, 0.5])
@pytest.mark.parametrize("mode", MODES)
def test_ls_prefill_merges_with_the_suspended_be_batch_at_its_cursor(mode, switch_ms):
    """The LS prefill starts at 9 ms and reaches boundary 4 at 18 ms; there the two merge, and
    the BE batch's saved state is restored (the profile's context switch, as on a resume). The
    rest of the iteration runs at two tokens: experts 1-3 of layer 0 at 4 ms each (12), layer 1
    with two prompts' attention (8) + router (1) + 4 experts x 4 ms (16), lm_head 3: 40 ms, so
    both first tokens come at 58 ms + the switch. Then one decode batch of both: 1 + 2 x (4 + 1
    + 16) + 3 = 46 ms."""
    profile = merge_profile()
    profile.points += [OpPoint("preempt_switch", num_tokens=n, median_ms=switch_ms,
                               p90_ms=switch_ms) for n in (1, 4096)]  # fmt: skip
    result, sched = simulate(two_requests(), QLLM(merge=True), profile, mode, EveryExpert)
    be, ls = sorted(result.sequences, key=lambda s: s.id)
    assert sched.cursors == [4] and sched.merge_cursors == [4] and sched.merges == 1
    first_ms = 58 + switch_ms
    assert ls.first_token_s == pytest.approx(first_ms * MS, abs=1e-12)
    assert be.first_token_s == pytest.approx(first_ms * MS, abs=1e-12)
    assert be.finish_s == ls.finish_s == pytest.approx((first_ms + 46) * MS, abs=1e-12)
    assert be.generated == be.request.output_tokens and ls.generated == ls.request.output_tokens
    assert [kind for _, _, _, kind, _ in result.trace] == ["preempted", "merged", "prefill",
                                                          "decode"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_without_merge_the_be_batch_waits_for_the_whole_ls_iteration(mode):
    """merge=false (the default): the LS prefill runs its 38 ms alone (first token at 47 ms),
    then LS decode work goes before a suspended batch (Algorithm 1, step 3): the LS decode runs
    1 + 2 x (4 + 1 + 4 x 3) + 3 = 38 ms, and only then (85 ms) does the BE batch resume at
    boundary 4 for its remaining 29 ms: its first token at 114 ms."""
    for policy in (QLLM(), QLLM(merge=False)):
        result, sched = simulate(two_requests(), policy, merge_profile(), mode, EveryExpert)
        be, ls = sorted(result.sequences, key=lambda s: s.id)
        assert sched.merges == 0 and sched.merge_cursors == []
        assert ls.first_token_s == pytest.approx(47 * MS, abs=1e-12)
        assert be.first_token_s == pytest.approx(114 * MS, abs=1e-12)


def test_merge_respects_the_batch_size_cap():
    """With max_batch_size=1 the LS prefill has no room for the suspended batch: no merge."""
    result, sched = simulate(two_requests(), QLLM(merge=True, max_batch_size=1), merge_profile(),
                             "lookup", EveryExpert)  # fmt: skip
    be, ls = sorted(result.sequences, key=lambda s: s.id)
    assert sched.merges == 0
    assert be.first_token_s == pytest.approx(114 * MS, abs=1e-12)


def sched_with(policy, running, suspended):
    s = Scheduler(policy, 1_000_000)
    s.running, s.suspended = running, list(suspended)
    s._held = {b.id: 0 for b in suspended}
    return s


def prefill(*specs, cursor=0):
    seqs = [Sequence(Request(i, cls, 0.0, 4, 3)) for i, cls in specs]
    return Batch(seqs, Phase.PREFILL, cursor=cursor)


def test_partner_is_a_suspended_batch_ahead_of_an_ls_batch_with_room():
    ls = prefill((0, LS))
    behind, ahead = prefill((1, BE), cursor=0), prefill((2, BE), (3, BE), cursor=7)
    pol = QLLM(merge=True, max_batch_size=3)
    assert sched_with(pol, ls, [behind, ahead]).merge_partner() is ahead
    assert sched_with(QLLM(), ls, [ahead]).merge_partner() is None  # merge off
    assert sched_with(QLLM(merge=True, max_batch_size=2), ls, [ahead]).merge_partner() is None
    be = prefill((4, BE))  # a batch without LS work does not merge
    assert sched_with(pol, be, [ahead]).merge_partner() is None


def test_merge_happens_at_equal_cursors_only_and_joins_both_batches():
    ls, be = prefill((0, LS), cursor=5), prefill((1, BE), (2, BE), cursor=7)
    decode = Batch([Sequence(Request(3, BE, 0.0, 4, 3), generated=1)], Phase.DECODE, cursor=7)
    s = sched_with(QLLM(merge=True), ls, [be, decode])
    with pytest.raises(RuntimeError, match="equal cursors"):
        s.merge(be, 0.0)
    assert s.running is ls and s.suspended == [be, decode] and s.merges == 0
    ls.cursor = 7
    merged = s.merge(be, 0.0)
    assert s.running is merged and s.suspended == [decode] and s.merges == 1
    assert [q.id for q in merged.sequences] == [0, 1, 2]
    assert merged.cursor == 7 and merged.phase is Phase.PREFILL
    mixed = s.merge(decode, 0.0)  # a prefill and a decode batch make a mixed one
    assert mixed.phase is Phase.MIXED and [q.id for q in mixed.sequences] == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", [1, 2])
def test_merged_runs_finish_every_request_the_same_in_both_executor_modes(seed):
    """A Poisson workload with few LS jobs (so BE batches get suspended): merges happen, every
    request produces all its tokens, KV accounting holds after every call (MergeChecking), and
    the one-timeout path gives the per-request times of the stage-by-stage path."""
    profile = linear_profile(num_layers=4, num_experts=8, attn_ms=3, expert_ms=1)
    runs = {}
    for mode in MODES:
        result, sched = simulate(poisson(200, 6, seed, ls_fraction=0.1), QLLM(merge=True),
                                 profile, mode)  # fmt: skip
        assert sched.merges >= 3
        assert set(sched.merge_cursors) <= set(sched.cursors)  # where a batch was suspended
        for q in result.sequences:
            assert q.generated == q.request.output_tokens and q.finish_s is not None
        runs[mode] = sorted((q.id, q.first_token_s, q.finish_s) for q in result.sequences)
    for (i, first_a, fin_a), (j, first_b, fin_b) in zip(runs["lookup"], runs["step"], strict=True):
        assert i == j
        assert first_a == pytest.approx(first_b, rel=1e-9)
        assert fin_a == pytest.approx(fin_b, rel=1e-9)
