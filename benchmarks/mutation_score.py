"""Mutation score per file from mutmut's results (run `make mutation`, which calls this).

A mutant counts as killed when a test failed or timed out on it; as surviving when every test
passed or no test covers its function ("no tests"). Mutants not yet checked are left out of the
score and counted apart. Prints one line per file, the total, then each survivor.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "caught by type check", "segfault"}
SURVIVED = {"survived", "no tests", "suspicious"}


def module_of(mutant: str) -> str:
    """'policies.layer.xǁLayerPreemptiveǁselect__mutmut_2' -> 'policies/layer.py'."""
    return mutant.split(".x")[0].replace(".", "/") + ".py"


def main() -> int:
    mutmut = [sys.executable, "-m", "mutmut"] if len(sys.argv) < 2 else sys.argv[1:]
    out = subprocess.run([*mutmut, "results", "--all", "true"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors = []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+): (.+)$", line)
        if not m:
            continue
        name, status = m.groups()
        path = module_of(name)
        if status in KILLED:
            counts[path]["killed"] += 1
        elif status in SURVIVED:
            counts[path]["survived"] += 1
            survivors.append(f"{name}: {status}")
        else:
            counts[path]["unchecked"] += 1
    total = Counter()
    print(f"{'file':<24} {'killed':>7} {'survived':>9} {'score':>7} {'unchecked':>10}")
    for path in sorted(counts):
        c = counts[path]
        total.update(c)
        done = c["killed"] + c["survived"]
        score = f"{100 * c['killed'] / done:.1f}%" if done else "n/a"
        print(f"{path:<24} {c['killed']:>7} {c['survived']:>9} {score:>7} {c['unchecked']:>10}")
    done = total["killed"] + total["survived"]
    score = f"{100 * total['killed'] / done:.1f}%" if done else "n/a"
    print(f"{'total':<24} {total['killed']:>7} {total['survived']:>9} {score:>7} "
          f"{total['unchecked']:>10}")  # fmt: skip
    print("\nsurvivors (`.venv/bin/mutmut show NAME` prints the change):")
    for line in survivors:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
