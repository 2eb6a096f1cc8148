"""Batch metrics computed after ``meshshard.grad`` (Flax's examples' pattern) equal jax.jit.

The step returns the logits as aux and scores them against the batch's labels after the
grad.  ``passes/sink_metrics.py`` computes that per micro-batch, before the grad's
marker, and combines the score like any aux value.  Before, every such step was refused:
"the update part of the step reads the batch leaf" (one micro-batch), or "aux ... has
the batch as a dimension" (several).
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
    """Accuracy and the correct count become aux values with inferred reductions; with
    micro-batches the per-example logits leave the marker, and the update reads no batch
    leaf either way."""
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
    if m > 1:
        assert sorted(labels[k][0] for k in added) == ["mean", "sum"]
    batch_in = {v for v, info in zip(jaxpr.invars, traced.inputs, strict=True) if info.is_batch}
    after = [v for e in jaxpr.eqns[g_idx + 1 :] for v in e.invars if not is_literal(v)]
    assert not batch_in & set(after)


def test_per_example_values_after_the_grad_are_refused_with_micro_batches():
    state, batches = _case()
    par = meshshard.parallelize(
        predictions_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    with pytest.raises(MeshshardInputError, match=r"has the batch as a dimension"):
        par.lower(state, batches[0], cluster=meshshard.ClusterSpec("sink-4x2", 4, 2))


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
def test_the_flax_example_step_equals_jit_on_ray(ray_cluster):
    """The host-actors trace the step themselves and move the metrics alike."""
    state, batches = _case()
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="1f1b")
    check_step_parity(flax_example_step, method, state, batches)
