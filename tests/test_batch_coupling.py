"""passes/batch_coupling.py: a step that reduces activations over the batch and uses the
result on every example (batch norm, a branch on a batch mean, centring) is named in the
plan's notes, with the user's line, and warned of at compile time: with micro-batches
each uses its own statistic, so the step is not jax.jit's.  Steps whose batch reductions
are the loss, metrics, gradients or statistics of the data alone get no note."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from examples import gpt
from meshshard import DataParallel, PipeshardParallel
from meshshard.passes.batch_coupling import NOTE
from tests import test_batch_norm, test_moe
from tests.random_parity import assert_results_close

pytestmark = pytest.mark.slow  # traces each step twice


class Centre(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h - h.mean(axis=0)  # LINE-remat


class Residual(nn.Module):
    """A block for ``nn.scan``: per example, or centred on the batch's mean."""

    centre: bool = False

    @nn.compact
    def __call__(self, h, _):
        if self.centre:
            h = h - h.mean(axis=0)  # LINE-scan_centre
        return h + nn.Dense(16)(jnp.tanh(h)), None


class Coupled(nn.Module):
    """An MLP whose hidden layer is coupled over the batch, as ``how`` says."""

    how: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        if self.how == "branch":
            h = jax.lax.cond(h.mean() > 0, lambda a: 2.0 * a, lambda a: 0.5 * a, h)  # LINE-branch
        elif self.how == "centre":
            h = h - h.mean(axis=0)  # LINE-centre
        elif self.how == "remat":  # inside a checkpoint's body, and its recomputation
            h = nn.remat(Centre)()(h)
        elif self.how in ("scan", "scan_centre"):  # found inside the scan's body
            layers = nn.scan(
                Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            h, _ = layers(centre=self.how == "scan_centre")(h, None)
        meshshard.mark_pipeline_boundary()
        return nn.Dense(1)(jnp.tanh(h))


def mse_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def masked_step(state, batch):
    """A token-weighted mean: its count is a statistic of the batch data alone."""

    def loss_fn(params):
        err = (state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2
        return jnp.sum(err[:, 0] * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _case(how):
    r = np.random.RandomState(0)
    batch = {
        "x": r.randn(8, 4).astype(np.float32),
        "y": r.randn(8, 1).astype(np.float32),
        "mask": (r.rand(8) > 0.3).astype(np.float32),
    }
    model = Coupled(how)
    params = model.init(jax.random.key(0), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    return state, batch


def _line(tag):
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if f"# LINE-{tag}" in text)


def _coupled_notes(step, state, batch, method):
    plan = meshshard.parallelize(step, method=method).lower(state, batch)
    return [n for n in plan.notes if n.startswith(NOTE)]


TWO_STAGES = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])


@pytest.mark.parametrize("how", ["branch", "centre", "remat", "scan_centre"])
def test_a_coupled_layer_is_named_with_its_line(how):
    state, batch = _case(how)
    notes = _coupled_notes(mse_step, state, batch, TWO_STAGES)
    assert len(notes) == 1, notes
    where = {"remat": "Centre", "scan_centre": "Residual"}.get(how, "Coupled")
    assert f"test_batch_coupling.py:{_line(how)} ({where}.__call__)" in notes[0]
    assert "num_micro_batches=1" in notes[0]
    # one micro-batch: the statistic is the whole batch's, as under jax.jit
    one = PipeshardParallel(num_micro_batches=1, stages=[(1, 1), (1, 1)])
    assert _coupled_notes(mse_step, state, batch, one) == []


def test_batch_norm_gets_one_note_per_line():
    state = test_batch_norm._state()
    batch = test_batch_norm.BATCHES[0]
    method = DataParallel(mesh_shape=(1, 1), num_micro_batches=2)
    notes = _coupled_notes(test_batch_norm.train_step, state, batch, method)
    assert len(notes) == 1, notes  # both blocks' batch norms are one line of ConvBlock
    assert "test_batch_norm.py:" in notes[0] and "(ConvBlock.__call__)" in notes[0]
    assert "reductions (reduce_sum" in notes[0]
    # inference mode normalises by the running averages: no batch statistic
    assert _coupled_notes(test_batch_norm.eval_step, state, batch, method) == []


def test_losses_metrics_and_data_statistics_are_not_coupling():
    state, batch = _case("none")
    assert _coupled_notes(mse_step, state, batch, TWO_STAGES) == []
    state, batch = _case("scan")  # the scan's body reads no batch statistic
    assert _coupled_notes(mse_step, state, batch, TWO_STAGES) == []
    assert _coupled_notes(masked_step, state, batch, TWO_STAGES) == []
    b = gpt.make_batch(batch_size=8)
    four = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2)
    assert (
        _coupled_notes(gpt.train_step, gpt.make_state(gpt.GPT(num_layers=2), b["inputs"]), b, four)
        == []
    )
    # a declared mean is gradient accumulation's semantics, asked for: no note
    declared = test_moe.make_step(loss_reduce="mean")
    assert _coupled_notes(declared, test_moe._state(), test_moe._batches()[0], TWO_STAGES) == []


def test_the_note_is_warned_at_compile_time(threads_cluster, caplog):
    state, batch = _case("branch")
    step = meshshard.parallelize(mse_step, method=TWO_STAGES)
    with caplog.at_level(logging.WARNING, logger="meshshard"):
        _, loss = step(state, batch)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith(NOTE)]
    assert len(warned) == 1 and f"test_batch_coupling.py:{_line('branch')}" in warned[0]
    assert np.isfinite(float(loss))


class HandNorm(nn.Module):
    """A batch norm written by hand: per-example values divided by a batch statistic."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)  # LINE-hand_norm
        meshshard.mark_pipeline_boundary()
        return nn.Dense(1)(jnp.tanh(h))


def _mse(model):
    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return loss_fn


def hand_norm_step(params, batch):
    return meshshard.value_and_grad(_mse(HandNorm()))(params, batch)


def sam_step(params, batch):
    """Sharpness-aware minimization: the gradient at the weights moved up the batch's
    own gradient (``jax.grad``), a statistic of the batch used on every example."""
    loss_fn = _mse(Coupled("none"))
    g = jax.grad(loss_fn)(params, batch)
    norm = optax.tree.norm(g)
    ascended = jax.tree.map(lambda p, d: p + 0.05 * d / norm, params, g)
    return meshshard.value_and_grad(loss_fn)(ascended, batch)


def _per_micro_batch(step, params, batch, m):
    """``step`` run by jax on each of ``m`` micro-batches, its results averaged: GPipe's
    semantics, each micro-batch with its own statistics (SAM's m-sharpness)."""
    rows = len(batch["x"]) // m
    runs = [
        jax.jit(step)(params, {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()})
        for i in range(m)
    ]
    return jax.tree.map(lambda *xs: sum(xs) / m, *runs)


@pytest.mark.parametrize(
    "step, model", [(hand_norm_step, HandNorm()), (sam_step, Coupled("none"))], ids=["norm", "sam"]
)
def test_a_statistic_that_divides_runs_per_micro_batch(threads_cluster, step, model):
    # was refused ("cannot tell how the loss combines over micro-batches: it divides by a
    # total computed from the batch"), though Flax's BatchNorm, which multiplies by an
    # rsqrt, ran with this note
    _, batch = _case("none")
    params = model.init(jax.random.key(0), batch["x"])["params"]
    notes = _coupled_notes(step, params, batch, TWO_STAGES)
    if step is hand_norm_step:
        assert len(notes) == 1 and f"test_batch_coupling.py:{_line('hand_norm')}" in notes[0]
    else:  # the ascent's weight gradients: each Dense layer's reduction over the batch
        assert len(notes) == 2 and all("(Coupled.__call__)" in n for n in notes), notes
    got = meshshard.parallelize(step, method=TWO_STAGES)(params, batch)
    assert_results_close(_per_micro_batch(step, params, batch, 2), got, rtol=1e-5)
