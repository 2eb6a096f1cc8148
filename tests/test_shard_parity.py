"""ShardParallel and PipeshardParallel(sharding=...) compute what single-device jax.jit does."""

import pytest

from meshshard import PipeshardParallel, ShardParallel
from meshshard.refs import BufferKind
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.conftest import with_fabric_costs
from tests.parity import check_parity


@pytest.fixture
def one_host_of_8():
    with use_cluster(ThreadsCluster(1, 8)) as cluster:
        yield with_fabric_costs(cluster)


def _sharded(plan) -> bool:
    """Some parameter or optimizer state is split: the plan is not plain data parallel."""
    kinds = (BufferKind.PARAMS, BufferKind.APPLY_STATE)
    return any(t.spec for b in plan.buffers if b.name.kind in kinds for t in b.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 4), (1, 8)])
def test_shard_parallel_matches_single_device(one_host_of_8, shape):
    step = check_parity("mlp_wide", ShardParallel(shape), steps=2)
    assert any(n.startswith("mesh0 sharding ILP on host=1xdevice=") for n in step.plan.notes)
    assert _sharded(step.plan), "\n".join(step.plan.notes)


@pytest.mark.slow
def test_zero3_splits_parameters_and_keeps_parity(one_host_of_8):
    step = check_parity("mlp_wide", ShardParallel((1, 4), sharding="zero3"), steps=2)
    params = [t for b in step.plan.buffers for t in b.tensors if "kernel" in t.name]
    assert params and all(t.spec for t in params)


@pytest.mark.slow
def test_pipeshard_auto_sharding_matches_single_device(sharded_threads_cluster):
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], sharding="auto")
    step = check_parity("mlp_wide", method, steps=2)
    assert sum("sharding ILP" in n for n in step.plan.notes) == 2  # one ILP per mesh


@pytest.mark.jax_groups(1)
@pytest.mark.ray
def test_shard_parallel_mesh_across_two_host_actors(ray_cluster):
    step = check_parity("mlp_wide", ShardParallel((2, 2)), steps=2)
    assert step.plan.meshes[0].hosts == (0, 1)
    assert any("sharding ILP on host=2xdevice=2" in n for n in step.plan.notes)


@pytest.mark.slow
def test_gpt_under_pipeshard_auto_sharding_matches_single_device(sharded_threads_cluster):
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], sharding="auto")
    step = check_parity("gpt_small", method, steps=1)
    assert sum("sharding ILP" in n for n in step.plan.notes) == 2  # one ILP per mesh


@pytest.mark.jax_groups(2)
@pytest.mark.ray
def test_pipeshard_auto_sharding_on_meshes_across_two_host_actors(ray_cluster):
    """Two (2, 2) stages on the Ray cluster, each mesh spanning two host-actors, planned
    with the fabric's collective costs so the ILP splits values (not all-replicated).
    The first mesh runs as a logical 4 x 1 view: its host axis spans both host-actors'
    devices (the jax.distributed mesh laid out as the view)."""
    spec = ray_cluster.spec
    with_fabric_costs(ray_cluster)
    try:
        method = PipeshardParallel(
            num_micro_batches=2,
            stages=[(2, 2), (2, 2)],
            sharding="auto",
            logical_shapes=[(4, 1), None],
        )
        step = check_parity("mlp_wide", method, steps=2)
    finally:
        ray_cluster.spec = spec
    assert [m.hosts for m in step.plan.meshes] == [(0, 1), (2, 3)]
    assert [m.view for m in step.plan.meshes] == [(4, 1), None]
    assert sum("sharding ILP on host=4xdevice=1" in n for n in step.plan.notes) == 1
    assert sum("sharding ILP on host=2xdevice=2" in n for n in step.plan.notes) == 1
    assert _sharded(step.plan), "\n".join(step.plan.notes)


@pytest.mark.ray
def test_stages_auto_on_ray_keeps_parity(ray_cluster):
    """One-host submeshes (a mesh over all four host-actors would regroup them all)."""
    method = PipeshardParallel(num_micro_batches=4, stages="auto", submeshes=[(1, 2)])
    step = check_parity("mlp", method, steps=1)
    assert any(n.startswith("auto: ") for n in step.plan.notes), step.plan.notes
    assert all(m.shape == (1, 2) for m in step.plan.meshes)
