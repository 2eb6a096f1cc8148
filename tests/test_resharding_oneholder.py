"""The one-holder term (meshshard/resharding/oneholder.py): which problems it covers, its
cases, and no strategy's plan below it on one-holder broadcasts to 2-4 hosts (the
schedule enumeration is in tests/test_resharding_relays.py)."""

import dataclasses

import numpy as np
import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import STRATEGIES, plan_resharding
from meshshard.resharding.oneholder import one_holder_family, one_holder_seconds
from meshshard.resharding.relays import relay_bound, relay_bound_terms
from meshshard.tiles import resharding_problem

CLUSTER = dataclasses.replace(ClusterSpec.preset("aws-p3.8xlarge"), num_hosts=5)
LAT, BW = 30e-6, 1.25e9


def test_the_family_is_one_holder_and_the_same_data_everywhere():
    one = MeshSpec(0, (1, 2), (0,))
    dst = MeshSpec(1, (3, 2), (1, 2, 3))
    p = resharding_problem((6000,), "int8", one, ("device",), dst, ("device",))
    assert one_holder_family(p) == (3, 6000, 6000)
    two = MeshSpec(0, (2, 1), (0, 1))
    assert one_holder_family(resharding_problem((6000,), "int8", two, (), dst, ())) is None
    split = resharding_problem((6000,), "int8", one, (), dst, ("host",))
    assert one_holder_family(split) is None  # each host needs a different third
    rep = resharding_problem((6000,), "int8", one, (), dst, ())
    assert one_holder_family(rep) == (3, 6000, 12000)  # both devices need all of it


@pytest.mark.parametrize(
    "total, how",
    [
        (4096, "no chain through all"),
        (62208, "no chain through all"),
        (148176, "one chain through all"),
        (1 << 20, "one chain through all"),
    ],
)
def test_the_smallest_case_is_a_schedule_the_runtime_can_run(total, how):
    """Cases A and B are times of schedules (a chain through all; a chain of two then a
    direct send): the term is never above the better of them."""
    seconds, name = one_holder_seconds(3, total, total, LAT, BW)
    chain = 3 * LAT + (total + 2 * total / -(-total // (32 << 10))) / BW
    assert name == how
    assert seconds <= min(chain, 2 * LAT + 2 * total / BW) + 1e-12


@pytest.mark.slow
def test_no_strategy_beats_the_bound_on_one_holder_broadcasts():
    """Every strategy's simulated plan takes at least the relay bound (with the one-holder
    term) on random one-holder broadcasts to 2-4 hosts, and the term binds on some."""
    rng = np.random.default_rng(7)
    binds = 0
    for i in range(10):
        src = MeshSpec(0, (1, int(rng.integers(1, 3))), (0,))
        m = int(rng.integers(2, 5))
        dst = MeshSpec(1, (m, int(rng.integers(1, 4))), tuple(range(1, m + 1)))
        n = 96 * int(rng.integers(1, 3000))
        spec = ((None,), ("device",))[i % 2]
        p = resharding_problem((n,), "int8", src, ("device",), dst, spec)
        terms = relay_bound_terms(p, CLUSTER)
        binds += terms.binding.resource == "one holder"
        for s in STRATEGIES:
            if s != "broadcast_search":
                t = plan_resharding(p, s, CLUSTER).sim_time_s
                assert t >= relay_bound(p, CLUSTER) * (1 - 1e-9), (s, p)
    assert binds >= 3
