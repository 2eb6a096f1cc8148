"""Train steps that draw random numbers: dropout in the MLP and GPT examples, with the
dropout key kept in the train state and split every step (as Flax users write them).

>>> import numpy as np
>>> from examples import mlp
>>> model = mlp.MLP(num_layers=2, dropout=0.5)
>>> state = make_state(model, np.ones((4, 8), np.float32), seed=0)
>>> state, loss = mlp_train_step(state, mlp.make_batch(batch_size=4))
>>> int(state.step), loss.shape
(1, ())
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import meshshard


class KeyedState(train_state.TrainState):
    """A TrainState that also carries the dropout key."""

    key: jax.Array


def make_state(model, example_input, seed: int = 0, tx=None, key=None) -> KeyedState:
    """Parameters of ``model`` and a typed dropout key (``jax.random.key``) in one state.

    ``key`` may be given (e.g. a raw ``jax.random.PRNGKey``) instead of the default.
    """
    params = model.init(jax.random.key(seed), example_input)["params"]
    return KeyedState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx if tx is not None else optax.adam(1e-2),
        key=jax.random.key(seed + 1) if key is None else key,
    )


def mlp_train_step(state: KeyedState, batch):
    """MSE step of the MLP with dropout; the key is split each step."""
    key, dropout_key = jax.random.split(state.key)

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": dropout_key})
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads).replace(key=key), loss


def gpt_train_step(state: KeyedState, batch):
    """Next-token cross-entropy step of the GPT with dropout; the key is split each step."""
    key, dropout_key = jax.random.split(state.key)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"], rngs={"dropout": dropout_key})
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.mean(losses)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads).replace(key=key), loss
