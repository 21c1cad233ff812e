"""Policies modelled on today's engines (vllm, sglang) and QLLM's BE eviction for LS work."""

from __future__ import annotations

import pytest
from conftest import ids, linear_profile, step

from policies import BE, Phase, Request, Scheduler
from policies.memory import PagedMemory
from policies.qllm import QLLM
from policies.sglang import SGLang
from policies.vllm import VLLM
from sim.latency import LatencyModel, RoutingModel


def req(i, cls="BE", prompt=4, out=10, t=0.0):
    return Request(i, cls, t, prompt, out)


def paged(capacity, block=4):
    return PagedMemory(capacity, block_size_tokens=block, watermark=0.0)


# ------------------------------------------------------------------------------------- vllm
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_vllm_40004_a_waiting_ls_request_waits_while_max_num_seqs_be_requests_run(policy):
    """vLLM issue #40004: priority orders the waiting queue, but a waiting request never
    displaces a running one; the LS request waits for a BE request to finish."""
    s = Scheduler(VLLM(max_num_seqs=2, scheduling_policy=policy), kv_capacity_tokens=10_000)
    be = [s.arrive(req(0, out=6), 0), s.arrive(req(1, out=8), 0)]
    assert ids(step(s)) == [0, 1]
    ls = s.arrive(req(2, "LS", t=0.5), 0.5)
    while not be[0].done:
        batch = step(s)
        assert ids(batch) == [0, 1] and ls.scheduled_s is None
    batch = step(s)  # one step: the running BE request's decode and the LS prefill
    assert ids(batch) == [1, 2] and batch.phase is Phase.MIXED


def test_vllm_priority_admits_ls_before_earlier_be():
    s = Scheduler(VLLM(max_num_seqs=1, scheduling_policy="priority"), kv_capacity_tokens=10_000)
    s.arrive(req(0), 0)
    s.arrive(req(1, "LS", t=0.1), 0.1)
    assert ids(step(s)) == [1]
    fcfs = Scheduler(VLLM(max_num_seqs=1), kv_capacity_tokens=10_000)
    fcfs.arrive(req(0), 0)
    fcfs.arrive(req(1, "LS", t=0.1), 0.1)
    assert ids(step(fcfs)) == [0]


def _vllm_growth_shortage(policy):
    """BE 0, BE 1, then LS 2 admitted together (1 block each of 5); the next decode needs 3
    more blocks and gets 2: one sequence is preempted by recompute."""
    s = Scheduler(VLLM(scheduling_policy=policy), kv_capacity_tokens=20, memory=paged(20))
    seqs = [s.arrive(req(0), 0), s.arrive(req(1, t=0.1), 0.1), s.arrive(req(2, "LS", t=0.2), 0.2)]
    assert step(s).phase is Phase.PREFILL
    step(s)
    return s, seqs


def test_vllm_priority_preempts_the_lowest_priority_latest_arrival():
    s, (be0, be1, ls2) = _vllm_growth_shortage("priority")
    assert (be0.recomputes, be1.recomputes, ls2.recomputes) == (0, 1, 0)
    assert list(s.waiting["BE"]) == [be1] and be1.generated == 1


def test_vllm_fcfs_preempts_the_last_admitted():
    s, (be0, be1, ls2) = _vllm_growth_shortage("fcfs")
    assert (be0.recomputes, be1.recomputes, ls2.recomputes) == (0, 0, 1)
    assert list(s.waiting["LS"]) == [ls2]


def test_vllm_fcfs_requeues_the_latest_preempted_first_across_classes():
    """V1's fcfs ``prepend_request`` puts each preempted request at the queue's front: the
    latest preempted comes first, whatever its arrival or class (until 2026-12-05 preempted
    requests were ordered by arrival: LS 0 before BE 2 here)."""
    s = Scheduler(VLLM(), kv_capacity_tokens=10_000)
    ls0, _, be2 = (s.arrive(req(0, "LS"), 0), s.arrive(req(1, t=0.1), 0.1),
                   s.arrive(req(2, t=0.2), 0.2))  # fmt: skip
    assert ids(step(s)) == [0, 1, 2]
    for q in (ls0, be2):  # preempted in this order (by hand, as Scheduler._grow does)
        s.ready[q.cls].remove(q)
        s.evict(q)
    be3 = s.arrive(req(3, t=0.3), 0.3)
    assert [q.id for q in s.policy._waiting(s)] == [2, 0, 3]
    batch = s.next_batch(0.3)  # be1's decode, then the waiting requests in that order
    assert ids(batch) == [1, 2, 0, 3] and be3.scheduled_s is not None


def test_vllm_admits_nothing_in_a_step_that_preempted_and_again_in_the_next():
    """V1's ``if not preempted_reqs`` is local to one schedule() call: the step that preempts
    admits nothing, the next one may (until 2026-12-04 the next one admitted nothing too)."""
    s = Scheduler(VLLM(scheduling_policy="priority"), kv_capacity_tokens=24, memory=paged(24))
    s.arrive(req(0, out=12), 0)
    s.arrive(req(1, out=12, t=0.1), 0)
    step(s)  # two sequences grow to outgrow 6 blocks of 4: stop one step before
    while sum(s.memory.grow_tokens(q) for q in s.ready[BE]) <= 24 - s.kv_used_tokens:
        step(s)
    ls = s.arrive(req(2, "LS", prompt=1, out=1, t=1), 1)  # it fits once BE 1 is preempted
    batch = s.next_batch(1)  # this step preempts BE 1 (the later arrival) and admits nothing
    assert s.recomputes == 1 and ids(batch) == [0] and ls.scheduled_s is None
    s.complete_iteration(1)
    assert ids(s.next_batch(2)) == [0, 2]  # the next step admits it, beside BE 0's decode


@pytest.mark.parametrize("chunked", [False, True])
def test_vllm_grows_the_running_requests_before_it_admits(chunked):
    """V1 allocates the running requests' blocks first: an LS arrival that would take the two
    blocks that two running BE requests need in this step waits, rather than being admitted
    and a BE request preempted for it."""
    s = Scheduler(VLLM(scheduling_policy="priority", enable_chunked_prefill=chunked),
                  kv_capacity_tokens=24, memory=paged(24))  # fmt: skip
    be = [s.arrive(req(0, out=20), 0), s.arrive(req(1, out=20), 0)]
    while be[0].generated < 5:
        step(s)
    assert s.kv_used_tokens == 16  # 2 blocks each of 6; the next decode needs a third each
    ls = s.arrive(req(2, "LS", prompt=1, out=1, t=1), 1)
    batch = s.next_batch(1)
    assert ids(batch) == [0, 1] and ls.scheduled_s is None
    assert s.recomputes == 0 and s.kv_used_tokens == 24


def test_vllm_options_are_checked_by_name():
    with pytest.raises(ValueError, match="^scheduling_policy=lifo: must be one of fcfs, prio"):
        VLLM(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="^max_num_batched_tokens=0: must be an integer >= 1"):
        VLLM(max_num_batched_tokens=0)


# ----------------------------------------------------------------------------------- sglang
def test_sglang_ls_preempts_running_be_above_the_threshold():
    s = Scheduler(SGLang(max_batch_size=2), kv_capacity_tokens=10_000)
    be = [s.arrive(req(0, out=20), 0), s.arrive(req(1, out=20, t=0.1), 0)]
    step(s)
    s.arrive(req(2, "LS", t=0.5), 0.5)
    batch = step(s)
    assert ids(batch) == [2]  # the slot of the latest BE arrival was freed
    assert [q.recomputes for q in be] == [0, 1] and list(s.waiting["BE"]) == [be[1]]


def test_sglang_threshold_is_strict_and_can_turn_preemption_off():
    for kwargs in ({"priority_scheduling_preemption_threshold": 100},
                   {"enable_priority_preemption": False}):  # fmt: skip
        s = Scheduler(SGLang(max_batch_size=2, **kwargs), kv_capacity_tokens=10_000)
        s.arrive(req(0, out=20), 0)
        s.arrive(req(1, out=20), 0)
        step(s)
        s.arrive(req(2, "LS", t=0.5), 0.5)
        assert ids(step(s)) == [0, 1] and s.recomputes == 0  # LS (100) - BE (0) is not > 100


def test_sglang_preempts_for_a_slot_never_for_kv_room_alone():
    """As SGLang's get_new_batch_prefill: a free slot but no KV room stops admission (NO_TOKEN)
    and preempts nobody; a full batch preempts lower-priority requests until the LS request
    fits the budget, or none. preempt_to_schedule credits a victim its budget charge, not the
    KV it holds, so a request larger than the free KV never gets in by preempting."""
    s = Scheduler(SGLang(), kv_capacity_tokens=64, memory=paged(64))
    # 3 BE prompts of 8, 4 out: each charged 8 + 4 (12 < 64 - 12, then 12 < 64 - 24): 6 blocks
    be = [s.arrive(req(i, prompt=8, out=4, t=0.1 * i), 0) for i in range(3)]
    assert ids(step(s)) == [0, 1, 2]
    s.arrive(req(3, "LS", prompt=44, out=4, t=1), 1)  # 24 + 44 > 64, a slot free
    assert step(s).phase is Phase.DECODE and s.recomputes == 0

    def full(ls_prompt):
        full = Scheduler(SGLang(max_batch_size=3), kv_capacity_tokens=64, memory=paged(64))
        be = [full.arrive(req(i, prompt=8, out=4, t=0.1 * i), 0) for i in range(3)]
        step(full)  # 24 of 64 in use; each BE charged min(4 - 1, 4096) x 0.7 = 2.1
        full.arrive(req(3, "LS", prompt=ls_prompt, out=4, t=1), 1)
        return full, be, full.next_batch(1)

    # LS 20 + 4 - (40 - 6.3) = -9.7 <= 0: one victim for the slot (the latest BE arrival), then
    # 24 < (40 + 8) - 4.2 admits it
    _, be, batch = full(20)
    assert ids(batch) == [3] and [q.recomputes for q in be] == [0, 0, 1]
    # LS 44 + 4 - (40 - 6.3) = 14.3, less 2.1 per BE: 8.0 > 0 with all three, so none goes
    s1, be, batch = full(44)
    assert batch.phase is Phase.DECODE and s1.recomputes == 0
    s2 = Scheduler(SGLang(max_batch_size=3), kv_capacity_tokens=64, memory=paged(64))
    for i in range(3):
        s2.arrive(req(i, "LS", prompt=8, out=4), 0)
    step(s2)
    s2.arrive(req(3, "LS", prompt=20, out=4, t=1), 1)  # no lower priority to preempt
    assert step(s2).phase is Phase.DECODE and s2.recomputes == 0


def test_sglang_retracts_fewest_generated_then_longest_prompt():
    # prompts only charged (clip 0), so that B and C are admitted and the cache runs out
    s = Scheduler(SGLang(clip_max_new_tokens_estimation=0), kv_capacity_tokens=24,
                  memory=paged(24))  # fmt: skip
    a = s.arrive(req(0, prompt=4, out=20), 0)
    step(s)
    step(s)
    step(s)  # A: 3 tokens generated, 2 blocks
    b = s.arrive(req(1, prompt=8, out=10, t=0.1), 0.1)
    c = s.arrive(req(2, prompt=4, out=10, t=0.2), 0.2)
    assert ids(step(s)) == [1, 2]  # prefill first: 5 blocks of 6 in use
    step(s)  # A needs none, B its third block, C a second: 7 > 6, retract one
    assert (a.recomputes, b.recomputes, c.recomputes) == (0, 1, 0)


def test_sglang_forgets_a_retracted_request_once_it_finishes():
    """The retraction above notes B's re-queue (its place in the waiting queue); when B has
    finished the note goes, so a long run does not keep one per request ever retracted."""
    policy = SGLang(clip_max_new_tokens_estimation=0)
    s = Scheduler(policy, kv_capacity_tokens=24, memory=paged(24))
    s.arrive(req(0, prompt=4, out=20), 0)
    for _ in range(3):
        step(s)
    b = s.arrive(req(1, prompt=8, out=10, t=0.1), 0.1)
    s.arrive(req(2, prompt=4, out=10, t=0.2), 0.2)
    step(s)
    step(s)
    assert b.recomputes == 1 and b.id in policy._entries
    t = 1.0
    while not b.done:
        step(s, t)
        t += 1
    assert b.id not in policy._entries


@pytest.mark.parametrize(("clip", "admitted"), [(4096, False), (30, True), (0, True)])
def test_sglang_budget_refuses_what_the_prompts_kv_alone_would_admit(clip, admitted):
    """PrefillAdder.add_one_req: A (8 + 150 out) runs in 200 tokens; B (8 + 100 out) is
    refused, though its 8 prompt tokens fit: 108 >= 200 - 8 - 149 x 0.7 = 87.7. Outputs
    clipped at 30: 8 + 30 < 192 - 30 x 0.7 = 171, admitted; prompts only (clip 0): 8 < 192."""
    s = Scheduler(SGLang(clip_max_new_tokens_estimation=clip), kv_capacity_tokens=200,
                  memory=paged(200))  # fmt: skip
    s.arrive(req(0, prompt=8, out=150), 0)
    step(s)  # A alone: 2 blocks
    s.arrive(req(1, prompt=8, out=100, t=0.1), 0.1)
    assert (ids(step(s, 0.1)) == [1]) is admitted


def test_sglang_new_token_ratio_decays_per_decode_step_to_its_floor_and_resets_when_idle():
    """update_running_batch: 0.7 lowers by (0.7 - 0.7 x 0.14) / 4 = 0.1505 a decode step (decay
    steps 4), not at a prefill, to 0.098 and no lower; self_check_during_idle puts 0.7 back."""
    policy = SGLang(new_token_ratio_decay_steps=4)
    s = Scheduler(policy, kv_capacity_tokens=1000)
    s.arrive(req(0, prompt=4, out=7), 0)
    ratios = []
    for _ in range(7):  # the prefill, then 6 decodes (the last finishes the request)
        step(s)
        ratios.append(policy.new_token_ratio)
    assert ratios == pytest.approx([0.7, 0.5495, 0.399, 0.2485, 0.098, 0.098, 0.098])
    assert s.next_batch(1) is None and policy.new_token_ratio == 0.7  # idle


def test_sglang_the_decay_lets_a_refused_request_in():
    """A (8 + 150 out) runs in 200 tokens, B (8 + 100 out) waits (108 >= 87.7, test above).
    With decay steps 10 (0.0602 a step), the selection after k decodes leaves 200 - A's
    ceil((8 + k) / 4) blocks - (149 - k) x (0.7 - 0.0602 k): 93.3, 102.8, then 112.2 > 108 at
    k = 3. With no decay (floor = initial ratio) A's blocks grow faster than its charge falls:
    84.4, 85.1, ... 82.7 after 10 decodes, all < 108."""
    s = Scheduler(SGLang(new_token_ratio_decay_steps=10), kv_capacity_tokens=200,
                  memory=paged(200))  # fmt: skip
    s.arrive(req(0, prompt=8, out=150), 0)
    step(s)
    s.arrive(req(1, prompt=8, out=100), 0)
    assert [step(s).phase for _ in range(4)] == [Phase.DECODE] * 3 + [Phase.PREFILL]
    fixed = Scheduler(SGLang(min_new_token_ratio_factor=1.0), kv_capacity_tokens=200,
                      memory=paged(200))  # fmt: skip
    fixed.arrive(req(0, prompt=8, out=150), 0)
    step(fixed)
    fixed.arrive(req(1, prompt=8, out=100), 0)
    assert [step(fixed).phase for _ in range(10)] == [Phase.DECODE] * 10


def test_sglang_a_retraction_sets_the_ratio_from_the_requests_left():
    """retract_decode, prompts only charged (clip 0) in 12 blocks: A (4 + 40 out) has 3 tokens
    and 2 blocks; B (24) and C (12) are admitted (24 < 40, 12 < 40 - 24), D (8) is not
    (8 >= 4). The next decode needs A none, B a 7th block, C a 4th: 13 > 12, B (1 generated,
    longest prompt) is retracted. The ratio becomes, over A and C, (3 + 1 + 20 x 2) /
    (40 + 10 + 1) = 44/51, not a decay of the old one; the next decode lowers it one step.
    B re-queues behind D, which was waiting (_add_request_to_queue: a new entry time), so D
    is admitted first."""
    policy = SGLang(clip_max_new_tokens_estimation=0)
    s = Scheduler(policy, kv_capacity_tokens=48, memory=paged(48))
    a = s.arrive(req(0, prompt=4, out=40), 0)
    for _ in range(3):
        step(s)
    b = s.arrive(req(1, prompt=24, out=10, t=0.1), 0.1)
    c = s.arrive(req(2, prompt=12, out=10, t=0.2), 0.2)
    d = s.arrive(req(3, prompt=8, out=10, t=0.3), 0.3)
    assert ids(step(s)) == [1, 2]
    assert ids(step(s)) == [0, 2] and b.recomputes == 1
    assert policy.new_token_ratio == 44 / 51
    assert list(s.waiting["BE"]) == [d, b]
    assert ids(step(s)) == [3]  # D first (8 < 48 - 24); B, 24 + 1 to recompute, waits
    assert policy.new_token_ratio == 44 / 51  # a prefill: no decay
    assert step(s).phase is Phase.DECODE  # B: 25 >= 48 - 32
    assert policy.new_token_ratio == 44 / 51 - (0.7 - 0.7 * 0.14) / 600
    assert (a.recomputes, c.recomputes, d.recomputes) == (0, 0, 0)


def test_sglang_a_request_alone_is_admitted_whatever_the_budget():
    """8 + 32 >= 40 free on an empty server would be refused forever (SGLang waits); alone, it
    is admitted since its KV fits, and leaves 40 - (8 + 32) = 0: admission stops there."""
    s = Scheduler(SGLang(), kv_capacity_tokens=40, memory=paged(40))
    s.arrive(req(0, prompt=8, out=32), 0)
    s.arrive(req(1, prompt=4, out=4), 0)
    assert ids(step(s)) == [0]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("schedule_conservativeness", -0.5, "a number >= 0"),
        ("schedule_conservativeness", True, "a number >= 0"),
        ("init_new_token_ratio", "0.7", "a number >= 0"),
        ("min_new_token_ratio_factor", float("nan"), "a number >= 0"),
        ("new_token_ratio_decay_steps", 0, "an integer >= 1"),
        ("new_token_ratio_decay_steps", 2.5, "an integer >= 1"),
        ("retract_decode_steps", -1, "an integer >= 0"),
        ("clip_max_new_tokens_estimation", -1, "an integer >= 0"),
    ],
)
def test_sglang_budget_options_are_checked(key, value, expected):
    with pytest.raises(ValueError, match=f"^{key}={value}: must be {expected}$"):
        SGLang(**{key: value})


def test_sglang_ratio_settings_follow_sglangs_formulas():
    """init = min(0.7 x conservativeness, 1), floor = min(init x 0.14, 1), step = (init -
    floor) / decay steps."""
    default = SGLang()
    assert (default.init_ratio, default.min_ratio) == (0.7, 0.7 * 0.14)
    assert default.ratio_step == (0.7 - 0.7 * 0.14) / 600
    cautious = SGLang(schedule_conservativeness=2.0)
    assert (cautious.init_ratio, cautious.min_ratio) == (1.0, 0.14)
    assert cautious.new_token_ratio == 1.0


# ------------------------------------------------------------------ qllm evicts BE for LS
def _be_holds_the_memory(evict):
    s = Scheduler(QLLM(evict_be_for_ls=evict), kv_capacity_tokens=40, memory=paged(40))
    be = s.arrive(req(0, prompt=24, out=10), 0)
    step(s)
    ls = s.arrive(req(1, "LS", prompt=20, out=2, t=1), 1)  # 24 + 20 > 40
    return s, be, ls


def test_qllm_evicts_be_kv_to_admit_ls_work():
    s, be, ls = _be_holds_the_memory(evict=True)
    batch = s.next_batch(1)
    assert ids(batch) == [1] and be.recomputes == 1 and list(s.waiting["BE"]) == [be]


def test_qllm_without_eviction_keeps_ls_waiting_for_memory():
    s, be, ls = _be_holds_the_memory(evict=False)
    batch = s.next_batch(1)
    assert ids(batch) == [0] and be.recomputes == 0 and ls.scheduled_s is None


@pytest.mark.parametrize("evict", [True, False])
def test_qllm_preempts_for_ls_when_evicting_other_be_kv_makes_room(evict):
    """A BE prefill runs while another BE job holds KV; an LS job that fits only without that
    KV preempts the prefill (with eviction), and the decode-ready BE job's KV is evicted, not
    the suspended batch's."""
    s = Scheduler(QLLM(max_batch_size=2, evict_be_for_ls=evict), 48, memory=paged(48))
    be0 = s.arrive(req(0, prompt=16, out=10), 0)
    step(s)
    s.arrive(req(1, prompt=16, out=10), 0)
    running = s.next_batch(0)
    assert ids(running) == [1] and s.kv_used_tokens == 32
    s.arrive(req(2, "LS", prompt=20, out=2, t=1), 1)  # 32 + 20 > 48
    assert s.should_preempt(1) is evict
    if evict:
        s.preempt(1)
        assert ids(s.next_batch(1)) == [2]
        assert be0.recomputes == 1 and s.suspended == [running]


# ------------------------------------------------------------- vllm with chunked prefill
def chunked(**kwargs):
    return VLLM(enable_chunked_prefill=True, **kwargs)


def test_chunked_prefill_splits_a_prompt_and_mixes_it_with_decodes():
    s = Scheduler(chunked(max_num_batched_tokens=10), kv_capacity_tokens=10_000)
    be = s.arrive(req(0, prompt=4, out=8), 0)
    step(s)
    ls = s.arrive(req(1, "LS", prompt=25, out=3), 0)
    chunks = []
    while ls.first_token_s is None:
        batch = s.next_batch(1)
        assert batch.phase is Phase.MIXED and be in batch.sequences  # decodes never wait
        chunks.append((ls.new_tokens, ls.context_tokens))
        s.complete_iteration(1)
    assert chunks == [(9, 0), (9, 9), (7, 18)]  # the budget less one decode token
    assert ls.generated == 1 and be.generated == 4
    batch = s.next_batch(2)
    assert [q.new_tokens for q in batch.sequences] == [1, 1] and ls.context_tokens == 25


def test_chunked_prefill_runs_running_requests_first_then_waiting_ones():
    s = Scheduler(chunked(max_num_batched_tokens=8), kv_capacity_tokens=10_000)
    a = s.arrive(req(0, prompt=12), 0)
    batch = s.next_batch(0)
    assert [q.new_tokens for q in batch.sequences] == [8]
    s.complete_iteration(0)
    b = s.arrive(req(1, prompt=5), 0)
    batch = s.next_batch(0)  # a's last 4 prompt tokens, then 4 of b's 5
    assert [(q.id, q.new_tokens) for q in batch.sequences] == [(0, 4), (1, 4)]
    s.complete_iteration(0)
    assert a.generated == 1 and b.generated == 0 and list(s.prefilling) == [b]


def test_chunks_allocate_blocks_as_they_land():
    memory = paged(64, block=4)
    s = Scheduler(chunked(max_num_batched_tokens=6), kv_capacity_tokens=64, memory=memory)
    s.arrive(req(0, prompt=14, out=2), 0)
    step(s)
    assert memory.blocks == {0: 2}  # 6 tokens
    step(s)
    assert memory.blocks == {0: 3}  # 12 tokens
    step(s)
    assert memory.blocks == {0: 4}  # 14 tokens, and its first token


def test_a_mixed_iteration_is_costed_by_its_prefill_chunks_and_decodes():
    latency = LatencyModel(linear_profile(num_layers=2, num_experts=4, attn_ms=1.0),
                           RoutingModel(2, 4, 2))  # fmt: skip
    s = Scheduler(chunked(max_num_batched_tokens=10), kv_capacity_tokens=10_000)
    s.arrive(req(0, prompt=4, out=8), 0)
    s.arrive(req(1, prompt=3, out=8), 0)
    step(s)
    s.arrive(req(2, "LS", prompt=25), 0)
    batch = s.next_batch(0)
    plan = latency.plan(batch)
    assert batch.new_tokens == 10  # two decode tokens and an 8-token chunk
    assert plan.expert_tokens.sum() == 10 * 2 * 2  # tokens x top_k x layers
    # attention: one prefill chunk (1 ms) plus one decode attention of two sequences (1 ms)
    assert plan.attention_s == pytest.approx(2e-3)
