"""Parity with single-device JAX on real Ray host-actors (processes, gloo transfers)."""

import pytest

from meshshard import DataParallel, PipeshardParallel
from tests.parity import check_parity

pytestmark = pytest.mark.ray


def test_mlp_two_stages_on_two_host_meshes(ray_cluster):
    """Each stage is a 2-host x 2-device mesh: one SPMD program across two actors."""
    step = check_parity("mlp", PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (2, 2)]))
    assert [m.hosts for m in step.plan.meshes] == [(0, 1), (2, 3)]


def test_gpt_two_stages_1f1b(ray_cluster):
    check_parity("gpt", PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))


def test_gpt_four_stages_gpipe(ray_cluster):
    check_parity("gpt", PipeshardParallel(num_micro_batches=4, stages="uniform", schedule="gpipe"))


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_data_parallel_on_four_devices(ray_cluster, model):
    step = check_parity(model, DataParallel(mesh_shape=(2, 2)))
    assert step.plan.meshes[0].num_devices == 4
