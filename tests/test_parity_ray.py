"""Parity with single-device JAX on real Ray host-actors (processes, gloo transfers)."""

import pytest

from meshshard import DataParallel, PipeshardParallel
from meshshard.refs import Phase, ProgramRef
from tests.parity import check_parity

pytestmark = pytest.mark.ray


@pytest.mark.jax_groups(2)
def test_mlp_two_stages_on_two_host_meshes(ray_cluster):
    """Each stage is a 2-host x 2-device mesh: one SPMD program across two actors."""
    step = check_parity("mlp", PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (2, 2)]))
    assert [m.hosts for m in step.plan.meshes] == [(0, 1), (2, 3)]


def test_gpt_two_stages_1f1b(ray_cluster):
    check_parity("gpt_small", PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))


def test_mlp_four_stages_gpipe(ray_cluster):
    """Four one-host stages (the GPT's four-stage parity runs on threads)."""
    check_parity("mlp", PipeshardParallel(num_micro_batches=4, stages="uniform", schedule="gpipe"))


@pytest.mark.jax_groups(1)
def test_data_parallel_on_four_devices(ray_cluster):
    """A (2, 2) mesh over two host-actors: gradients all-reduced across processes (the
    GPT under the same plan runs on threads), inside the one program of the step."""
    step = check_parity("mlp", DataParallel(mesh_shape=(2, 2)))
    assert step.plan.meshes[0].num_devices == 4
    # one micro-batch: both actors run the whole step as one program (passes/fuse_step.py)
    assert [str(p.name) for p in step.plan.programs_run()] == ["s0.step"]


@pytest.mark.jax_groups(1)
@pytest.mark.parametrize(
    "strategy", ["broadcast", "broadcast_nolb"]
)  # every strategy keeps parity on threads (test_parity_threads); here the real broadcasts
def test_replicated_activations_cross_two_host_meshes(ray_cluster, strategy):
    """Micro-batches of 2 rows cannot split over the (2, 2) mesh's 4 devices, so its
    values are replicated there: the backward transfer from the one-host mesh must reach
    both hosts of the first mesh.  ``broadcast_nolb`` does it with real broadcasts (torch
    subgroups); ``broadcast`` picks whatever its simulation finds fastest (for these tiny
    arrays, latency-bound point-to-point messages)."""
    method = PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (1, 2)], resharding=strategy)
    step = check_parity("mlp", method, batch_size=8)
    backward = next(t for t in step.plan.transfers if t.consumer == ProgramRef(Phase.BACKWARD, 0))
    assert backward.dst_spec == () and len(step.plan.meshes[0].hosts) == 2
    for w in step.plan.meshes[0].hosts:  # both hosts get every row
        rows = sorted(b.index[0] for m in backward.messages if w in m.receivers for b in m.parts)
        assert rows[0][0] == 0 and rows[-1][1] == 2
    if strategy == "broadcast_nolb":
        assert all(m.is_broadcast for m in backward.messages)
