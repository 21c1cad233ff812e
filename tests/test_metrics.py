"""The metrics on ten hand-made requests whose token times are known, every expected value
worked out by hand from the definitions (README, "Outputs"); and both executors record the gap
before every token.

The requests (times in s; every gap is a multiple of 0.25, exact in float32; prompt = 10 + id):

    id cls arrival token times                 output  preempted
     1 LS  0.0     0.5 1.0 1.5 2.0              4
     2 LS  1.0     1.75 2.75 3.25               3       1
     3 LS  2.0     4.0 4.25                     2
     4 LS  3.0     3.5                          1
     5 LS  5.0     5.25 5.5                     4 (unfinished)
     6 BE  0.5     2.5 3.5 4.5 6.5              4       2
     7 BE  1.5     3.0 6.0                      2       1
     8 BE  2.5     7.0 7.25 7.5 7.75 8.0        5
     9 BE  4.0     -                            3 (unfinished)
    10 BE  4.5     8.5                          1

Each was scheduled 0.25 s before its first token, so a TTFT measured from scheduling instead of
arrival shows.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import linear_profile

from policies import BE, LS, Request, Scheduler
from policies.core import Sequence
from policies.iteration import IterationFCFS
from policies.qllm import QLLM
from profiler.models import build_model
from profiler.ops import ModelRunner
from realrun.clock import VirtualClock
from realrun.engine import RealEngine
from realrun.prompts import build_prompts
from sim.engine import Simulation
from sim.latency import LatencyModel, RoutingModel
from sim.metrics import outputs

MAKESPAN_S = 10.0
ROWS = [  # id, cls, arrival_s, token times, output tokens, preemptions
    (1, LS, 0.0, [0.5, 1.0, 1.5, 2.0], 4, 0),
    (2, LS, 1.0, [1.75, 2.75, 3.25], 3, 1),
    (3, LS, 2.0, [4.0, 4.25], 2, 0),
    (4, LS, 3.0, [3.5], 1, 0),
    (5, LS, 5.0, [5.25, 5.5], 4, 0),
    (6, BE, 0.5, [2.5, 3.5, 4.5, 6.5], 4, 2),
    (7, BE, 1.5, [3.0, 6.0], 2, 1),
    (8, BE, 2.5, [7.0, 7.25, 7.5, 7.75, 8.0], 5, 0),
    (9, BE, 4.0, [], 3, 0),
    (10, BE, 4.5, [8.5], 1, 0),
]
NAN = math.nan


def slo(ls_ttft_s=1.0, be_ttft_s=None, ls_tpot_s=None, be_tpot_s=None):
    return SimpleNamespace(ls_ttft_s=ls_ttft_s, be_ttft_s=be_ttft_s, ls_tpot_s=ls_tpot_s,
                           be_tpot_s=be_tpot_s)  # fmt: skip


def hand_made(rows=ROWS) -> list[Sequence]:
    """Sequences in the state the scheduler leaves them in, token by token."""
    seqs = []
    for rid, cls, arrival, times, output, preemptions in rows:
        s = Sequence(Request(rid, cls, arrival, 10 + rid, output), preemptions=preemptions)
        for t in times:
            s.generated += 1
            s.record_token(t)
            if s.first_token_s is None:
                s.first_token_s, s.scheduled_s = t, t - 0.25
        if s.done:
            s.finish_s = times[-1]
        seqs.append(s)
    return seqs


def summary(**kw) -> dict:
    return outputs(hand_made(), MAKESPAN_S, events=0, wall_s=0.0, slo=slo(**kw))[1]


def expect_stats(got: dict, mean, std, p50, p90, p95, p99, max_) -> None:
    want = {"mean": mean, "std": std, "p50": p50, "p90": p90, "p95": p95, "p99": p99,
            "max": max_}  # fmt: skip
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_per_request_columns():
    df = outputs(hand_made(), MAKESPAN_S, 0, 0.0, slo())[0].set_index("id")
    assert df["ttft_s"].tolist() == pytest.approx(
        [0.5, 0.75, 2.0, 0.5, 0.25, 2.0, 1.5, 4.5, NAN, 4.0], nan_ok=True)  # fmt: skip
    assert df["turnaround_s"].tolist() == pytest.approx(
        [2.0, 2.25, 2.25, 0.5, NAN, 6.0, 4.5, 5.5, NAN, 4.0], nan_ok=True)  # fmt: skip
    # TPOT = (finish - first token) / (output tokens - 1): e.g. id 1: 1.5 / 3, id 8: 1.0 / 4
    assert df["tpot_s"].tolist() == pytest.approx(
        [0.5, 0.75, 0.25, NAN, NAN, 4 / 3, 3.0, 0.25, NAN, NAN], nan_ok=True)  # fmt: skip
    assert df["itl_max_s"].tolist() == pytest.approx(
        [0.5, 1.0, 0.25, NAN, NAN, 2.0, 3.0, 0.25, NAN, NAN], nan_ok=True)  # fmt: skip
    assert df["preemptions"].tolist() == [0, 1, 0, 0, 0, 2, 1, 0, 0, 0]


def test_ttft_is_from_arrival_with_numpy_percentiles_and_population_std():
    ls = summary()["classes"][LS]["ttft_s"]
    # TTFTs 0.25 0.5 0.5 0.75 2.0 (id 5 has a first token, unfinished or not); mean 4 / 5;
    # linear percentile p at rank (n - 1) p / 100 = 4 p / 100: p90 at 3.6 = 0.75 + 0.6 x 1.25
    # std with ddof=0 (numpy's and vLLM's): sqrt(sum of squared deviations 1.925 / 5)
    expect_stats(ls, 0.8, math.sqrt(1.925 / 5), 0.5, 1.5, 1.75, 1.95, 2.0)
    # the hand figures are numpy's default ("linear") percentiles
    linear = np.percentile([0.25, 0.5, 0.5, 0.75, 2.0], [90, 95, 99])
    assert linear == pytest.approx([1.5, 1.75, 1.95])


def test_tpot_is_a_per_request_figure_and_itl_every_gap():
    s = summary()["classes"]
    # LS TPOTs of finished multi-token requests: 0.5 0.75 0.25
    expect_stats(s[LS]["tpot_s"], 0.5, math.sqrt(0.125 / 3), 0.5, 0.7, 0.725, 0.745, 0.75)
    # LS gaps of finished requests: 0.5 0.5 0.5 | 1.0 0.5 | 0.25 (id 5's 0.25 is unfinished)
    # sorted 0.25 0.5 0.5 0.5 0.5 1.0: rank 5 p / 100, p90 at 4.5 = 0.5 + 0.5 x 0.5
    expect_stats(s[LS]["itl_s"], 13 / 24, math.sqrt(2.0625 / 6 - (13 / 24) ** 2),
                 0.5, 0.75, 0.875, 0.975, 1.0)  # fmt: skip
    # BE gaps: 1 1 2 | 3 | 0.25 x 4; sorted 0.25 x 4, 1, 1, 2, 3 (sum 8, squares 15.25)
    expect_stats(s[BE]["itl_s"], 1.0, math.sqrt(15.25 / 8 - 1.0), 0.625, 2.3, 2.65, 2.93, 3.0)
    # all: the 14 gaps of both classes; mean (3.25 + 8) / 14
    assert s["all"]["itl_s"]["mean"] == pytest.approx(11.25 / 14)
    assert s["all"]["itl_s"]["max"] == 3.0
    assert s["all"]["tpot_s"]["mean"] == pytest.approx((1.5 + 4 / 3 + 3.25) / 6)
    # turnaround (vLLM's E2EL) of finished requests: LS 2.0 2.25 2.25 0.5
    assert s[LS]["turnaround_s"]["mean"] == pytest.approx(7.0 / 4)
    assert s[BE]["turnaround_s"]["p50"] == pytest.approx((4.5 + 5.5) / 2)  # of 4.0 4.5 5.5 6.0


def test_slo_attainment_is_null_without_an_slo_and_all_counts_only_classes_with_one():
    s = summary()["classes"]  # LS TTFT SLO 1 s; BE none
    # LS met: ids 1, 2, 4; id 3 is late (2 s); id 5 did not finish (its first token was on time)
    assert s[LS]["slo_attainment"] == pytest.approx(3 / 5)
    assert s[BE]["slo_attainment"] is None
    assert s["all"]["slo_attainment"] == pytest.approx(3 / 5)  # BE's 5 requests left out
    assert s[LS]["goodput"] == pytest.approx(3 / 5)  # no TPOT SLO: goodput = TTFT attainment
    assert s[BE]["goodput"] is None and s["all"]["goodput"] == pytest.approx(3 / 5)
    # a BE SLO of 2 s: ids 6 (2.0, on the line) and 7 met, 8 and 10 late, 9 unfinished
    s = summary(be_ttft_s=2.0)["classes"]
    assert s[BE]["slo_attainment"] == pytest.approx(2 / 5)
    assert s["all"]["slo_attainment"] == pytest.approx((3 + 2) / 10)


def test_goodput_needs_every_slo_that_is_set():
    s = summary(ls_tpot_s=0.5, be_tpot_s=1.5)
    c = s["classes"]
    # LS: id 1 (TPOT 0.5 on the line) and id 4 (one token: no TPOT to miss) are good; id 2's
    # TPOT 0.75 is over; id 3 is late; id 5 unfinished
    assert c[LS]["goodput"] == pytest.approx(2 / 5)
    assert c[LS]["slo_attainment"] == pytest.approx(3 / 5)  # attainment is TTFT only
    # BE has only a TPOT SLO: ids 6 (4/3) and 8 (0.25) and 10 (one token) good, 7 (3.0) not
    assert c[BE]["goodput"] == pytest.approx(3 / 5) and c[BE]["slo_attainment"] is None
    assert c["all"]["goodput"] == pytest.approx(5 / 10)
    assert s["throughput"]["goodput_jobs_per_s"] == pytest.approx(5 / MAKESPAN_S)


def test_preemptions_per_class_sum_the_requests_events():
    s = summary()["classes"]
    assert (s[LS]["preemptions"], s[BE]["preemptions"], s["all"]["preemptions"]) == (1, 3, 4)


def test_throughput():
    t = summary()["throughput"]
    # finished: ids 1 2 3 4 6 7 8 10; output 4+3+2+1 + 4+2+5+1 = 22; prompts 8 x 10 + 41
    assert t["jobs_per_s"] == pytest.approx(8 / MAKESPAN_S)
    assert t["output_tokens_per_s"] == pytest.approx(22 / MAKESPAN_S)
    assert t["total_tokens_per_s"] == pytest.approx((22 + 121) / MAKESPAN_S)
    assert t["goodput_jobs_per_s"] == pytest.approx(3 / MAKESPAN_S)  # LS ids 1 2 4; BE has none
    # arrivals sorted: 0 0.5 1 1.5 2 2.5 3 4 4.5 5; window (a[10 // 10], a[9]] = (0.5, 5];
    # finished inside: ids 1 (2.0), 2 (3.25), 3 (4.25), 4 (3.5)
    assert t["steady_jobs_per_s"] == pytest.approx(4 / 4.5)


def test_a_run_without_any_slo_or_class_reports_null_not_a_number():
    be_only = [r for r in ROWS if r[1] == BE]
    s = outputs(hand_made(be_only), MAKESPAN_S, 0, 0.0, slo())[1]
    assert s["classes"][LS]["count"] == 0
    assert set(s["classes"][LS]["ttft_s"].values()) == {None}
    assert s["classes"][LS]["slo_attainment"] is None  # an SLO, but no request to meet it
    assert s["classes"]["all"]["slo_attainment"] is None
    assert s["classes"]["all"]["goodput"] is None
    assert s["throughput"]["goodput_jobs_per_s"] is None
    same_time = [(1, LS, 2.0, [3.0], 1, 0), (2, BE, 2.0, [4.0], 1, 0)]
    s = outputs(hand_made(same_time), 4.0, 0, 0.0, slo())[1]
    assert s["throughput"]["steady_jobs_per_s"] is None  # no window between the arrivals
    assert set(s["classes"][LS]["tpot_s"].values()) == {None}  # one token: no TPOT


# ------------------------------------------------------------- both executors record the gaps
def test_the_scheduler_records_the_gap_before_every_token():
    sched = Scheduler(IterationFCFS(), kv_capacity_tokens=100)
    sched.arrive(Request(0, LS, 0.0, 5, 3), now=0.0)
    for now in (1.0, 1.5, 2.25):  # prefill, then two decode iterations
        sched.next_batch(now - 0.1)
        (seq,) = sched.running.sequences
        sched.complete_iteration(now)
    assert list(seq.token_gaps_s) == [0.5, 0.75]
    df, s = outputs([seq], 2.25, 0, 0.0, slo())
    assert df["itl_max_s"][0] == 0.75 and df["tpot_s"][0] == pytest.approx(1.25 / 2)


def check_gaps(sequences) -> None:
    """Every finished request has one gap per token after the first, summing to its decode
    time; and the run's ITL distribution holds all of them."""
    for s in sequences:
        assert len(s.token_gaps_s) == s.request.output_tokens - 1
        assert s.first_token_s + sum(s.token_gaps_s) == pytest.approx(s.finish_s, rel=1e-5)
        assert all(g > 0 for g in s.token_gaps_s)


def mixed(n=24):
    return [Request(i, LS if i % 4 == 0 else BE, 0.02 * i, 3 + (7 * i) % 29, 1 + i % 6)
            for i in range(n)]  # fmt: skip


def test_the_simulator_fills_the_token_gaps():
    profile = linear_profile(num_layers=2, num_experts=4)
    m = profile.model
    latency = LatencyModel(profile, RoutingModel(m.num_layers, m.num_experts, m.top_k, seed=0))
    sched = Scheduler(QLLM(max_batch_size=4), kv_capacity_tokens=100_000)
    result = Simulation(mixed(), sched, latency).run()
    assert result.preemptions > 0  # gaps across a suspension are covered too
    check_gaps(result.sequences)
    s = outputs(result.sequences, result.makespan_s, 0, 0.0, slo())[1]
    gaps = sum(len(q.token_gaps_s) for q in result.sequences)
    assert gaps == sum(r.output_tokens - 1 for r in mixed()) > 0
    assert s["classes"]["all"]["itl_s"]["max"] == pytest.approx(
        max(max(q.token_gaps_s, default=0) for q in result.sequences))  # fmt: skip


def test_the_real_engine_fills_the_token_gaps():
    torch.set_num_threads(1)
    model, _ = build_model("tiny-mixtral")
    requests, prompts = build_prompts(mixed(10), 512, max_prompt_tokens=16, seed=0)
    sched = Scheduler(QLLM(max_batch_size=4), kv_capacity_tokens=100_000)
    result = RealEngine(requests, prompts, sched, ModelRunner(model), VirtualClock(1e-3)).run()
    check_gaps(result.sequences)
    assert sum(len(q.token_gaps_s) for q in result.sequences) > 0


def test_outputs_reports_the_executor_figures_and_arrivals_as_given():
    df, s = outputs(hand_made(), MAKESPAN_S, events=17, wall_s=0.5, slo=slo())
    assert s["executor"] == {"events": 17, "wall_s": 0.5}
    assert s["arrived"] == len(df) == len(ROWS)
    assert s["completed"] == int(df["finish_s"].notna().sum()) < len(ROWS)
    assert s["makespan_s"] == MAKESPAN_S
    assert [s["classes"][c]["recomputes"] for c in (LS, BE, "all")] == [0, 0, 0]


def test_steady_window_is_open_at_its_start_and_closed_at_its_end():
    import pandas as pd

    from sim.metrics import steady_jobs_per_s

    # 10 arrivals at 0..9 s: the window is (arrival 1, arrival 9] = (1, 9], 8 s long. Finishes
    # exactly at 1 (out), at 9 (in) and at 5 (in); the rest never finish.
    finish = [1.0, 9.0, 5.0] + [math.nan] * 7
    df = pd.DataFrame({"arrival_s": [float(i) for i in range(10)], "finish_s": finish})
    assert steady_jobs_per_s(df) == pytest.approx(2 / 8)
    one = pd.DataFrame({"arrival_s": [3.0], "finish_s": [4.0]})
    assert steady_jobs_per_s(one) is None  # a single arrival spans no window
    assert steady_jobs_per_s(df.iloc[:0]) is None


def test_write_outputs_writes_every_table_and_the_summary_last_and_whole(tmp_path):
    import json

    import pandas as pd

    from sim.metrics import write_outputs

    df, s = outputs(hand_made(), MAKESPAN_S, events=3, wall_s=0.1, slo=slo())
    extra = pd.DataFrame({"t_s": [0.0, 1.0], "replica": [0, 0], "in_system": [1, 0]})
    run_dir = tmp_path / "a" / "run"  # parents are made
    write_outputs(run_dir, df, s, {"replicas": extra})
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "replicas.parquet",
        "requests.parquet",
        "summary.json",
    ]  # no temporary file left
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "requests.parquet"), df)
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "replicas.parquet"), extra)
    text = (run_dir / "summary.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(s))
    assert text.endswith("}\n") and text.startswith('{\n  "classes"')  # indented, one per line
    write_outputs(run_dir, df, s)  # a rewrite replaces the summary whole
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(s))


# ---------------------------------------------------------------- ITL statistics, bounded memory
@pytest.mark.parametrize("seed", [0, 1])
def test_gap_statistics_past_the_exact_limit_stay_within_their_bound(seed):
    """Past ``exact_up_to`` gaps a class, mean, std and max come from running moments and the
    percentiles from a histogram of 2**12 bins per power of two: within 2**-13 of numpy's
    figures on every gap (relative), here on 200,000 gaps spread over six decades, and for
    the merged ``all`` class too."""
    from array import array

    from sim.metrics import GapStats, stats

    rng = np.random.default_rng(seed)
    ls = rng.lognormal(-3.0, 2.0, 200_000).astype(np.float32)
    be = rng.lognormal(-2.0, 1.0, 120_000).astype(np.float32)
    parts = {}
    for name, gaps in (("LS", ls), ("BE", be)):
        g = parts[name] = GapStats(exact_up_to=30_000)
        g.FOLD = 7_000  # each fold in several slices
        for chunk in np.array_split(gaps, 997):  # requests of unequal lengths
            g.add(array("f", chunk.tobytes()))
        assert g.hist is not None and len(g.buffer) < 30_000  # folded: bounded memory
    merged = GapStats.merged([parts["LS"], parts["BE"]]).stats()
    for got, gaps in ((parts["LS"].stats(), ls), (parts["BE"].stats(), be),
                      (merged, np.concatenate([ls, be]))):  # fmt: skip
        exact = stats(gaps)
        assert got["max"] == exact["max"]
        assert got["mean"] == pytest.approx(exact["mean"], rel=1e-12)
        assert got["std"] == pytest.approx(exact["std"], rel=1e-9)
        for p in ("p50", "p90", "p95", "p99"):
            assert abs(got[p] - exact[p]) <= 2**-13 * exact[p], p


def test_gap_statistics_below_the_limit_are_exact():
    from array import array

    from sim.metrics import GapStats, stats

    gaps = np.random.default_rng(2).lognormal(-3.0, 1.0, 5_000).astype(np.float32)
    g = GapStats(exact_up_to=10_000)
    for chunk in np.array_split(gaps, 50):
        g.add(array("f", chunk.tobytes()))
    assert g.stats() == stats(gaps)
