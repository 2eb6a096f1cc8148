"""The hop bound (meshshard/resharding/hops.py): valid against every schedule the runtime
can execute on tiny cases, tight there, and never above what the planners achieve."""

import dataclasses
import itertools

import numpy as np
import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import STRATEGIES, plan_resharding, simulate_resharding
from meshshard.resharding.blocks import make_message
from meshshard.resharding.bound import tight_bound
from meshshard.resharding.hops import hop_bound, hop_bound_terms, makespan, one_chunk_relays
from meshshard.tiles import resharding_problem
from tests.bound_checks import assert_bound_met

pytestmark = pytest.mark.fast

CLUSTER = ClusterSpec(name="test-5x4", num_hosts=5, devices_per_host=4)
SRC = MeshSpec(0, (2, 1), (0, 1))
DST_HOSTS = (2, 3, 4)


def chains(hosts: tuple[int, ...]):
    """Every way to cut ``hosts`` into chains: a set of disjoint ordered tuples covering them."""
    if not hosts:
        yield ()
        return
    first, rest = hosts[0], hosts[1:]
    for k in range(len(rest) + 1):
        for others in itertools.combinations(rest, k):
            left = tuple(h for h in rest if h not in others)
            for chain in itertools.permutations((first,) + others):
                for tail in chains(left):
                    yield (chain,) + tail


def schedules():
    """Every whole-slice schedule of two roots (hosts 0 and 1) each reaching hosts 2-4
    through chains, in every per-worker order, one per class under swapping the roots
    and permuting the destination hosts (the case is symmetric in both).  A schedule is
    a tuple of ``(root, chain)`` in execution order."""
    seen = set()
    symmetries = [
        (roots, dict(zip(DST_HOSTS, perm, strict=True)))
        for roots in ((0, 1), (1, 0))
        for perm in itertools.permutations(DST_HOSTS)
    ]
    for a, b in itertools.product(chains(DST_HOSTS), repeat=2):
        msgs = [(0, c) for c in a] + [(1, c) for c in b]
        for order in itertools.permutations(msgs):
            key = min(_per_worker(order, roots, hmap) for roots, hmap in symmetries)
            if key not in seen:
                seen.add(key)
                yield order


def _per_worker(order, roots, hmap):
    """Each worker's sequence of messages once roots and hosts are renamed."""
    mapped = [(roots[r], tuple(hmap[h] for h in c)) for r, c in order]
    return tuple(tuple(m for m in mapped if w == m[0] or w in m[1]) for w in (0, 1, *DST_HOSTS))


def _messages(problem, order, devices):
    by_root = {next(iter(n.holders))[0]: n for n in problem.needs}
    out = []
    for i, (root, chain) in enumerate(order):
        need = by_root[root]
        m = make_message(need.index, 1, next(iter(need.holders)), [(h, devices) for h in chain])
        out.append(dataclasses.replace(m, round=i))
    return out


@pytest.mark.parametrize("devices", [(0,), (0, 1)], ids=["1dev", "2dev"])
def test_no_schedule_beats_the_hop_bound_and_one_meets_it(devices):
    """Two source hosts each hold half of an int8 array that three destination hosts
    need whole: 6 hops, at most 2 at once.  Every schedule (chains of every shape, every
    order) takes at least the hop bound; the best takes it (to 0.1%), and the tight
    bound is lower."""
    dst = MeshSpec(1, (3, len(devices)), DST_HOSTS)
    p = resharding_problem((2048,), "int8", SRC, ("host",), dst, ())
    bound = hop_bound(p, CLUSTER)
    assert bound > tight_bound(p, CLUSTER) * 1.2
    times = [simulate_resharding(p, _messages(p, o, devices), CLUSTER) for o in schedules()]
    assert len(times) > 100
    assert_bound_met(times, bound, 1.001)  # tight: the 2-device case adds a copy's bytes


def test_the_term_names_its_hops_and_applies_only_to_one_chunk_relays():
    dst = MeshSpec(1, (3, 1), DST_HOSTS)
    small = resharding_problem((2048,), "int8", SRC, ("host",), dst, ())
    assert str(hop_bound_terms(small, CLUSTER)).startswith(
        "hop bound 301.138 us: hops, 6 into 3 hosts, at most 2 at once"
    )
    big = resharding_problem((1 << 17,), "int8", SRC, ("host",), dst, ())
    assert one_chunk_relays(small) and not one_chunk_relays(big)
    assert hop_bound(big, CLUSTER) == tight_bound(big, CLUSTER)
    # as many destination hosts as pairs: the per-host terms already say as much
    two = resharding_problem((2048,), "int8", SRC, ("host",), MeshSpec(1, (2, 1), (2, 3)), ())
    assert hop_bound(two, CLUSTER) == tight_bound(two, CLUSTER)


def test_makespan_counts_only_sources_before_the_first_latency():
    assert makespan(6.0, 1.0, 2, 2) == 3.0
    assert makespan(3.0, 1.0, 1, 2) == 2.0  # 1 hop in [0, 1), then 2 at once
    assert makespan(0.5, 1.0, 1, 2) == 0.5


def test_no_strategy_beats_the_hop_bound_on_small_random_cases():
    """Every strategy's simulated plan takes at least the hop bound (the 500-case sweep
    is benchmarks/resharding_random.py)."""
    rng = np.random.default_rng(7)
    applied = 0
    for _ in range(6):
        parts = int(rng.integers(1, 3))
        src = MeshSpec(0, (2, parts), (0, 1))
        dst = MeshSpec(1, (3, int(rng.integers(1, 4))), DST_HOSTS)
        p = resharding_problem((96 * int(rng.integers(1, 40)),), "int8", src, ("host",), dst, ())
        bound = hop_bound(p, CLUSTER)
        applied += bound > tight_bound(p, CLUSTER)
        for s in STRATEGIES:
            if s != "broadcast_search":
                assert plan_resharding(p, s, CLUSTER).sim_time_s >= bound * (1 - 1e-9), s
    assert applied >= 3
