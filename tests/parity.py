"""Train a model a few steps with meshshard and with plain jax.jit; compare after each step."""

import jax
import numpy as np

import meshshard
from examples import gpt, mlp
from tests.conftest import assert_trees_close

MODELS = {
    "mlp": lambda: (mlp, mlp.MLP(num_layers=4), mlp.make_batch(batch_size=16)),
    "gpt": lambda: (gpt, gpt.GPT(num_layers=4), gpt.make_batch(batch_size=8)),
    "gpt_small": lambda: (gpt, gpt.GPT(num_layers=2), gpt.make_batch(batch_size=8)),
    # a large table: its replicas' gradient moves as touched rows under comm_schedule sparse
    "gpt_vocab": lambda: (gpt, gpt.GPT(vocab=1024, num_layers=2), gpt.make_batch(batch_size=8)),
    # wide enough that the sharding ILP splits weights and activations (not all-replicated)
    "mlp_wide": lambda: (mlp, mlp.MLP(hidden=256, num_layers=2), mlp.make_batch(batch_size=64)),
    # narrow with a long batch: the sharding ILP splits the batch on the last stage
    "mlp_long_batch": lambda: (mlp, mlp.MLP(hidden=64, num_layers=2), mlp.make_batch(8192)),
}


def run_steps(step, state, batches):
    """``state`` after ``step`` on each of ``batches``: (params as NumPy, the losses)."""
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(np.asarray(loss))
    return jax.tree.map(np.asarray, state.params), losses


def check_parity(model_name: str, method, steps: int = 3, batch_size: int | None = None):
    """Parameters and loss after each of ``steps`` steps equal a single-device jax.jit run."""
    module, model, batch = MODELS[model_name]()
    if batch_size is not None:
        batch = module.make_batch(batch_size=batch_size)
    key = "x" if model_name.startswith("mlp") else "inputs"
    state = module.make_state(model, batch[key])
    ref_step = jax.jit(module.train_step)
    step = meshshard.parallelize(module.train_step, method=method)
    ref, got = state, state
    for i in range(steps):
        batch_i = module.make_batch(seed=i, **({"batch_size": batch[key].shape[0]}))
        ref, ref_loss = ref_step(ref, batch_i)
        got, got_loss = step(got, batch_i)
        assert_trees_close(ref.params, got.params)
        assert_trees_close(ref.opt_state, got.opt_state)
        assert_trees_close(ref_loss, got_loss)
        assert int(got.step) == i + 1
    return step
