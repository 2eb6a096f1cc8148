"""A small MLP regression model with pipeline boundaries between its layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import meshshard


class MLP(nn.Module):
    """``num_layers`` Dense+tanh layers, a boundary after each but the last."""

    hidden: int = 16
    num_layers: int = 4
    out: int = 4
    dropout: float = 0.0  # > 0 needs rngs={"dropout": key} (see examples/random_steps.py)

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers - 1):
            x = jnp.tanh(nn.Dense(self.hidden, name=f"dense{i}")(x))
            x = nn.Dropout(self.dropout, deterministic=not self.dropout)(x)
            meshshard.mark_pipeline_boundary()
        return nn.Dense(self.out, name=f"dense{self.num_layers - 1}")(x)


def make_state(model: MLP, batch_x, learning_rate: float = 1e-2, seed: int = 0):
    """A Flax TrainState with Adam for ``model``."""
    params = model.init(jax.random.PRNGKey(seed), batch_x)["params"]
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(learning_rate)
    )


def train_step(state, batch):
    """One Adam step on the mean squared error; returns (new state, loss)."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make_batch(batch_size: int = 16, in_dim: int = 8, out_dim: int = 4, seed: int = 0):
    """A random regression batch {"x", "y"} as numpy arrays."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((batch_size, in_dim)).astype(np.float32),
        "y": rng.standard_normal((batch_size, out_dim)).astype(np.float32),
    }
