"""Random keys and summed losses on real Ray host-actors (processes, gloo transfers)."""

import pytest

from meshshard import PipeshardParallel
from tests.random_parity import check_step_parity, dropout_case

pytestmark = pytest.mark.ray


def test_gpt_dropout_with_key_in_state_on_ray(ray_cluster):
    """Typed key in the state, split each step; the workers trace the keyed step themselves."""
    step, state, batches = dropout_case("gpt")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="1f1b")
    par = check_step_parity(step, method, state, batches)
    assert [m.hosts for m in par.plan.meshes] == [(0,), (1,)]
