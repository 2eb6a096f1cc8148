"""Steps and losses already wrapped in jax.jit, and remat'd layers, pipeline like plain code."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import meshshard
from examples import mlp
from meshshard import ClusterSpec, MeshshardInputError, PipeshardParallel
from meshshard.passes.trace import trace_step
from tests.random_parity import check_step_parity

BATCHES = [mlp.make_batch(batch_size=8, seed=i) for i in range(2)]
METHOD = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def mlp_state():
    return mlp.make_state(mlp.MLP(num_layers=4), BATCHES[0]["x"])


def test_jit_wrapped_step(threads_cluster):
    par = check_step_parity(jax.jit(mlp.train_step), METHOD, mlp_state(), BATCHES)
    assert len(par.plan.stages) == 2


def jit_loss_step(state, batch):
    @jax.jit
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_jit_wrapped_loss(threads_cluster):
    par = check_step_parity(jit_loss_step, METHOD, mlp_state(), BATCHES)
    assert [s.layers for s in par.plan.stages] == [(0, 1), (2, 3)]


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(16)(x))


class RematMLP(nn.Module):
    """Each layer under nn.remat; the boundaries sit between layers."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.remat(Layer)(name=f"layer{i}")(x)
            meshshard.mark_pipeline_boundary()
        return nn.Dense(4)(x)


def remat_state():
    model = RematMLP()
    params = model.init(jax.random.key(0), BATCHES[0]["x"])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def test_remat_layers(threads_cluster):
    state = remat_state()
    traced = trace_step(
        mlp.train_step, (state, BATCHES[0]), batch_argnums=(1,), num_micro_batches=2
    )
    # the recomputation survives inlining: each layer's backward recomputes behind the
    # barrier XLA's lowering of remat puts there (passes/inline_remat.py)
    names = [e.primitive.name for e in traced.jaxpr.eqns]
    assert names.count("optimization_barrier") >= 3 and "remat2" not in names
    check_step_parity(mlp.train_step, METHOD, state, BATCHES)


def checkpoint_loss_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jax.checkpoint(lambda p, y: jnp.mean((p - y) ** 2))(pred, batch["y"])

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_jax_checkpoint_in_loss(threads_cluster):
    check_step_parity(checkpoint_loss_step, METHOD, mlp_state(), BATCHES)


class BoundaryInsideRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        return jax.checkpoint(lambda h: (meshshard.mark_pipeline_boundary(), jnp.tanh(h))[1])(x)


def test_boundary_inside_remat_is_refused():
    model = BoundaryInsideRemat()
    params = model.init(jax.random.key(0), BATCHES[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    with pytest.raises(
        MeshshardInputError,
        match=r"mark_pipeline_boundary\(\) is called inside jax.checkpoint / nn.remat.*"
        r"put the boundary outside it",
    ):
        step.lower(state, BATCHES[0], cluster=ClusterSpec("jit-4x2", 4, 2))
