"""A small BERT-style encoder for masked-token prediction: token + segment + position
embeddings with layer norm and dropout, post-LN bidirectional encoder layers (padding
mask from the batch, GELU MLP, dropout), and an MLM head whose output matrix is the
token embedding (tied input/output embeddings, as in BERT).  A pipeline boundary
follows every encoder layer but the last.

>>> import numpy as np
>>> batch = make_batch(batch_size=4)
>>> state = make_state(Encoder(num_layers=2), batch)
>>> state, loss = train_step(state, batch)
>>> int(state.step), loss.shape
(1, ())
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import meshshard
from examples.random_steps import KeyedState


class EncoderLayer(nn.Module):
    """Post-LN transformer encoder layer (attention, then a GELU MLP), with dropout."""

    d_model: int
    num_heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask):
        drop = nn.Dropout(self.dropout, deterministic=not self.dropout)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, deterministic=True, use_bias=False, name="attn"
        )(x, x, mask=mask)
        x = nn.LayerNorm(name="ln_attn")(x + drop(h))
        h = nn.Dense(2 * self.d_model, name="up")(x)
        h = nn.Dense(self.d_model, name="down")(jax.nn.gelu(h))
        return nn.LayerNorm(name="ln_mlp")(x + drop(h))


class Encoder(nn.Module):
    """BERT-like masked language model; ``num_layers`` encoder layers."""

    vocab: int = 48
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 4
    max_len: int = 12
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, segments, padding):
        wte = nn.Embed(self.vocab, self.d_model, name="tok")
        pos = jnp.arange(tokens.shape[1])[None, :]
        x = wte(tokens) + nn.Embed(2, self.d_model, name="seg")(segments)
        x = x + nn.Embed(self.max_len, self.d_model, name="pos")(pos)
        x = nn.Dropout(self.dropout, deterministic=not self.dropout)(nn.LayerNorm(name="ln_emb")(x))
        mask = nn.make_attention_mask(padding, padding)
        for i in range(self.num_layers):
            x = EncoderLayer(self.d_model, self.num_heads, self.dropout, name=f"layer{i}")(x, mask)
            if i < self.num_layers - 1:
                meshshard.mark_pipeline_boundary()
        h = nn.LayerNorm(name="ln_head")(jax.nn.gelu(nn.Dense(self.d_model, name="head")(x)))
        bias = self.param("out_bias", nn.initializers.zeros, (self.vocab,))
        return wte.attend(h) + bias  # the output matrix is the token embedding


def mlm_loss(logits, batch):
    """Cross-entropy at the masked positions, averaged over all positions (a mean over
    the batch, so the loss combines over micro-batches by its mean)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.mean(ce * batch["weights"])


def make_state(model: Encoder, batch, seed: int = 0, tx=None) -> KeyedState:
    """Parameters, optimizer state and a dropout key for ``model``."""
    params = model.init(jax.random.key(seed), batch["tokens"], batch["segments"], batch["padding"])[
        "params"
    ]
    return KeyedState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx if tx is not None else optax.adam(1e-3),
        key=jax.random.key(seed + 1),
    )


def loss_of(state: KeyedState, batch, dropout_key):
    """The MLM loss as a function of the parameters, with dropout drawn from ``dropout_key``."""

    def loss_fn(params):
        logits = state.apply_fn(
            {"params": params},
            batch["tokens"],
            batch["segments"],
            batch["padding"],
            rngs={"dropout": dropout_key},
        )
        return mlm_loss(logits, batch)

    return loss_fn


def train_step(state: KeyedState, batch):
    """One MLM step with dropout; the dropout key is split each step."""
    key, dropout_key = jax.random.split(state.key)
    loss, grads = meshshard.value_and_grad(loss_of(state, batch, dropout_key))(state.params)
    return state.apply_gradients(grads=grads).replace(key=key), loss


def make_batch(batch_size: int = 8, seq_len: int = 12, vocab: int = 48, seed: int = 0):
    """Sentence pairs of a toy language with padding; 15% of real tokens masked (id 1)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(2, vocab, size=(batch_size, seq_len)).astype(np.int32)
    lengths = rng.integers(seq_len // 2, seq_len + 1, size=(batch_size, 1))
    padding = (np.arange(seq_len)[None, :] < lengths).astype(np.int32)
    segments = (np.arange(seq_len)[None, :] >= lengths // 2).astype(np.int32) * padding
    masked = (rng.random((batch_size, seq_len)) < 0.15) & (padding == 1)
    tokens = np.where(masked, 1, labels) * padding
    return {
        "tokens": tokens.astype(np.int32),
        "segments": segments,
        "padding": padding,
        "labels": labels,
        "weights": masked.astype(np.float32),
    }
