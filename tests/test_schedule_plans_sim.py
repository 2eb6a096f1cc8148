"""Simulated schedules on synthetic plans: with free communication the bubble equals
each schedule's closed form, and eager 1F1B beats 1F1B once sends take time."""

from dataclasses import replace

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.passes.schedules import make_schedule
from meshshard.sim.schedule_plans import StageCosts, schedule_plan
from meshshard.sim.simulator import simulate
from meshshard.verify import verify

FREE = ClusterSpec(
    name="free",
    num_hosts=8,
    devices_per_host=1,
    peak_flops=(("float16", 1e12),),
    launch_overhead=0.0,
    nic_bandwidth=1e18,
    nic_latency=0.0,
    intra_bandwidth=1e18,
    intra_latency=0.0,
)
UNIT = StageCosts(1e12, 1e12, 1e12, 1 << 10, param_bytes=1 << 10)  # F = B = W = 1 s


def _busiest_idle(name, S, M, cluster=FREE, costs=UNIT, **opts):
    plan = schedule_plan(make_schedule(name, S, M, **opts), costs, cluster=cluster)
    assert verify(plan) == []
    t = simulate(plan, cluster).iteration_time
    return t, 1 - 3 * M / t


@pytest.mark.parametrize("S,M", [(2, 4), (4, 4), (4, 8)])
def test_free_communication_bubbles_equal_the_closed_forms(S, M):
    closed = {
        "gpipe": (S - 1) / (M + S - 1),
        "1f1b": (S - 1) / (M + S - 1),
        "eager_1f1b": (S - 1) / (M + S - 1),
        "zb_h1": (S - 1) / (3 * M + S - 1),
    }
    for name, want in closed.items():
        assert _busiest_idle(name, S, M)[1] == pytest.approx(want, abs=1e-9), name
    v = 2  # chunks take half a stage's time: (S-1) / (v M + S - 1)
    got = _busiest_idle("interleaved_1f1b", S, M, virtual_stages=v)[1]
    assert got == pytest.approx((S - 1) / (v * M + S - 1), abs=1e-9)


def test_2bw_steady_state_has_no_bubble():
    t2 = _busiest_idle("2bw", 4, 4, steps=2)[0]
    t4 = _busiest_idle("2bw", 4, 4, steps=4)[0]
    assert (t4 - t2) / 2 == pytest.approx(4 * 3.0)  # M (F + B + W) per step


def test_eager_1f1b_hides_forward_sends_that_1f1b_waits_for():
    slow = replace(FREE, nic_bandwidth=1e9 / 4, nic_latency=0.0)
    costs = replace(UNIT, activation_bytes=int(0.25e9 / 4))  # a send takes 1/4 of an F
    t_1f1b = _busiest_idle("1f1b", 4, 8, slow, costs)[0]
    t_eager = _busiest_idle("eager_1f1b", 4, 8, slow, costs)[0]
    assert t_eager < t_1f1b * 0.97
