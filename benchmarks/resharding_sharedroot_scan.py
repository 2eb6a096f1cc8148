"""Where the shared-root (or two-roots) term applies on further random cases, and no plan beats it.

    .venv/bin/python benchmarks/resharding_sharedroot_scan.py [--seeds 8] [--term tworoots] [--above]

Draws ``resharding_random.py``'s cases for seeds 3, 4, ... (500 each, not the seeds
the bound was tuned on), and for every case where the term
(:func:`~meshshard.resharding.sharedroot.shared_root_terms`, or with ``--term
tworoots`` :func:`~meshshard.resharding.tworoots.two_roots_terms`) gives a term
(``--above``: a term above the hop bound), plans it with every strategy but
``broadcast_search`` and prints the term, the hop bound and the best simulated plan.
Ends with the counts: cases, cases with a term, cases where it is above the hop bound,
and plans below it (there must be none).
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
from meshshard.resharding.tworoots import two_roots_terms  # noqa: E402

TERMS = {"sharedroot": shared_root_terms, "tworoots": two_roots_terms}


def main(argv: list[str] | None = None) -> int:
    """Print one row per case with a term, then the counts; 1 if a plan beats a term."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--term", choices=sorted(TERMS), default="sharedroot")
    ap.add_argument("--above", action="store_true", help="plan only terms above the hop bound")
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
            terms = TERMS[args.term](p, cluster, hop)
            if not terms:
                continue
            hits += 1
            term = terms[0].seconds
            above += term > hop.seconds * (1 + 1e-9)
            if args.above and term <= hop.seconds * (1 + 1e-9):
                continue
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
