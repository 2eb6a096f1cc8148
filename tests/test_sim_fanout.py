"""The in-host fan-out (meshshard/sim/fanout.py): the landing device scatters each
device its own blocks, after a point-to-point message and on every host of a broadcast;
the planner's estimate and the tight bound's landing term agree with the simulator."""

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import Block, MeshSpec, Message
from meshshard.resharding import plan_resharding, simulate_resharding
from meshshard.resharding.bound import lower_bound, tight_bound, tight_bound_terms
from meshshard.resharding.estimate import estimate_makespan
from meshshard.sim.fanout import device_shares, scatter_broadcast
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=6)
B, ALPHA = P38.nic_bandwidth, P38.nic_latency
FB, FALPHA = P38.intra_bandwidth, P38.intra_latency


def problem(shape, ss, sp, ds, dp, dtype="int32"):
    src = MeshSpec(0, ss, tuple(range(ss[0])))
    dst = MeshSpec(1, ds, tuple(range(ss[0], ss[0] + ds[0])))
    return resharding_problem(shape, dtype, src, sp, dst, dp)


def test_host_message_scatters_once_after_the_nic():
    """Four blocks for four devices of one host: one NIC message, then one fabric latency
    while the landing device copies three blocks at once (not three chained hops)."""
    p = problem((3492,), (1, 4), ("device",), (1, 4), ("device",))
    r = plan_resharding(p, "broadcast", P38)
    assert len(r.messages) == 1 and len(r.messages[0].blocks) == 4
    nic = ALPHA + 3492 * 4 / B
    expected = nic + FALPHA + 3 * 873 * 4 / FB
    assert r.sim_time_s == pytest.approx(expected, rel=1e-9)
    assert estimate_makespan(r.messages, P38) == pytest.approx(expected, rel=1e-9)
    # the tight bound's landing term: one message, its last blocks still need a hop
    assert lower_bound(p, P38) == pytest.approx(nic)
    assert tight_bound(p, P38) == pytest.approx(nic + FALPHA)
    assert "landing" in str(tight_bound_terms(p, P38))


def test_landing_term_absent_when_one_device_needs_everything():
    """One destination device: nothing to fan out, the tight bound is the NIC bound."""
    p = problem((4096,), (1, 4), ("device",), (1, 1), ())
    assert tight_bound(p, P38) == pytest.approx(lower_bound(p, P38))


def test_broadcast_enters_each_host_once_and_scatters():
    """A 6.9 KiB host-level broadcast to two hosts of four devices: the chain crosses
    each host on one device (two NIC hops), each host scatters its four blocks; the
    estimate is the simulator's time."""
    p = problem((84, 21), (1, 1), ("device", None), (2, 4), ("device", None))
    blocks = tuple(Block(((21 * d, 21 * d + 21), (0, 21)), 0, ((d,), (d,))) for d in range(4))
    msg = Message(
        0, 1, blocks[0].index, 84 * 21 * 4, (0, 1, 2), 0, ((0, 1, 2, 3),) * 2, blocks=blocks
    )
    sim = simulate_resharding(p, [msg], P38)
    hop = ALPHA + msg.nbytes / B
    assert sim == pytest.approx(2 * hop + FALPHA + 3 * 21 * 21 * 4 / FB, rel=1e-9)
    assert estimate_makespan([msg], P38) == pytest.approx(sim, rel=1e-9)


def test_shares_and_flow_dag():
    """Each device's share is the bytes of the blocks naming it; the DAG has one NIC
    chain per host and one copy chain per other device that needs bytes."""
    m = Message(
        0,
        1,
        ((0, 4),),
        32,
        (0, 1, 2),
        0,
        ((0, 1), (0,)),
        blocks=(Block(((0, 4),), 0, ((0,), (0,))), Block(((4, 8),), 0, ((1,), (0,)))),
    )
    assert device_shares(m, 0) == ((0, 16.0), (1, 16.0))
    assert device_shares(m, 1) == ((0, 32.0),)
    d = scatter_broadcast((0, 0), [(1, device_shares(m, 0)), (2, device_shares(m, 1))], 32.0, P38)
    assert [(s.src, s.dst, s.nbytes) for s in d.steps] == [
        ((0, 0), (1, 0), 32.0),
        ((1, 0), (1, 1), 16.0),
        ((1, 0), (2, 0), 32.0),
    ]
