"""The update part of a micro-batched step reads constants of the full batch's size
(``passes/update_constants.py``).

Before, a constant Python computed from the batch's shape after ``meshshard.grad`` was
the micro-batch's: the examples-seen counter advanced by 8 per step of 16 and the
gradients divided by the batch size came out M times too large, silently."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from meshshard import DataParallel, PipeshardParallel
from meshshard.passes.update_constants import update_constant_overrides, use_full_batch_constants
from tests.random_parity import check_step_parity


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        meshshard.mark_pipeline_boundary()
        return nn.Dense(4)(x)


TX = optax.sgd(0.05)


def counting_step(state, batch):
    params, opt, seen = state

    def loss_fn(p):  # a sum over the examples, scaled by hand below
        return jnp.sum((Net().apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    total, grads = meshshard.value_and_grad(loss_fn)(params)
    n = batch["x"].shape[0]
    grads = jax.tree.map(lambda g: g / n, grads)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt, seen + n), total / n


def _setup():
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.standard_normal((16, 4)).astype(np.float32),
        }
        for _ in range(2)
    ]
    params = Net().init(jax.random.key(0), batches[0]["x"])["params"]
    return (params, TX.init(params), jnp.zeros((), jnp.int32)), batches


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, schedule="zb_h1"),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["pipe-M2", "zb_h1-M4", "dp-M2"],
)
def test_a_step_counting_examples_and_scaling_by_the_batch_size_equals_jit(threads_cluster, method):
    state, batches = _setup()
    par = check_step_parity(counting_step, method, state, batches)
    assert par.plan.num_micro_batches == method.num_micro_batches


def test_the_overrides_name_the_update_literals_that_differ():
    state, batches = _setup()
    half = jax.tree.map(lambda a: a[:8], batches[0])
    micro = jax.make_jaxpr(counting_step)(state, half)
    full = jax.make_jaxpr(counting_step)(state, batches[0])
    overrides = update_constant_overrides(micro, full)
    assert sorted(float(v) for v in overrides.values()) == [16.0] * len(overrides)
    assert len(overrides) >= 3  # the gradients' divisions, the counter, the loss
    fixed = use_full_batch_constants(micro, full)
    assert not update_constant_overrides(fixed, full)
    assert use_full_batch_constants(full, full) is full  # nothing to change: unchanged
