"""meshshard.DynamicScale: a float16 step with dynamic loss scaling, pipelined over
micro-batches, equals the same step under jax.jit with Flax's own DynamicScale, through
steps whose scaled gradients overflow (the scale backs off, the update is skipped) and
steps that grow the scale."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state

import meshshard
from tests.conftest import assert_trees_close


class HalfMLP(nn.Module):
    """Two float16 layers with float32 parameters."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(32, dtype=jnp.float16)(x))
        meshshard.mark_pipeline_boundary()
        return nn.Dense(1, dtype=jnp.float16)(x)


class ScaledState(train_state.TrainState):
    dynamic_scale: flax_dynamic_scale.DynamicScale


def train_step(state, batch):
    """Flax's mixed-precision recipe: skip the update where the gradients overflowed."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        err = pred.astype(jnp.float32) - batch["y"]
        return jnp.mean(err**2), jnp.mean(jnp.abs(err))

    dyn, finite, (loss, mae), grads = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    new = state.apply_gradients(grads=grads)
    keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
    new = new.replace(
        params=jax.tree.map(keep, new.params, state.params),
        opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
        dynamic_scale=dyn,
    )
    return new, loss, mae, finite


def make_state(dynamic_scale):
    """A state whose first steps overflow float16 at ``scale`` 2**20, then recover."""
    x = np.random.RandomState(0).randn(16, 8).astype(np.float32)
    model = HalfMLP()
    params = model.init(jax.random.key(0), x)["params"]
    return ScaledState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-2), dynamic_scale=dynamic_scale
    )


def batches(n):
    out = []
    for i in range(n):
        r = np.random.RandomState(i)
        out.append({"x": r.randn(16, 8).astype(np.float32), "y": r.randn(16, 1).astype(np.float32)})
    return out


# float16's epsilon is 9.8e-4: a gradient summed in float16 over 8 rows, then over 2
# micro-batches, differs by a few epsilons from one summed over 16 rows (measured: up to 2.6e-3)
HALF_RTOL = 5e-3
SCALE = dict(scale=2.0**20, backoff_factor=2.0**-6, growth_interval=2)


@pytest.mark.parametrize(
    "method",
    [
        meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        meshshard.PipeshardParallel(num_micro_batches=4, stages=[(1, 1), (1, 1)], schedule="gpipe"),
        meshshard.DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["1f1b-M2", "gpipe-M4", "dp-M2"],
)
def test_pipelined_dynamic_scale_equals_flax_under_jit(threads_cluster, method):
    ref = make_state(flax_dynamic_scale.DynamicScale(**SCALE))
    got = make_state(meshshard.DynamicScale(**SCALE))
    ref_step = jax.jit(train_step)
    step = meshshard.parallelize(train_step, method=method)
    finites = []
    for batch in batches(6):
        ref, ref_loss, ref_mae, ref_finite = ref_step(ref, batch)
        got, loss, mae, finite = step(got, batch)
        assert bool(finite) == bool(ref_finite)
        finites.append(bool(finite))
        assert float(got.dynamic_scale.scale) == float(ref.dynamic_scale.scale)
        assert int(got.dynamic_scale.fin_steps) == int(ref.dynamic_scale.fin_steps)
        # float16 sums over a micro-batch's rows round otherwise than over the batch's
        assert_trees_close(ref.params, got.params, rtol=HALF_RTOL)
        assert_trees_close(ref.opt_state, got.opt_state, rtol=HALF_RTOL)
        assert_trees_close((ref_loss, ref_mae), (loss, mae), rtol=HALF_RTOL)
    # the run covers both branches: overflowed steps that back off, finite ones that grow
    assert finites[0] is False and finites[-1] is True
    assert float(got.dynamic_scale.scale) > SCALE["scale"] * SCALE["backoff_factor"] ** 2


@pytest.mark.fast
def test_flax_dynamic_scale_is_refused_with_a_pointer_to_ours():
    step = meshshard.parallelize(
        train_step, method=meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 2)
    )
    state = make_state(flax_dynamic_scale.DynamicScale(**SCALE))
    with pytest.raises(meshshard.MeshshardInputError, match="use meshshard.DynamicScale"):
        step.lower(state, batches(1)[0])


@pytest.mark.fast
def test_axis_name_is_refused():
    with pytest.raises(meshshard.MeshshardInputError, match="axis_name='batch'"):
        meshshard.DynamicScale().value_and_grad(jnp.sum, axis_name="batch")
