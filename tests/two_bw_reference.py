"""An independent plain-JAX PipeDream-2BW reference, and the check against meshshard.

The reference never calls meshshard: per step it averages ``jax.grad`` of the MLP's
mean-squared error over the ``M`` micro-batches (in order) at the *previous* step's
weights, and applies the optimizer to the current weights:
``W(k+1) = W(k) - opt(mean_m grad f_m(W(k-1)))``, with ``W(-1) = W(0)``.
"""

import jax
import jax.numpy as jnp
import numpy as np

import meshshard
from examples import mlp
from tests.conftest import assert_trees_close


def reference_2bw(state, batches, num_micro_batches):
    """(state, loss) after each step of the 2BW update rule, in plain JAX."""

    def loss_fn(params, x, y):
        pred = state.apply_fn({"params": params}, x)
        return jnp.mean((pred - y) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    stale, out = state.params, []
    for batch in batches:
        xs = np.split(batch["x"], num_micro_batches)
        ys = np.split(batch["y"], num_micro_batches)
        parts = [grad_fn(stale, x, y) for x, y in zip(xs, ys, strict=True)]
        loss = sum(p[0] for p in parts) / num_micro_batches
        grads = jax.tree.map(lambda *g: sum(g) / num_micro_batches, *(p[1] for p in parts))
        stale = state.params  # this step's weights are the next step's stale version
        state = state.apply_gradients(grads=grads)
        out.append((state, loss))
    return out


def check_2bw(method, steps: int = 5):
    """meshshard's ``schedule='2bw'`` equals the reference step for step."""
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(steps)]
    state = mlp.make_state(model, batches[0]["x"], learning_rate=0.05)
    want = reference_2bw(state, batches, method.num_micro_batches)
    step = meshshard.parallelize(mlp.train_step, method=method)
    got, outs = state, []
    for batch in batches:  # no fetch in between: later calls run pipelined, unflushed
        got, loss = step(got, batch)
        outs.append((got, loss))
    for (want_state, want_loss), (got_state, got_loss) in zip(want, outs, strict=True):
        assert_trees_close(want_state.params, got_state.params)
        assert_trees_close(want_state.opt_state, got_state.opt_state)
        assert_trees_close(want_loss, got_loss)
    # and it is not plain synchronous training: from step 2 on the weights differ
    sync = state
    for batch in batches[:2]:
        sync, _ = jax.jit(mlp.train_step)(sync, batch)
    diff = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), sync.params, want[1][0].params)
    )
    assert max(diff) > 1e-4
    return step
