"""Resharding plans executed for real: every destination device ends with exactly the
NumPy reference tile, and every worker receives exactly the bytes its plan says."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshshard.cluster import ClusterSpec
from meshshard.methods import RESHARDING_STRATEGIES
from meshshard.passes.emit import transfer_only_plan
from meshshard.plan import MeshSpec, TensorSpec, TransferSpec
from meshshard.resharding import plan_resharding
from meshshard.runtime.transfer_run import (
    expected_bytes_received,
    expected_tiles,
    run_transfer_threads,
)
from meshshard.tiles import resharding_problem

CLUSTER = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=4)
AXES = [None, "host", "device", ("host", "device"), ("device", "host")]


def make_plan(shape, src_shape, src_spec, dst_shape, dst_spec, strategy, dtype="int32"):
    src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
    dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
    problem = resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)
    planned = plan_resharding(problem, strategy, CLUSTER, simulate=False)
    t = TransferSpec(
        "t0",
        TensorSpec(0, "x", shape, dtype, src_spec),
        dst_spec,
        0,
        1,
        None,  # no producer program: a transfer on its own
        None,
        planned.messages,
        planned.strategy,
    )
    return transfer_only_plan(t, (src, dst), CLUSTER)


def check_delivery(plan, tiles, received, full):
    dst = plan.meshes[1]
    assert sorted(tiles) == list(dst.hosts)
    for w in dst.hosts:
        exp = expected_tiles(full, plan, w)
        for d, (idx, data) in exp.items():
            assert tiles[w][d][0] == idx
            np.testing.assert_array_equal(tiles[w][d][1], data)
    for w, nbytes in received.items():
        assert nbytes == expected_bytes_received(plan, w), f"w{w}"


@st.composite
def problems(draw):
    src_shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    dst_shape = (draw(st.integers(1, 4 - src_shape[0])), draw(st.integers(1, 3)))
    ndim = draw(st.integers(1, 3))
    specs = []
    for _ in range(2):  # a spec for the source mesh, then the destination
        used, spec = set(), []
        for _ in range(ndim):
            entry = draw(st.sampled_from(AXES))
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            if used & set(names):
                entry, names = None, ()
            used |= set(names)
            spec.append(entry)
        specs.append(tuple(spec))
    # every dim divisible by any combination of axis sizes that may split it
    mult = int(np.lcm(src_shape[0] * src_shape[1], dst_shape[0] * dst_shape[1]))
    shape = tuple(int(mult * draw(st.integers(1, 2))) for _ in range(ndim))
    return shape, src_shape, specs[0], dst_shape, specs[1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(RESHARDING_STRATEGIES))
def test_random_reshardings_deliver_exact_tiles_threads(case, strategy):
    shape, src_shape, src_spec, dst_shape, dst_spec = case
    plan = make_plan(shape, src_shape, src_spec, dst_shape, dst_spec, strategy)
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    tiles, received = run_transfer_threads(plan, full)
    check_delivery(plan, tiles, received, full)


RAY_CASES = [
    ((64, 48, 32), (1, 2), ("device",), (2, 2), ()),  # one host to two, replicated
    ((64, 48, 32), (2, 2), ("host",), (2, 2), ("host",)),  # paper case 1, scaled down
    ((64, 48, 32), (2, 2), (None, "host"), (2, 2), ("host",)),  # paper case 3
    ((96, 40, 8), (1, 4), ("device",), (3, 1), ()),  # paper case 7 shape: 1 host to 3
]


def test_ray_cases_exercise_collectives():
    """Sanity of the cases below: real broadcasts run (broadcast_nolb always, ours where its
    simulation finds them faster, as in the one-host-to-three case)."""
    for case in RAY_CASES:
        plan = make_plan(*case, "broadcast_nolb")
        if len(plan.meshes[1].hosts) > 1 and case[4] == ():
            assert all(m.is_broadcast for m in plan.transfers[0].messages), case
    plan = make_plan(*RAY_CASES[3], "broadcast")
    assert any(m.is_broadcast for m in plan.transfers[0].messages)


@pytest.mark.ray
@pytest.mark.parametrize(
    "strategy", ["broadcast", "broadcast_nolb", "send_recv", "local_allgather"]
)
@pytest.mark.parametrize("case", RAY_CASES, ids=lambda c: f"{c[1]}{c[2]}->{c[3]}{c[4]}")
def test_reshardings_on_ray_actors(ray_cluster, case, strategy):
    shape, src_shape, src_spec, dst_shape, dst_spec = case
    plan = make_plan(shape, src_shape, src_spec, dst_shape, dst_spec, strategy)
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    tiles, _, received = ray_cluster.run_transfer(plan, full)
    check_delivery(plan, tiles, received, full)
