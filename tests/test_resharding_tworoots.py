"""The two-roots term (meshshard/resharding/tworoots.py): valid against every schedule of
the two-holder family (two source hosts, each holding its own half, three hosts that need
both), cut halves included; the best schedule takes the bound, and so does
``broadcast``'s plan."""

import dataclasses

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import STRATEGIES, plan_resharding, simulate_resharding
from meshshard.resharding.bound import MIN_CHUNK_BYTES
from meshshard.resharding.hops import hop_bound_terms
from meshshard.resharding.relays import relay_bound_terms
from meshshard.resharding.tworoots import two_roots_terms
from meshshard.tiles import resharding_problem
from tests import twoholder_schedules as two
from tests.bound_checks import assert_bound_met
from tests.test_resharding_hops import schedules as whole_schedules

CLUSTER = dataclasses.replace(ClusterSpec.preset("aws-p3.8xlarge"), num_hosts=5)
CHUNKS = (1 << 20, MIN_CHUNK_BYTES)


def _term(p):
    """The two-roots term's seconds (0.0 where it does not apply)."""
    terms = two_roots_terms(p, CLUSTER, hop_bound_terms(p, CLUSTER))
    return terms[0].seconds if terms else 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("u", "devices", "within"),
    [(38642, 1, 1.001), (73008, 1, 1.001), (73008, 2, 1.001), (282752, 1, 1.035)],
)
def test_no_whole_half_schedule_beats_the_bound_and_the_plan_is_the_best(u, devices, within):
    """Every schedule of whole halves (chains of every shape from each holder, every
    per-worker order, 1 MiB and 32 KiB chunks; 193 classes) takes at least the relay
    bound, which is the two-roots term; the best takes it (to 0.1%: each holder sends
    its half three times) except at 276 KiB halves (a chain of two hosts and a direct
    send per holder, 3.4% over: the term's "three operations into the shared host"),
    and ``broadcast``'s plan takes the best.  The sizes are three of the random
    benchmark's four two-holder misses (the fourth, 57,600 bytes, lies between).  About
    2 s each."""
    p = two.problem(u, devices)
    bound = relay_bound_terms(p, CLUSTER).seconds
    assert bound == _term(p)
    times = []
    for order in whole_schedules():
        sched = tuple((r, c, "w") for r, c in order)
        for chunk in CHUNKS:
            times.append(simulate_resharding(p, two.messages(p, sched, 0.5, chunk), CLUSTER))
    assert len(times) >= 386
    plan = plan_resharding(p, "broadcast", CLUSTER).sim_time_s
    assert_bound_met(times, bound, within, plan)


@pytest.mark.slow
@pytest.mark.parametrize("u", [38642])  # the benchmark below runs all four misses
def test_no_cut_schedule_beats_the_bound(u):
    """Each holder's half reaches each host whole or cut in two (at the half or a
    quarter), through chains of every shape, up to six messages, in every per-worker
    order, both chunk sizes: none takes less than the bound, which the plan takes.
    Message sets whose busiest worker is, in the bounds' execution model, busy past
    1.05x the plan's time are skipped (no order of them can go below the bound: the
    model is what every bound test checks).  ``benchmarks/resharding_twoholder_cuts.py``
    runs the same on all four misses.  About 10 s."""
    p = two.problem(u)
    terms = relay_bound_terms(p, CLUSTER)
    bound, lat, bw = terms.seconds, terms.latency, terms.bandwidth
    plan = plan_resharding(p, "broadcast", CLUSTER).sim_time_s
    times = []
    for msgs in two.message_sets(6):
        cuts = (0.5, 0.25) if any(piece != "w" for _, _, piece in msgs) else (0.5,)
        kinds = [
            (c, k)
            for c in cuts
            for k in CHUNKS
            if two.busiest(msgs, u, c, k, lat, bw) < 1.05 * plan
        ]
        for order in two.orders(msgs) if kinds else ():
            times += [
                simulate_resharding(p, two.messages(p, order, c, k), CLUSTER) for c, k in kinds
            ]
    assert len(times) >= 1000
    assert_bound_met(times, bound, 1.001, plan)


def test_the_term_names_its_case_and_needs_roots_that_must_share():
    """The doctest's case binds on "one holder sends each host apart"; the big halves on
    the shared host; with four destination hosts two chains need not meet (no term)."""
    assert str(relay_bound_terms(two.problem(282752), CLUSTER)).endswith(
        "roots w0 and w1, a shared host forwards twice"
    )
    four = resharding_problem(
        (4096,), "int8", two.SRC, ("host",), MeshSpec(1, (4, 1), (2, 3, 4, 5)), (None,)
    )
    cluster = dataclasses.replace(CLUSTER, num_hosts=6)
    assert two_roots_terms(four, cluster, hop_bound_terms(four, cluster)) == []
    # one source host: no pair
    one = resharding_problem(
        (4096,),
        "int8",
        MeshSpec(0, (1, 2), (0,)),
        ("device",),
        MeshSpec(1, (3, 1), (1, 2, 3)),
        (None,),
    )
    assert two_roots_terms(one, CLUSTER, hop_bound_terms(one, CLUSTER)) == []


@pytest.mark.slow
def test_no_strategy_beats_the_term_on_two_holder_cases():
    """Every strategy's plan takes at least the term on two-holder cases of several
    shapes and sizes (the 500-case sweep is benchmarks/resharding_random.py)."""
    cases = [
        ((2, 2), ("host",), (3, 1), (None,)),
        ((2, 1), ("host",), (3, 2), ("device",)),
        ((2, 2), (("host", "device"),), (3, 2), (None,)),
        ((2, 1), ("host",), (2, 2), (None,)),
    ]
    applied = 0
    for src_shape, sspec, dst_shape, dspec in cases:
        for n in (4096, 40_000, 150_000):
            src = MeshSpec(0, src_shape, (0, 1))
            dst = MeshSpec(1, dst_shape, (2, 3, 4)[: dst_shape[0]])
            p = resharding_problem((n,), "int8", src, sspec, dst, dspec)
            term = _term(p)
            applied += term > 0
            for s in STRATEGIES:
                if s != "broadcast_search":
                    assert plan_resharding(p, s, CLUSTER).sim_time_s >= term * (1 - 1e-9), s
    assert applied >= 9
