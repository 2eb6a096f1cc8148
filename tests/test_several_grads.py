"""A step that calls meshshard.grad more than once (a GAN: the discriminator's update,
then the generator's through the updated discriminator) runs as one program on one
stage and one micro-batch, equal to ``jax.jit``; a pipeline, which accumulates one
gradient per step, refuses it with a message that says what runs it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from meshshard import MeshshardInputError
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.random_parity import assert_results_close, check_step_parity

GEN = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
DISC = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])
OPT = optax.adam(1e-2)


def _bce(logits, target):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, target)))


def gan_step(state, batch):
    gen, disc, gen_opt, disc_opt = state

    def disc_loss(disc):
        fake = GEN.apply(gen, batch["z"])
        return _bce(DISC.apply(disc, batch["x"]), 1.0) + _bce(DISC.apply(disc, fake), 0.0)

    d_loss, grads = meshshard.value_and_grad(disc_loss)(disc)
    updates, disc_opt = OPT.update(grads, disc_opt, disc)
    disc = optax.apply_updates(disc, updates)

    def gen_loss(gen):
        return _bce(DISC.apply(disc, GEN.apply(gen, batch["z"])), 1.0)

    g_loss, grads = meshshard.value_and_grad(gen_loss)(gen)
    updates, gen_opt = OPT.update(grads, gen_opt, gen)
    return (optax.apply_updates(gen, updates), disc, gen_opt, disc_opt), (d_loss, g_loss)


def _case():
    rng = np.random.default_rng(0)
    batch = {
        "z": rng.standard_normal((16, 4)).astype(np.float32),
        "x": rng.standard_normal((16, 8)).astype(np.float32),
    }
    gen = GEN.init(jax.random.key(0), batch["z"])
    disc = DISC.init(jax.random.key(1), batch["x"])
    return (gen, disc, OPT.init(gen), OPT.init(disc)), batch


@pytest.mark.parametrize(
    "method",
    [meshshard.ShardParallel((1, 2)), meshshard.DataParallel((1, 2))],
    ids=["shard", "data"],
)
def test_a_gan_step_runs_as_one_program_equal_to_jit(method):
    state, batch = _case()
    with use_cluster(ThreadsCluster(1, 2)):
        check_step_parity(gan_step, method, state, [batch, batch], rtol=1e-4)


@pytest.mark.parametrize(
    "method, asked",
    [
        (meshshard.DataParallel((1, 2), num_micro_batches=2), "num_micro_batches=2"),
        (meshshard.PipeshardParallel(num_micro_batches=1, stages=[(1, 1), (1, 1)]), "2 stages"),
    ],
)
def test_a_pipelined_gan_step_is_refused_saying_what_runs_it(method, asked):
    state, batch = _case()
    with use_cluster(ThreadsCluster(1, 2)):
        step = meshshard.parallelize(gan_step, method=method)
        with pytest.raises(MeshshardInputError) as err:
            step(state, batch)
    assert (
        "calls meshshard.grad 2 times (e.g. a GAN's discriminator and generator updates, "
        f"SAM's ascent and descent gradients), and {asked} asks" in str(err.value)
    )
    assert "one stage and num_micro_batches=1" in str(err.value)
    assert "returns meshshard.grad's ascent gradient and a second takes it" in str(err.value)


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(16)(x))
        meshshard.mark_pipeline_boundary()
        return nn.Dense(8)(x)


def _mse(params, batch):
    return jnp.mean((Tower().apply({"params": params}, batch["z"]) - batch["x"]) ** 2)


def sam_step(params, batch):
    """Sharpness-aware minimization in one step: two meshshard.grad calls."""
    g = meshshard.grad(_mse)(params, batch)
    return sam_descent(params, batch, g)


def sam_ascent(params, batch):
    return meshshard.grad(_mse)(params, batch)


def sam_descent(params, batch, ascent):
    norm = optax.tree.norm(ascent)
    moved = jax.tree.map(lambda p, g: p + 0.05 * g / norm, params, ascent)
    loss, grads = meshshard.value_and_grad(_mse)(moved, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_sam_split_into_two_pipelined_steps_equals_jit(threads_cluster):
    # the workaround the refusal names: the ascent gradient from one step, taken by a second
    _, batch = _case()
    params = Tower().init(jax.random.key(0), batch["z"])["params"]
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    with pytest.raises(MeshshardInputError, match="SAM's ascent and descent"):
        meshshard.parallelize(sam_step, method=method).lower(params, batch)
    ascent = meshshard.parallelize(sam_ascent, method=method)
    descent = meshshard.parallelize(sam_descent, method=method)
    got, want = params, params
    for _ in range(2):
        got, loss = descent(got, batch, ascent(got, batch))
        want, want_loss = jax.jit(sam_step)(want, batch)
        assert_results_close((want, want_loss), (got, loss), rtol=1e-5)
