"""The GPU machine's environment and a CUDA smoke test of the stepped runner.

``python -m gpu.smoke --device cuda --json smoke.json`` prints the versions, then, for two model
families, runs sequences through ``ModelRunner`` (a two-sequence prefill of unequal lengths, a
join, batched decode with unequal KV lengths) and compares every token with ``model.generate``:

- float64: the tokens must be equal (exit 1 otherwise);
- bfloat16: the dtype the GPU runs are timed in; rounding may flip a near-tie, so the share of
  equal tokens is reported, not required.

The runner checks after every iteration that each KV cache holds every token it was fed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import transformers

from profiler.models import build_model
from profiler.ops import ModelRunner

FAMILIES = ("tiny-mixtral", "tiny-qwen2-moe")
NEW_TOKENS = 8


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env |= {"device": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count}  # fmt: skip
    return env


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 11, 3)]


def run_family(name: str, device: str, dtype: str) -> dict:
    model, info = build_model({"name": name, "config": {"initializer_range": 0.2}},
                              device=device, dtype=dtype, seed=3)  # fmt: skip
    runner = ModelRunner(model)
    a, b, c = (runner.new_sequence(p) for p in prompts(info.shape.vocab_size))
    t0 = time.perf_counter()
    runner.run(runner.begin([a, b]))  # prefill of unequal lengths
    runner.run(runner.begin([a, b]))
    runner.run(runner.begin([c]))  # c joins: decode KV lengths now differ
    while min(len(s.generated) for s in (a, b, c)) < NEW_TOKENS:
        runner.run(runner.begin([s for s in (a, b, c) if len(s.generated) < NEW_TOKENS]))
    if device == "cuda":
        torch.cuda.synchronize()
    runner_s = time.perf_counter() - t0
    equal = total = 0
    for s in (a, b, c):
        ref = model.generate(torch.tensor([s.token_ids[: s.num_prompt]], device=info.device),
                             do_sample=False, max_new_tokens=NEW_TOKENS)  # fmt: skip
        ref = ref[0, s.num_prompt :].tolist()
        equal += sum(x == y for x, y in zip(s.generated, ref, strict=True))
        total += NEW_TOKENS
    return {"model": name, "device": str(info.device), "dtype": dtype, "tokens": total,
            "equal_tokens": equal, "runner_s": round(runner_s, 4)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--env-only", action="store_true", help="versions only, no model")
    args = ap.parse_args()
    if args.device == "cpu":  # OpenMP teams on a busy small machine make tiny ops ~30x slower
        torch.set_num_threads(1)
    out = {"environment": environment(), "runs": []}
    print(json.dumps(out["environment"]))
    failed = False
    if not args.env_only:
        for name in FAMILIES:
            for dtype in ("float64", "bfloat16"):
                run = run_family(name, args.device, dtype)
                run["exact"] = run["equal_tokens"] == run["tokens"]
                failed |= dtype == "float64" and not run["exact"]
                out["runs"].append(run)
                print(" ".join(f"{k}={v}" for k, v in run.items()), flush=True)
    out["ok"] = not failed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
