"""Workloads: data-set salvage and filtering, the token cache, traces, arrivals, determinism."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from sim.config import Arrival, LengthConfig, LengthDist, UserError, WorkloadConfig, WorkloadKind
from sim.workloads import build_workload, humaneval, sharegpt
from sim.workloads.cache import cache_file
from sim.workloads.tokenizer import count_tokens

# shipped in the repository (data/README.md: source and licence)
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "splitwise_conv.csv"
DEFAULT_LIMITS = {"min_tokens": 4, "max_prompt_tokens": 1024, "max_total_tokens": 2048}

# Measured with Mixtral's tokenizer on the packaged (truncated) file: ARCHITECTURE.md's 9,785
# pairs (111 / 320 tokens). A prompt that recurs stays one pair per occurrence (a separate job,
# as in vLLM's benchmark), so the pool holds fewer distinct texts than pairs.
SHAREGPT_PAIRS, SHAREGPT_PROMPT_MEAN, SHAREGPT_OUTPUT_MEAN = 9785, 111.1, 320.5


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Every test caches under a temporary directory, never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def cold_sharegpt(session_cache):
    """The packaged ShareGPT pool loaded with no cache entry: (pool, seconds, stderr)."""
    cache_file(sharegpt.default_path(), {"dataset": "sharegpt", **DEFAULT_LIMITS}).unlink(
        missing_ok=True
    )
    sharegpt._warned.clear()  # as in a fresh process
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        start = time.perf_counter()
        pool = sharegpt.load_pool()
        seconds = time.perf_counter() - start
    print(f"\nShareGPT cold load: {seconds:.2f} s, {len(pool)} pairs")
    return pool, seconds, err.getvalue()


def conversation(prompt: str, reply: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {
        "id": prompt[:8],
        "conversations": [{"from": first, "value": prompt}, {"from": second, "value": reply}],
    }


def write_sharegpt(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records, indent=2))
    return path


def workload(**kw) -> WorkloadConfig:
    return WorkloadConfig(**kw)


# --- ShareGPT -------------------------------------------------------------------------------


def test_packaged_sharegpt_is_salvaged_up_to_the_cut():
    records, truncated = sharegpt.read_conversations(sharegpt.default_path())
    assert truncated
    assert len(records) == 17_671
    assert all("conversations" in r for r in records)


def test_truncation_warning_is_one_line_per_process(cold_sharegpt, capsys):
    _, _, err = cold_sharegpt
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == (
        f"warning: {sharegpt.default_path()} is truncated; recovered 17671 complete conversations"
    )
    sharegpt.load_pool()
    assert capsys.readouterr().err == ""


def test_truncation_warning_survives_the_cache(cold_sharegpt, capsys, monkeypatch):
    monkeypatch.setattr(sharegpt, "_warned", set())  # as in a fresh process
    sharegpt.load_pool()
    assert "recovered 17671 complete conversations" in capsys.readouterr().err


def test_sharegpt_pool_matches_reference_figures(cold_sharegpt):
    pool, _, _ = cold_sharegpt
    assert len(pool) == pytest.approx(SHAREGPT_PAIRS, rel=0.02)
    assert pool.prompt_tokens.mean() == pytest.approx(SHAREGPT_PROMPT_MEAN, rel=0.03)
    assert pool.output_tokens.mean() == pytest.approx(SHAREGPT_OUTPUT_MEAN, rel=0.03)
    assert len(set(pool.text)) < len(pool)  # repeated prompts are separate jobs, as in vLLM


def test_vllm_filter_bounds_hold_on_every_request(cold_sharegpt):
    reqs = build_workload(workload(kind=WorkloadKind.sharegpt, num_requests=3000), seed=0)
    for r in reqs:
        assert r.prompt_tokens >= 4 and r.output_tokens >= 4
        assert r.prompt_tokens <= 1024 and r.prompt_tokens + r.output_tokens <= 2048
        assert r.source == "sharegpt" and r.text


def test_cache_hit_neither_reads_nor_tokenizes_and_is_identical(cold_sharegpt, monkeypatch):
    cold, _, _ = cold_sharegpt
    assert cache_file(sharegpt.default_path(), {"dataset": "sharegpt", **DEFAULT_LIMITS}).is_file()

    def rebuilt(*args, **kwargs):
        raise AssertionError("a cache hit rebuilt the pool")

    # What a miss costs (parsing the JSON, tokenizing): neither may run on a hit.
    monkeypatch.setattr(sharegpt, "read_conversations", rebuilt)
    monkeypatch.setattr(sharegpt, "count_tokens", rebuilt)
    warm = sharegpt.load_pool()
    np.testing.assert_array_equal(warm.prompt_tokens, cold.prompt_tokens)
    np.testing.assert_array_equal(warm.output_tokens, cold.output_tokens)
    assert warm.text == cold.text


def test_a_pool_cached_by_other_workload_code_is_rebuilt(tmp_path, monkeypatch):
    """An edit of the salvage or tokenizing code (without a FORMAT_VERSION bump) must not
    leave the tables it cached before in use: the cache key holds the package's sources."""
    from sim.workloads import cache

    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_sharegpt(
        tmp_path / "s.json",
        [conversation("What is the capital city of Italy?", "Rome is the capital of Italy.")],
    )
    assert len(sharegpt.load_pool(path)) == 1
    params = {"dataset": "sharegpt", **DEFAULT_LIMITS}
    before = cache_file(path, params)
    assert before.is_file()
    monkeypatch.setattr(cache, "builders_digest", lambda: "0" * 16)  # as after a code edit
    assert cache_file(path, params) != before
    built = []
    real = sharegpt.read_conversations
    monkeypatch.setattr(
        sharegpt, "read_conversations", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    assert len(sharegpt.load_pool(path)) == 1 and built == [1]


def test_cache_follows_the_source_file_and_survives_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    first = conversation("What is the capital city of France?", "Paris is the capital of France.")
    second = conversation("What is the capital city of Spain?", "Madrid is the capital of Spain.")
    path = write_sharegpt(tmp_path / "s.json", [first])
    assert len(sharegpt.load_pool(path)) == 1
    write_sharegpt(path, [first, second])  # new size and mtime: a new key
    assert len(sharegpt.load_pool(path)) == 2
    cached = cache_file(path, {"dataset": "sharegpt", **DEFAULT_LIMITS})
    cached.write_bytes(b"not parquet")
    assert len(sharegpt.load_pool(path)) == 2  # rebuilt and rewritten
    assert cached.read_bytes().startswith(b"PAR1")


def test_cache_follows_an_edit_that_keeps_size_and_modification_time(tmp_path, monkeypatch):
    """cp -p, rsync -a or tar put an edited file back with its old modification time: an
    edit of the same size must still not be served the lengths cached before it."""
    import os

    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    question = "What is the capital city of France?"
    old, new = "Paris is the capital of France, a big city.", "Paris. " * 5 + "Paris"
    new += "." * (len(old) - len(new))  # the same size
    assert count_tokens([old]) != count_tokens([new])
    path = write_sharegpt(tmp_path / "s.json", [conversation(question, old)])
    stat = path.stat()
    assert sharegpt.load_pool(path).output_tokens.tolist() == count_tokens([old])
    write_sharegpt(path, [conversation(question, new)])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    assert sharegpt.load_pool(path).output_tokens.tolist() == count_tokens([new])


def test_full_file_loads_without_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_sharegpt(
        tmp_path / "full.json",
        [
            conversation("Explain how a hash table handles collisions.", "It chains. " * 20),
            conversation("Explain how a hash table handles collisions.", "Duplicate prompt."),
            conversation("Hello there, how are you today?", "Fine thanks, and you?", "gpt"),
            conversation("Write a haiku about the sea in spring.", "ok"),  # reply too short
            conversation("List three prime numbers above one hundred.", "101, 103 and 107."),
        ],
    )
    pool = sharegpt.load_pool(path)
    assert capsys.readouterr().err == ""
    assert pool.text == [
        "Explain how a hash table handles collisions.",
        "Explain how a hash table handles collisions.",
        "List three prime numbers above one hundred.",
    ]
    reqs = build_workload(workload(path=str(path), num_requests=4), seed=1)
    assert {r.text for r in reqs} == set(pool.text)  # a pool of two, cycled


def test_filter_keeps_exactly_the_pairs_within_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    # Prompts of 11..152 tokens; every third reply too short; one prompt too short.
    pairs = [
        (f"Question number {i}: " + "why " * (5 * i), "Yes." if i % 3 == 0 else "Because. " * 20)
        for i in range(1, 30)
    ] + [("Why?", "Because. " * 20)]
    path = write_sharegpt(tmp_path / "f.json", [conversation(p, r) for p, r in pairs])
    pool = sharegpt.load_pool(path, min_tokens=8, max_prompt_tokens=100, max_total_tokens=130)
    texts = sorted({t for pair in pairs for t in pair})
    tokens = dict(zip(texts, count_tokens(texts), strict=True))

    def passes(prompt: str, reply: str) -> bool:
        p, r = tokens[prompt], tokens[reply]
        return p >= 8 and r >= 8 and p <= 100 and p + r <= 130

    kept = [p for p, r in pairs if passes(p, r)]
    assert 0 < len(kept) < len(pairs) and pool.text == kept
    assert pool.prompt_tokens.tolist() == [tokens[p] for p in kept]
    # Each limit rejects something here, so none of them is a no-op.
    assert any(tokens[p] < 8 for p, _ in pairs) and any(tokens[r] < 8 for _, r in pairs)
    assert any(tokens[p] > 100 for p, _ in pairs)
    assert any(tokens[p] <= 100 and tokens[p] + tokens[r] > 130 for p, r in pairs)


def test_small_truncated_file_reports_what_it_recovered(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    whole = json.dumps(
        [
            conversation(f"Tell me fact number {i} about owls.", "Owls can turn heads.")
            for i in range(3)
        ]
    )
    path = tmp_path / "cut.json"
    path.write_text(whole[: whole.rindex("Owls") - 5])  # cut inside the third record
    pool = sharegpt.load_pool(path)
    assert len(pool) == 2
    assert (
        capsys.readouterr().err
        == f"warning: {path} is truncated; recovered 2 complete conversations\n"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"conversations": []}', "expected a JSON array"),
        ('[{"conversations": [}]\n]', "invalid JSON at line 1"),
        ('[{"conversations": []} {"a": 1}]', "expected ',' or ']' at line 1"),
        ("[]", "no ShareGPT first turn passes the filter"),
    ],
)
def test_malformed_sharegpt_raises_user_error(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as err:
        sharegpt.load_pool(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("kind", [WorkloadKind.sharegpt, WorkloadKind.trace])
def test_missing_path_is_a_user_error(tmp_path, kind):
    path = tmp_path / "nope"
    with pytest.raises(UserError, match=f"workload.path={path}: file not found"):
        build_workload(workload(kind=kind, path=str(path), num_requests=3), seed=0)


# --- HumanEval and the card mix ------------------------------------------------------------


def test_humaneval_has_164_problems_of_known_length():
    assert len(humaneval.read_problems()) == 164
    pool = humaneval.load_pool()
    assert len(pool) == 164
    assert pool.prompt_tokens.mean() == pytest.approx(157, rel=0.02)
    assert np.median(pool.prompt_tokens) == pytest.approx(135, abs=3)


@pytest.mark.parametrize("kind", [WorkloadKind.humaneval, WorkloadKind.sharegpt])
def test_max_output_tokens_caps(cold_sharegpt, kind):
    plain = build_workload(workload(kind=kind, num_requests=400), seed=3)
    capped = build_workload(workload(kind=kind, num_requests=400, max_output_tokens=32), seed=3)
    assert max(r.output_tokens for r in plain) > 32
    for p, c in zip(plain, capped, strict=True):
        assert c.output_tokens == min(p.output_tokens, 32)
        assert c.prompt_tokens == p.prompt_tokens


def test_card_ls_jobs_are_humaneval_and_be_jobs_sharegpt(cold_sharegpt):
    reqs = build_workload(workload(kind=WorkloadKind.card, num_requests=2000), seed=5)
    problems = {p["prompt"] for p in humaneval.read_problems()}
    ls = [r for r in reqs if r.cls == "LS"]
    assert len(ls) / len(reqs) == pytest.approx(0.2, abs=0.03)
    for r in reqs:
        assert r.source == ("humaneval" if r.cls == "LS" else "sharegpt")
        assert (r.text in problems) == (r.cls == "LS")


def test_card_with_only_ls_jobs_needs_no_sharegpt(tmp_path):
    cfg = workload(kind=WorkloadKind.card, ls_fraction=1.0, num_requests=50)
    cfg.path = str(tmp_path / "absent.json")  # never opened: no BE job
    assert {r.source for r in build_workload(cfg, seed=0)} == {"humaneval"}


# --- Determinism, classes, arrivals ----------------------------------------------------------


def test_same_seed_same_list_and_structured_config_agrees(cold_sharegpt):
    cfg = workload(kind=WorkloadKind.card, num_requests=300, arrival=Arrival.gamma, cv=2.0)
    a = build_workload(cfg, seed=11)
    assert a == build_workload(cfg, seed=11)
    assert a == build_workload(OmegaConf.structured(cfg), seed=11)
    b = build_workload(cfg, seed=12)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [r.text for r in a] != [r.text for r in b]
    assert [r.cls for r in a] != [r.cls for r in b]


def test_ids_follow_arrival_order():
    reqs = build_workload(workload(kind=WorkloadKind.synthetic, num_requests=500), seed=0)
    assert [r.id for r in reqs] == list(range(500))
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] > 0  # first arrival after the first gap


def test_ls_fraction_and_poisson_rate():
    cfg = workload(kind=WorkloadKind.synthetic, num_requests=20_000, rate=7.0, ls_fraction=0.3)
    reqs = build_workload(OmegaConf.structured(cfg), seed=2)
    assert sum(r.cls == "LS" for r in reqs) / len(reqs) == pytest.approx(0.3, abs=0.01)
    assert len(reqs) / reqs[-1].arrival_s == pytest.approx(7.0, rel=0.05)
    gaps = np.diff([0.0] + [r.arrival_s for r in reqs])
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_arrivals_have_requested_rate_and_cv(cv):
    cfg = workload(
        kind=WorkloadKind.synthetic, num_requests=20_000, rate=4.0, arrival=Arrival.gamma, cv=cv
    )
    times = np.array([r.arrival_s for r in build_workload(cfg, seed=4)])
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.10)


def test_synthetic_lengths():
    cfg = workload(kind=WorkloadKind.synthetic, num_requests=5000)
    cfg.prompt = LengthConfig(dist=LengthDist.uniform, min=10, max=20)
    cfg.output = LengthConfig(dist=LengthDist.lognormal, tokens=100, sigma=1.0, min=5, max=400)
    reqs = build_workload(OmegaConf.structured(cfg), seed=0)
    prompt = np.array([r.prompt_tokens for r in reqs])
    output = np.array([r.output_tokens for r in reqs])
    assert set(prompt) == set(range(10, 21))
    assert np.median(output) == pytest.approx(100, rel=0.05)
    assert output.min() == 5 and output.max() == 400  # the tails are clipped
    fixed = build_workload(workload(kind=WorkloadKind.synthetic, num_requests=10), seed=0)
    assert {(r.prompt_tokens, r.output_tokens, r.text) for r in fixed} == {(128, 128, None)}


def test_another_prompt_distribution_leaves_the_output_lengths_as_they_were():
    """Prompt and output lengths come from streams of their own (one stream shifted every
    output length when the prompt's distribution changed: a sweep over it changed both)."""
    outputs = []
    for prompt in (LengthConfig(dist=LengthDist.fixed, tokens=128),
                   LengthConfig(dist=LengthDist.uniform, min=10, max=200),
                   LengthConfig(dist=LengthDist.lognormal, tokens=64, sigma=0.8)):  # fmt: skip
        cfg = workload(
            kind=WorkloadKind.synthetic,
            num_requests=50,
            prompt=prompt,
            output=LengthConfig(dist=LengthDist.lognormal, tokens=100, sigma=1.0),
        )
        reqs = build_workload(OmegaConf.structured(cfg), seed=3)
        outputs.append([r.output_tokens for r in reqs])
        assert len({r.prompt_tokens for r in reqs}) > (prompt.dist is not LengthDist.fixed)
    assert outputs[0] == outputs[1] == outputs[2] and len(set(outputs[0])) > 10


def test_a_fixed_length_over_the_default_max_needs_no_max():
    """A fixed length reads neither min nor max: 4,096 was refused as over max 2,048, and
    raising max then warned that max is ignored."""
    from hydra import compose, initialize_config_dir

    from sim.app import CONF_DIR
    from sim.config import validate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["workload=synthetic", "workload.prompt.tokens=4096"])
    validate(cfg)
    reqs = build_workload(cfg.workload, seed=0)
    assert {r.prompt_tokens for r in reqs} == {4096}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"arrival": Arrival.trace}, "workload.arrival=trace: needs workload.kind=trace"),
        ({"rate": None}, "workload.rate=None: required unless workload.arrival=trace"),
        ({"kind": WorkloadKind.trace, "arrival": Arrival.trace}, "needs a trace CSV"),
    ],
)
def test_inconsistent_configs_are_user_errors(changes, message):
    with pytest.raises(UserError, match=message):
        build_workload(workload(num_requests=5, **changes), seed=0)


# --- Traces ----------------------------------------------------------------------------------


def trace_config(path: Path, **kw) -> WorkloadConfig:
    kw = {"kind": WorkloadKind.trace, "arrival": Arrival.trace, "rate": None, **kw}
    return workload(path=str(path), **kw)


def test_splitwise_trace_replays_its_own_timestamps():
    rows = np.loadtxt(TRACE, delimiter=",", skiprows=1)
    assert len(rows) == 19_366
    reqs = build_workload(trace_config(TRACE, num_requests=len(rows)), seed=0)
    assert len(reqs) == 19_366
    np.testing.assert_allclose([r.arrival_s for r in reqs], rows[:, 0] - rows[0, 0])
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (int(p), int(d)) for p, d in rows[:, 1:]
    ]
    assert {r.source for r in reqs} == {"trace"} and reqs[0].text is None


def test_splitwise_trace_rescaled_to_a_rate():
    reqs = build_workload(trace_config(TRACE, num_requests=1000, rate=2.0), seed=0)
    times = np.array([r.arrival_s for r in reqs])
    assert times[0] == 0 and (len(times) - 1) / times[-1] == pytest.approx(2.0)
    own = np.array([r.arrival_s for r in build_workload(trace_config(TRACE, num_requests=1000), 0)])
    # Same shape, other time scale: gaps keep their proportions.
    np.testing.assert_allclose(times / times[-1], own / own[-1])


def test_trace_lengths_with_poisson_arrivals():
    reqs = build_workload(
        trace_config(TRACE, num_requests=50, arrival=Arrival.poisson, rate=3.0), 0
    )
    rows = np.loadtxt(TRACE, delimiter=",", skiprows=1, max_rows=50)
    assert [r.prompt_tokens for r in reqs] == rows[:, 1].astype(int).tolist()
    assert reqs[0].arrival_s > 0  # drawn, not the trace's own (which start at 0)


def test_short_trace_is_cycled(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n5,10,1\n6,20,2\n8,30,3\n")
    reqs = build_workload(trace_config(path, num_requests=7), seed=0)
    assert [r.prompt_tokens for r in reqs] == [10, 20, 30, 10, 20, 30, 10]
    # Repeats follow one another after one mean gap (1.5 s).
    assert [r.arrival_s for r in reqs] == [0, 1, 3, 4.5, 5.5, 7.5, 9]


@pytest.mark.parametrize(
    ("body", "line", "expected"),
    [
        ("arrived_at,num_prefill_tokens\n0,10\n", 1, "missing ['num_decode_tokens']"),
        ("0,10,5\n1,ten,5\n", 3, "an integer for num_prefill_tokens, got 'ten'"),
        ("0,10,5\nsoon,10,5\n", 3, "a number for arrived_at, got 'soon'"),
        ("0,10,-5\n", 2, "num_decode_tokens >= 1, got -5"),
        ("0,0,5\n", 2, "num_prefill_tokens >= 1, got 0"),
        ("-1,10,5\n", 2, "arrived_at >= 0 seconds, got -1.0"),
        ("0,10,5\n2,10,5\n1,10,5\n", 4, "arrived_at >= the previous row's 2.0, got 1.0"),
        ("0,10,5\n1,10\n", 3, "3 values like the header, got 2"),
        ("", 2, "at least one request after the header"),
    ],
)
def test_malformed_trace_names_file_and_line(tmp_path, body, line, expected):
    path = tmp_path / "bad.csv"
    header = (
        "" if body.startswith("arrived_at") else "arrived_at,num_prefill_tokens,num_decode_tokens\n"
    )
    path.write_text(header + body)
    with pytest.raises(UserError) as err:
        build_workload(trace_config(path, num_requests=3), seed=0)
    assert str(err.value).startswith(f"workload.path={path}, line {line}: expected ")
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_a_streamed_workload_refuses_arrival_times_out_of_order():
    """A streamed run replays requests in index order without sorting them: a time out of
    order would be admitted late, silently, so the workload refuses it."""
    from sim.workloads import Workload, _Jobs

    jobs = _Jobs(3)
    jobs.prompt[:], jobs.output[:] = 8, 4
    assert [r.arrival_s for r in Workload(np.array([0.0, 1.0, 1.0]), np.zeros(3, bool), jobs)] \
        == [0.0, 1.0, 1.0]  # fmt: skip
    with pytest.raises(ValueError, match="must not decrease"):
        Workload(np.array([0.0, 2.0, 1.0]), np.zeros(3, bool), jobs)


def test_a_streamed_workloads_request_alone_is_the_one_iteration_makes():
    """``Workload.request(i)`` (qllm-plan checks a stopped run's largest request with it) is
    request i as the replay makes it, past the first chunk too."""
    from sim.workloads import stream_workload

    cfg = OmegaConf.structured(WorkloadConfig(kind=WorkloadKind.synthetic, num_requests=5000,
                                              rate=50.0, ls_fraction=0.3))  # fmt: skip
    workload = stream_workload(cfg, seed=3)
    made = list(workload)
    for i in (0, 1, 4095, 4096, 4999):
        assert workload.request(i) == made[i]
    assert {made[i].cls for i in range(5000)} == {"LS", "BE"}
