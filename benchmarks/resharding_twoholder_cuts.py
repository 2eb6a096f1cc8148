"""Search the two-holder family for schedules faster than ``broadcast``'s plan, cuts included.

    .venv/bin/python benchmarks/resharding_twoholder_cuts.py [--max-messages 6] [--slack 1.05] [U ...]

The four random-benchmark misses of issue 7 item 6 ("two-holder multi-chunk relays")
are two source hosts, each holding its own half of an array, and three destination
hosts that need both halves.  This script takes the one-dimensional form of that
family (``tests/twoholder_schedules.py``; ``U`` bytes per holder, the arguments: the
four misses' by default) on the 5-host ``aws-p3.8xlarge`` cluster and simulates, with
the planner's own simulator (:func:`simulate_resharding`), the schedules in which each
holder's half reaches each host whole or *cut* in two pieces (at the half or at a
quarter), each through chains of every shape, in every per-worker order, with 1 MiB
and 32 KiB chunks, up to ``--max-messages``.  A message set is simulated only where
its busiest worker's least busy time in the bounds' execution model
(``twoholder_schedules.busiest``) is under the plan's time times ``--slack``: no order
of the others beats the plan (``--slack inf``: every set, the model not assumed).  It prints the best schedule simulated against
``broadcast``'s plan and the relay bound, and how many schedules simulate below the
bound (there must be none).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.resharding import plan_resharding, simulate_resharding  # noqa: E402
from meshshard.resharding.bound import MIN_CHUNK_BYTES  # noqa: E402
from meshshard.resharding.relays import relay_bound_terms  # noqa: E402
from tests import twoholder_schedules as two  # noqa: E402

CLUSTER = dataclasses.replace(ClusterSpec.preset("aws-p3.8xlarge"), num_hosts=5)
MISSES = (73008, 57600, 282752, 38642)  # U of the four misses (bytes per holder)
CUTS = (0.5, 0.25)
CHUNKS = (1 << 20, MIN_CHUNK_BYTES)


def search(u: int, max_messages: int, limit: float):
    """``(best seconds, its schedule, schedules simulated, below the bound, bound)``
    for halves of ``u``, skipping sets whose busiest worker takes ``limit`` or more."""
    p = two.problem(u)
    terms = relay_bound_terms(p, CLUSTER)
    bound, lat, bw = terms.seconds, terms.latency, terms.bandwidth
    best, best_how, tried, below = float("inf"), None, 0, 0
    for msgs in two.message_sets(max_messages):
        cuts = CUTS if any(piece != "w" for _, _, piece in msgs) else (0.5,)
        kinds = [
            (cut, chunk)
            for cut in cuts
            for chunk in CHUNKS
            if two.busiest(msgs, u, cut, chunk, lat, bw) < limit
        ]
        for order in two.orders(msgs) if kinds else ():
            for cut, chunk in kinds:
                t = simulate_resharding(p, two.messages(p, order, cut, chunk), CLUSTER)
                tried += 1
                below += t < bound * (1 - 1e-9)
                if t < best:
                    best, best_how = t, (order, cut, chunk)
    return best, best_how, tried, below, bound


def main(argv=None) -> int:
    """Print, per ``U``, the best schedule against the plan and the relay bound."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("nbytes", type=int, nargs="*", default=list(MISSES))
    ap.add_argument("--max-messages", type=int, default=6)
    ap.add_argument("--slack", type=float, default=1.05, help="simulate sets under plan x this")
    args = ap.parse_args(argv)
    for u in args.nbytes:
        t0 = time.perf_counter()
        plan = plan_resharding(two.problem(u), "broadcast", CLUSTER).sim_time_s
        best, how, tried, below, bound = search(u, args.max_messages, plan * args.slack)
        print(
            f"U={u}: plan {plan * 1e6:.1f} us, best of {tried} schedules {best * 1e6:.1f} us"
            f" ({best / plan:.4f}x the plan), relay bound {bound * 1e6:.1f} us"
            f" (plan {plan / bound:.4f}x it), {below} below it ({time.perf_counter() - t0:.0f} s)"
        )
        if how is not None:
            print(f"  best: {how[0]} cut {how[1]} chunk {how[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
