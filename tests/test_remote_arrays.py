"""A step's results used outside the step, as ``jax.jit``'s would be: the trained state
in an eval function (eager, ``jax.jit``, Flax ``apply``, ``nnx.jit``), in arithmetic and
NumPy-style methods, in ``jax.tree`` maps and Flax serialization; each equal to the
same computation on the fetched host copy."""

import copy
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import meshshard
from meshshard.errors import MeshshardInputError

OPT = optax.adam(1e-2)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(hidden)


MODEL = Mlp()
X = jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8)
Y = jnp.cos(X[:, :4])


def train_step(state, batch):
    params, opt_state, count = state

    def loss_fn(p):
        return jnp.mean((MODEL.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, count + 1), loss


@pytest.fixture
def trained(threads_cluster):
    """(remote state, its host copy, the step): two steps of two micro-batches."""
    params = MODEL.init(jax.random.PRNGKey(0), X)["params"]
    step = meshshard.parallelize(
        train_step, method=meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2))
    )
    state = (params, OPT.init(params), jnp.int32(0))
    for _ in range(2):
        state, _ = step(state, (X, Y))
    assert isinstance(state[0]["Dense_0"]["kernel"], meshshard.RemoteArray)
    return state, meshshard.fetch(state), step


def test_eval_functions_take_the_remote_state(trained):
    state, host, _ = trained
    want = MODEL.apply({"params": host[0]}, X)
    np.testing.assert_allclose(MODEL.apply({"params": state[0]}, X), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(MODEL.apply)({"params": state[0]}, X), want, rtol=1e-6)
    norm = optax.tree.norm(state[0])
    np.testing.assert_allclose(norm, optax.tree.norm(host[0]), rtol=1e-6)
    doubled = jax.tree.map(lambda a: a * 2, state[0])
    np.testing.assert_allclose(
        doubled["Dense_1"]["bias"], 2 * host[0]["Dense_1"]["bias"], rtol=1e-6
    )


def test_arithmetic_indexing_and_methods_compute_on_the_value(trained):
    state, host, _ = trained
    w, h = state[0]["Dense_0"]["kernel"], host[0]["Dense_0"]["kernel"]
    assert len(w) == 8 and w.shape == (8, 16) and w.ndim == 2
    cases = {
        "w + 1": (w + 1, h + 1),
        "1 - w": (1 - w, 1 - h),
        "w @ w.T": (w @ w.T, h @ h.T),
        "np + w": (np.ones((8, 16), np.float32) + w, 1 + h),
        "w[2, 3:5]": (w[2, 3:5], h[2, 3:5]),
        "w.sum(0)": (w.sum(0), h.sum(0)),
        "w.astype": (w.astype(jnp.bfloat16), h.astype(jnp.bfloat16)),
        "jnp.where": (jnp.where(w > 0, w, 0.0), np.where(h > 0, h, 0.0)),
        "-abs(w)": (-abs(w), -np.abs(h)),
    }
    for name, (got, want) in cases.items():
        assert isinstance(got, jax.Array), name
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, err_msg=name
        )
    count = state[2]
    assert isinstance(count, jax.Array)
    assert int(count) == 2 and f"{count:d}" == "2" and [0, 1, 2][count] == 2
    assert f"{w[0, 0]:.4f}" == f"{float(h[0, 0]):.4f}"
    assert "RemoteArray(float32[8, 16]" in f"{w}"  # no format spec: names it, as repr


def test_remote_arrays_stay_keys_and_say_what_they_are_not(trained):
    state, _, _ = trained
    w = state[0]["Dense_0"]["kernel"]
    assert w == w and w != state[0]["Dense_1"]["kernel"]  # identity, not elementwise
    assert len({w, w}) == 1
    assert w.block_until_ready() is w and not w.is_deleted()
    with pytest.raises(AttributeError, match="meshshard.fetch"):
        getattr(w, "sharding")  # noqa: B009
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        getattr(w, "no_such_thing")  # noqa: B009


def test_a_donated_array_refuses_use_after_its_value_was_read(threads_cluster):
    params = MODEL.init(jax.random.PRNGKey(0), X)["params"]
    step = meshshard.parallelize(
        train_step,
        method=meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2)),
        donate_argnums=(0,),
    )
    state, _ = step((params, OPT.init(params), jnp.int32(0)), (X, Y))
    w = state[0]["Dense_0"]["kernel"]
    before = np.asarray(w + 0)  # the local copy is made and kept
    step(state, (X, Y))
    assert w.is_deleted()
    with pytest.raises(MeshshardInputError, match="donated"):
        w + 0
    assert before.shape == (8, 16)


def test_flax_serialization_writes_host_copies(trained):
    state, host, _ = trained
    data = serialization.to_bytes(state[0])
    assert data == serialization.to_bytes(host[0])
    back = serialization.from_bytes(host[0], data)
    np.testing.assert_array_equal(back["Dense_1"]["kernel"], host[0]["Dense_1"]["kernel"])


def test_pickle_and_deepcopy_take_copies_of_the_values(trained):
    """``pickle`` of a trained state and ``copy.deepcopy`` of it (keeping the best state
    so far) copy each array's value, as for ``jax.Array``; both failed inside the
    array's internals before ("cannot pickle 'weakref.ReferenceType' object")."""
    state, host, step = trained
    kept = copy.deepcopy(state)
    for got in (pickle.loads(pickle.dumps(state)), kept):
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(got))  # not remote
        jax.tree.map(np.testing.assert_array_equal, got, host)
    w = state[0]["Dense_0"]["kernel"]
    assert copy.copy(w) is w  # immutable: a shallow copy is the array itself
    # the copy trains on like the state it was taken from
    after_copy, _ = step(kept, (X, Y))
    after_state, _ = step(state, (X, Y))
    jax.tree.map(
        np.testing.assert_array_equal, meshshard.fetch(after_copy), meshshard.fetch(after_state)
    )


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 16, rngs=rngs)
        self.second = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(nnx.relu(self.first(x)))


def test_an_nnx_model_trained_in_place_evaluates_outside_the_step(threads_cluster):
    model = Nnx(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPT, wrt=nnx.Param)

    def step(model, optimizer, batch):
        def loss_fn(model):
            return jnp.mean((model(batch[0]) - batch[1]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    parallel = meshshard.parallelize(
        step,
        method=meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2)),
        batch_argnums=(2,),
    )
    parallel(model, optimizer, (X, Y))
    assert isinstance(model.first.kernel.get_value(), meshshard.RemoteArray)
    host = nnx.merge(*meshshard.fetch(nnx.split(model)))
    want = host(X)
    np.testing.assert_allclose(model(X), want, rtol=1e-6)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, X), want, rtol=1e-6)


def small_results_step(state, batch):
    """A step whose results are small (returned by value), literals (a NumPy and two
    Python ones), a weakly typed computed result and a passthrough."""
    params, count, scale = state

    def loss_fn(p):
        return jnp.mean((MODEL.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    hits = jnp.sum(batch[1] > 0).astype(jnp.int32)
    results = (loss, hits, jnp.float32(2.5), loss / hits, 0.0, 1, scale * 2.0)
    return (params, count + 1, scale), results


def test_small_results_are_jax_arrays_like_jits(threads_cluster):
    """Results the workers return by value, literals and host values passed through are
    ``jax.Array``s of ``jax.jit``'s dtypes and weak types: ``loss.block_until_ready()``
    works, ``loss / hits`` stays float32 (NumPy values made it float64), and a Python
    ``0.0`` the step returns is a weak float32 (it was a strong one)."""
    params = MODEL.init(jax.random.PRNGKey(0), X)["params"]
    state = (params, np.int32(0), 0.5)  # a NumPy counter and a Python float pass through
    want_state, want = jax.jit(small_results_step)(state, (X, Y))
    step = meshshard.parallelize(
        small_results_step,
        method=meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2)),
    )
    got_state, got = step(state, (X, Y))
    loss, hits, literal, *_ = got
    assert loss.block_until_ready() is loss
    assert float(hits) == float(want[1])
    for name, g, w in zip(
        ["loss", "hits", "literal", "ratio", "py float", "py int", "weak", "count", "scale"],
        [*got, *got_state[1:]],
        [*want, *want_state[1:]],
        strict=True,
    ):
        assert isinstance(g, jax.Array), (name, type(g))
        assert (g.dtype, g.weak_type, g.shape) == (w.dtype, w.weak_type, w.shape), name
        np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=name)
    assert (loss / hits).dtype == jnp.float32
    assert (hits + literal).dtype == jnp.float32
