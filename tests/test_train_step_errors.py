"""What stays unsupported in a train step is refused with the operation, the stage and a fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, MeshshardInputError, PipeshardParallel
from tests.random_parity import check_step_parity

CLUSTER = ClusterSpec("step-errors-4x2", 4, 2)
METHOD = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
BATCH = mlp.make_batch(batch_size=8)


@pytest.fixture(scope="module")
def state():
    return mlp.make_state(mlp.MLP(num_layers=4), BATCH["x"])


def lower(step, *args):
    return meshshard.parallelize(step, method=METHOD).lower(*args, cluster=CLUSTER)


def mse(state, batch):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    return loss_fn


def test_aux_with_the_batch_as_a_dimension_other_than_the_first(state):
    """Per-example rows are concatenated over micro-batches; the batch as a second
    dimension is not rows of examples, and is refused naming the aux value."""

    def step(state, batch):
        def loss_fn(p):
            pred = state.apply_fn({"params": p}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2), {"pred": pred.T}

        (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), aux

    with pytest.raises(
        MeshshardInputError,
        match=r"the aux\['pred'\] value meshshard.grad returns keeps the batch, but it has "
        r"the batch as a dimension other than the first \(\[4, 8\] on the batch\).*reduce it "
        r"over the batch inside the loss function",
    ):
        lower(step, state, BATCH)


def test_draw_in_shape_dependent_control_flow(state):
    def step(state, batch, key):
        def loss_fn(p):
            x = batch["x"]
            if x.shape[0] > 4:  # only on the full batch
                x = x * 2
            x = x + jax.random.normal(key, x.shape)
            return jnp.mean((state.apply_fn({"params": p}, x) - batch["y"]) ** 2)

        grads = meshshard.grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads)

    with pytest.raises(
        MeshshardInputError,
        match=r"the step draws random numbers \(random_bits\) but traces to different programs "
        r"at micro-batch and full-batch shape.*make the step's Python control flow independent",
    ):
        lower(step, state, BATCH, jax.random.key(0))


def test_draw_not_sliceable_along_the_batch(state):
    def step(state, batch, key):
        def loss_fn(p):
            n = batch["x"].shape[0]
            noise = jax.random.normal(key, (n + 1,))[:n, None]
            pred = state.apply_fn({"params": p}, batch["x"] + noise)
            return jnp.mean((pred - batch["y"]) ** 2)

        grads = meshshard.grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads)

    with pytest.raises(
        MeshshardInputError,
        match=r"random draw random_bits has shape \[5\] per micro-batch but \[9\] on the full "
        r"batch; meshshard can only slice a draw along one dimension that is the batch",
    ):
        lower(step, state, BATCH, jax.random.key(0))


def _lbfgs_step(opt):
    def step(carry, batch):
        params, opt_state = carry

        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w"])
            meshshard.mark_pipeline_boundary()
            return jnp.mean((h @ p["v"] - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(
            grads, opt_state, params, value=loss, grad=grads, value_fn=loss_fn
        )
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def test_a_line_search_in_the_update_is_refused_with_a_step_size_instead(threads_cluster):
    """optax.lbfgs's zoom line search calls the loss on the batch inside the update;
    the error named only the batch leaf.  It now names the line and the fix, which runs."""
    params = {
        "w": jnp.linspace(-0.5, 0.5, 4 * 8).reshape(4, 8),
        "v": jnp.linspace(0.3, -0.3, 8 * 2).reshape(8, 2),
    }
    batches = [{"x": jnp.cos(jnp.arange(32.0) + s).reshape(8, 4)} for s in range(2)]
    batches = [dict(b, y=b["x"][:, :2] ** 2) for b in batches]
    searching = optax.lbfgs()
    with pytest.raises(MeshshardInputError, match=r"reads the batch leaf args\[1\]\['x'\]") as err:
        lower(_lbfgs_step(searching), (params, searching.init(params)), batches[0])
    assert "test_train_step_errors.py" in str(err.value)  # the user's line
    assert "optax.lbfgs(learning_rate=..., linesearch=None)" in str(err.value)
    stepped = optax.lbfgs(learning_rate=0.1, linesearch=None)
    check_step_parity(_lbfgs_step(stepped), METHOD, (params, stepped.init(params)), batches)


@pytest.mark.parametrize("m", [1, 2])
def test_a_metric_of_the_updated_parameters_on_the_batch_is_refused_by_name(m):
    """An accuracy of the new parameters on the batch reads the batch together with the
    update.  With micro-batches it failed inside the compiler with JAX's bare "eq got
    incompatible shapes for broadcasting: (16,), (8,)"; it now gets the refusal one
    micro-batch gave, naming the leaf, the user's line and the fix."""
    params = {
        "e": jnp.linspace(-0.5, 0.5, 10 * 4).reshape(10, 4),
        "w": jnp.linspace(-0.5, 0.5, 4 * 8).reshape(4, 8),
        "v": jnp.linspace(0.3, -0.3, 8 * 2).reshape(8, 2),
    }
    tokens = jnp.arange(16, dtype=jnp.int32) % 10
    batch = {"x": tokens, "y": tokens % 2}

    def logits(p, tokens):  # an embedding lookup: its index arithmetic reads the batch only
        return jnp.tanh(p["e"][tokens] @ p["w"]) @ p["v"]

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(p["e"][batch["x"]] @ p["w"])
            meshshard.mark_pipeline_boundary()
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["v"], batch["y"]).mean()

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        new = jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)
        hits = jnp.argmax(logits(new, batch["x"]), -1) == batch["y"]
        return new, (loss, jnp.mean(hits))

    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2), (1, 2)])
    with pytest.raises(
        MeshshardInputError,
        match=r"the update part of the step \(after meshshard.grad\) reads the batch leaf "
        r"args\[1\]\['(x|y)'\] \(\w+ at test_train_step_errors\.py:\d+ \(",
    ) as err:
        meshshard.parallelize(step, method=method).lower(params, batch, cluster=CLUSTER)
    assert "compute everything that needs the batch inside the loss function" in str(err.value)


def test_an_update_that_evaluates_the_loss_again_is_refused_by_name(state):
    """optax.contrib.sophia's update takes the loss (obj_fn) and differentiates it again on
    the batch.  With micro-batches that value was refused as "the after meshshard.grad #k
    value meshshard.grad returns", which named neither the line nor the cause; it is now
    the refusal of any update that reads the batch, naming the leaf, the line and sophia."""
    from optax import contrib

    opt = contrib.sophia(1e-2)
    carry = (state.params, opt.init(state.params))

    def step(carry, batch):
        params, opt_state = carry
        loss_fn = mse(state, batch)
        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params, obj_fn=loss_fn)
        return (optax.apply_updates(params, updates), opt_state), loss

    with pytest.raises(
        MeshshardInputError,
        match=r"the update part of the step \(after meshshard.grad\) reads the batch leaf "
        r"args\[1\]\['x'\] \(dot_general at mlp.py:\d+ .*optax.contrib.sophia's obj_fn",
    ):
        lower(step, carry, BATCH)


def test_a_pmap_style_collective_is_refused_naming_the_axis_and_the_fix(state):
    """Code written for jax.pmap averages its gradients with jax.lax.pmean over a named
    axis; traced here it failed with JAX's bare NameError from deep inside tracing."""

    def pmap_style_step(state, batch):
        loss, grads = meshshard.value_and_grad(mse(state, batch))(state.params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        return state.apply_gradients(grads=grads), jax.lax.pmean(loss, "batch")

    with pytest.raises(
        MeshshardInputError,
        match=r"pmap_style_step calls a collective over the named axis 'batch' .*"
        r"drop the collective",
    ):
        lower(pmap_style_step, state, BATCH)


def test_a_hidden_state_kept_in_the_state_names_the_leaf_and_the_fix():
    """Truncated backpropagation through time carries the RNN's hidden state, one row per
    example, from step to step; kept in the state, micro-batches failed with JAX's
    broadcasting error and a hint about loss weights and lookup tables."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)}

    def tbptt_step(state, batch):
        def loss_fn(p):
            h = jnp.tanh(state["h"] @ p["w"] + batch["x"])
            return jnp.mean((h - batch["y"]) ** 2), h

        (loss, h), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state["params"])
        new = jax.tree.map(lambda a, g: a - 0.1 * g, state["params"], grads)
        return {"params": new, "h": h}, loss

    state = {"params": params, "h": jnp.zeros((8, 4), jnp.float32)}
    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 4), np.float32)}
    with pytest.raises(
        MeshshardInputError,
        match=r"args\[0\]\['h'\] has 8 rows, as the batch has: .*pass it in a batch argument",
    ):
        lower(tbptt_step, state, batch)
