"""Logical views of a physical mesh (issue 11 item 3): one host's ``(1, 4)`` devices run
as a 2 x 2 mesh, the shardings name both axes, and the step equals ``jax.jit``."""

import re

import pytest

from meshshard import PipeshardParallel, ShardParallel
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.plan import MeshSpec, Plan
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from meshshard.tiles import device_blocks, resharding_problem
from tests.conftest import with_fabric_costs
from tests.parity import check_parity


@pytest.fixture
def one_host_of_8():
    with use_cluster(ThreadsCluster(1, 8)) as cluster:
        yield with_fabric_costs(cluster)


def _axes_named(plan, mesh_id: int) -> set[str]:
    """Mesh axes any buffer of mesh ``mesh_id`` is split over."""
    out = set()
    for b in plan.buffers:
        if b.mesh != mesh_id:
            continue
        for t in b.tensors:
            for entry in t.spec:
                out |= set((entry,) if isinstance(entry, str) else entry or ())
    return out


# --- the IR and the methods -------------------------------------------------------------


def test_a_view_keeps_the_devices_and_names_the_axis_sizes():
    m = MeshSpec(0, (1, 4), (0,), view=(2, 2))
    assert (m.shape, m.axis_shape, m.num_devices) == ((1, 4), (2, 2), 4)
    assert str(m) == "mesh0  1x4  viewed as 2x2  workers [w0]  axes ('host', 'device')"
    assert MeshSpec(0, (1, 4), (0,)).axis_shape == (1, 4)
    with pytest.raises(MeshshardInputError, match=r"\(3, 1\) is not a view of its 1x4"):
        MeshSpec(0, (1, 4), (0,), view=(3, 1))
    with pytest.raises(MeshshardInputError, match="device axis stays inside a host"):
        MeshSpec(0, (2, 2), (0, 1), view=(1, 4))


def test_tiles_follow_the_view_in_host_major_device_order():
    # (1, 4) as 2 x 2: devices 0, 1 are host-axis row 0, devices 2, 3 row 1
    blocks = device_blocks((2, 2), ("host", "device"), (4, 6))
    assert blocks == [((0, 2), (0, 3)), ((0, 2), (3, 6)), ((2, 4), (0, 3)), ((2, 4), (3, 6))]
    src = MeshSpec(0, (1, 4), (0,), view=(2, 2))
    dst = MeshSpec(1, (1, 4), (1,))
    p = resharding_problem((4, 6), "float32", src, ("host", "device"), dst, ())
    # every destination device needs all 4 blocks, each held by exactly one source device
    assert sorted(n.holders for n in p.needs) == [((0, 0),), ((0, 1),), ((0, 2),), ((0, 3),)]
    assert all(len(n.receivers) == 4 for n in p.needs)


def test_the_host_axis_of_a_view_inside_one_host_is_priced_on_the_fabric():
    c = ClusterSpec(num_hosts=2, devices_per_host=4)
    inside = LogicalMesh.of_mesh(MeshSpec(0, (1, 4), (0,), view=(2, 2)), c)
    across = LogicalMesh.of_mesh(MeshSpec(0, (2, 4), (0, 1), view=(4, 2)), c)
    t = lambda m: m.collective_time("all-reduce", ("host",), 1e6)  # noqa: E731
    assert inside.shape == (2, 2) and across.shape == (4, 2)
    assert t(inside) < t(across)
    assert inside.collective_time("all-reduce", ("host",), 1e6) == inside.collective_time(
        "all-reduce", ("device",), 1e6
    )


def test_methods_check_views_and_name_what_fits():
    assert ShardParallel((1, 4), logical_shape=(1, 4)).logical_shape is None  # no view
    with pytest.raises(MeshshardInputError, match=r"ShardParallel.logical_shape=\(1, 2\).*"):
        ShardParallel((1, 4), logical_shape=(1, 2))
    with pytest.raises(
        MeshshardInputError, match=r"views that fit: \[\(4, 1\), \(2, 2\), \(1, 4\)\]"
    ):
        PipeshardParallel(2, stages=[(1, 4), (1, 4)], logical_shapes=[(2, 2), (4, 2)])
    with pytest.raises(MeshshardInputError, match="one view \\(or None\\) per stage"):
        PipeshardParallel(2, stages=[(1, 4), (1, 4)], logical_shapes=[(2, 2)])
    with pytest.raises(MeshshardInputError, match="stage DP chooses"):
        PipeshardParallel(2, stages="auto", logical_shapes=[(2, 2)])
    m = PipeshardParallel(2, stages=[(1, 4), (1, 4)], logical_shapes=[(2, 2), (1, 4)])
    assert m.logical_shapes == ((2, 2), None)
    assert "logical_shapes=((2, 2), None)" in repr(m)


def test_a_view_that_does_not_fit_the_placed_mesh_names_the_argument(one_host_of_8):
    import meshshard
    from examples import mlp

    model, batch = mlp.MLP(hidden=16, num_layers=2), mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"])
    # uniform stages are (1, 8) meshes here; (3, 1) is no view of them
    method = PipeshardParallel(2, num_stages=1, logical_shapes=[(3, 1)])
    step = meshshard.parallelize(mlp.train_step, method=method)
    with pytest.raises(MeshshardInputError, match=r"logical_shapes=\(3, 1\) is not a logical view"):
        step.lower(state, batch)


def _tiny_plan(method, cluster):
    from examples import mlp
    from meshshard.passes.pipeline import plan_step

    model, batch = mlp.MLP(hidden=64, num_layers=2), mlp.make_batch(batch_size=32)
    state = mlp.make_state(model, batch["x"])
    return plan_step(mlp.train_step, (state, batch), method=method, cluster=cluster)[0]


def test_plan_json_keeps_the_view():
    import json

    plan = _tiny_plan(
        ShardParallel((1, 4), logical_shape=(2, 2)), ClusterSpec(num_hosts=1, devices_per_host=4)
    )
    assert plan.meshes[0].view == (2, 2)
    assert "mesh0  1x4  viewed as 2x2" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    del data["meshes"][0]["view"]  # a plan written before views: the physical shape
    assert Plan.from_json(json.dumps(data)).meshes[0].view is None


def test_data_parallel_stages_auto_keeps_physical_meshes():
    method = PipeshardParallel(num_micro_batches=4, stages="auto")
    plan = _tiny_plan(method, ClusterSpec(num_hosts=1, devices_per_host=8))
    assert all(m.view is None for m in plan.meshes)


# --- running on a view --------------------------------------------------------------------


@pytest.mark.slow
def test_shard_parallel_on_a_2x2_view_of_one_host_matches_jit(one_host_of_8):
    step = check_parity("mlp_wide", ShardParallel((1, 4), logical_shape=(2, 2)), steps=2)
    assert step.plan.meshes[0].view == (2, 2)
    assert any("sharding ILP on host=2xdevice=2" in n for n in step.plan.notes)
    # a host axis of size 1 is never named: splits over it exist only on the view
    assert _axes_named(step.plan, 0) == {"host", "device"}


@pytest.mark.slow
def test_a_view_mesh_and_a_plain_mesh_pass_activations_both_ways(one_host_of_8):
    method = PipeshardParallel(
        2, stages=[(1, 4), (1, 4)], sharding="auto", logical_shapes=[(2, 2), None]
    )
    step = check_parity("mlp_wide", method, steps=2)
    assert [m.view for m in step.plan.meshes] == [(2, 2), None]
    assert step.plan.transfers, "the stages exchange activations and gradients"
    assert "host" in _axes_named(step.plan, 0) and "host" not in _axes_named(step.plan, 1)


@pytest.mark.slow
def test_stages_auto_with_auto_sharding_runs_the_stage_dp_views(one_host_of_8):
    method = PipeshardParallel(num_micro_batches=4, stages="auto", sharding="auto")
    step = check_parity("mlp_wide", method, steps=2)
    chosen = [
        n for n in step.plan.notes if n.strip().startswith("s") and " as dp" in n and " x tp" in n
    ]
    assert len(chosen) == len(step.plan.meshes), step.plan.notes
    for note, mesh in zip(chosen, step.plan.meshes, strict=True):
        dp, tp = map(int, re.search(r" as dp(\d+) x tp(\d+)", note).groups())
        assert mesh.axis_shape == (dp, tp), (note, mesh)
    assert any(m.view for m in step.plan.meshes), "the DP should pick a 2-D view here"
