"""Where the shared-root term applies on further random cases, and no plan beats it.

    .venv/bin/python benchmarks/resharding_sharedroot_scan.py [--seeds 8]

Draws ``resharding_random.py``'s cases for seeds 3, 4, ... (500 each, not the seeds
the bound was tuned on), and for every case where
:func:`~meshshard.resharding.sharedroot.shared_root_terms` gives a term, plans it with
every strategy but ``broadcast_search`` and prints the term, the hop bound and the best
simulated plan.  Ends with the counts: cases, cases with a term, cases where it is
above the hop bound, and plans below it (there must be none).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resharding_random import label, random_problem  # noqa: E402

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.resharding import STRATEGIES, plan_resharding  # noqa: E402
from meshshard.resharding.hops import hop_bound_terms  # noqa: E402
from meshshard.resharding.sharedroot import shared_root_terms  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Print one row per case with a term, then the counts; 1 if a plan beats a term."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args(argv)
    cluster = ClusterSpec.preset("aws-p3.8xlarge")
    cluster = ClusterSpec(**{**cluster.__dict__, "num_hosts": 6})
    cases = hits = above = below = 0
    for seed in range(3, 3 + args.seeds):
        rng = np.random.default_rng(seed)
        for _ in range(500):
            p = random_problem(rng)
            cases += 1
            hop = hop_bound_terms(p, cluster)
            terms = shared_root_terms(p, cluster, hop)
            if not terms:
                continue
            hits += 1
            term = terms[0].seconds
            above += term > hop.seconds * (1 + 1e-9)
            best = min(
                plan_resharding(p, s, cluster).sim_time_s
                for s in STRATEGIES
                if s != "broadcast_search"
            )
            below += best < term * (1 - 1e-9)
            print(
                f"{label(p)}: term {term * 1e6:.2f} us, hop bound {hop.seconds * 1e6:.2f} us, "
                f"best plan {best * 1e6:.2f} us ({best / term:.4f}x)"
            )
    print(f"{cases} cases, {hits} with a term, {above} above the hop bound, {below} plans below")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
