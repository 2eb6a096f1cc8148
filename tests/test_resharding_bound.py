"""The NIC lower bound in closed form (PAPER_NOTES section 1.7), and that no plan beats it."""

import dataclasses
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshshard.cluster import ClusterSpec, gbit
from meshshard.plan import MeshSpec
from meshshard.resharding import (
    lower_bound,
    lower_bound_terms,
)
from meshshard.tiles import ReshardingProblem, SliceNeed, resharding_problem

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_resharding_properties import problems, scaled, strategy_times  # noqa: E402

P38 = ClusterSpec.preset("aws-p3.8xlarge")
GIB2 = (1024, 1024, 512)  # int32: 2 GiB
NIC = gbit(10)
ALPHA = P38.nic_latency


def problem(src_shape, src_spec, dst_shape, dst_spec, shape=GIB2, dtype="int32"):
    src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
    dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
    return resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)


# (case, src mesh, src spec, dst mesh, dst spec, shape, bytes on the binding NIC,
#  messages it needs at least: one per source host a destination must hear from, or per
#  group of destination hosts a source must reach)
PAPER = [
    (1, (2, 4), ("host",), (2, 4), ("host",), GIB2, 2**30, 1),
    (2, (2, 4), (), (2, 4), ("host",), GIB2, 2**30, 1),
    (3, (2, 4), (None, "host"), (2, 4), ("host",), GIB2, 2**30, 2),
    (4, (2, 4), (None, ("host", "device")), (2, 4), (("host", "device"),), GIB2, 2**30, 2),
    (5, (2, 4), ("device",), (2, 4), ("host",), GIB2, 2**30, 1),
    (6, (2, 4), ("host",), (3, 4), ("host",), (3072, 1024, 170), 1536 * 1024 * 170 * 4, 2),
    (7, (1, 4), ("device",), (2, 4), (), GIB2, 2**31, 1),
    (9, (2, 4), (None, "host"), (2, 4), (None, None, "host"), GIB2, 2**30, 2),
]


@pytest.mark.parametrize("case,ss,sp,ds,dp,shape,nbytes,senders", PAPER)
def test_paper_cases_closed_form(case, ss, sp, ds, dp, shape, nbytes, senders):
    """PAPER_NOTES 1.7: 0.859 s (18.6 'Gbps') for cases 1-5 and 9, 0.856 s for case 6,
    1.72 s (9.3) for case 7: the busiest NIC's bytes at 10 Gb/s, plus one latency per
    source host a destination host needs (the slices it takes from one source host can
    come in one host-level message)."""
    got = lower_bound(problem(ss, sp, ds, dp, shape), P38)
    assert got == pytest.approx(nbytes / NIC + senders * ALPHA, rel=1e-12)
    paper = {1: 0.859, 6: 0.856, 7: 1.72}.get(case, 0.859)
    assert got == pytest.approx(paper, abs=0.002)


def test_binding_terms_name_the_resource():
    b = lower_bound_terms(problem((2, 4), ("host",), (3, 4), ("host",), (3072, 1024, 170)), P38)
    assert b.binding.resource in ("w0 egress", "w1 egress")  # case 6: each source sends its half
    b7 = lower_bound_terms(problem((1, 4), ("device",), (2, 4), ()), P38)
    tied = {t.resource for t in b7.terms if t.seconds == b7.seconds}
    assert tied == {"w0 egress", "w1 ingress", "w2 ingress"}  # case 7: 2 GiB through each NIC
    assert str(b7) == "lower bound 1.718 s: w1 ingress, 2.0 GiB at 1.25 GB/s + 1 x 30 us latency"


def test_replicated_source_spreads_over_holders():
    """A slice every source host holds may leave from any: the whole-mesh term, not one host's."""
    p = problem((2, 1), (), (1, 1), (), shape=(1 << 20,), dtype="int8")
    b = lower_bound_terms(p, dataclasses.replace(P38, nic_latency=0.0))
    egress = {t.resource: t.seconds for t in b.terms if "egress" in t.resource}
    assert egress == {"w0+w1 egress": pytest.approx((1 << 20) / (2 * NIC))}
    assert b.seconds == pytest.approx((1 << 20) / NIC)  # the single receiver binds


def test_subset_term_is_the_max_flow_bound():
    """Slices held only by w0 (3 units) or by w0 and w1 (1 unit): spreading the egress
    gives w0 3 units (the {w0} term), not 4/2 (the whole-mesh term)."""
    src, dst = MeshSpec(0, (2, 1), (0, 1)), MeshSpec(1, (4, 1), (2, 3, 4, 5))
    needs = tuple(
        SliceNeed(((i, i + 1),), ((0, 0),) if i < 3 else ((0, 0), (1, 0)), ((2 + i, 0),))
        for i in range(4)
    )
    p = ReshardingProblem((4,), "int8", src, (), dst, ("host",), needs)
    b = lower_bound_terms(p, dataclasses.replace(P38, num_hosts=6, nic_latency=0.0))
    egress = {t.resource: t.nbytes for t in b.terms if "egress" in t.resource}
    assert egress == {"w0 egress": 3, "w0+w1 egress": 4}
    assert b.binding.resource == "w0 egress" and b.seconds == pytest.approx(3 / NIC)
    assert lower_bound(problem((1, 1), (), (1, 1), (), shape=(0,)), P38) == 0.0


def test_more_nics_raise_the_bandwidth():
    p = problem((2, 4), ("host",), (2, 4), ("host",))
    c = dataclasses.replace(P38, nics_per_host=4, nic_of_device=(0, 1, 2, 3))
    assert lower_bound(p, c) == pytest.approx(2**30 / (4 * NIC) + ALPHA)


CLUSTER6 = dataclasses.replace(P38, num_hosts=6)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(problem=problems(), scale=st.sampled_from([1 << 12, 1 << 20]))
def test_no_strategy_beats_the_bound(problem, scale):
    """The simulated time of every strategy's plan is at least the bound."""
    p = scaled(problem, scale)
    bound = lower_bound(p, CLUSTER6)
    for strategy, t in strategy_times(p, CLUSTER6):
        assert t >= bound * (1 - 1e-9), strategy
