"""Batch metrics computed after ``meshshard.grad`` (Flax's examples' pattern) equal jax.jit.

The step returns the logits as aux and scores them against the batch's labels after the
grad.  ``passes/sink_metrics.py`` computes that per micro-batch, before the grad's
marker, and combines the score like any aux value.  Before, every such step was refused:
"the update part of the step reads the batch leaf" (one micro-batch), or "aux ... has
the batch as a dimension" (several).  Per-example values (the logits themselves, which
examples were right) are concatenated over the micro-batches, in order.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from meshshard import DataParallel, MeshshardInputError, PipeshardParallel
from meshshard.jaxpr_util import is_literal, is_marker
from meshshard.passes.sink_metrics import LABEL
from meshshard.passes.trace import trace_step
from tests.random_parity import check_step_parity


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(32)(x))
            meshshard.mark_pipeline_boundary()
        return nn.Dense(10)(x)


def flax_example_step(state, batch):
    """As Flax's MNIST example, with preprocessing outside the loss function."""
    images = batch["image"] / 4.0

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        labels = optax.smooth_labels(jax.nn.one_hot(batch["label"], 10), 0.1)
        return jnp.mean(optax.softmax_cross_entropy(logits, labels)), logits

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
        "correct": jnp.sum(jnp.argmax(logits, -1) == batch["label"]),
        "perplexity": jnp.exp(loss),  # of the combined loss: stays after the grad
    }
    return state.apply_gradients(grads=grads), metrics


def predictions_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["label"]
        ).mean(), logits

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, jnp.argmax(logits, -1) == batch["label"]


def _case():
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(16, 8)).astype(np.float32),
        "label": rng.integers(0, 10, size=(16,)).astype(np.int32),
    }
    model = Classifier()
    params = model.init(jax.random.key(0), batch["image"])["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1, momentum=0.9)
    )
    return state, [batch, jax.tree.map(lambda a: a[::-1].copy(), batch)]


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2),
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, schedule="zb_h1"),
        DataParallel(mesh_shape=(1, 2)),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["pipe-M1", "pipe-M2", "zb_h1-M4", "dp", "dp-M2"],
)
def test_the_flax_example_step_equals_jit(threads_cluster, method):
    state, batches = _case()
    check_step_parity(flax_example_step, method, state, batches)


@pytest.mark.parametrize("m", [1, 2])
def test_the_metrics_pass_through_the_grad_marker(m):
    """Accuracy's and the correct count's batch sums become aux values with inferred
    reductions (the division by the batch size stays in the update, where it reads the
    full batch's size); with micro-batches the per-example logits leave the marker, and
    the update reads no batch leaf either way."""
    state, batches = _case()
    traced = trace_step(
        flax_example_step, (state, batches[0]), batch_argnums=(1,), num_micro_batches=m
    )
    jaxpr = traced.closed.jaxpr
    g_idx, g = next((i, e) for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end"))
    labels = {label: (red, source) for label, red, source in g.params["reduce"]}
    added = sorted(k for k in labels if k.startswith(LABEL))
    assert len(added) == 2  # accuracy and the count; the perplexity stays after the grad
    assert ("aux" in labels) == (m == 1)  # the logits
    if m > 1:  # the accuracy's sum of right answers: its division stays in the update
        assert sorted(labels[k][0] for k in added) == ["sum", "sum"]
    batch_in = {v for v, info in zip(jaxpr.invars, traced.inputs, strict=True) if info.is_batch}
    after = [v for e in jaxpr.eqns[g_idx + 1 :] for v in e.invars if not is_literal(v)]
    assert not batch_in & set(after)


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, schedule="zb_h1"),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["pipe-M2", "zb_h1-M4", "replicas-M4", "dp-M2"],
)
def test_per_example_values_after_the_grad_are_concatenated(threads_cluster, method):
    """Per-example values derived from the aux logits (which examples were right) were
    refused under micro-batches ("has the batch as a dimension"); each micro-batch's
    rows now go into the batch's rows in order, also across data-parallel replicas,
    whose summed gradients would have summed these rows."""
    state, batches = _case()
    par = check_step_parity(predictions_step, method, state, batches)
    notes = "\n".join(par.plan.notes)
    assert f"{LABEL} #0: concat over {method.num_micro_batches} micro-batches" in notes


def aux_logits_step(state, batch):
    """Returns the aux logits themselves, and the step's accuracy from them."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state.apply_gradients(grads=grads), {"loss": loss, "acc": accuracy, "logits": logits}


def test_aux_logits_are_concatenated(threads_cluster):
    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    par = check_step_parity(aux_logits_step, method, state, batches)
    assert "aux: concat over 4 micro-batches (traced: per-example values)" in par.plan.notes


def _refusal(step) -> str:
    state, batches = _case()
    par = meshshard.parallelize(
        step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    with pytest.raises(MeshshardInputError) as err:
        par.lower(state, batches[0], cluster=meshshard.ClusterSpec("sink-4x2", 4, 2))
    return str(err.value)


def test_batch_values_that_are_not_rows_are_refused():
    """Logits with the batch second, and rows standardized by the batch's own mean, are
    not one row per example: refused, naming what a micro-batch cannot reproduce."""

    def transposed(state, batch):
        new_state, _, right = predictions_step(state, batch)
        return new_state, right[None, :]

    def standardized(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            return jnp.mean(logits**2), logits - jnp.mean(logits, axis=0)

        (loss, centred), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), centred

    msg = _refusal(transposed)
    assert "keeps the batch, but it has the batch as a dimension other than the first" in msg
    assert "num_micro_batches=1" in msg
    assert "each row depends on other rows of the batch" in _refusal(standardized)


def per_example_grads(params, batch):
    """Each example's own gradient of its loss: meshshard.grad under jax.vmap."""

    def loss1(p, x, y):
        logits = Classifier().apply({"params": p}, x[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[None]).sum()

    return jax.vmap(meshshard.grad(loss1), in_axes=(None, 0, 0))(
        params, batch["image"], batch["label"]
    )


def test_per_example_gradients_run_with_one_micro_batch(threads_cluster):
    """DP-SGD as optax writes it: per-example gradients (meshshard.grad under jax.vmap),
    clipped per example, summed and noised by a key in the optimizer state, on two
    pipeline stages."""
    tx = optax.chain(  # what optax.contrib.dpsgd builds, with a typed key
        optax.contrib.differentially_private_aggregate(1.0, 1.1, key=jax.random.key(3)),
        optax.sgd(0.1),
    )

    def dpsgd_step(state, batch):
        params, opt = state
        updates, opt = tx.update(per_example_grads(params, batch), opt, params)
        return (optax.apply_updates(params, updates), opt), jnp.float32(0)

    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    check_step_parity(dpsgd_step, method, (state.params, tx.init(state.params)), batches)


def test_per_example_gradients_are_refused_with_micro_batches():
    """meshshard.grad under jax.vmap (DP-SGD's per-example gradients): every gradient
    keeps the batch; the message names the case and the fix (one micro-batch)."""

    def per_example(state, batch):
        mean = jax.tree.map(lambda g: g.mean(0), per_example_grads(state.params, batch))
        return state.apply_gradients(grads=mean), jnp.float32(0)

    msg = _refusal(per_example)
    assert "the loss meshshard.grad differentiates has the batch as a dimension" in msg
    assert "jax.vmap" in msg and "num_micro_batches=1" in msg


def test_per_example_values_after_the_grad_with_one_micro_batch(threads_cluster):
    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    check_step_parity(predictions_step, method, state, batches)


def test_a_boolean_aux_value_with_one_micro_batch_stays_boolean(threads_cluster):
    """One micro-batch's 'mean' was finished as ``acc // 1``: an int32 where jax.jit
    returns a bool."""

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, jnp.all(jnp.isfinite(logits))

        (loss, finite), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss, finite

    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    check_step_parity(step, method, state, batches)


@pytest.mark.ray
def test_the_metrics_and_logits_equal_jit_on_ray(ray_cluster):
    """The host-actors trace the step themselves and move the metrics alike; the two
    replicas' logits rows cross processes in the all-gather and come back in order."""
    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2)
    par = check_step_parity(aux_logits_step, method, state, batches)
    assert {e.reduce for e in par.plan.gathered} == {"concat"}


def running_totals_step(state, totals, batch):
    """Metrics accumulated in the state after the grad: a count of right answers (int),
    a float sum of them, and an exponential moving average of the accuracy."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return loss.mean(), logits

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    right = jnp.argmax(logits, -1) == batch["label"]
    totals = {
        "right": totals["right"] + right.sum(),
        "right_f": totals["right_f"] + jnp.asarray(right, jnp.float32).sum(),
        "ema_accuracy": 0.9 * totals["ema_accuracy"] + 0.1 * right.mean(),
    }
    return (state.apply_gradients(grads=grads), totals), loss


MICRO_BATCHED = pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=4),
    ],
    ids=["pipe-M2", "dp-M4"],
)


@MICRO_BATCHED
def test_running_totals_of_batch_metrics_equal_jit(threads_cluster, method):
    """Adding a batch metric to a total in the state stays in the update; only the metric
    is computed per micro-batch.  Before, ``total + right.sum()`` was computed per
    micro-batch and its M values summed (the total counted M times) or, for floats,
    averaged (1/M of the right answers), with only a 'default' warning."""
    state, batches = _case()
    totals = {
        "right": jnp.zeros((), jnp.int32),
        "right_f": jnp.zeros((), jnp.float32),
        "ema_accuracy": jnp.full((), 0.5, jnp.float32),
    }

    def step(carry, batch):
        return running_totals_step(*carry, batch)

    check_step_parity(step, method, (state, totals), batches)


def running_histograms_step(state, totals, batch):
    """Array-valued running totals after the grad: a confusion matrix added to, per-class
    counts scattered into in place, predicted classes counted through ``one_hot``."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return loss.mean(), logits

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    pred = jnp.argmax(logits, -1)
    classes = totals["predicted"].shape[0]
    confusion = jnp.zeros((classes, classes), jnp.int32).at[batch["label"], pred].add(1)
    totals = {
        "confusion": totals["confusion"] + confusion,
        "labels": totals["labels"].at[batch["label"]].add(1.0),
        "predicted": totals["predicted"] + jax.nn.one_hot(pred, classes).sum(0),
    }
    return (state.apply_gradients(grads=grads), totals), loss


@MICRO_BATCHED
def test_array_running_totals_equal_jit(threads_cluster, method):
    """Before, each was computed per micro-batch whole: the confusion matrix's total was
    summed M times and the scattered float counts averaged (wrong, with a 'default'
    warning), and the ``one_hot`` counts failed in the compiler with JAX's
    broadcast_in_dim shape error."""
    state, batches = _case()
    classes = 10  # the classifier's outputs
    totals = {
        "confusion": jnp.zeros((classes, classes), jnp.int32),
        "labels": jnp.zeros((classes,), jnp.float32),
        "predicted": jnp.zeros((classes,), jnp.float32),
    }

    def step(carry, batch):
        return running_histograms_step(*carry, batch)

    check_step_parity(step, method, (state, totals), batches + batches)


def ratio_metrics_step(state, batch):
    """Metrics that are functions of batch sums, not sums or means themselves: an F1
    score and a batch variance of the losses."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return losses.mean(), (logits, losses)

    (loss, (logits, losses)), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    predicted, actual = jnp.argmax(logits, -1) == 0, batch["label"] == 0
    tp = jnp.sum(predicted & actual)
    fp, fn = jnp.sum(predicted & ~actual), jnp.sum(~predicted & actual)
    metrics = {
        "f1": 2 * tp / jnp.maximum(2 * tp + fp + fn, 1),
        "loss_variance": jnp.mean(losses**2) - jnp.mean(losses) ** 2,
    }
    return state.apply_gradients(grads=grads), metrics


@MICRO_BATCHED
def test_functions_of_batch_sums_are_computed_from_the_combined_sums(threads_cluster, method):
    """Only the sums run per micro-batch; the F1 and the variance are computed in the
    update from the combined sums, the full batch's.  Before, each was computed per
    micro-batch and averaged, with a 'default' warning: not the batch's F1 or variance."""
    state, batches = _case()
    check_step_parity(ratio_metrics_step, method, state, batches, rtol=1e-4)


def all_and_any_step(p, batch):
    """``jnp.all`` and ``jnp.any`` of the predictions, scored after the grad; ``flag``
    makes one row of the second half fail the ``all`` and one of the first pass the
    ``any``, so the two micro-batches' answers differ."""

    def loss_fn(p):
        pred = jnp.tanh(batch["x"] @ p["w"])[:, 0]
        return jnp.mean((pred - batch["y"]) ** 2), pred

    (loss, pred), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(p)
    every = jnp.all(pred - 100.0 * batch["fail"] > -50.0)
    some = jnp.any(pred + 100.0 * batch["pass"] > 50.0)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss, every, some


def test_all_and_any_after_the_grad_combine_as_and_and_or(threads_cluster):
    """``jnp.all`` was summed over the micro-batches by default (a warning): True + False
    made True where jax.jit says False. It combines as the minimum now, ``jnp.any`` as
    the maximum."""
    rng = np.random.default_rng(9)
    one_hot = lambda i: np.eye(8, dtype=np.float32)[i]  # noqa: E731
    batch = {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "y": rng.normal(size=(8,)).astype(np.float32),
        "fail": one_hot(6),
        "pass": one_hot(1),
    }
    p = {"w": rng.normal(size=(4, 2)).astype(np.float32)}
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    par = check_step_parity(all_and_any_step, method, p, [batch])
    _, _, every, some = par(p, batch)
    assert (bool(every), bool(some)) == (False, True)
