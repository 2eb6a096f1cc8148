"""Cross-stage updates on real Ray host-actors: the all-reduce runs on torch.distributed
(gloo) over every worker, including meshes that span two host-actors."""

import pytest

from meshshard import PipeshardParallel
from meshshard.verify import verify
from tests.test_cross_stage import OPTIMIZERS, check, mlp_setup

pytestmark = pytest.mark.ray


@pytest.mark.jax_groups(2)
def test_update_across_two_host_meshes(ray_cluster):
    """Two stages, each a 2-host x 2-device mesh: a mesh's two workers contribute its
    partial once (the leader) and the identity (the other).  Global-norm clipping sums
    every mesh's partial; the other optimizers' cross-stage updates run the same
    reduction instructions (test_cross_stage, on one-host meshes)."""
    method = PipeshardParallel(num_micro_batches=2, stages=[(2, 2), (2, 2)])
    step = check(mlp_setup(OPTIMIZERS["clip_adamw"]()), method)
    assert [m.hosts for m in step.plan.meshes] == [(0, 1), (2, 3)]
    assert all(r.group == (0, 1, 2, 3) and r.leaders == (0, 2) for r in step.plan.reductions)
    assert verify(step.plan) == []


def test_clip_on_four_stages(ray_cluster):
    """Global-norm clipping over four host-actors (every optimizer: test_cross_stage)."""
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    check(mlp_setup(OPTIMIZERS["clip_adamw"]()), method)
