"""Plain-JAX train states (a tuple or a dict, not a Flax TrainState) under sharding
inference: each state leaf keeps one layout from step to step, and a state kept in one
layout by one plan is read by a plan that lays it out otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from meshshard import DataParallel, PipeshardParallel, ShardParallel
from meshshard.passes.shard_plan import tied_state
from meshshard.passes.trace import trace_step
from tests.conftest import assert_trees_close


def make_step(kind: str):
    """SGD with momentum on a 2-layer MLP; the state is ``(params, momentum)`` or
    ``{"params": ..., "mom": ...}``."""

    def train_step(state, batch):
        params, mom = (state["params"], state["mom"]) if kind == "dict" else state

        def loss_fn(p):
            h = jnp.tanh(batch[0] @ p["w1"] + p["b1"])
            meshshard.mark_pipeline_boundary()
            return jnp.mean((h @ p["w2"] - batch[1]) ** 2)

        loss, g = meshshard.value_and_grad(loss_fn)(params)
        mom = jax.tree.map(lambda m, gg: 0.9 * m + gg, mom, g)
        params = jax.tree.map(lambda p, m: p - 1e-2 * m, params, mom)
        new = {"params": params, "mom": mom} if kind == "dict" else (params, mom)
        return new, loss

    return train_step


def make_state(kind: str):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(k1, (12, 64)) * 0.3,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 4)) * 0.3,
    }
    mom = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "mom": mom} if kind == "dict" else (params, mom)


def batches(n: int, rows: int = 16):
    r = np.random.default_rng(1)
    return [
        (r.normal(size=(rows, 12)).astype(np.float32), r.normal(size=(rows, 4)).astype(np.float32))
        for _ in range(n)
    ]


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_every_updated_state_leaf_ties_to_its_input(kind):
    """The sharding ILP gives a state leaf one spec as input and as output only if it
    sees them tied: all six leaves of either structure are."""
    traced = trace_step(
        make_step(kind), (make_state(kind), batches(1)[0]), batch_argnums=(1,), num_micro_batches=1
    )
    assert len(tied_state(traced)) == 6


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, method",
    [
        ("tuple", ShardParallel((1, 2))),
        ("dict", PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, sharding="auto")),
    ],
    ids=["tuple-shard", "dict-pipeshard-auto"],
)
def test_plain_states_train_like_jit(sharded_threads_cluster, kind, method):
    step = meshshard.parallelize(make_step(kind), method=method)
    ref = got = make_state(kind)
    for b in batches(3):
        ref, ref_loss = jax.jit(make_step(kind))(ref, b)
        got, loss = step(got, b)
        assert_trees_close(ref, got)
        assert_trees_close(ref_loss, loss)


@pytest.mark.slow
def test_a_state_kept_by_one_plan_is_read_by_a_plan_laying_it_out_otherwise(
    sharded_threads_cluster,
):
    """ShardParallel splits the weights; a data-parallel step on the same host-actor
    reads the kept arrays replicated, and training goes on equal to jax.jit."""
    fn = make_step("tuple")
    shard = meshshard.parallelize(fn, method=ShardParallel((1, 2)))
    plain = meshshard.parallelize(fn, method=DataParallel((1, 2)))
    ref = got = make_state("tuple")
    for step, b in zip([shard, plain, shard], batches(3, rows=64), strict=True):
        ref, ref_loss = jax.jit(fn)(ref, b)
        got, loss = step(got, b)
        assert_trees_close(ref, got)
        assert_trees_close(ref_loss, loss)
    specs = {t.spec for b in shard.plan.buffers for t in b.tensors if "w1" in t.name}
    assert specs != {()}, "ShardParallel kept w1 whole: the test lays out nothing otherwise"
