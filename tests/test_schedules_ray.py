"""The new schedules on real Ray host-actors (processes, gloo transfers)."""

import optax
import pytest

from examples import mlp, random_steps
from meshshard import PipeshardParallel
from tests.parity import check_parity
from tests.random_parity import check_step_parity, dropout_case
from tests.two_bw_reference import check_2bw

pytestmark = pytest.mark.ray


def test_zb_h1_on_ray(ray_cluster):
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="zb_h1")
    step = check_parity("mlp", method, steps=2)
    assert {"s0.W", "s1.W"} <= {str(p.name) for p in step.plan.programs}


def test_2bw_on_ray(ray_cluster):
    check_2bw(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="2bw"))


def test_interleaved_1f1b_on_ray(ray_cluster):
    method = PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="interleaved_1f1b", virtual_stages=2
    )
    step = check_parity("mlp", method, steps=2)
    assert [m.hosts for m in step.plan.meshes] == [(0,), (1,), (0,), (1,)]


def test_interleaved_1f1b_with_dropout_and_clipping_on_ray(ray_cluster):
    """The dropout key crosses from chunk 0 to chunk 2 on the same host-actor: read in
    place (a local transfer), with nothing sent to itself; the global norm's all-reduce
    takes each host-actor once, its two chunks' partials combined."""
    step, _, batches = dropout_case("mlp")
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    state = random_steps.make_state(mlp.MLP(num_layers=4, dropout=0.3), batches[0]["x"], tx=tx)
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="interleaved_1f1b", virtual_stages=2
    )
    par = check_step_parity(step, method, state, batches)
    assert any(t.is_local for t in par.plan.transfers)
