"""The reproduction's experiments, each a small declaration.

An *arm* is a policy with its settings, labelled as it appears in the table's ``policy`` column
(``qllm-cap32`` is ``qllm`` with ``policy.max_in_flight=32``). An *experiment* is a setup (the
paper's, with some keys changed), the arms run on it, and its grid: rates x replicates, plus any
extra axes. All arms of one grid point replay the same workload (a paired comparison); every
point draws its own workload (seed derived from the replicate and the rate), so the points of a
curve are independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLO_S = 3.0
# Under load (0.5-1 req/s: the machine completes ~1.3-1.5 jobs/s) to deep overload (10 req/s).
RATES = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0)
HEADLINE_SEEDS = 20
SIDE_SEEDS = 10
ATTAINMENT = 0.9  # the stricter reading of "meets the SLO", reported beside the main one
# The paper's setup; the last three workload keys are the authors' repository defaults.
PAPER_SETUP = {
    "workload": "paper",
    "workload.ls_fraction": "0.2",
    "workload.arrival": "poisson",
    "workload.num_requests": "256",
    "workload.max_output_tokens": "50",
    "profile": "a100-mixtral-nf4-hf",
    "policy.max_batch_size": "32",
    "slo.ls_ttft_s": str(SLO_S),
}
FAST_PROFILE = "a100x2-mixtral-fp16"


@dataclass(frozen=True)
class Arm:
    label: str
    policy: str
    overrides: tuple[str, ...] = ()
    what: str = ""

    def args(self) -> list[str]:
        return [f"policy={self.policy}", *self.overrides]


TGI = Arm(
    "iteration",
    "iteration",
    (),
    "HF TGI's router, waiting_served_ratio 1.2 (TGI's default before April 2024)",
)
TGI_03 = Arm(
    "tgi-0.3",
    "iteration",
    ("policy.waiting_served_ratio=0.3",),
    "HF TGI's router, waiting_served_ratio 0.3 (TGI's default since April 2024)",
)
PRIORITY = Arm("priority", "priority", (), "LS first at iteration boundaries (vLLM style)")
ALG1 = Arm("alg1", "alg1", (), "Algorithm 1's queue order, no preemption")
LAYER = Arm("layer", "layer", (), "Algorithm 1, preemption after attention/router stages")
QLLM = Arm("qllm", "qllm", (), "Algorithm 1, preemption after any expert (QLLM)")
QLLM_CAP = Arm(
    "qllm-cap32",
    "qllm",
    ("policy.max_in_flight=32",),
    "qllm with at most 32 admitted sequences in flight, as the baseline",
)
QLLM_NOFILL = Arm(
    "qllm-nofill",
    "qllm",
    ("policy.fill_be_prefill=false",),
    "qllm without BE prompts filling LS prefill batches",
)
QLLM_AUTHORS = Arm(
    "qllm-authors",
    "qllm",
    ("policy.preempt_prefill=false",),
    "the authors' code: decode batches only, checked after each router",
)
QLLM_MERGE = Arm(
    "qllm-merge",
    "qllm",
    ("policy.merge=true",),
    "qllm with the paper's merge: LS work joins a suspended batch at its cursor",
)
QLLM_LIKE = Arm("qllm-cap32-nofill", "qllm",
                ("policy.max_in_flight=32", "policy.fill_be_prefill=false"),
                "qllm capped at 32 in flight, no BE fill")  # fmt: skip

# Today's engines, on paged KV memory with recompute preemption; batch limit 32 on every side.
VLLM_FCFS = Arm(
    "vllm-fcfs",
    "vllm",
    ("policy.scheduling_policy=fcfs", "policy.max_num_seqs=32"),
    "vLLM V1, FCFS",
)
VLLM_PRIO = Arm(
    "vllm-priority",
    "vllm",
    ("policy.scheduling_policy=priority", "policy.max_num_seqs=32"),
    "vLLM V1, --scheduling-policy priority",
)
VLLM_CHUNK = Arm(
    "vllm-priority-chunked",
    "vllm",
    (
        "policy.scheduling_policy=priority",
        "policy.max_num_seqs=32",
        "policy.enable_chunked_prefill=true",
    ),
    "vLLM V1, priority, chunked prefill",
)
SGLANG = Arm("sglang", "sglang", (), "SGLang, priority scheduling with priority preemption")
QLLM_EVICT = Arm(
    "qllm-evict",
    "qllm",
    ("policy.evict_be_for_ls=true",),
    "qllm, evicting BE KV (recompute) to admit LS work",
)
ENGINES = ("vllm-fcfs", "vllm-priority", "vllm-priority-chunked", "sglang")

BASELINE, OURS = TGI.label, QLLM.label
GRANULARITIES = ("iteration", "priority", "alg1", "layer", "qllm")
STARVATION_WAITS_S = (None, 120.0, 60.0, 30.0, 10.0)


@dataclass(frozen=True)
class Experiment:
    name: str
    what: str
    arms: tuple[Arm, ...]
    changes: dict = field(default_factory=dict)  # setup keys changed from PAPER_SETUP (None: drop)
    seeds: int = SIDE_SEEDS
    rates: tuple[float, ...] = RATES
    axes: dict = field(default_factory=dict)  # extra grid axes: key -> values
    scale_rates: bool = False  # rates are nf4-equivalent loads, scaled to the profile's speed


EXPERIMENTS = (
    Experiment("paper", "the paper's setup, every reading of it",
               (TGI, TGI_03, PRIORITY, ALG1, LAYER, QLLM, QLLM_CAP, QLLM_NOFILL, QLLM_AUTHORS,
                QLLM_LIKE), seeds=HEADLINE_SEEDS),
    Experiment("card", "HumanEval prompts as LS, ShareGPT as BE",
               (TGI, PRIORITY, ALG1, LAYER, QLLM), {"workload": "card"}),
    Experiment("fp16", "fp16 on two A100s (tensor parallel): iterations ~10x faster",
               (TGI, PRIORITY, ALG1, LAYER, QLLM), {"profile": FAST_PROFILE}),
    Experiment("uncapped", "sensitivity: no output cap (ShareGPT reference reply lengths)",
               (TGI, QLLM), {"workload.max_output_tokens": "null"}, rates=(1.0, 3.0, 5.0, 7.0)),
    Experiment("jobs1000", "sensitivity: 1000 jobs per run", (TGI, QLLM),
               {"workload.num_requests": "1000"}, rates=(1.0, 3.0, 5.0, 7.0)),
    Experiment("where", "where preemption matters: qllm against alg1 by LS share and speed",
               (ALG1, LAYER, QLLM), rates=(0.5, 1.0, 2.0),
               axes={"workload.ls_fraction": (0.05, 0.1, 0.2, 0.4),
                     "profile": ("a100-mixtral-nf4-hf", "a100-mixtral-nf4-hf-expertcost",
                                 FAST_PROFILE, "h200-mixtral-bf16")},
               scale_rates=True),
    Experiment("engines", "today's engines on paged KV memory: vLLM V1, SGLang, qllm",
               (VLLM_FCFS, VLLM_PRIO, VLLM_CHUNK, SGLANG, QLLM, QLLM_EVICT),
               {"memory.model": "paged", "policy.max_batch_size": None}, rates=(1.0, 3.0, 5.0),
               axes={"profile": ("a100-mixtral-nf4-hf", FAST_PROFILE, "h100x2-mixtral-bf16"),
                     "profile.kv_capacity_tokens": ("null", "4000")},
               scale_rates=True),
    Experiment("merge", "the paper's merge: qllm with policy.merge=true", (QLLM, QLLM_MERGE),
               rates=(0.5, 1.0, 3.0)),
    Experiment("starvation", "BE starvation guard: qllm with policy.be_max_wait_s",
               tuple(Arm("qllm" if w is None else f"qllm-wait{w:g}", "qllm",
                         () if w is None else (f"policy.be_max_wait_s={w}",))
                     for w in STARVATION_WAITS_S), rates=(3.0, 5.0, 7.0)),
)  # fmt: skip

PAPER = {  # the paper's figures (abstract and Sec. 5)
    "ls_ttft_reduction_avg": 65.5,
    "ls_ttft_reduction_max": 101.6,
    "slo_max_rate_qllm": 7.0,
    "slo_max_rate_baseline": None,
    "ls_turnaround_reduction_max": 12.8,
    "be_turnaround_ratio_avg": 1.38,
    "be_turnaround_ratio_max": 2.04,
    "throughput_ratio_avg": 1.0,
}

# (label, baseline arm, ours arm, what): the headline is the first.
READINGS = (
    ("as the paper reads", TGI.label, QLLM.label,
     "TGI with waiting_served_ratio 1.2; Algorithm 1 as written (BE fill, no in-flight cap)"),
    ("TGI since April 2024", TGI_03.label, QLLM.label, "baseline waiting_served_ratio 0.3"),
    ("equal in-flight cap", TGI.label, QLLM_CAP.label, "qllm admits at most 32 sequences"),
    ("no BE fill", TGI.label, QLLM_NOFILL.label, "LS prefill batches hold LS prompts only"),
    ("the authors' code", TGI.label, QLLM_AUTHORS.label,
     "no prefill preemption; checks after each layer's router"),
    ("like-for-like", TGI_03.label, QLLM_LIKE.label,
     "TGI 0.3 against qllm capped at 32 without BE fill"),
)  # fmt: skip


def by_name(names) -> list[Experiment]:
    return [e for e in EXPERIMENTS if e.name in names]
