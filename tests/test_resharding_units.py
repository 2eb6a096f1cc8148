"""The pieces of the planners: round LP, bounded search, estimate, block cuts, docstrings."""

import doctest
import importlib

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec, Message
from meshshard.resharding import plan_resharding
from meshshard.resharding.blocks import cut_block, cut_dim, make_message, split_block
from meshshard.resharding.estimate import estimate_makespan, execution_order
from meshshard.resharding.rounds import Flow, routes_of, schedule_rounds
from meshshard.resharding.search import Work, search_schedule
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge")


def test_rounds_meet_the_busiest_host_on_case6():
    """PAPER_NOTES 1.7, case 6: A=s0->d0 (2), B=s0->d1 (1), C=s1->d1 (1), D=s1->d2 (2)."""
    flows = [Flow((0,), (10,), 2), Flow((0,), (11,), 1), Flow((1,), (11,), 1), Flow((1,), (12,), 2)]
    s = schedule_rounds(flows)
    assert s.optimal and s.length == pytest.approx(3.0)
    for r in s.rounds:  # every round is host-disjoint
        hosts = [h for route in r.routes for h in route.hosts]
        assert len(hosts) == len(set(hosts))


def test_rounds_split_receivers_when_broadcasts_collide():
    """Three slices, each needed by two of three hosts and held by its own sender: as
    broadcasts every pair collides (3 units); sent to each receiver alone they pack into
    2 units, the receivers' ingress."""
    flows = [Flow((0,), (10, 11), 1), Flow((1,), (11, 12), 1), Flow((2,), (10, 12), 1)]
    s = schedule_rounds(flows)
    assert s.length == pytest.approx(2.0)
    assert all(len(route.receivers) == 1 for r in s.rounds for route in r.routes)


def test_rounds_prefer_the_chain_broadcast_for_multicast():
    """Case 7: one sender, two receivers: one broadcast (each byte leaves once)."""
    s = schedule_rounds([Flow((0,), (1, 2), 4)])
    assert s.length == pytest.approx(4.0)
    assert [r.routes[0].receivers for r in s.rounds] == [(1, 2)]


def test_route_costs_shift_work_to_cheaper_routes():
    flows = [Flow((0, 1), (2,), 2)]
    assert {r.sender for r in routes_of(flows)} == {0, 1}
    s = schedule_rounds(flows, cost=lambda r: 1.0 if r.sender == 0 else 0.0)
    moved = {}
    for r in s.rounds:
        for route, amount in zip(r.routes, r.amounts, strict=True):
            moved[route.sender] = moved.get(route.sender, 0) + amount
    assert sum(moved.values()) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="every flow must carry bytes"):
        schedule_rounds([Flow((0,), (1,), 0)])


def test_search_finds_the_case6_order_and_stops_at_the_bound():
    works = [Work((0,), (10,), 2), Work((0,), (11,), 1), Work((1,), (11,), 1), Work((1,), (12,), 2)]
    r = search_schedule(works)
    assert r.makespan == 3 and r.complete
    assert str(r).startswith("search: makespan 3 B after")


def test_search_chooses_senders():
    works = [Work((0, 1), (10,), 2), Work((0, 1), (11,), 2)]
    r = search_schedule(works)
    assert r.makespan == 2 and set(r.senders) == {0, 1}


def test_estimate_runs_messages_by_round_then_position():
    a = Message(0, 2, ((0, 1),), 10**6, round=1)
    b = Message(0, 3, ((1, 2),), 10**6, round=0)
    assert execution_order([a, b]) == [1, 0]
    one = 10**6 / P38.nic_bandwidth + P38.nic_latency
    assert estimate_makespan([a, b], P38) == pytest.approx(2 * one)
    chain = Message(0, 1, ((0, 1),), 8 << 20, group=(0, 1, 2), dst_devices=((0,), (0,)))
    fill = (1 << 20) / P38.nic_bandwidth
    assert estimate_makespan([chain], P38) == pytest.approx(
        2 * P38.nic_latency + (8 << 20) / P38.nic_bandwidth + fill
    )


def test_blocks_cut_along_the_outer_long_dim():
    assert cut_dim(((0, 4), (0, 64))) == 1
    assert cut_dim(((0, 32), (0, 64))) == 0
    assert cut_block(((8, 40), (0, 64)), 2, 5) == ((10, 13), (0, 64))
    assert split_block(((0, 6),), 0, 3) == (((0, 2),), ((2, 4),), ((4, 6),))
    m = make_message(((0, 4),), 4, (0, 1), [(2, (0, 1)), (3, (2,))])
    assert m.group == (0, 2, 3) and m.dst == 2 and m.src_device == 1 and m.nbytes == 16
    assert make_message(((0, 4),), 4, (0, 1), [(2, (3,))]).group == ()


def test_ours_cuts_a_replicated_slice_between_its_holders():
    """Two replicated source hosts, three receivers of a third each: the egress bound
    (n/2 per source) needs one third split between the senders."""
    src, dst = MeshSpec(0, (2, 1), (0, 1)), MeshSpec(1, (3, 1), (2, 3, 4))
    p = resharding_problem((3 << 20,), "int8", src, (), dst, ("host",))
    c = ClusterSpec.preset("aws-p3.8xlarge")
    r = plan_resharding(p, "broadcast", c)
    sent = {}
    for m in r.messages:
        sent[m.src] = sent.get(m.src, 0) + m.nbytes
    assert sent == {0: 3 << 19, 1: 3 << 19}
    assert r.ratio < 1.05  # six 512 KiB messages: latency is 7% of each


MODULES = [
    "meshshard.resharding.blocks",
    "meshshard.resharding.bound",
    "meshshard.resharding.chunks",
    "meshshard.resharding.coverage",
    "meshshard.resharding.estimate",
    "meshshard.resharding.gather",
    "meshshard.resharding.planner",
    "meshshard.resharding.result",
    "meshshard.resharding.rounds",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"ClusterSpec": ClusterSpec})
    assert result.failed == 0 and result.attempted > 0
