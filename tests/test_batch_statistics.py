"""Statistics of the batch data (a masked mean's token count) are taken over the full batch.

Token-weighted losses divide by a count of the whole batch; micro-batches hold
different counts, so per-micro-batch masked means do not combine into the batch's.
Each step here equals ``jax.jit`` of the unmodified step with micro-batches whose counts
differ (the first rows are masked more than the rest).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from examples import gpt, mlp
from meshshard import (
    ClusterSpec,
    DataParallel,
    MeshshardInputError,
    PipeshardParallel,
    ShardParallel,
)
from meshshard._compat import jaxpr_as_fun
from meshshard.passes.batch_statistics import (
    PATH,
    find_statistics,
    hoist_statistics,
    statistics_program,
)
from meshshard.passes.trace import trace_step
from tests.random_parity import check_step_parity

CLUSTER = ClusterSpec("statistics-4x2", 4, 2)
PIPE = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def _batches(n=3, rows=8):
    """Regression batches whose mask keeps fewer rows' entries at the front: each
    micro-batch's count differs from the others'."""
    out = []
    for i in range(n):
        b = mlp.make_batch(batch_size=rows, seed=i)
        keep = np.arange(rows)[:, None] + np.arange(4)[None, :] >= rows // 2 - i
        out.append({**b, "mask": keep.astype(np.float32)})
    return out


BATCHES = _batches()


def _state(lr=0.05):
    model = mlp.MLP(num_layers=4)
    params = model.init(jax.random.key(0), BATCHES[0]["x"])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))


def masked_step(state, batch):
    """A token-weighted mean: sum of masked errors over the batch's count."""

    def loss_fn(params):
        err = (state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2
        return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def weights_step(state, batch):
    """Per-example weights normalized by their batch total, masked accuracy as aux."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        w = batch["mask"] / jnp.sum(batch["mask"])
        hit = (jnp.abs(pred - batch["y"]) < 0.5) * batch["mask"]
        return jnp.sum(w * (pred - batch["y"]) ** 2), {
            "accuracy": jnp.sum(hit) / jnp.sum(batch["mask"]),
            "tokens": jnp.sum(batch["mask"]),
        }

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def standardized_step(state, batch):
    """Inputs standardized by the batch's own mean and deviation, the update scaled by a
    batch statistic, and the batch's largest target returned."""

    def loss_fn(params):
        x = (batch["x"] - jnp.mean(batch["x"], axis=0)) / jnp.std(batch["x"], axis=0)
        return jnp.mean((state.apply_fn({"params": params}, x) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    scale = jnp.mean(batch["mask"])
    grads = jax.tree.map(lambda g: g * scale, grads)
    return state.apply_gradients(grads=grads), loss, jnp.max(batch["y"])


def _traced(step, m=2):
    return trace_step(step, (_state(), BATCHES[0]), batch_argnums=(1,), num_micro_batches=m)


def test_the_count_becomes_an_input_computed_from_the_full_batch():
    traced = _traced(masked_step)
    stats = [leaf for leaf in traced.inputs if leaf.path.startswith("<full-batch")]
    assert [s.path for s in stats] == [PATH.format(k=0)]
    assert stats[0].shape == () and not stats[0].is_batch
    leaves = jax.tree.leaves((_state(), BATCHES[1]))
    (count,) = traced.statistics(leaves)
    assert float(count) == BATCHES[1]["mask"].sum()  # the full batch's, not a micro-batch's
    assert traced.statistics.leaves == (len(leaves) - 3,)  # the mask alone (mask, x, y)
    loss = [r for r in traced.jaxpr.eqns if r.params.get("kind") == "grad_end"][0]
    assert loss.params["reduce"][0][:2] == ("loss", "sum")  # sum(err_i * mask_i) / C


def test_find_and_hoist_on_a_plain_function():
    def f(x, mask, w):
        return jnp.sum(x @ w * mask) / jnp.sum(mask), jnp.sum(mask)

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((4, 3), (4,), (3,))]
    full = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 3), (8,), (3,))]
    micro, whole = jax.make_jaxpr(f)(*args), jax.make_jaxpr(f)(*full)
    found = find_statistics(micro, whole, [True, True, False])
    # the count, written twice (the division's and the result's): one input for both
    assert len(found.positions) == 2 and found.inputs == (0, 0)
    hoisted = hoist_statistics(micro, found)
    assert len(hoisted.jaxpr.invars) == 4
    assert [e.primitive.name for e in hoisted.jaxpr.eqns].count("reduce_sum") == 1  # x@w*mask
    program = statistics_program(whole, found, [True, True, False])
    mask = np.array([1, 1, 0, 0, 1, 0, 1, 1], np.float32)
    assert [float(c) for c in program([np.ones((8, 3)), mask, np.ones(3)])] == [5.0]
    x, w = np.ones((4, 3), np.float32), np.ones(3, np.float32)
    out = jaxpr_as_fun(hoisted)(x, mask[:4], w, np.float32(5.0))
    assert float(out[0]) == pytest.approx(2 * 3 / 5) and float(out[1]) == 5.0


def test_a_value_that_reads_the_parameters_is_no_statistic():
    def f(x, w):
        s = jax.nn.sigmoid(x @ w)
        return jnp.sum(s * x[:, 0]) / jnp.sum(s)

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((4, 3), (3,))]
    full = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 3), (3,))]
    found = find_statistics(jax.make_jaxpr(f)(*args), jax.make_jaxpr(f)(*full), [True, False])
    assert not found


@pytest.mark.parametrize(
    "method",
    [
        PIPE,
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, schedule="gpipe"),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, schedule="zb_h1"),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
        ShardParallel(mesh_shape=(1, 2), num_micro_batches=4),
    ],
    ids=["1f1b-M2", "gpipe-M4", "zb_h1-M4", "dp-M2", "shard-M4"],
)
def test_a_token_weighted_mean_equals_jit(threads_cluster, method):
    """Refused before ("it divides by a total computed from the batch"); a declared mean
    averaged the micro-batches' masked means with equal weights instead."""
    par = check_step_parity(masked_step, method, _state(), BATCHES)
    assert "gradients and loss: sum over" in str(par.plan)
    assert PATH.format(k=0) in str(par.plan)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_a_token_weighted_mean_under_remat_equals_jit(threads_cluster, remat):
    """A rematerialized layer recomputed the count inside its backward, per micro-batch,
    while the forward divided by the full batch's (relative error 1.0 on a bias): the
    count is now computed outside the checkpoint, and read by it."""
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, remat=remat)
    check_step_parity(masked_step, method, _state(), BATCHES)


def test_normalized_weights_and_a_masked_accuracy_equal_jit(threads_cluster, caplog):
    """The accuracy took the default mean, with a warning, and differed from jit's."""
    par = check_step_parity(weights_step, PIPE, _state(), BATCHES)
    text = str(par.plan)
    assert "aux['accuracy']: sum over 2 micro-batches (traced: sum over the batch)" in text
    assert "aux['tokens']: sum over 2 micro-batches (traced: sum over the batch)" in text
    assert "default" not in "".join(r.getMessage() for r in caplog.records)


def test_batch_standardized_inputs_and_an_update_reading_a_statistic_equal_jit(threads_cluster):
    """Standardizing per micro-batch gave other inputs than jit's; the update reading
    ``jnp.mean(batch["mask"])`` and the returned ``jnp.max(batch["y"])`` were refused."""
    check_step_parity(standardized_step, PIPE, _state(), BATCHES)


def test_a_declared_mean_keeps_the_micro_batches_own_counts():
    """``loss_reduce='mean'`` asks for the equal-weight average of the micro-batches'
    masked means (gradient accumulation's rule): their counts stay their own."""

    def step(state, batch):
        def loss_fn(params):
            err = (state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2
            return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])

        loss, grads = meshshard.value_and_grad(loss_fn, loss_reduce="mean")(state.params)
        return state.apply_gradients(grads=grads), loss

    traced = _traced(step)
    assert traced.statistics is None
    assert not any(leaf.path.startswith("<full-batch") for leaf in traced.inputs)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_micro_batches_of_one_row_take_a_masked_mean_over_the_full_batch(threads_cluster, schedule):
    """JAX specializes a dimension of size 1, so the two traces do not pair up, and the
    count was not matched: the loss was refused ("divides by a total computed from the
    batch"), though one-row micro-batches are the usual pipeline setting for large
    models. The traces differ only in the backward (the transposes of size-1
    broadcasts): the count, in the forward, pairs."""
    method = PipeshardParallel(num_micro_batches=8, stages=[(1, 2), (1, 2)], schedule=schedule)
    check_step_parity(masked_step, method, _state(), BATCHES)
    traced = _traced(masked_step, m=8)
    stats = [leaf for leaf in traced.inputs if leaf.path.startswith("<full-batch")]
    assert [s.path for s in stats] == [PATH.format(k=0)]
    (count,) = traced.statistics(jax.tree.leaves((_state(), BATCHES[1])))
    assert float(count) == BATCHES[1]["mask"].sum()


def eval_step(state, batch):
    """A forward-only evaluation: masked accuracy and per-example standardized errors."""
    pred = state.apply_fn({"params": state.params}, batch["x"])
    hit = (jnp.abs(pred - batch["y"]) < 0.5) * batch["mask"]
    err = jnp.sum((pred - batch["y"]) ** 2, axis=1)
    return jnp.sum(hit) / jnp.sum(batch["mask"]), err / jnp.max(err)


def test_a_forward_only_masked_accuracy_equals_jit(threads_cluster):
    """Refused before: the accuracy divides by the batch's count.  (The per-example errors
    over their batch maximum read the parameters: per micro-batch, so not compared.)"""

    def step(state, batch):
        return eval_step(state, batch)[0]

    par = meshshard.parallelize(step, method=PIPE)
    for batch in BATCHES:
        np.testing.assert_allclose(
            np.asarray(par(_state(), batch)), jax.jit(step)(_state(), batch), rtol=1e-6
        )


def lm_step(state, batch):
    """Next-token cross-entropy over the unpadded tokens, and their accuracy."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        mask = batch["targets"] != 0
        n = jnp.maximum(jnp.sum(mask), 1)
        hit = (jnp.argmax(logits, -1) == batch["targets"]) & mask
        return jnp.sum(jnp.where(mask, ce, 0.0)) / n, {"accuracy": jnp.sum(hit) / n}

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def _lm_batches(n=2, rows=8, seq=16):
    """Padded sequences (token 0 after each one's length), lengths growing with the row."""
    out = []
    for i in range(n):
        b = gpt.make_batch(batch_size=rows, seq_len=seq, seed=i)
        pad = np.arange(seq)[None, :] >= (np.arange(rows)[:, None] * 2 + 3 + i)
        out.append({k: np.where(pad, 0, v).astype(np.int32) for k, v in b.items()})
    return out


@pytest.mark.ray
def test_a_padded_language_model_equals_jit_on_ray(ray_cluster):
    """The host-actors trace the step themselves; the driver sends the count each call."""
    batches = _lm_batches()
    state = gpt.make_state(gpt.GPT(num_layers=2), batches[0]["inputs"])
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    check_step_parity(lm_step, method, state, batches)


class _RematLayer(nn.Module):
    """A rematerialized layer, scaled by the mask's fill when ``inner_stat``."""

    inner_stat: bool

    @nn.compact
    def __call__(self, x, mask):
        h = jnp.tanh(nn.Dense(16)(x))
        return h * (jnp.sum(mask) / mask.size) if self.inner_stat else h


class _RematModel(nn.Module):
    inner_stat: bool

    @nn.compact
    def __call__(self, x, mask):
        for _ in range(3):
            x = nn.remat(_RematLayer)(self.inner_stat)(x, mask)
            meshshard.mark_pipeline_boundary()
        return nn.Dense(4)(x)


def _remat_case(inner_stat: bool):
    model = _RematModel(inner_stat)
    params = model.init(jax.random.key(0), BATCHES[0]["x"], BATCHES[0]["mask"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            err = (state.apply_fn({"params": p}, batch["x"], batch["mask"]) - batch["y"]) ** 2
            return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, state


def test_user_remat_layers_keep_the_full_batch_count(threads_cluster):
    step, state = _remat_case(inner_stat=False)
    check_step_parity(step, PIPE, state, BATCHES)


def test_a_statistic_inside_a_user_remat_layer_takes_none_over_the_full_batch():
    """Its backward recomputes it inside the layer, per micro-batch, where the count
    outside would be the full batch's (relative error 1.1 on a bias): the step keeps
    per-micro-batch statistics, so its masked mean is refused as before."""
    step, state = _remat_case(inner_stat=True)
    par = meshshard.parallelize(step, method=PIPE)
    with pytest.raises(MeshshardInputError, match=r"divides by a total computed from the batch"):
        par.lower(state, BATCHES[0], cluster=CLUSTER)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(16, 16)(ids)
        x = x + nn.Dense(16)(nn.relu(nn.Dense(32)(x)))
        meshshard.mark_pipeline_boundary()
        return nn.Dense(16)(x)


LM_TX = optax.adamw(1e-2)


def token_normalised_step(state, batch):
    """A summed token loss whose gradients are divided by the batch's token count after
    the grad, and a tokens-seen counter: the count is a statistic of the batch data."""
    params, opt, seen = state

    def loss_fn(p):
        logits = TinyLM().apply({"params": p}, batch["ids"][:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:])
        return jnp.sum(ce * batch["mask"])

    total, grads = meshshard.value_and_grad(loss_fn)(params)
    tokens = jnp.maximum(batch["mask"].sum(), 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt = LM_TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt, seen + tokens), total / tokens


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=4),
    ],
    ids=["pipe-M2", "dp-M4"],
)
def test_gradients_divided_by_the_token_count_after_the_grad_equal_jit(threads_cluster, method):
    """Before: "meshshard.grad returns <full-batch statistic 0> unchanged from its
    inputs" (the count, sunk before the grad as a batch metric, then read from the
    driver's full-batch statistics, passed the marker unchanged)."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        mask = (rng.random((16, 8)) < 0.7).astype(np.float32)
        mask[:4] = 0.0  # the first micro-batch's count differs from the others'
        batches.append({"ids": rng.integers(0, 16, (16, 9)).astype(np.int32), "mask": mask})
    params = TinyLM().init(jax.random.key(0), batches[0]["ids"][:, :-1])["params"]
    state = (params, LM_TX.init(params), jnp.zeros(()))
    check_step_parity(token_normalised_step, method, state, batches, rtol=1e-4)


def _aux_across_cuts_step(params, batch):
    """Three layers cut by ``layers=``; the first layer's pre-activation norm, returned as
    aux, crosses the cut with no gradient (its cotangent at the backward boundary is a
    literal zero)."""

    def loss_fn(p):
        pre = batch["x"] @ p["w0"]
        norm = jnp.mean(pre**2)
        h = jnp.tanh(jnp.tanh(pre) @ p["w1"])
        pred = h @ p["w2"]
        return jnp.mean((pred - batch["y"]) ** 2), norm

    (loss, norm), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), (loss, norm)


@pytest.mark.slow
def test_an_aux_value_crossing_cuts_with_a_zero_cotangent_equals_jit(threads_cluster):
    # was: TypeError "unhashable type: 'Literal'" from looking the backward boundary's
    # literal zero cotangent up among the batch data (a Flax sow'd intermediate did it)
    rng = np.random.RandomState(0)
    params = {
        k: rng.randn(*s).astype(np.float32) * 0.5
        for k, s in {"w0": (6, 16), "w1": (16, 16), "w2": (16, 1)}.items()
    }
    batches = [
        {"x": rng.randn(8, 6).astype(np.float32), "y": rng.randn(8, 1).astype(np.float32)}
        for _ in range(2)
    ]
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)
    check_step_parity(_aux_across_cuts_step, method, params, batches, rtol=1e-5)
