"""Activations that skip stages: a U-Net's encoder features read by its last stage, and
a sequence-to-sequence model whose encoder output every decoder stage attends to.
Training equals ``jax.jit``.  Such a value is relayed: every boundary it crosses carries
it, so each stage in between receives it and sends it on (and its gradient back)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from examples.mlp import train_step as unet_step  # the mean squared error to the clean image
from meshshard import PipeshardParallel
from meshshard.verify import verify
from tests.conftest import assert_trees_close

pytestmark = pytest.mark.slow  # each test compiles and runs a four-stage pipeline


class UNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        skips = []
        for width in (8, 16):
            x = nn.relu(nn.Conv(width, (3, 3))(x))
            skips.append(x)
            x = nn.avg_pool(x, (2, 2), (2, 2))
            meshshard.mark_pipeline_boundary()
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        meshshard.mark_pipeline_boundary()
        for width, skip in zip((16, 8), reversed(skips), strict=True):
            x = jax.image.resize(x, (*skip.shape[:3], x.shape[3]), "nearest")
            x = nn.relu(nn.Conv(width, (3, 3))(jnp.concatenate([x, skip], -1)))
        return nn.Conv(1, (1, 1))(x)


VOCAB, LENGTH, WIDTH = 32, 6, 16


class Seq2Seq(nn.Module):
    @nn.compact
    def __call__(self, src, tgt):
        embed = nn.Embed(VOCAB, WIDTH)
        memory = nn.Dense(WIDTH)(embed(src))
        meshshard.mark_pipeline_boundary()
        h = embed(tgt)
        for i in range(3):  # stages 1-3 each attend to stage 0's output
            q = nn.LayerNorm()(h)
            h = h + nn.MultiHeadDotProductAttention(num_heads=2, name=f"cross{i}")(q, memory)
            h = h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(h)))
            if i < 2:
                meshshard.mark_pipeline_boundary()
        return embed.attend(nn.LayerNorm()(h))


def unet_batch(seed):
    r = np.random.default_rng(seed)
    clean = r.standard_normal((8, 8, 8, 1)).astype(np.float32)
    return {"x": clean + 0.1 * r.standard_normal(clean.shape).astype(np.float32), "y": clean}


def seq_batch(seed):
    r = np.random.default_rng(seed)
    ints = lambda: r.integers(0, VOCAB, (8, LENGTH)).astype(np.int32)  # noqa: E731
    return {"src": ints(), "tgt": ints(), "y": ints()}


def seq_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["src"], batch["tgt"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _state(model, *inputs):
    params = model.init(jax.random.PRNGKey(0), *inputs)["params"]
    # eps=1e-3: gradient entries at rounding level must not become full-size updates
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3, eps=1e-3)
    )


def _check(step_fn, state, batches, method):
    """Parameters and loss after each step equal ``jax.jit``'s; returns the plan."""
    step, ref_step = meshshard.parallelize(step_fn, method=method), jax.jit(step_fn)
    ref, got = state, state
    for batch in batches:
        ref, ref_loss = ref_step(ref, batch)
        got, loss = step(got, batch)
        # per element, with an absolute floor: an attention key bias gets a gradient
        # of exactly zero (softmax ignores a shift), so both runs hold rounding noise
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
        assert_trees_close(ref_loss, loss)
    assert verify(step.plan) == []
    return step.plan


def _carried(plan, shape) -> list:
    """(from mesh, to mesh) of the forward transfers of values of ``shape`` (per
    micro-batch)."""
    return sorted(
        (t.src_mesh, t.dst_mesh)
        for t in plan.transfers
        if t.tensor.shape == shape and str(t.producer).endswith(".F")
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_unet_s_skips_cross_stages_and_train_equal_to_jit(threads_cluster, schedule):
    """Stage 0's features (8 x 8 x 8 per example) reach the last stage, where the
    decoder's two blocks run after the bottleneck, through stages 1 and 2."""
    batches = [unet_batch(s) for s in range(3)]
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 4, schedule=schedule)
    plan = _check(unet_step, _state(UNet(), batches[0]["x"]), batches, method)
    assert _carried(plan, (2, 8, 8, 8)) == [(0, 1), (1, 2), (2, 3)]


def test_every_decoder_stage_reads_the_encoder_output(threads_cluster):
    """The encoder's output (stage 0) is read by stages 1, 2 and 3; its gradient comes
    back as the sum of the three stages' contributions."""
    batches = [seq_batch(s) for s in range(3)]
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    state = _state(Seq2Seq(), batches[0]["src"], batches[0]["tgt"])
    plan = _check(seq_step, state, batches, method)
    # the encoder's output from stage 0 on, the decoder's activations from stage 1 on
    assert _carried(plan, (4, LENGTH, WIDTH)) == [(0, 1), (1, 2), (1, 2), (2, 3), (2, 3)]
