"""Flax ``BatchNorm`` in a convolutional train step: the semantics the README states.

With one micro-batch a step that normalises by its batch's statistics and returns the
updated running averages equals ``jax.jit``. With several, each micro-batch normalises
by its own statistics (as in GPipe): the step then equals gradient accumulation over the
micro-batches, with the running averages averaged, and a warning names the running
variances, whose mean over micro-batches is not the full batch's variance.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from meshshard import DataParallel, PipeshardParallel
from tests.random_parity import assert_results_close, check_step_parity


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x)


class SmallResNet(nn.Module):
    """Two conv + batch-norm blocks, a stage each, and a linear classifier."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = ConvBlock(8)(x, train)
        meshshard.mark_pipeline_boundary()
        x = x + ConvBlock(8)(x, train)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class BatchNormState(train_state.TrainState):
    batch_stats: dict


def _batches(n=2, rows=8):
    rng = np.random.RandomState(0)
    return [
        {
            "x": rng.randn(rows, 8, 8, 3).astype(np.float32) + 0.5 * i,
            "y": rng.randint(0, 10, rows).astype(np.int32),
        }
        for i in range(n)
    ]


BATCHES = _batches()


def _state():
    model = SmallResNet()
    variables = model.init(jax.random.key(0), BATCHES[0]["x"])
    return BatchNormState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adam(1e-2),
    )


def _loss(state, params, batch):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        batch["x"],
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]


def train_step(state, batch):
    """The Flax ImageNet example's step: the loss, and the new running averages as aux."""
    (loss, stats), grads = meshshard.value_and_grad(lambda p: _loss(state, p, batch), has_aux=True)(
        state.params
    )
    return state.apply_gradients(grads=grads, batch_stats=stats), loss


def eval_step(state, batch):
    """Inference mode: normalised by the running averages, so no batch statistic."""
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats}, batch["x"], train=False
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return state, loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])


def accumulation_reference(state, batch, m):
    """GPipe's semantics in plain JAX: each micro-batch normalised by its own statistics,
    gradients and running averages averaged over the micro-batches."""
    rows = batch["x"].shape[0] // m
    grads, losses, stats = [], [], []
    for i in range(m):
        micro = jax.tree.map(lambda a, i=i: a[i * rows : (i + 1) * rows], batch)
        (loss, stat), grad = jax.value_and_grad(
            lambda p, micro=micro: _loss(state, p, micro), has_aux=True
        )(state.params)
        grads.append(grad)
        losses.append(loss)
        stats.append(stat)
    mean = lambda *xs: sum(xs) / m  # noqa: E731
    new = state.apply_gradients(grads=jax.tree.map(mean, *grads))
    return new.replace(batch_stats=jax.tree.map(mean, *stats)), mean(*losses)


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=1, stages=[(1, 2), (1, 2)]),
        DataParallel(mesh_shape=(1, 2)),
    ],
    ids=["pipeshard", "data-parallel"],
)
def test_one_micro_batch_matches_jit(threads_cluster, method):
    check_step_parity(train_step, method, _state(), BATCHES)


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="gpipe"),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["1f1b-m2", "gpipe-m4", "data-parallel-m2"],
)
def test_micro_batches_match_gradient_accumulation(threads_cluster, method):
    par = meshshard.parallelize(train_step, method=method)
    m = method.num_micro_batches
    reference = jax.jit(accumulation_reference, static_argnums=2)
    ref, got = _state(), _state()
    for batch in BATCHES:
        ref_out = reference(ref, batch, m)
        got_out = par(got, batch)
        assert_results_close(ref_out, got_out)
        ref, got = ref_out[0], got_out[0]
    guessed = [n for n in par.plan.notes if "['BatchNorm_0']['var']: mean over" in n]
    assert len(guessed) == 2, par.plan.notes  # one per block, warned at compile time
    # and differs from the full batch's step: the statistics really are per micro-batch
    full = jax.jit(train_step)(_state(), BATCHES[0])[0].batch_stats
    once = par(_state(), BATCHES[0])[0].batch_stats
    assert not np.allclose(
        full["ConvBlock_0"]["BatchNorm_0"]["var"], once["ConvBlock_0"]["BatchNorm_0"]["var"]
    )


def test_inference_mode_matches_jit_with_micro_batches(threads_cluster):
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)])
    par = meshshard.parallelize(eval_step, method=method)
    state = jax.jit(train_step)(_state(), BATCHES[0])[0]  # running averages moved once
    for batch in BATCHES:
        assert_results_close(jax.jit(eval_step)(state, batch), par(state, batch))
