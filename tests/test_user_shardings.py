"""A step written for ``jax.jit`` over a ``Mesh`` pins values to that mesh's devices
(``with_sharding_constraint``, ``device_put``); ``passes/user_shardings.py`` drops them.

Before, every method failed at run time inside a worker: "Received incompatible devices
for jitted computation ... sharding_constraint inside jit with device ids [0, ..., 7]".
"""

import logging

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshshard
from meshshard import DataParallel, PipeshardParallel, ShardParallel
from meshshard._compat import jaxpr_as_fun
from meshshard.jaxpr_util import sub_jaxprs
from meshshard.passes.user_shardings import NOTE, drop_user_shardings, user_sharding_note
from tests.random_parity import check_step_parity


def _user_mesh():
    return Mesh(np.array(jax.devices()), ("data",))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = jax.lax.with_sharding_constraint(h, NamedSharding(_user_mesh(), P("data")))
        return x + nn.Dense(x.shape[-1])(h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(Block)()(x)
        meshshard.mark_pipeline_boundary()
        x = Block()(x)
        return nn.Dense(3)(x)


TX = optax.adam(1e-2)


def step(state, batch):
    params, opt = state
    x = jax.device_put(batch["x"], NamedSharding(_user_mesh(), P("data")))

    def loss_fn(p):
        logits = Net().apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def _setup():
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.integers(0, 3, 16).astype(np.int32),
        }
        for _ in range(2)
    ]
    params = Net().init(jax.random.key(0), batches[0]["x"])["params"]
    return (params, TX.init(params)), batches


def _line_of(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def _names(jaxpr, out):
    for e in jaxpr.eqns:
        out.append(e.primitive.name)
        for j in sub_jaxprs(e):
            _names(j, out)
    return out


def test_the_pass_drops_placements_at_every_depth_and_keeps_the_values():
    state, batches = _setup()
    closed = jax.make_jaxpr(step)(state, batches[0])
    names = _names(closed.jaxpr, [])
    assert names.count("sharding_constraint") >= 3 and "device_put" in names  # remat too
    dropped = drop_user_shardings(closed)
    left = _names(dropped.jaxpr, [])
    assert "sharding_constraint" not in left and "device_put" not in left
    assert drop_user_shardings(dropped) is dropped
    args = jax.tree.leaves((state, batches[0]))
    for a, b in zip(jaxpr_as_fun(closed)(*args), jaxpr_as_fun(dropped)(*args), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7
        )  # 8 vs 1 device
    note = user_sharding_note(closed)
    constraint = _line_of("h = jax.lax.with_sharding_constraint(")
    put = _line_of("x = jax.device_put(")
    assert note.startswith(NOTE) and f"test_user_shardings.py:{constraint} (Block.__call__)" in note
    assert f"test_user_shardings.py:{put} (step)" in note
    assert "meshshard.shard(x, P(...))" in note
    assert user_sharding_note(dropped) is None


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        DataParallel(num_micro_batches=2, mesh_shape=(1, 2)),
        ShardParallel(mesh_shape=(1, 2)),
    ],
    ids=["pipeshard", "data", "shard"],
)
def test_a_step_written_for_a_user_mesh_equals_jit_and_says_so(threads_cluster, method, caplog):
    state, batches = _setup()
    with caplog.at_level(logging.WARNING, logger="meshshard"):
        par = check_step_parity(step, method, state, batches, rtol=1e-4)
    notes = [n for n in par.plan.notes if n.startswith(NOTE)]
    assert len(notes) == 1 and "Block.__call__" in notes[0], par.plan.notes
    assert sum(NOTE in r.getMessage() for r in caplog.records) == 1
