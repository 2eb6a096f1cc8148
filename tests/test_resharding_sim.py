"""Resharding plans on the simulator: device-level routes, the paper's order effects, all-gathers.

Arrays are 64 MiB (not the paper's 2 GiB) so the file runs fast; ratios between plans
are what the paper's analysis predicts (PAPER_NOTES 1.7 and 4.7).
"""

import dataclasses

import pytest

from meshshard.cluster import ClusterSpec, gbit
from meshshard.plan import MeshSpec, Message
from meshshard.resharding import check_messages, plan_resharding, simulate_resharding
from meshshard.resharding.simulate import resharding_sim_plan
from meshshard.sim import SimOptions, simulate
from meshshard.sim.collectives import decompose
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge")
MIB64 = (256, 256, 256)  # int32: 64 MiB


def problem(src_shape, src_spec, dst_shape, dst_spec, shape=MIB64, dtype="int32"):
    src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
    dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
    return resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)


def sim(p, strategy, cluster=P38):
    return plan_resharding(p, strategy, cluster).sim_time_s


# --- the simulator's device-level routes ---------------------------------------------------


def test_broadcast_chains_through_every_listed_device():
    d = decompose("broadcast", (0, 1), 0, 4 << 20, P38, devices={0: (2,), 1: (1, 3)})
    edges = sorted({(s.src, s.dst) for s in d.steps})
    assert edges == [((0, 2), (1, 1)), ((1, 1), (1, 3))]
    assert len(d.steps) == 2 * 4  # two edges, four 1 MiB chunks each
    plain = decompose("broadcast", (0, 1), 0, 4 << 20, P38)
    assert {(s.src, s.dst) for s in plain.steps} == {((0, 0), (1, 0))}


def test_intra_host_fan_out_is_pipelined():
    """A broadcast to 4 devices of one host costs the NIC time plus a few fabric chunks."""
    p = problem((1, 1), (), (1, 4), ())
    t = sim(p, "broadcast")
    nic = (64 << 20) / gbit(10)
    chunk = (1 << 20) / P38.intra_bandwidth
    assert nic < t < nic + P38.nic_latency + 3 * (chunk + P38.intra_latency) + 1e-6
    assert sim(p, "send_recv") == pytest.approx(4 * (nic + P38.nic_latency), rel=1e-6)


def test_point_to_point_flows_use_the_named_devices():
    p = problem((1, 4), ("device",), (1, 4), ("device",), shape=(4 << 20,), dtype="int8")
    r = plan_resharding(p, "send_recv", P38, simulate=False)
    assert [(m.src_device, m.dst_devices) for m in r.messages] == [(d, ((d,),)) for d in range(4)]
    plan, times = resharding_sim_plan(p, r.messages, P38)
    res = simulate(plan, P38, options=SimOptions(serial_comm=True), program_times=times)
    moved = {link.name: link.moved for link in res.links if link.moved}
    for d in range(4):
        assert moved[f"h0.d{d}.out"] == pytest.approx(1 << 20)
        assert moved[f"h1.d{d}.in"] == pytest.approx(1 << 20)


def test_devices_pick_the_nic_on_multi_nic_hosts():
    """With a NIC per device, two sends from different devices run side by side."""
    two = dataclasses.replace(P38, nics_per_host=4, nic_of_device=(0, 1, 2, 3))
    p = problem((1, 2), ("device",), (1, 2), ("device",), shape=(2 << 20,), dtype="int8")
    msgs = plan_resharding(p, "send_recv", two, simulate=False).messages
    plan, times = resharding_sim_plan(p, msgs, two)
    overlapped = simulate(plan, two, options=SimOptions(serial_comm=False), program_times=times)
    assert overlapped.iteration_time == pytest.approx((1 << 20) / gbit(10) + P38.nic_latency)


# --- the paper's effects ------------------------------------------------------------------


def test_case3_naive_order_costs_half_again():
    """Every source host sends to every destination host: naive order 1.5x (PAPER_NOTES 1.7)."""
    p = problem((2, 4), (None, "host"), (2, 4), ("host",))
    ours, naive = sim(p, "broadcast"), sim(p, "broadcast_nolb")
    assert ours == pytest.approx(plan_resharding(p, "broadcast", P38).lower_bound_s, rel=0.01)
    assert naive / ours == pytest.approx(1.5, rel=0.01)


def test_case6_naive_order_costs_double():
    """Two source hosts, three destinations: the naive order blocks behind the first send."""
    p = problem((2, 4), ("host",), (3, 4), ("host",), shape=(384, 256, 170))
    ours, naive, search = sim(p, "broadcast"), sim(p, "broadcast_nolb"), sim(p, "broadcast_search")
    assert naive / ours == pytest.approx(2.0, rel=0.01)
    assert search == pytest.approx(ours, rel=0.01)


def test_case2_first_holder_overloads_one_sender():
    p = problem((2, 4), (), (2, 4), ("host",))
    ours, nolb, greedy = sim(p, "broadcast"), sim(p, "broadcast_nolb"), sim(p, "broadcast_greedy")
    assert nolb / ours == pytest.approx(2.0, rel=0.01)
    assert greedy == pytest.approx(ours, rel=0.01)


def test_case7_broadcast_is_8x_send_recv():
    """One host to two hosts x 4 devices, replicated: 8 copies per slice with send/recv."""
    p = problem((1, 4), ("device",), (2, 4), ())
    r = plan_resharding(p, "broadcast", P38)
    assert 1 < r.ratio < 1.08  # per 16 MiB slice: a 1 MiB chunk of chain fill, 6 fabric hops
    assert sim(p, "send_recv") / r.lower_bound_s == pytest.approx(8.0, rel=0.01)
    assert sim(p, "local_allgather") == sim(p, "send_recv")  # not applicable: falls back


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_one_to_many_send_recv_slope(k):
    p = problem((1, 1), (), (1, k), (), shape=(16 << 20,))
    ours = sim(p, "broadcast")
    assert sim(p, "send_recv") / ours == pytest.approx(k, rel=0.02)


def test_local_allgather_pays_its_gather():
    """Case 1: each of 4 replicas gets 1/4 over the NIC, then takes 3/4 over the fabric."""
    p = problem((2, 4), ("host",), (2, 4), ("host",))
    r = plan_resharding(p, "local_allgather", P38)
    tile = (64 << 20) // 2
    assert [g.missing for g in r.gathers] == [tile * 3 // 4] * 2
    gather = tile * 3 / 4 / P38.intra_bandwidth + 3 * P38.intra_latency
    nic = tile / gbit(10)
    assert r.sim_time_s == pytest.approx(nic + 4 * P38.nic_latency + gather, rel=1e-3)
    assert sim(p, "broadcast") < r.sim_time_s


def test_simulate_rejects_incomplete_messages():
    p = problem((1, 1), (), (1, 2), (), shape=(8,))
    half = Message(0, 1, ((0, 4),), 16, dst_devices=((0,),))
    with pytest.raises(ValueError, match=r"w1\.0 gets 4 of the 8 elements"):
        simulate_resharding(p, [half], P38)
    with pytest.raises(ValueError, match="lacks|num_hosts"):
        simulate_resharding(
            p,
            plan_resharding(p, "broadcast", P38, simulate=False).messages,
            dataclasses.replace(P38, num_hosts=1),
        )
    check_messages(p, plan_resharding(p, "broadcast", P38, simulate=False).messages)


HD = ("host", "device")
PAPER_64MIB = [
    ((2, 4), ("host",), (2, 4), ("host",), MIB64),
    ((2, 4), (), (2, 4), ("host",), MIB64),
    ((2, 4), (None, "host"), (2, 4), ("host",), MIB64),
    ((2, 4), (None, HD), (2, 4), (HD,), MIB64),
    ((2, 4), ("device",), (2, 4), ("host",), MIB64),
    ((2, 4), ("host",), (3, 4), ("host",), (384, 256, 170)),
    ((1, 4), ("device",), (2, 4), (), MIB64),
    ((2, 4), (None, "host"), (2, 4), (None, None, "host"), MIB64),
]


@pytest.mark.parametrize("case", PAPER_64MIB, ids=[str(i) for i in (1, 2, 3, 4, 5, 6, 7, 9)])
def test_ours_meets_the_bound_and_every_baseline(case):
    """The paper's n-to-m cases at 64 MiB: ours within 1.08x of the bound (case 7 pays a
    chunk of chain fill per 16 MiB slice; the rest a few fabric hops) and never slower."""
    p = problem(*case)
    ours = plan_resharding(p, "broadcast", P38)
    assert ours.ratio < (1.08 if case[0] == (1, 4) else 1.005)
    for strategy in ("send_recv", "local_allgather", "broadcast_nolb", "broadcast_greedy"):
        assert ours.sim_time_s <= sim(p, strategy) * (1 + 1e-9), strategy
