"""A model this project had not seen (examples/bert.py: a BERT-like encoder with tied
input/output embeddings, dropout, layer norm and a padding mask) trained with
chain(clip_by_global_norm(1.0), adamw) on uneven stages, against jax.jit."""

import jax
import optax
import pytest

import meshshard
from examples import bert
from meshshard import PipeshardParallel
from meshshard.verify import verify
from tests.conftest import assert_trees_close

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined model

#: 4 layers on 3 stages: stage 0 holds 2 layers (the embeddings too), stages 1 and 2 one
#: each (the last with the tied MLM head); the middle mesh is one device.
UNEVEN = [(1, 2), (1, 1), (1, 2)]


def setup():
    batch = bert.make_batch(batch_size=8)
    # eps=1e-6: with 1e-8, Adam turns gradient entries at rounding-noise level into
    # full-size updates (see tests/test_shared_params.py, the tied GPT's docstring)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6))
    state = bert.make_state(bert.Encoder(num_layers=4), batch, tx=tx)
    return state, lambda i: bert.make_batch(batch_size=8, seed=i)


def run_and_compare(m: int, steps: int = 2):
    state, batches = setup()
    step = meshshard.parallelize(
        bert.train_step, method=PipeshardParallel(num_micro_batches=m, stages=UNEVEN)
    )
    ref_step = jax.jit(bert.train_step)
    ref, got = state, state
    for i in range(steps):
        ref, ref_loss = ref_step(ref, batches(i))
        got, loss = step(got, batches(i))
        assert_trees_close(ref.params, got.params)
        assert_trees_close(ref.opt_state, got.opt_state)
        assert_trees_close(ref_loss, loss)
        assert_trees_close(jax.random.key_data(ref.key), jax.random.key_data(got.key))
    return step.plan


@pytest.mark.parametrize(
    "m", [4]
)  # one M keeps the suite in budget; M=2 paths are covered by test_shared_params
def test_bert_like_encoder_on_uneven_stages_matches_jit(threads_cluster, m):
    plan = run_and_compare(m)
    assert verify(plan) == []
    assert [st.layers for st in plan.stages] == [(0, 1), (2,), (3,)]
    assert [mesh.shape for mesh in plan.meshes] == [(1, 2), (1, 1), (1, 2)]
    notes = "\n".join(plan.notes)
    assert "shared parameter args[0].params['tok']['embedding']: owner stage 0" in notes
    assert plan.reductions  # the global norm: partial sums per mesh + an all-reduce
    assert any(i.path == "<micro-batch index>" for i in plan.inputs)  # dropout draws


@pytest.mark.ray
def test_bert_like_encoder_on_ray(ray_cluster):
    run_and_compare(2)
