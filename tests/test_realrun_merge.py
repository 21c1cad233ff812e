"""The real engine executes the paper's merge (``qllm`` with ``policy.merge=true``): an LS
batch that reaches a suspended batch's cursor joins it, and every request still gets exactly
``model.generate``'s greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import greedy_setup
from test_realrun import STAGE_S, mixed_requests, policy, run_cli

from policies.core import Phase, Stage
from policies.scheduler import Scheduler
from profiler.ops import RunnerError
from realrun.clock import VirtualClock
from realrun.engine import RealEngine
from realrun.trace import ChromeTrace


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class MergeRecording(Scheduler):
    """Keeps (cursor, phases of the two batches) of every merge."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.merged: list[tuple[int, Phase, Phase]] = []

    def merge(self, partner, now):
        self.merged.append((partner.cursor, self.running.phase, partner.phase))
        return super().merge(partner, now)


@pytest.fixture(scope="module")
def f64():
    """As test_realrun's: float64, weights large enough that tokens depend on the context."""
    return greedy_setup(mixed_requests(), max_prompt_tokens=64)


def test_merged_iterations_generate_exactly_the_greedy_tokens(f64):
    runner, requests, prompts, reference = f64
    pol = policy("qllm", max_batch_size=12)
    pol.merge = True
    sched = MergeRecording(pol, kv_capacity_tokens=100_000, activation_tokens_per_token=1.0)
    trace = ChromeTrace(stages=False)
    result = RealEngine(requests, prompts, sched, runner, VirtualClock(STAGE_S), trace).run()
    assert result.tokens == reference
    assert all(s.done for s in result.sequences)
    assert sched.merges >= 3, sched.merged
    where = [runner.locate(cursor) for cursor, _, _ in sched.merged]
    assert any(ref.stage == "expert" and ref.expert > 0 for ref in where)  # mid-layer queues
    assert any(a is not b for _, a, b in sched.merged)  # a prefill joined a decode batch
    # merged iterations run each stage once for all their sequences: fewer stages than
    # one iteration per batch would take
    assert result.stages < (result.iterations + sched.merges) * runner.num_stages
    # per-iteration records: a segment ends at each merge (marked merged) and the merged
    # batch's starts there, holding both batches' shapes; the stretches add up to the stages
    merged = [s for s in result.segments if s.merged]
    assert len(merged) == sched.merges and not any(s.preempted for s in merged)
    for seg in merged:
        after = next(s for s in result.segments
                     if s.start_s == seg.end_s and s.start_cursor == seg.end_cursor)  # fmt: skip
        assert len(after.shape) > len(seg.shape)
    assert sum(s.end_cursor - s.start_cursor for s in result.segments) == result.stages
    # the trace shows every segment, the stretch before a merge too (it was left out: the
    # engine looked idle there)
    spans = [e for e in trace.events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0]
    assert [(e["ts"], e["dur"]) for e in spans] == [
        (round(s.start_s * 1e6, 3), round(s.measured_s * 1e6, 3)) for s in result.segments
    ]
    assert sum(e["name"].endswith("(merged)") for e in spans) == sched.merges


def test_the_runner_merges_only_iterations_at_the_same_boundary(f64):
    runner, _, prompts, _ = f64
    a, b = (runner.begin([runner.new_sequence(prompts[i])]) for i in (0, 1))
    runner.run(a, until=3)
    runner.run(b, until=4)
    with pytest.raises(RunnerError, match="same inner boundary"):
        runner.merge(a, b)


def test_qllm_realrun_accepts_merge_and_counts_merges(tmp_path):
    done = run_cli(tmp_path, "workload=synthetic", "workload.num_requests=6", "workload.rate=50",
                   "workload.prompt.tokens=12", "workload.output.tokens=3", "policy=qllm",
                   "policy.merge=true", "workload.ls_fraction=0.5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["executor"]["merges"] >= 0


@pytest.mark.parametrize("kinds", [("decode", "decode"), ("prefill", "decode"),
                                   ("decode", "prefill"), ("prefill", "prefill")])  # fmt: skip
@pytest.mark.parametrize("where", [(0, Stage.ATTENTION, 0), (1, Stage.ROUTER, 0),
                                   (1, Stage.EXPERT, 2)])  # fmt: skip
def test_two_iterations_merged_at_one_boundary_give_the_greedy_tokens(f64, kinds, where):
    """Two batches of two sequences each, every one in the given phase, run to one boundary
    (a layer's start, after a router, between two experts), merge, and finish as one: each
    sequence's tokens so far are ``generate``'s."""
    runner, requests, prompts, reference = f64
    ids = [r.id for r in requests if r.output_tokens >= 2][:4]
    groups = []
    for kind, pair in zip(kinds, (ids[:2], ids[2:]), strict=True):
        seqs = [runner.new_sequence(prompts[i]) for i in pair]
        if kind == "decode":
            runner.run(runner.begin(seqs))  # the prefill: the next iteration decodes
        groups.append(seqs)
    cursor = runner.flat_index(*where)
    first, second = (runner.run(runner.begin(seqs), until=cursor) for seqs in groups)
    merged = runner.run(runner.merge(first, second))
    assert merged.done and len(merged.next_tokens) == 4
    for seq, i in zip(groups[0] + groups[1], ids, strict=True):
        assert seq.generated == reference[i][: len(seq.generated)]
