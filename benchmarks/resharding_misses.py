"""Classify the random benchmark's misses: ``broadcast`` over 1.05x of its best bound.

    .venv/bin/python benchmarks/resharding_misses.py resharding_random.json

Reads a ``resharding_random.py --json`` file, rebuilds each case (same seed), and for
every case where ``broadcast`` takes over 1.05x of the largest bound recorded (NIC,
tight, hop, relay) prints a row: the class (more destination hosts than source hosts with
one-chunk or multi-chunk relays, or other), the ratio and the case.  Ends with a count
per class.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resharding_random import random_problem  # noqa: E402

from meshshard.resharding.hops import one_chunk_relays  # noqa: E402

BOUNDS = ("nic_bound_s", "tight_bound_s", "hop_bound_s", "relay_bound_s")


def classify(problem) -> str:
    """``more dst hosts, one-chunk relays`` / ``more dst hosts, multi-chunk relays`` /
    ``other``."""
    senders = {h for n in problem.needs for h, _ in n.holders}
    receivers = {h for n in problem.needs for h, _ in n.receivers}
    if len(receivers) <= len(senders):
        return "other"
    kind = "one-chunk" if one_chunk_relays(problem) else "multi-chunk"
    return f"more dst hosts, {kind} relays"


def main(argv: list[str]) -> int:
    """Print the table of misses and the count per class."""
    with open(argv[0]) as f:
        data = json.load(f)
    rng = np.random.default_rng(data["meta"]["seed"])
    counts: Counter[str] = Counter()
    rows = []
    for r in data["results"]:
        p = random_problem(rng)
        bound = max(r.get(k, 0.0) for k in BOUNDS)
        ratio = r["times_s"]["broadcast"] / bound
        if ratio > 1.05:
            kind = classify(p)
            counts[kind] += 1
            rows.append((kind, ratio, r["case"], r["times_s"]["broadcast"], bound))
    for kind, ratio, case, t, b in sorted(rows, key=lambda x: (x[0], -x[1])):
        print(f"{kind:34s} {ratio:6.3f}x  {t * 1e6:8.1f} / {b * 1e6:8.1f} us  {case}")
    for kind, n in sorted(counts.items()):
        print(f"{n:4d}  {kind}")
    print(
        f"{sum(counts.values()):4d}  of {len(data['results'])} cases over 1.05x of the best bound"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
