"""A small GPT-style decoder (token + position embedding, pre-LN blocks with causal
self-attention and an MLP, final layer norm, an output head that is its own matrix or,
with ``tie_embeddings=True``, the token embedding) with a pipeline boundary after
every block."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import meshshard


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a GELU MLP, both residual."""

    d_model: int
    num_heads: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        drop = nn.Dropout(self.dropout, deterministic=not self.dropout)
        seq = x.shape[1]
        mask = nn.make_causal_mask(jnp.ones((x.shape[0], seq), jnp.int32))
        h = nn.LayerNorm(name="ln1")(x)
        # No q/k/v biases (as in most current GPTs): a key bias cannot change the
        # softmax, so its gradient is pure rounding noise that Adam would amplify.
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, name="attn", deterministic=True, use_bias=False
        )(h, h, mask=mask)
        x = x + drop(h)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * self.d_model, name="fc1")(h)
        h = nn.Dense(self.d_model, name="fc2")(jax.nn.gelu(h))
        return x + drop(h)


class GPT(nn.Module):
    """Decoder-only language model; ``num_layers`` blocks, a boundary after each but the last.

    ``tie_embeddings``: the output head is the token embedding ``wte`` (read by the
    first and the last stage).
    """

    vocab: int = 64
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 4
    max_len: int = 16
    tie_embeddings: bool = False
    dropout: float = 0.0  # > 0 needs rngs={"dropout": key} (see examples/random_steps.py)

    @nn.compact
    def __call__(self, tokens):
        pos = jnp.arange(tokens.shape[1])[None, :]
        wte = nn.Embed(self.vocab, self.d_model, name="wte")
        x = wte(tokens)
        x = x + nn.Embed(self.max_len, self.d_model, name="wpe")(pos)
        for i in range(self.num_layers):
            x = Block(self.d_model, self.num_heads, self.dropout, name=f"block{i}")(x)
            if i < self.num_layers - 1:
                meshshard.mark_pipeline_boundary()
        x = nn.LayerNorm(name="ln_f")(x)
        if self.tie_embeddings:
            return wte.attend(x)
        return nn.Dense(self.vocab, use_bias=False, name="head")(x)


def make_state(model: GPT, tokens, learning_rate: float = 3e-3, seed: int = 0):
    """A Flax TrainState with Adam for ``model``."""
    params = model.init(jax.random.PRNGKey(seed), tokens)["params"]
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(learning_rate)
    )


def train_step(state, batch):
    """One Adam step of next-token cross-entropy; returns (new state, loss)."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.mean(losses)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make_batch(batch_size: int = 8, seq_len: int = 16, vocab: int = 64, seed: int = 0):
    """A batch of a learnable toy language: each sequence counts up from a random start."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(batch_size, 1))
    seq = (start + np.arange(seq_len + 1)[None, :]) % vocab
    return {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)}
