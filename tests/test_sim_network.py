"""Flow model and collectives against closed forms (PAPER_NOTES 4.1, 4.7).

Every expected value is a formula of the cluster's figures; tolerances are 1% or
tighter (most results are exact to rounding).
"""

import math
from dataclasses import replace

import pytest

from meshshard.cluster import ClusterSpec, gbit
from meshshard.sim import SimOptions, simulate
from meshshard.sim.collectives import decompose
from meshshard.sim.network import FlowNetwork, max_min_rates
from meshshard.sim.synthetic import synthetic_collective, synthetic_exchange
from meshshard.sim.topology import Topology

P38 = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=5)
B = P38.nic_bandwidth  # 10 Gb/s
ALPHA = P38.nic_latency
N = 100_000_000


def close(a, b, rel=1e-9):
    return a == pytest.approx(b, rel=rel)


# --- max-min solver and the flow network ---------------------------------------------


def test_max_min_progressive_filling():
    # two links: flow 0 on A, flow 1 on A and B, flow 2 on B; A is the bottleneck
    assert max_min_rates([(0,), (0, 1), (1,)], [2.0, 10.0]) == [1.0, 1.0, 9.0]
    # three flows on one link share it equally
    assert max_min_rates([(0,), (0,), (0,)], [3.0]) == [1.0, 1.0, 1.0]
    # a flow with no links (same-device copy) is not limited
    assert max_min_rates([()], [1.0]) == [math.inf]


def test_flow_joining_later_shares_from_then_on():
    net = FlowNetwork([10.0])
    a = net.start(0.0, (0,), 20.0)
    net.advance(1.0)  # a has moved 10 of 20 bytes alone
    b = net.start(1.0, (0,), 5.0)
    net.run()
    # from t=1 both get 5 B/s: b needs 1 s, then a has 5 bytes left alone at 10 B/s
    assert close(b.end, 2.0) and close(a.end, 2.5)
    assert close(net.moved[0], 25.0) and close(net.busy[0], 2.5)


def test_latency_is_paid_before_the_bytes():
    net = FlowNetwork([4.0])
    f = net.start(0.0, (0,), 8.0, latency=0.5)
    net.run()
    assert close(f.end, 2.5)


def test_topology_path_crosses_each_hop():
    topo = Topology(ClusterSpec.preset("dgx-a100", num_hosts=2))
    names = [topo.links[i].name for i in topo.path((0, 3), (1, 5))]
    assert names == ["h0.d3.out", "h0.nic3.out", "h1.nic5.in", "h1.d5.in"]
    assert [topo.links[i].name for i in topo.path((0, 1), (0, 2))] == ["h0.d1.out", "h0.d2.in"]
    over = Topology(replace(ClusterSpec.preset("dgx-a100", num_hosts=2), oversubscription=4.0))
    assert "switch" in [over.links[i].name for i in over.path((0, 0), (1, 0))]


# --- point to point through the whole simulator ----------------------------------------


def test_one_transfer_is_latency_plus_bytes_over_bandwidth():
    r = simulate(synthetic_exchange([(0, 1, N)], cluster=P38), P38)
    assert close(r.iteration_time, ALPHA + N / B)
    assert close(r.link("h0.nic0.out").moved, N) and close(r.link("h1.nic0.in").moved, N)


def test_two_flows_sharing_one_nic_take_twice_as_long():
    # two senders into one receiver NIC
    r = simulate(synthetic_exchange([(0, 2, N), (1, 2, N)], cluster=P38), P38)
    assert close(r.iteration_time, ALPHA + 2 * N / B)
    # one sender out of one NIC to two receivers
    r = simulate(synthetic_exchange([(0, 1, N), (0, 2, N)], cluster=P38), P38)
    assert close(r.iteration_time, ALPHA + 2 * N / B)


def test_nic_is_full_duplex():
    r = simulate(synthetic_exchange([(0, 1, N), (1, 0, N)], cluster=P38), P38)
    assert close(r.iteration_time, ALPHA + N / B)


def test_oversubscribed_switch_caps_aggregate_traffic():
    over = ClusterSpec(
        name="o",
        num_hosts=4,
        devices_per_host=1,
        nic_bandwidth=1e9,
        nic_latency=0.0,
        oversubscription=2.0,
    )
    # two disjoint pairs would each run at 1 GB/s; the core carries 4*1/2 = 2 GB/s total
    r = simulate(synthetic_exchange([(0, 1, N), (2, 3, N)], cluster=over), over)
    assert close(r.iteration_time, N / 1e9)
    # four flows at once: the core (2 GB/s) binds, each gets 0.5 GB/s
    r = simulate(
        synthetic_exchange([(0, 1, N), (1, 0, N), (2, 3, N), (3, 2, N)], cluster=over), over
    )
    assert close(r.iteration_time, N / 0.5e9)


def test_intra_host_message_uses_the_fabric():
    c = ClusterSpec(
        name="c", num_hosts=1, devices_per_host=2, intra_bandwidth=2e9, intra_latency=1e-6
    )
    net = FlowNetwork(Topology(c).capacity)
    topo = Topology(c)
    f = net.start(0.0, topo.path((0, 0), (0, 1)), 1e9, latency=topo.latency((0, 0), (0, 1)))
    net.run()
    assert close(f.end, 1e-6 + 0.5)


# --- collectives ----------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_ring_allreduce_closed_form(p):
    r = simulate(synthetic_collective("allreduce", range(p), N, cluster=P38), P38)
    expected = 2 * (p - 1) / p * N / B + 2 * (p - 1) * ALPHA
    assert close(r.iteration_time, expected)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_chain_broadcast_is_bytes_over_bandwidth_plus_fill(k):
    r = simulate(synthetic_collective("broadcast", range(k), N, root=0, cluster=P38), P38)
    chunks = math.ceil(N / P38.chunk_bytes)
    c = N / chunks
    # chunks stream back to back: each of the k-1 edges pays alpha once, and the last
    # chunk leaves the last edge after chunks + k - 2 chunk times
    assert close(r.iteration_time, (k - 1) * ALPHA + (chunks + k - 2) * c / B)
    # each host boundary is crossed once: every NIC out but the last member's carries n
    for h in range(k - 1):
        assert close(r.link(f"h{h}.nic0.out").moved, N)
    assert r.link(f"h{k - 1}.nic0.out").moved == 0


def test_broadcast_stays_flat_while_send_recv_falls_as_one_over_k():
    # PAPER_NOTES 1.7 / 4.7: 1-to-m on p3.8xlarge, 1 GiB
    n = 2**30
    times_bc, times_sr = [], []
    for k in (1, 2, 4):
        group = tuple(range(k + 1))
        times_bc.append(
            simulate(
                synthetic_collective("broadcast", group, n, root=0, cluster=P38), P38
            ).iteration_time
        )
        sr = synthetic_exchange([(0, d, n) for d in range(1, k + 1)], cluster=P38)
        times_sr.append(simulate(sr, P38).iteration_time)
    gbps = [n * 8 / 2**30 / t for t in times_bc]
    assert all(g == pytest.approx(9.31, rel=0.01) for g in gbps)  # the paper's units
    # k copies through the root's one NIC: alpha + k n / B, i.e. 9.31/k in the paper's units
    for k, t in zip((1, 2, 4), times_sr, strict=True):
        assert close(t, ALPHA + k * n / B)


def test_allgather_reducescatter_alltoall_closed_forms():
    p = 4
    r = simulate(synthetic_collective("allgather", range(p), N, cluster=P38), P38)
    assert close(r.iteration_time, (p - 1) * (ALPHA + N / p / B))
    r = simulate(synthetic_collective("reducescatter", range(p), N, cluster=P38), P38)
    assert close(r.iteration_time, (p - 1) * (ALPHA + N / p / B))
    # all pairs at once: each NIC out carries p-1 flows of n/p
    r = simulate(synthetic_collective("alltoall", range(p), N, cluster=P38), P38)
    assert close(r.iteration_time, ALPHA + (p - 1) / p * N / B)


def test_hierarchical_allreduce_on_dgx():
    dgx = ClusterSpec.preset("dgx-a100", num_hosts=2)
    g, p, n = 8, 2, 1e9
    plan = synthetic_collective("allreduce", (0, 1), int(n), cluster=dgx, devices_per_host=8)
    r = simulate(plan, dgx, options=SimOptions(allreduce="hierarchical"))
    intra = 2 * (g - 1) * (dgx.intra_latency + n / g / dgx.intra_bandwidth)
    inter = 2 * (p - 1) * (dgx.nic_latency + n / (g * p) / dgx.nic_bandwidth)
    assert close(r.iteration_time, intra + inter)
    # ring over hosts uses one channel per NIC: 8 parallel rings
    r = simulate(plan, dgx, options=SimOptions(allreduce="ring"))
    assert close(
        r.iteration_time, 2 * (p - 1) * (dgx.nic_latency + n / (p * g) / dgx.nic_bandwidth)
    )


def test_decompose_structure():
    d = decompose("broadcast", (2, 0, 1), 0, 8 << 20, P38, chunk_bytes=4 << 20)
    assert d.members == (0, 1, 2)  # the chain starts at the root
    assert [(s.src[0], s.dst[0]) for s in d.steps] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert d.steps[3].deps == (1, 2)
    assert len(decompose("allreduce", (0,), None, 10, P38).steps) == 0
    with pytest.raises(ValueError, match="no decomposition rule for collective 'gather'"):
        decompose("gather", (0, 1), None, 10, P38)


def test_gbit_helper():
    assert gbit(10) == 1.25e9
