"""Parity helpers for steps with random draws: meshshard vs jax.jit of the same step."""

import jax
import numpy as np

import meshshard
from examples import gpt, mlp, random_steps
from tests.conftest import assert_trees_close


def dropout_case(model_name: str, batch_size: int = 8):
    """(step, state, batches) for the MLP or GPT example with dropout 0.3."""
    if model_name == "mlp":
        model = mlp.MLP(num_layers=4, dropout=0.3)
        batches = [mlp.make_batch(batch_size=batch_size, seed=i) for i in range(2)]
        state = random_steps.make_state(model, batches[0]["x"])
        return random_steps.mlp_train_step, state, batches
    model = gpt.GPT(num_layers=4, dropout=0.3)
    batches = [gpt.make_batch(batch_size=batch_size, seed=i) for i in range(2)]
    state = random_steps.make_state(model, batches[0]["inputs"])
    return random_steps.gpt_train_step, state, batches


def check_step_parity(step, method, state, batches, *extra, batch_argnums=(1,), rtol=1e-5):
    """Each step's state and results equal ``jax.jit(step)``'s (within ``rtol``, see
    :func:`tests.conftest.assert_trees_close`); returns the parallel step."""
    ref_step = jax.jit(step)
    par = meshshard.parallelize(step, method=method, batch_argnums=batch_argnums)
    ref, got = state, state
    for batch in batches:
        ref_out = ref_step(ref, batch, *extra)
        got_out = par(got, batch, *extra)
        assert_results_close(ref_out, got_out, rtol)
        ref, got = ref_out[0], got_out[0]
    return par


def assert_results_close(ref, got, rtol=1e-5):
    """Trees equal within the foundation's tolerance; typed keys compared by their data."""

    def plain(x):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    ref = jax.tree.map(plain, ref)
    got = jax.tree.map(plain, got)
    ints = [
        (a, b)
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True)
        if not np.issubdtype(a.dtype, np.floating)
    ]
    for a, b in ints:  # keys, counters and counts: exactly equal
        np.testing.assert_array_equal(a, b)
    assert_trees_close(ref, got, rtol)
