"""Behaviour-level pipeline tests of Alpa (alpa-projects/alpa, tests/pipeline_parallel/),
ported to meshshard's API: the facts each test checks carry over, the code does not.
Each test names its origin; what could not be ported is listed in tests/peer/README.md.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax import lax

import meshshard
from examples import mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.verify import verify
from tests.conftest import assert_trees_close

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined model

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


class TiedModel(nn.Module):
    """Tied input and output embedding with one boundary between them."""

    vocab: int = 256
    hidden: int = 16

    def setup(self):
        self.embed = nn.Embed(self.vocab, self.hidden)

    def __call__(self, x):
        x = self.embed(x)
        meshshard.mark_pipeline_boundary()
        return x @ self.embed.variables["params"]["embedding"].T


def tied_train_step(state, batch):
    def loss_fn(params):
        out = state.apply_fn(params, batch["x"])
        y = jax.nn.one_hot(batch["y"], out.shape[-1])
        return -jnp.sum(y * jax.nn.log_softmax(out, axis=-1), axis=-1).sum()  # a summed loss

    grads = meshshard.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


def test_tied_embedding_pipeshard(threads_cluster):
    # origin: tests/pipeline_parallel/test_tied_embedding.py::test_tied_embedding_pipeshard_parallel
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.integers(0, 256, (8, 8)).astype(np.int32),
        "y": rng.integers(0, 256, (8, 8)).astype(np.int32),
    }
    model = TiedModel()
    params = model.init(jax.random.PRNGKey(0), batch["x"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    step = meshshard.parallelize(
        tied_train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    got = step(state, batch)
    assert_trees_close(jax.jit(tied_train_step)(state, batch).params, got.params)


def mlp_inference_step(state, batch):
    out = state.apply_fn({"params": state.params}, batch["x"])
    return out, jnp.mean((out - batch["y"]) ** 2)


def test_mlp_inference_micro_batches(threads_cluster):
    # origin: tests/pipeline_parallel/test_inference_only.py::test_mlp (schedule
    # "inference", 4 micro-batches, per-example outputs and the loss)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(
        mlp_inference_step, method=PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    )
    got = step(state, batch)
    assert_trees_close(jax.jit(mlp_inference_step)(state, batch), got)
    assert step.plan.schedule.name == "inference"


def global_norm_and_all_le_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    grads = meshshard.grad(loss_fn)(state.params)
    norm = optax.global_norm(grads)
    new_grads = jax.tree.map(lambda g: g / norm, grads)
    all_le = jnp.array(True)
    for g in jax.tree.leaves(grads):
        all_le &= jnp.all(lax.le(g, 1.0))
    return state.apply_gradients(grads=new_grads), (new_grads, all_le)


def test_global_norm_and_all_le_are_cross_mesh_all_reduces(threads_cluster):
    # origin: tests/pipeline_parallel/test_global_norm.py::test_glob_norm_and_all_le
    # (Alpa checks two CrossMeshAllReduce ops, SUM and AND, in the HLO; meshshard shows
    # them in the plan and runs them as COLL allreduce)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(
        global_norm_and_all_le_step,
        method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
    )
    got_state, (got_grads, got_le) = step(state, batch)
    ref_state, (ref_grads, ref_le) = jax.jit(global_norm_and_all_le_step)(state, batch)
    assert_trees_close((ref_state.params, ref_grads), (got_state.params, got_grads))
    assert bool(got_le) == bool(ref_le)
    assert sorted(r.op for r in step.plan.reductions) == ["and", "sum"]
    assert verify(step.plan) == []
