"""A Flax NNX model: split into its graph and its parameters (``nnx.split``), merged
back inside the loss, differentiated with ``meshshard.value_and_grad``.  Its parameters
are an ``nnx.State`` pytree, and a ``mark_pipeline_boundary()`` in its ``__call__``
cuts it into stages as in a Linen model."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshshard
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.random_parity import check_step_parity

TX = optax.adamw(1e-2)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(8, 32, rngs=rngs)
        self.second = nnx.Linear(32, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.first(x))
        meshshard.mark_pipeline_boundary()
        return self.head(self.norm(nnx.relu(self.second(x))))


GRAPH, PARAMS, REST = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)


def nnx_step(state, batch):
    params, opt_state = state

    def loss_fn(params):
        model = nnx.merge(GRAPH, params, REST)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


@pytest.mark.parametrize(
    "method, stages",
    [
        (meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]), 2),
        (meshshard.ShardParallel((1, 2)), 1),
    ],
    ids=["pipeline", "shard"],
)
def test_an_nnx_model_trains_equal_to_jit(method, stages):
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 4)).astype(np.float32),
    }
    state = (PARAMS, TX.init(PARAMS))
    with use_cluster(ThreadsCluster(4, 2)):
        step = check_step_parity(nnx_step, method, state, [batch, batch], rtol=1e-4)
    assert len(step.plan.stages) == stages
