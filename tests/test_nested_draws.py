"""Random draws inside nested jaxprs: remat, scan, cond and while bodies draw what jax.jit does.

A dropout mask inside ``nn.remat`` is drawn twice (the forward pass and its
recomputation in the backward pass) and inside ``nn.scan`` once per layer; with
micro-batches each must be the full-batch draw sliced at the micro-batch's rows
(``passes/random_draws.py``).  A draw the rewrite cannot reach is refused at plan time.
Workers are threads of this process.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import meshshard
from examples import mlp, random_steps
from meshshard import DataParallel, PipeshardParallel
from meshshard.errors import MeshshardInputError
from meshshard.passes.random_draws import find_batch_draws, slice_batch_draws
from tests.random_parity import check_step_parity


class Block(nn.Module):
    """Dense, tanh, dropout, dense, dropout: two batch-shaped masks."""

    hidden: int = 16

    @nn.compact
    def __call__(self, x, _=None):
        x = nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(self.hidden)(x)))
        x = nn.Dropout(0.2, deterministic=False)(nn.Dense(self.hidden)(x))
        return x, None


class RematMLP(nn.Module):
    """Two ``nn.remat`` blocks, a pipeline boundary after each, and a head."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x, _ = nn.remat(Block)(name=f"block{i}")(x)
            meshshard.mark_pipeline_boundary()
        return nn.Dense(4, name="head")(x)


class ScanMLP(nn.Module):
    """Three blocks under ``nn.scan`` (one dropout key per layer), a boundary, a head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embed")(x)
        layers = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=3,
        )
        x, _ = layers(name="layers")(x, None)
        meshshard.mark_pipeline_boundary()
        return nn.Dense(4, name="head")(x)


def _case(model):
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(2)]
    return random_steps.make_state(model, batches[0]["x"]), batches


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["pipeshard", "data"],
)
@pytest.mark.parametrize("model", [RematMLP, ScanMLP], ids=["remat", "scan"])
def test_dropout_in_remat_and_scan_matches_jit(threads_cluster, model, method):
    state, batches = _case(model())
    check_step_parity(random_steps.mlp_train_step, method, state, batches)


def _drop(h, k, keep=0.8):
    return h * jax.random.bernoulli(k, keep, h.shape) / keep


def control_flow_step(w, key, x, y):
    """Dropout at the top, in a remat body, in each scan iteration (of a plain and of a
    remat'd body) and in a cond branch; the loss and its gradient."""

    def loss_fn(w):
        k = jax.random.split(key, 8)
        h = _drop(jnp.tanh(x @ w), k[0])
        h = jax.checkpoint(lambda c: _drop(_drop(c, k[1]), k[2]))(h)
        h, _ = jax.lax.scan(lambda c, kk: (_drop(c, kk), None), h, k[3:5])
        h, _ = jax.lax.scan(lambda c, kk: (jax.checkpoint(_drop)(c, kk), None), h, k[6:8])
        h = jax.lax.cond(jnp.sum(w) > 0, lambda c: _drop(c, k[5]), lambda c: c * 2.0, h)
        return jnp.mean((h - y) ** 2)

    loss, g = meshshard.value_and_grad(loss_fn)(w)
    return w - 0.1 * g, loss


def _pass_inputs(m):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    key = jax.random.key_data(jax.random.key(3))  # raw: the draw pass sees traced steps

    def step(w, k, x, y):
        return control_flow_step(w, jax.random.wrap_key_data(k), x, y)

    trace = jax.make_jaxpr(step)
    full = trace(w, key, x, y)
    micro = trace(w, key, x[: 8 // m], y[: 8 // m])
    return micro, full, (w, key, x, y)


def test_find_batch_draws_looks_inside_remat_scan_and_cond():
    micro, full, _ = _pass_inputs(2)
    draws = find_batch_draws(micro, full, 2)
    nested = {s.primitive for d in draws for s in d.path[:1]}
    assert {"remat2", "scan", "cond"} <= nested
    assert any([s.primitive for s in d.path[:2]] == ["scan", "remat2"] for d in draws)
    assert all((d.axis, d.size, d.full_shape) == (0, 4, (8, 4)) for d in draws)


@pytest.mark.slow  # compiles three programs with scans (~10 s)
def test_sliced_micro_batches_draw_the_full_batch_masks():
    """Per micro-batch, the rewritten step's loss and gradient are those of the full
    batch's masks on its rows: their mean is the full-batch step's."""
    m = 2
    micro, full, (w, key, x, y) = _pass_inputs(m)
    sliced = slice_batch_draws(micro, find_batch_draws(micro, full, m))
    want_w, want_loss = jax.jit(jaxpr_as_fun(full))(w, key, x, y)
    rows = 8 // m
    outs = [
        jaxpr_as_fun(sliced)(
            w,
            key,
            x[i * rows : (i + 1) * rows],
            y[i * rows : (i + 1) * rows],
            jnp.array([i], jnp.int32),
        )
        for i in range(m)
    ]
    got_loss = np.mean([float(o[1]) for o in outs])
    got_w = np.mean([np.asarray(o[0]) for o in outs], axis=0)
    np.testing.assert_allclose(got_loss, float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(got_w, np.asarray(want_w), rtol=1e-5, atol=1e-6)
    # not vacuous: micro-batch 1 drawing at its own shape gets other masks (micro-batch
    # 0 may not: the partitionable threefry's first rows do not depend on the shape)
    own = jax.jit(jaxpr_as_fun(micro))(w, key, x[rows:], y[rows:])[1]
    assert abs(float(own) - float(outs[1][1])) > 1e-4


def test_draw_in_while_body_is_sliced():
    """A forward-only loop: each micro-batch's rows of the full batch's masks."""

    def f(x, k):
        body = lambda c: (c[0] + 1, _drop(c[1], jax.random.fold_in(k, c[0])))  # noqa: E731
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    _assert_slices_make_the_full_draw(f, jnp.ones((8, 3)), jax.random.key(1), 4, "while")


def test_draw_in_custom_vjp_primal_is_sliced():
    """The traced step is never differentiated again: the primal function is evaluated."""

    @jax.custom_vjp
    def noisy(x, k):
        return x + jax.random.normal(k, x.shape)

    noisy.defvjp(lambda x, k: (noisy(x, k), None), lambda _, g: (g, None))
    x, k = jnp.ones((4, 3)), jax.random.key(0)
    _assert_slices_make_the_full_draw(noisy, x, k, 2, "custom_vjp_call")


def _assert_slices_make_the_full_draw(f, x, k, m: int, primitive: str) -> None:
    """``f(x, k)`` traced at ``1/m`` of ``x``'s rows has one batch draw, inside a
    ``primitive`` equation; the sliced program's ``m`` micro-batches, concatenated, equal
    the full batch's result."""
    rows = x.shape[0] // m
    micro, full = jax.make_jaxpr(f)(x[:rows], k), jax.make_jaxpr(f)(x, k)
    draws = find_batch_draws(micro, full, m)
    assert [d.path[0].primitive for d in draws] == [primitive]
    sliced = slice_batch_draws(micro, draws)
    got = [jaxpr_as_fun(sliced)(x[:rows], k, jnp.array([i], jnp.int32))[0] for i in range(m)]
    np.testing.assert_array_equal(np.concatenate(got), np.asarray(jaxpr_as_fun(full)(x, k)[0]))


def test_draw_in_shard_map_is_refused():
    mesh = jax.make_mesh((1,), ("i",))
    P = jax.sharding.PartitionSpec

    def f(x, k):
        body = lambda x: x + jax.random.normal(k, x.shape)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x)

    _assert_draws_refused(
        f,
        r"random draw of shape \[4, 3\] \(full batch\) inside a shard_map equation.*"
        r"draw the random values .* outside the shard_map function.*num_micro_batches=1",
    )


def _assert_draws_refused(f, match):
    """``f(x, key)``'s draws, traced at 2 and 4 rows (2 micro-batches), are refused."""
    k = jax.random.key(0)
    micro = jax.make_jaxpr(f)(jnp.ones((2, 3)), k)
    full = jax.make_jaxpr(f)(jnp.ones((4, 3)), k)
    with pytest.raises(MeshshardInputError, match=match):
        find_batch_draws(micro, full, 2)


def test_shape_dependent_program_inside_remat_is_refused():
    def f(x, k):
        def body(c):
            c = c * 2 if c.shape[0] > 2 else c  # only on the full batch
            return c + jax.random.normal(k, c.shape)

        return jax.checkpoint(body)(x)

    _assert_draws_refused(
        f,
        r"draws random numbers \(random_bits\) but traces to different programs at "
        r"micro-batch and full-batch shape inside remat2 eqn 0 .*control flow independent",
    )
