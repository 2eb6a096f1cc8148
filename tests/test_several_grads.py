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
from tests.random_parity import check_step_parity

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
        f"calls meshshard.grad 2 times (e.g. a GAN's discriminator and generator updates), and {asked} asks"
        in str(err.value)
    )
    assert "one stage and num_micro_batches=1" in str(err.value)
