"""Loss and aux metrics combine over micro-batches as the full-batch step would.

The loss's reduction (mean or sum) and each aux value's (mean, sum, max, min, integer
count) are found by tracing at micro-batch and full-batch shape, or declared; results
equal ``jax.jit`` of the unmodified step.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, MeshshardInputError, PipeshardParallel
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import classify
from tests.conftest import assert_trees_close
from tests.random_parity import check_step_parity

CLUSTER = ClusterSpec("reductions-4x2", 4, 2)


def sgd_state(batch_x, lr=0.05):
    model = mlp.MLP(num_layers=4)
    params = model.init(jax.random.key(0), batch_x)["params"]
    from flax.training import train_state

    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(lr))


def summed_loss_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.sum((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def metrics_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        err = pred - batch["y"]
        aux = {
            "mse": jnp.mean(err**2),
            "abs_sum": jnp.sum(jnp.abs(err)),
            "abs_max": jnp.max(jnp.abs(err)),
            "abs_min": jnp.min(jnp.abs(err)),
            "positives": jnp.sum(pred > 0),
            "weight_norm": jnp.sum(params["dense3"]["kernel"] ** 2),
            # a float histogram: the error summed per sign of the prediction
            "err_by_sign": jnp.zeros(2).at[(pred[:, 0] > 0) * 1].add(jnp.abs(err).sum(1)),
        }
        return jnp.mean(err**2), aux

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


BATCHES = [mlp.make_batch(batch_size=16, seed=i) for i in range(2)]


@pytest.mark.parametrize("m", [2, 4])
def test_summed_loss_sums_gradients_under_sgd(threads_cluster, m):
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2), (1, 2)])
    par = check_step_parity(summed_loss_step, method, state, BATCHES)
    assert f"gradients and loss: sum over {m} micro-batches (traced" in str(par.plan)


def time_summed_step(state, batch):
    """A recurrent model whose loss is summed over time steps in the scan's carry."""

    def loss_fn(params):
        xs, ys = jnp.swapaxes(batch["x"], 0, 1), jnp.swapaxes(batch["y"], 0, 1)

        def body(carry, inputs):
            h, total = carry
            x, y = inputs
            h = jnp.tanh(x @ params["w"] + h @ params["u"])
            return (h, total + jnp.sum((h @ params["v"] - y) ** 2)), None

        (_, total), _ = jax.lax.scan(body, (jnp.zeros((xs.shape[1], 8)), 0.0), (xs, ys))
        return total

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize(
    "method",
    [
        meshshard.DataParallel((1, 2), num_micro_batches=2),
        meshshard.ShardParallel((1, 2), num_micro_batches=2),
    ],
    ids=["data-parallel", "auto"],
)
def test_a_loss_summed_over_time_in_a_scan_sums_its_gradients(threads_cluster, method):
    """Its micro-batches' gradients were averaged (the loop also returns the per-row
    state, so it did not count as reducing the batch): half the gradient."""
    from flax.training import train_state

    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.standard_normal((3, 8)), jnp.float32) * 0.3,
        "u": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32) * 0.3,
        "v": jnp.asarray(rng.standard_normal(8), jnp.float32),
    }
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.01))
    batches = [
        {
            "x": rng.standard_normal((8, 5, 3)).astype(np.float32),
            "y": rng.standard_normal((8, 5)).astype(np.float32),
        }
        for _ in range(2)
    ]
    par = check_step_parity(time_summed_step, method, state, batches, rtol=1e-4)
    assert "gradients and loss: sum over 2 micro-batches (traced" in str(par.plan)


def test_averaging_a_summed_loss_would_show_under_sgd():
    """Guard against a vacuous parity: halving a summed loss's gradients moves SGD visibly."""
    state = sgd_state(BATCHES[0]["x"])
    grads = jax.grad(
        lambda p: jnp.sum((state.apply_fn({"params": p}, BATCHES[0]["x"]) - BATCHES[0]["y"]) ** 2)
    )(state.params)
    full = state.apply_gradients(grads=grads).params
    halved = state.apply_gradients(grads=jax.tree.map(lambda g: g / 2, grads)).params
    with pytest.raises(AssertionError, match="relative error"):
        assert_trees_close(full, halved)


def test_aux_metrics_match_jit(threads_cluster):
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="gpipe")
    par = check_step_parity(metrics_step, method, state, BATCHES)
    text = str(par.plan)
    for line in (
        "aux['abs_max']: max over 4 micro-batches (traced",
        "aux['abs_min']: min over 4 micro-batches (traced",
        "aux['abs_sum']: sum over 4 micro-batches (traced",
        "aux['err_by_sign']: sum over 4 micro-batches (traced",
        "aux['mse']: mean over 4 micro-batches (traced",
        "aux['positives']: sum over 4 micro-batches (traced",
        "aux['weight_norm']: mean over 4 micro-batches (traced: same on every micro-batch",
    ):
        assert line in text


def declared_step(state, batch):
    """Reductions the tracer cannot see (a masked ratio), declared two ways."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        err = jnp.abs(pred - batch["y"])
        big = err > 1.0
        aux = {
            "big_err_sum": jnp.sum(jnp.where(big, err, 0.0)),  # declared below: sum
            "worst": meshshard.aux_max(jnp.max(err, axis=0)),  # a marker, per column
        }
        return jnp.mean(err), aux

    (loss, aux), grads = meshshard.value_and_grad(
        loss_fn, has_aux=True, aux_reduce={"big_err_sum": "sum"}
    )(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def test_declared_reductions(threads_cluster):
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(declared_step, method, state, BATCHES)
    assert "aux['big_err_sum']: sum over 2 micro-batches (declared)" in str(par.plan)
    assert "aux['worst']: max over 2 micro-batches (declared)" in str(par.plan)


def masked_mean_step(state, batch):
    """A mean weighted by the model's own confidence: the total it divides by reads the
    parameters, so it is no statistic of the batch data the driver could take over the
    full batch (those are: tests/test_batch_statistics.py)."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        weight = jax.nn.sigmoid(pred)
        return jnp.sum((pred - batch["y"]) ** 2 * weight) / jnp.sum(weight)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_mean_weighted_by_the_model_is_refused():
    state = sgd_state(BATCHES[0]["x"])
    step = meshshard.parallelize(masked_mean_step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(
        MeshshardInputError,
        match=r"cannot tell how the loss combines over micro-batches: it divides by a total "
        r"computed from the batch.*loss_reduce='mean' or 'sum'",
    ):
        step.lower(state, BATCHES[0], cluster=CLUSTER)


def chunked_sum_step(state, batch, loss_reduce=None):
    """A summed loss computed in chunks of 4 rows: a Python loop over the batch size, so
    the step traces differently at micro-batch and full-batch shape."""

    def loss_fn(params):
        err = (state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2
        return sum(jnp.sum(err[i : i + 4]) for i in range(0, err.shape[0], 4))

    grad = meshshard.value_and_grad(loss_fn, loss_reduce=loss_reduce)
    loss, grads = grad(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_loss_whose_program_depends_on_the_batch_size_is_refused():
    """Guessing 'mean' here averaged a summed loss's gradients (half of jax.jit's with two
    micro-batches), with only a warning."""
    state = sgd_state(BATCHES[0]["x"])
    step = meshshard.parallelize(chunked_sum_step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(
        MeshshardInputError,
        match=r"cannot tell how the loss combines over micro-batches: the step traces "
        r"differently at micro-batch and full-batch shape.*loss_reduce='mean' or 'sum'",
    ):
        step.lower(state, BATCHES[0], cluster=CLUSTER)


def test_a_declared_loss_reduction_fixes_a_batch_size_dependent_program(threads_cluster):
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    step = functools.partial(chunked_sum_step, loss_reduce="sum")
    par = check_step_parity(step, method, state, BATCHES)
    assert "gradients and loss: sum over 2 micro-batches (declared)" in str(par.plan)


def _loss_step(make_loss):
    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return make_loss(pred, batch["y"], params)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _penalty(params):
    return 1e-2 * sum(jnp.sum(w**2) for w in jax.tree.leaves(params))


#: Losses that add a batch sum to terms combining otherwise: a mean, a constant.
SHARED_LOSSES = {
    # a summed loss plus a weight penalty: the penalty would count once per micro-batch
    "sum_plus_penalty": lambda pred, y, p: jnp.sum((pred - y) ** 2) + _penalty(p),
    "sum_plus_constant": lambda pred, y, p: jnp.sum((pred - y) ** 2) + 3.0,
    "mean_plus_sum": lambda pred, y, p: jnp.mean((pred - y) ** 2) + 1e-2 * jnp.sum(jnp.abs(pred)),
    # a masked token mean (a sum once its count is taken over the full batch) plus an
    # unmasked mean of the logits (a z-loss)
    "masked_mean_plus_mean": lambda pred, y, p: (
        jnp.sum(jnp.abs(pred - y) * (y > 0)) / jnp.maximum(jnp.sum(y > 0), 1) + jnp.mean(pred**2)
    ),
    # a token sum plus an unmasked mean minus a penalty, scaled: shares nest
    "sum_mean_penalty": lambda pred, y, p: (
        0.5 * (jnp.sum(jnp.abs(pred - y)) / 8.0 + jnp.mean(pred**2) - _penalty(p))
    ),
}


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, schedule="zb_h1"),
        meshshard.ShardParallel((1, 2), num_micro_batches=2),
        # layers under jax.checkpoint: the shares are taken inside the checkpoint too
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], remat="full"),
    ],
    ids=["1f1b-m2", "zb_h1-m4", "shard-m2", "remat-m2"],
)
@pytest.mark.parametrize("name", list(SHARED_LOSSES))
def test_a_loss_adding_a_batch_sum_to_a_mean_or_a_constant_equals_jit(
    threads_cluster, name, method
):
    """These were refused, and the refusal's fix (declaring loss_reduce='sum' or 'mean')
    gave other gradients than jax.jit: counted the penalty once per micro-batch, or
    averaged the batch sum.  Each micro-batch's loss now takes 1/M of the mean and
    constant terms, and the micro-batches' losses and gradients add up."""
    state = sgd_state(BATCHES[0]["x"])
    par = check_step_parity(_loss_step(SHARED_LOSSES[name]), method, state, BATCHES)
    m = method.num_micro_batches
    assert f"gradients and loss: sum over {m} micro-batches (traced: a sum over the batch plus" in (
        str(par.plan)
    )


def test_declaring_a_sum_for_a_summed_loss_plus_a_penalty_would_show():
    """Guard against a vacuous parity: counting the penalty once per micro-batch (what
    loss_reduce='sum' declared) moves SGD visibly."""
    state = sgd_state(BATCHES[0]["x"])
    x, y = BATCHES[0]["x"], BATCHES[0]["y"]

    def loss(p, penalties):
        return jnp.sum((state.apply_fn({"params": p}, x) - y) ** 2) + penalties * _penalty(p)

    once = state.apply_gradients(grads=jax.grad(loss)(state.params, 1.0)).params
    twice = state.apply_gradients(grads=jax.grad(loss)(state.params, 2.0)).params
    with pytest.raises(AssertionError, match="relative error"):
        assert_trees_close(once, twice)


def warm_up_step(state, batch):
    """Half the loss on the first step: a where on the step count, not the batch."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        loss = jnp.mean((pred - batch["y"]) ** 2)
        return jnp.where(state.step < 1, 0.5 * loss, loss)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_where_on_the_step_count_over_a_mean_loss_equals_jit(threads_cluster):
    """It was refused ("it applies select_n to a value reduced over the batch")."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(warm_up_step, method, state, BATCHES)
    assert "gradients and loss: mean over 2 micro-batches (traced" in str(par.plan)


def _assert_loss_refused(step, why: str, m: int = 2) -> None:
    """``step`` with ``m`` micro-batches is refused: meshshard cannot tell how its loss
    combines, for the reason matching the regex ``why``."""
    state = sgd_state(BATCHES[0]["x"])
    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=m))
    with pytest.raises(
        MeshshardInputError, match=r"cannot tell how the loss combines over micro-batches: " + why
    ):
        par.lower(state, BATCHES[0], cluster=CLUSTER)


def _cond_step(first, second, pick=lambda state, pred: state.step % 2 == 0):
    """A loss that ``lax.cond`` picks, by ``pick``, from the two its branches compute."""

    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jax.lax.cond(pick(state, pred), first, second, pred, batch["y"])

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _mean_sq(pred, y):
    return jnp.mean((pred - y) ** 2)


def _mean_abs(pred, y):
    return jnp.mean(jnp.abs(pred - y))


def _sum_sq(pred, y):
    return jnp.sum((pred - y) ** 2)


def _sum_abs(pred, y):
    return jnp.sum(jnp.abs(pred - y))


def _masked_mean_sq(pred, y):
    keep = y > 0
    return jnp.sum(jnp.where(keep, (pred - y) ** 2, 0.0)) / jnp.maximum(jnp.sum(keep), 1)


@pytest.mark.parametrize(
    "first,second,how", [(_mean_sq, _mean_abs, "mean"), (_sum_sq, _sum_abs, "sum")]
)
def test_a_cond_on_the_step_count_between_two_batch_losses_equals_jit(
    threads_cluster, first, second, how
):
    """The branches' reductions were not looked at: the lax.cond's loss (beside the
    per-row residuals its branches keep) was traced as "same on every micro-batch" and
    averaged, so two summed losses were halved."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(_cond_step(first, second), method, state, BATCHES)
    assert f"gradients and loss: {how} over 2 micro-batches (traced" in str(par.plan)


@pytest.mark.parametrize(
    "step,why",
    [
        (
            _cond_step(_mean_sq, _sum_sq),
            r"its lax\.cond's branches \(at test_reductions\.py:\d+ .*\) combine "
            r"differently over micro-batches: mean over the batch in one, sum over the batch",
        ),
        (  # each micro-batch would divide by its own count
            _cond_step(_masked_mean_sq, _mean_sq),
            r"in a branch of its lax\.cond \(at test_reductions\.py:\d+ .*\), it divides by "
            r"a total computed from the batch",
        ),
        (
            _cond_step(_mean_sq, _mean_abs, pick=lambda state, pred: jnp.mean(pred) > 0),
            r"it picks a lax\.cond branch by a value computed from the batch",
        ),
    ],
    ids=["mean_or_sum", "masked_mean", "batch_predicate"],
)
def test_a_cond_whose_branches_do_not_combine_alike_is_refused(step, why):
    """These ran, combined as means, and returned other numbers than jax.jit."""
    _assert_loss_refused(step, why)


def total_from_zero_step(state, batch):
    """A loss totalled from 0.0 over the outputs in a Python loop, then divided by the
    number of examples: the 0.0 is a constant added to a batch sum."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        total = 0.0
        for j in range(pred.shape[1]):
            total = total + jnp.sum((pred[:, j] - batch["y"][:, j]) ** 2)
        return total / pred.shape[0]

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_total_from_zero_divided_by_the_batch_size_equals_jit(threads_cluster):
    """The 0.0 made the total a sum with a constant term, taken as 1/M shares, and the
    division by the batch size after it was overlooked: the loss was summed over the
    micro-batches, so loss and gradients came back M times jax.jit's."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(total_from_zero_step, method, state, BATCHES)
    assert (
        "gradients and loss: mean over 2 micro-batches (traced: a mean over the batch of a sum"
        in str(par.plan)
    )


def _custom_vjp_loss(reduce):
    """A squared error under ``jax.custom_vjp`` with a hand-written backward, as fused
    loss kernels are: ``reduce`` (jnp.mean or jnp.sum) over the batch."""

    @jax.custom_vjp
    def loss(pred, y):
        return reduce((pred - y) ** 2)

    def fwd(pred, y):
        return loss(pred, y), (pred, y)

    def bwd(res, g):
        pred, y = res
        scale = 2.0 / pred.size if reduce is jnp.mean else 2.0
        return g * scale * (pred - y), None

    loss.defvjp(fwd, bwd)
    return lambda pred, y, p: loss(pred, y)


@pytest.mark.parametrize("reduce,how", [(jnp.mean, "mean"), (jnp.sum, "sum")], ids=["mean", "sum"])
def test_a_loss_with_a_custom_derivative_equals_jit(threads_cluster, reduce, how):
    """It was refused ("it reduces the batch with ['custom_vjp_call']"): the reduction
    inside the function with a custom derivative is now read from its primal body."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(_loss_step(_custom_vjp_loss(reduce)), method, state, BATCHES)
    assert f"gradients and loss: {how} over 2 micro-batches (traced" in str(par.plan)


def _chunk_losses(pred, y):
    """Squared errors summed per chunk of the examples, one chunk at a time (lax.map: a
    scan with stacked outputs), as a memory-saving loss over a large output does."""
    chunks = (pred.reshape(2, -1, pred.shape[1]), y.reshape(2, -1, y.shape[1]))
    return jax.lax.map(lambda c: jnp.sum((c[0] - c[1]) ** 2), chunks)


def test_a_loss_summed_over_lax_map_chunks_equals_jit(threads_cluster):
    """It was refused ("it reduces the batch in a scan loop other than by adding to a
    carry that starts at zero"): the stacked per-chunk sums, summed over the chunks, are
    the batch's sum."""
    state = sgd_state(BATCHES[0]["x"])
    step = _loss_step(lambda pred, y, p: jnp.sum(_chunk_losses(pred, y)) / pred.shape[0])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(step, method, state, BATCHES)
    assert "gradients and loss: mean over 2 micro-batches (traced" in str(par.plan)


def test_one_lax_map_chunk_of_the_batch_is_refused():
    """A micro-batch's first chunk holds other examples than the batch's first chunk."""
    _assert_loss_refused(
        _loss_step(lambda pred, y, p: _chunk_losses(pred, y)[0]),
        r"it reduces the batch in a scan loop other than",
    )


def _cond_on_the_loss(make_loss, second):
    """``lax.cond`` on the step count over a loss reduced before it: the first step takes
    ``second`` of it, later ones the loss itself."""

    def step(state, batch):
        def loss_fn(params):
            loss = make_loss(state.apply_fn({"params": params}, batch["x"]), batch["y"])
            return jax.lax.cond(state.step < 1, second, lambda v: v, loss)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


@pytest.mark.parametrize(
    "make_loss,how", [(_mean_sq, "mean"), (_masked_mean_sq, "sum")], ids=["mean", "masked_mean"]
)
def test_a_cond_on_the_step_count_over_a_reduced_loss_equals_jit(threads_cluster, make_loss, how):
    """It was refused ("it applies cond to a value reduced over the batch"), as
    jnp.where was before it; each branch is linear in the loss.  (A masked mean is a sum
    once its count is taken over the full batch.)"""
    state = sgd_state(BATCHES[0]["x"])
    step = _cond_on_the_loss(make_loss, lambda v: 0.5 * v)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(step, method, state, BATCHES)
    assert f"gradients and loss: {how} over 2 micro-batches (traced" in str(par.plan)


def test_a_cond_between_a_summed_loss_and_a_constant_is_refused():
    """Each micro-batch would count the constant once."""
    _assert_loss_refused(
        _cond_on_the_loss(_sum_sq, lambda v: jnp.float32(1.0)),
        r"it applies cond to a value reduced over the batch \(at test_reductions\.py:",
    )


def test_a_cond_whose_residuals_coincide_at_the_micro_batch_size_equals_jit(threads_cluster):
    """At 4 micro-batches of 4 rows the predictions are (4, 4), as the last kernel is
    (16, 4) against (16, 4) predictions at full size: the lax.cond kept another number of
    residuals in the two traces, and pairing them failed with a bare "zip() argument 2
    is shorter than argument 1".  The reductions are now read from traces at 2 and 8
    rows, which pair."""

    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            penalty = lambda pred, y: 1e-3 * sum(jnp.sum(a**2) for a in jax.tree.leaves(params))  # noqa: E731
            return jax.lax.cond(state.step < 1, penalty, _mean_sq, pred, batch["y"])

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)])
    par = check_step_parity(step, method, state, BATCHES)
    assert "gradients and loss: mean over 4 micro-batches (traced" in str(par.plan)


def batch_size_aux_step(state, batch):
    """Returns the number of examples as aux, as a literal result and through the
    update: constants that the batch's size makes."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {"examples": jnp.float32(batch["x"].shape[0])}

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux, batch["x"].shape[0]


@pytest.mark.parametrize("m", [1, 2])
def test_the_batch_size_returned_as_aux_or_a_result_equals_jit(threads_cluster, m):
    """A literal aux value failed the update's placement ("step output %93 could not be
    placed on a mesh; this is a bug"), and a literal result came back as the
    micro-batch's size (8 of 16)."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2), (1, 2)])
    par = meshshard.parallelize(batch_size_aux_step, method=method)
    want = jax.jit(batch_size_aux_step)(state, BATCHES[0])
    got = meshshard.fetch(par(state, BATCHES[0]))
    assert float(got[2]["examples"]) == 16.0 and int(got[3]) == 16, got[2:]
    assert_trees_close(want, got)


def test_a_sum_plus_a_penalty_inside_a_users_checkpoint_says_the_shares_found_no_place():
    """The refusal said such a sum "is combined for you", which it is not inside the
    user's own jax.checkpoint: the re-trace does not enter its body."""

    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jax.checkpoint(lambda pred, y, p: _sum_sq(pred, y) + _penalty(p))(
                pred, batch["y"], params
            )

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    _assert_loss_refused(
        step,
        r"it adds a value that does not depend on the batch to a batch sum .*could not put "
        r"the shares on these terms \(inside your own jax\.checkpoint",
    )


def test_a_where_between_a_batch_sum_and_a_constant_says_why():
    fn = lambda x: jax.lax.select(_WARM, jnp.sum(x), jnp.float32(0.0))  # noqa: E731
    x_full = jnp.arange(32.0).reshape(8, 4)
    micro, full = jax.make_jaxpr(fn)(x_full[:2]), jax.make_jaxpr(fn)(x_full)
    dep = batch_dependent(micro.jaxpr, [True], len(micro.jaxpr.eqns))
    why = classify(micro, full, micro.jaxpr.outvars[0], 4, dep)[1]
    assert why.startswith(
        "it picks between a batch sum and a value that does not depend on the batch"
    ), why


def test_a_share_of_a_batch_sum_is_still_refused():
    """Shares make sums of means and constants only: two batch maxima added to a sum
    are refused as before, without the fix of declaring loss_reduce (which would combine
    the maxima and the sum alike: wrong)."""
    state = sgd_state(BATCHES[0]["x"])
    step = _loss_step(lambda pred, y, p: jnp.sum((pred - y) ** 2) + jnp.max(pred) + jnp.max(y))
    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(MeshshardInputError, match="cannot tell how the loss combines") as err:
        par.lower(state, BATCHES[0], cluster=CLUSTER)
    assert "make each term of the loss a mean or a sum" in str(err.value)
    assert "declaring loss_reduce would combine every term alike" in str(err.value)


@pytest.mark.parametrize(
    "make_loss,why",
    [
        (  # in-batch negatives: each micro-batch would see only its own
            lambda pred, y, p: -jnp.mean(jnp.diagonal(jax.nn.log_softmax(pred @ pred.T))),
            r"it mixes examples: .* with the batch in 2 dimensions",
        ),
        (  # a running sum over the examples: a micro-batch lacks the rows before it
            lambda pred, y, p: jnp.mean(jnp.cumsum(pred - y, axis=0) ** 2),
            r"it mixes examples: cumsum runs along the batch dimension",
        ),
        (  # the hardest half of the examples: a micro-batch ranks only its own
            lambda pred, y, p: jnp.mean(
                jax.lax.top_k(jnp.mean((pred - y) ** 2, 1), pred.shape[0] // 2)[0]
            ),
            r"it mixes examples: top_k runs along the batch dimension",
        ),
        (  # a product of batch means (a mixture-of-experts balance loss, f . P)
            lambda pred, y, p: jnp.sum(jnp.mean(pred, 0) * jnp.mean(jnp.tanh(pred), 0)),
            r"it applies mul to a value reduced over the batch",
        ),
        (  # the batch's sum over its size squared: was combined as a mean (M times jit's)
            lambda pred, y, p: jnp.mean((pred - y) ** 2) / pred.shape[0],
            r"it divides by the batch size twice",
        ),
        (  # the same with the means taken in a scan's body (one per output column)
            lambda pred, y, p: (
                jax.lax.scan(
                    lambda total, col: (total + jnp.mean(col), None), 0.0, ((pred - y) ** 2).T
                )[0]
                / pred.shape[0]
            ),
            r"it divides by the batch size twice",
        ),
        (  # each micro-batch divided the penalty by its own size: M times jit's penalty
            lambda pred, y, p: jnp.mean((pred - y) ** 2) + _penalty(p) / pred.shape[0],
            r"it adds a value that does not depend on the batch divided by the batch size",
        ),
    ],
    ids=[
        "in_batch_negatives",
        "cumsum_over_batch",
        "hardest_half_top_k",
        "product_of_batch_means",
        "mean_over_batch_size",
        "scan_mean_over_batch_size",
        "penalty_over_batch_size",
    ],
)
def test_a_loss_whose_terms_combine_differently_is_refused(make_loss, why):
    """These took 'sum' or 'mean' from the kinds of reduction in the whole slice, and the
    parallel step silently returned other numbers than jax.jit.  The refusal names the
    user's line that mixes the examples or combines the reductions (it named only a
    primitive, which a user of a large model could not find)."""
    state = sgd_state(BATCHES[0]["x"])
    step = meshshard.parallelize(
        _loss_step(make_loss), method=PipeshardParallel(num_micro_batches=2)
    )
    with pytest.raises(
        MeshshardInputError, match=r"cannot tell how the loss combines over micro-batches: " + why
    ) as info:
        step.lower(state, BATCHES[0], cluster=CLUSTER)
    assert re.search(r"\(at test_reductions\.py:\d+ \(<lambda>\)\)", str(info.value)), str(
        info.value
    )


def test_a_max_loss_is_refused():
    """Its gradient is one example's; the micro-batches' gradients were combined by an
    elementwise max."""
    state = sgd_state(BATCHES[0]["x"])
    step = _loss_step(lambda pred, y, p: jnp.max((pred - y) ** 2))
    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(MeshshardInputError, match=r"the loss is a maximum over the batch"):
        par.lower(state, BATCHES[0], cluster=CLUSTER)


def _per_example(pred, y):
    return jnp.mean((pred - y) ** 2, axis=1)


@pytest.mark.parametrize(
    "make_loss,m,op",
    [
        # the median's index arithmetic was blamed ("sub by a literal that changes with
        # the batch size")
        (lambda pred, y, p: jnp.median(_per_example(pred, y)), 2, "sort"),
        (lambda pred, y, p: jnp.median(_per_example(pred, y)), 4, "sort"),
        (lambda pred, y, p: jnp.quantile(_per_example(pred, y), 0.9), 2, "sort"),
        # the 4 largest of 4 examples per micro-batch slice nothing: the traces differed,
        # and the refusal blamed code that branches on the batch size
        (lambda pred, y, p: jnp.sum(jnp.sort(_per_example(pred, y))[-4:]), 4, "sort"),
        (lambda pred, y, p: jnp.mean(jnp.sort(_per_example(pred, y))[-4:]), 2, "sort"),
        # a fixed k: was "it applies reduce_sum to a value reduced over the batch"
        (lambda pred, y, p: jnp.mean(jax.lax.top_k(_per_example(pred, y), 4)[0]), 2, "top_k"),
    ],
    ids=["median", "median-m4", "quantile", "sort-top4-m4", "sort-top4", "top_k-4"],
)
def test_an_order_statistic_loss_is_refused_naming_it_and_the_fix(make_loss, m, op):
    state = sgd_state(BATCHES[0]["x"])
    par = meshshard.parallelize(
        _loss_step(make_loss), method=PipeshardParallel(num_micro_batches=m)
    )
    with pytest.raises(MeshshardInputError) as info:
        par.lower(state, BATCHES[0], cluster=CLUSTER)
    msg = str(info.value)
    assert re.search(
        rf"cannot tell how the loss combines over micro-batches: it mixes examples: {op} "
        r"runs along the batch dimension \(axis 0\) of a per-example value: an order "
        r"statistic over the batch \(a sort, median, quantile or top-k.*\) ranks each "
        r"example against the whole batch, so it cannot be computed per micro-batch and "
        r"combined",
        msg,
    ), msg
    assert re.search(
        r"compute it with num_micro_batches=1, or outside the step, or use a mean", msg
    )
    for misleading in ("literal that changes", "branches or loops", "value reduced over"):
        assert misleading not in msg


def test_a_mixup_step_is_refused_naming_the_shuffle_not_a_sort():
    """Mixup pairs each example with a random partner from the whole batch
    (``jax.random.permutation``, which sorts random bits): it was refused as "an order
    statistic ... (a sort, median, quantile or top-k)", which the step does not compute."""
    state = sgd_state(BATCHES[0]["x"])

    def step(state, batch):
        perm = jax.random.permutation(jax.random.key(0), batch["x"].shape[0])
        x = 0.7 * batch["x"] + 0.3 * batch["x"][perm]
        y = 0.7 * batch["y"] + 0.3 * batch["y"][perm]

        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(MeshshardInputError) as info:
        par.lower(state, BATCHES[0], cluster=CLUSTER)
    msg = str(info.value)
    assert "it mixes examples: a random permutation of the batch (jax.random.permutation" in msg
    assert msg.endswith(
        "shuffle or mix the examples before the step (in the input pipeline), or run it "
        "with num_micro_batches=1"
    ), msg
    assert "order statistic" not in msg


def test_an_order_statistic_aux_value_takes_the_default_and_says_why():
    state = sgd_state(BATCHES[0]["x"])

    def step(state, batch):
        def loss_fn(params):
            err = _per_example(state.apply_fn({"params": params}, batch["x"]), batch["y"])
            return jnp.mean(err), {"median": jnp.median(err)}

        (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), aux

    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    notes = par.lower(state, BATCHES[0], cluster=CLUSTER).notes
    assert any(
        n.startswith(
            "aux['median']: mean over 2 micro-batches (default: it mixes examples: "
            "sort runs along the batch dimension (axis 0) of a per-example value: "
            "an order statistic over the batch"
        )
        for n in notes
    ), notes


def test_a_negated_batch_max_is_not_combined_as_a_max():
    """``-max(err)`` is the minimum of ``-err``: it was traced as a max and combined by a
    max over micro-batches (not jax.jit's value); now it takes the default and says so."""
    state = sgd_state(BATCHES[0]["x"])

    def step(state, batch):
        def loss_fn(params):
            err = (state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2
            return jnp.mean(err), {"neg_worst": -jnp.max(err), "worst": 2.0 * jnp.max(err)}

        (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), aux

    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    notes = par.lower(state, BATCHES[0], cluster=CLUSTER).notes
    assert any(
        re.fullmatch(
            r"aux\['neg_worst'\]: mean over 2 micro-batches \(default: it applies neg to a "
            r"batch maximum, which may reverse its order \(at test_reductions\.py:\d+ "
            r"\(test_a_negated_batch_max_is_not_combined_as_a_max\.<locals>\.step\.<locals>"
            r"\.loss_fn\)\)\)",
            n,
        )
        for n in notes
    ), notes
    assert "aux['worst']: max over 2 micro-batches (traced: reduction over the batch)" in notes


def test_a_mean_loss_plus_a_weight_penalty_is_a_mean(threads_cluster):
    """The penalty is the same on every micro-batch: averaging keeps it once."""
    state = sgd_state(BATCHES[0]["x"])
    step = _loss_step(lambda pred, y, p: jnp.mean((pred - y) ** 2) + _penalty(p))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(step, method, state, BATCHES)
    assert "gradients and loss: mean over 2 micro-batches (traced" in str(par.plan)


def test_aux_reduce_names_an_unknown_key():
    state = sgd_state(BATCHES[0]["x"])

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean(state.apply_fn({"params": p}, batch["x"])), {"a": jnp.float32(0)}

        return meshshard.value_and_grad(loss_fn, has_aux=True, aux_reduce={"b": "sum"})(
            state.params
        )

    with pytest.raises(MeshshardInputError, match=r"aux_reduce=\.\.\.\) names \['b'\].*\['a'\]"):
        jax.eval_shape(step, state, BATCHES[0])


def test_unknown_reduction_is_refused():
    with pytest.raises(MeshshardInputError, match=r"unknown reduction 'median'; use one of"):
        meshshard.metrics.aux_reduce(jnp.float32(1), "median")


#: A predicate the same on every micro-batch (a closed-over array, not the batch).
_WARM = jnp.asarray(True)


def _classify_loss(loss_fn, m=4):
    x_full = jnp.arange(32.0).reshape(8, 4)
    x_micro = x_full[: 8 // m]
    micro = jax.make_jaxpr(loss_fn)(x_micro)
    full = jax.make_jaxpr(loss_fn)(x_full)
    dep = batch_dependent(micro.jaxpr, [True], len(micro.jaxpr.eqns))
    return classify(micro, full, micro.jaxpr.outvars[0], m, dep)[0]


@pytest.mark.parametrize(
    "fn,want",
    [
        (lambda x: jnp.mean(x**2), "mean"),
        (lambda x: jnp.sum(x**2) / x.shape[0], "mean"),
        (lambda x: jnp.sum(jnp.mean(x, axis=1)), "sum"),
        (lambda x: jnp.max(x), "max"),
        (lambda x: jnp.min(x), "min"),
        (lambda x: jnp.sum(x > 3), "sum"),
        (lambda x: jnp.sum(x) / jnp.sum(x > 3), ""),
        (lambda x: jnp.max(x) + jnp.sum(x), ""),
        # non-linear after the batch reduction: no per-micro-batch value combines to it
        (lambda x: jnp.linalg.norm(x), ""),
        (lambda x: jnp.sqrt(jnp.mean(x**2)), ""),
        (lambda x: jnp.log(jnp.sum(jnp.exp(x))), ""),
        (lambda x: jnp.sum(x) * jnp.sum(x), ""),
        # linear after it: still a mean
        (lambda x: 2.0 * jnp.mean(x**2) + 1.0, "mean"),
        # rows picked by an index array: its integer arithmetic (add(i, n) wraps negative
        # indices) changes with the batch size but does not scale the value
        (lambda x: -jnp.mean(x[jnp.arange(x.shape[0]), 0]), "mean"),
        (lambda x: jnp.sum(jnp.zeros_like(x).at[jnp.arange(x.shape[0])].add(x)), "sum"),
        # a batch statistic used on the batch again (batch norm): per micro-batch, a mean
        (
            lambda x: jnp.mean(
                (x - x.mean(0)) * jax.lax.rsqrt(((x - x.mean(0)) ** 2).mean(0) + 1e-5)
            ),
            "mean",
        ),
        # Flax BatchNorm's default (use_fast_variance): mean(x**2) - mean(x)**2 is a batch
        # statistic used on the batch again, not a sum of the loss's terms (was refused:
        # "it applies square to a value reduced over the batch")
        (
            lambda x: jnp.mean(
                (x - x.mean(0))
                * jax.lax.rsqrt(jnp.maximum(0.0, (x**2).mean(0) - x.mean(0) ** 2) + 1e-5)
            ),
            "mean",
        ),
        # running along the batch: each row reads earlier rows a micro-batch lacks (was a
        # silent 'mean': a time-major batch, or a cumsum over examples)
        (lambda x: jnp.mean(jax.lax.cumsum(x, axis=0) ** 2), ""),
        (
            lambda x: jnp.mean(
                jax.lax.scan(lambda h, r: (0.5 * h + r, h), jnp.zeros(4), x)[1] ** 2
            ),
            "",
        ),
        # the hardest half of the examples (online hard example mining): a micro-batch
        # ranks only its own
        (lambda x: jnp.mean(jax.lax.top_k(jnp.mean(x, 1), x.shape[0] // 2)[0]), ""),
        (lambda x: jnp.mean(jax.lax.sort(jnp.mean(x, 1))[x.shape[0] // 2 :]), ""),
        # a scan over the examples that carries nothing from one to the next: still a mean
        (lambda x: jnp.mean(jax.lax.map(lambda r: jnp.tanh(r) ** 2, x)), "mean"),
        # a batch norm written with a division by the batch's std: a statistic used on
        # the batch again, per micro-batch (was refused: "divides by a total computed from
        # the batch")
        (lambda x: jnp.mean(((x - x.mean(0)) / (x.std(0) + 1e-5)) ** 2), "mean"),
        # per-member batch means averaged over another axis (an ensemble under vmap):
        # linear (was refused: "it applies reduce_sum to a value reduced over the batch")
        (lambda x: jnp.mean(jnp.mean(x**2, axis=0)), "mean"),
        (lambda x: jnp.dot(jnp.arange(4.0), jnp.mean(x**2, axis=0)), "mean"),
        # but a sum of per-column maxima is no maximum of anything
        (lambda x: jnp.sum(jnp.max(x, axis=0)), ""),
        # stop_gradient is the identity on values (Flax NNX's BatchNorm stops the batch
        # mean's gradient before its running average; was "it applies stop_gradient")
        (lambda x: jnp.mean(jax.lax.stop_gradient(jnp.mean(x, 0)) * 2.0), "mean"),
        # a histogram of the batch (per-class sums, a confusion matrix) scattered into
        # zeros: a sum (was the default, a mean for floats: 1/M of the counts)
        (lambda x: jnp.zeros(3).at[(x[:, 0] > 10).astype(int)].add(x[:, 1]), "sum"),
        (lambda x: jnp.zeros((2, 2)).at[(x[:, 0] > 10) * 1, (x[:, 1] > 20) * 1].add(1.0), "sum"),
        # into a running total: each micro-batch would add the total again
        (lambda x: jnp.arange(3.0).at[(x[:, 0] > 10).astype(int)].add(x[:, 1]), ""),
        # per-layer batch means joined (a split scan's pieces, passes/unroll_scans.py):
        # each element is the mean it was (was refused: "it applies concatenate")
        (lambda x: jnp.sum(jnp.concatenate([jnp.mean(x, 0), jnp.mean(x**2, 0)])), "mean"),
        (lambda x: jnp.concatenate([jnp.max(x, 0), jnp.max(-x, 0)]), "max"),
        # the same rules as a sum's terms: a constant beside a batch sum counts once per
        # micro-batch, and a mean beside a sum is neither
        (lambda x: jnp.concatenate([jnp.sum(x, 0), jnp.ones(2)]), ""),
        (lambda x: jnp.concatenate([jnp.sum(x, 0), jnp.mean(x, 0)]), ""),
        # a loss totalled over time steps in a scan carry (the columns are time steps):
        # a sum of batch sums is a sum, of batch means a mean (was refused)
        (lambda x: jax.lax.scan(lambda c, col: (c + jnp.sum(col**2), None), 0.0, x.T)[0], "sum"),
        (lambda x: jax.lax.scan(lambda c, col: (c + jnp.mean(col**2), None), 0.0, x.T)[0], "mean"),
        # beside a recurrent state with the batch's rows (was a silent "mean": the loop's
        # outputs changed shape with the batch, so it did not count as reducing it)
        (
            lambda x: jax.lax.scan(
                lambda c, col: (
                    (jnp.tanh(c[0] + col), c[1] + jnp.sum(jnp.tanh(c[0] + col) ** 2)),
                    None,
                ),
                (jnp.zeros(x.shape[0]), 0.0),
                x.T,
            )[0][1],
            "sum",
        ),
        # decayed, or starting from a value: no combination of micro-batch totals
        (lambda x: jax.lax.scan(lambda c, col: (0.5 * c + jnp.sum(col), None), 0.0, x.T)[0], ""),
        (lambda x: jax.lax.scan(lambda c, col: (c + jnp.sum(col), None), 1.0, x.T)[0], ""),
        # jnp.where's select_n (as the step's inlined jaxpr has it) on a predicate the
        # same on every micro-batch (a warm-up on the step count) picks one case
        # everywhere: the cases must combine alike (was refused: "it applies
        # select_n"); a predicate on the batch is not
        (lambda x: jax.lax.select(_WARM, 0.5 * jnp.mean(x**2), jnp.mean(x**2)), "mean"),
        (lambda x: jax.lax.select(_WARM, jnp.max(x), jnp.max(2 * x)), "max"),
        (lambda x: jax.lax.select(_WARM, jnp.sum(x), jnp.float32(0.0)), ""),
        (lambda x: jax.lax.select(_WARM, jnp.sum(x), jnp.mean(x)), ""),
        (lambda x: jax.lax.select(jnp.mean(x) > 3.0, jnp.mean(x), jnp.float32(0.0)), ""),
    ],
    ids=[
        "mean",
        "sum-over-n",
        "sum-of-row-means",
        "max",
        "min",
        "count",
        "ratio",
        "mixed",
        "norm",
        "rms",
        "logsumexp",
        "product-of-sums",
        "affine-mean",
        "index-picked-mean",
        "index-scattered-sum",
        "batch-norm",
        "batch-norm-fast-variance",
        "cumsum-over-batch",
        "scan-carry-over-batch",
        "hardest-half-top-k",
        "hardest-half-sort",
        "map-over-batch",
        "hand-written-batch-norm",
        "mean-of-column-means",
        "weighted-column-means",
        "sum-of-column-maxima",
        "stopped-gradient-mean",
        "class-histogram",
        "confusion-matrix",
        "scatter-into-a-total",
        "joined-means",
        "joined-maxima",
        "constant-beside-a-sum",
        "sum-beside-a-mean",
        "sum-over-time",
        "mean-over-time",
        "sum-over-time-beside-a-state",
        "decayed-total-over-time",
        "total-over-time-from-one",
        "where-on-the-step-count",
        "where-between-maxima",
        "where-between-a-sum-and-a-constant",
        "where-between-a-sum-and-a-mean",
        "where-on-the-batch",
    ],
)
def test_classify(fn, want):
    assert _classify_loss(fn) == want


def test_a_joined_sum_and_constant_says_concatenates():
    fn = lambda x: jnp.concatenate([jnp.sum(x, 0), jnp.ones(2)])  # noqa: E731
    x_full = jnp.arange(32.0).reshape(8, 4)
    micro, full = jax.make_jaxpr(fn)(x_full[:2]), jax.make_jaxpr(fn)(x_full)
    dep = batch_dependent(micro.jaxpr, [True], len(micro.jaxpr.eqns))
    why = classify(micro, full, micro.jaxpr.outvars[0], 4, dep)[1]
    assert why.startswith("it concatenates a value that does not depend on the batch")


def test_a_scatter_into_a_running_total_says_how_to_write_it():
    x_full = jnp.arange(32.0).reshape(8, 4)

    def counts(x):
        return jnp.arange(3.0).at[(x[:, 0] > 10).astype(int)].add(1.0)

    micro, full = jax.make_jaxpr(counts)(x_full[:2]), jax.make_jaxpr(counts)(x_full)
    dep = batch_dependent(micro.jaxpr, [True], len(micro.jaxpr.eqns))
    kind, why = classify(micro, full, micro.jaxpr.outvars[0], 4, dep)
    assert kind == "" and "total + jnp.zeros_like(total).at[i].add(...)" in why


@pytest.mark.parametrize("n", [8, 16])
def test_a_long_sum_of_terms_classifies_each_value_once(monkeypatch, n):
    """A loss adding ``n`` per-layer means (MoE balancing losses, deep supervision) is a
    mean, found looking at each value once: every partial sum's terms used to be
    classified again for every later term, twice the work per term (16 terms: about
    a minute)."""
    from meshshard.passes import reductions

    calls = []
    real = reductions._classify_once

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(reductions, "_classify_once", counted)

    def loss(x):
        total = 0.0
        for _ in range(n):
            x = jnp.tanh(x)
            total = total + jnp.mean(x**2)
        return total

    assert _classify_loss(loss) == "mean"
    assert len(calls) <= 3 * n


def norm_metric_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {"pred_norm": jnp.linalg.norm(pred)}

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def test_a_norm_metric_is_not_summed_and_the_user_is_told(threads_cluster, caplog):
    """A norm of the batch's predictions has no combination over micro-batches: the plan
    and a warning say its value is a default (it used to be summed silently)."""
    step = meshshard.parallelize(
        norm_metric_step,
        method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
    )
    state = sgd_state(BATCHES[0]["x"])
    with caplog.at_level("WARNING", logger="meshshard"):
        _, loss, _ = step(state, BATCHES[0])
    _, ref_loss, _ = jax.jit(norm_metric_step)(state, BATCHES[0])
    assert_trees_close(ref_loss, loss)  # the loss itself stays exact
    note = next(n for n in step.plan.notes if n.startswith("aux['pred_norm']"))
    assert "default: it applies sqrt to a value reduced over the batch" in note, note
    assert any(
        "pred_norm" in r.getMessage() and "aux_sum" in r.getMessage() for r in caplog.records
    )


def mixed_metric_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        err = jnp.abs(pred - batch["y"])
        return jnp.mean(err), {"total": jnp.sum(err) + jnp.mean(pred**2)}

    (loss, aux), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def test_an_aux_sum_plus_mean_tells_the_user_to_return_its_terms(threads_cluster, caplog):
    """Declaring a reduction for it (what the warning suggested) gives a wrong total:
    summed, the mean counts once per micro-batch; averaged, the sum is divided."""
    step = meshshard.parallelize(
        mixed_metric_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    )
    with caplog.at_level("WARNING", logger="meshshard"):
        step(sgd_state(BATCHES[0]["x"]), BATCHES[0])
    (message,) = [r.getMessage() for r in caplog.records if "aux['total']" in r.getMessage()]
    assert "it adds a batch sum and a batch mean" in message
    assert "Return its terms as separate values" in message and "aux_sum" not in message


def _eval_step(total):
    def eval_step(params, batch):
        err = jnp.abs(mlp.MLP(num_layers=4).apply({"params": params}, batch["x"]) - batch["y"])
        return total(err)

    return eval_step


@pytest.mark.parametrize(
    "total",
    [
        lambda err: jnp.sum(err) + jnp.mean(err**2),
        lambda err: jnp.sum(err * (err > 0.5)) / 16.0 + 2.0,
    ],
    ids=["sum_plus_mean", "sum_plus_constant"],
)
def test_a_forward_result_adding_a_sum_to_a_mean_or_a_constant_equals_jit(threads_cluster, total):
    """An eval step returning the training loss (a token sum plus a mean z-loss) with
    micro-batches was refused; its terms are now 1/M shares, as a train step's loss."""
    state = sgd_state(BATCHES[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = meshshard.parallelize(_eval_step(total), method=method)
    for batch in BATCHES:
        assert_trees_close(
            jax.jit(_eval_step(total))(state.params, batch), par(state.params, batch)
        )
    assert "out: sum over 2 micro-batches (traced: a sum over the batch plus" in str(par.plan)


def test_a_forward_result_adding_a_sum_and_a_max_names_the_fix():
    state = sgd_state(BATCHES[0]["x"])
    step = _eval_step(lambda err: jnp.sum(err) + jnp.max(err))
    par = meshshard.parallelize(step, method=PipeshardParallel(num_micro_batches=2))
    with pytest.raises(MeshshardInputError, match=r"return its terms as separate values"):
        par.lower(state.params, BATCHES[0], cluster=CLUSTER)


def _gpt_step(reduce):
    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return getattr(jnp, reduce)(losses)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_one_row_micro_batches_are_classified_from_other_sizes(threads_cluster, reduce):
    """A one-row micro-batch traces other equations than the full batch (JAX specializes
    dimensions of size 1), so the pair cannot be compared; the step is traced again at 2
    and 2M rows and the loss classified there.  Before, the GPT example with as many
    micro-batches as rows was refused (and, earlier, a summed loss was guessed a mean)."""
    from examples import gpt

    model = gpt.GPT(num_layers=2)
    batch = gpt.make_batch(batch_size=4)
    state = gpt.make_state(model, batch["inputs"])
    step_fn = _gpt_step(reduce)
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    step = meshshard.parallelize(step_fn, method=method)
    got, ref = step(state, batch), jax.jit(step_fn)(state, batch)
    assert_trees_close(ref[0].params, got[0].params)
    assert_trees_close(ref[1], got[1])
    assert f"loss: {reduce} over 4 micro-batches (traced: {reduce} over the batch)" in "\n".join(
        step.plan.notes
    )


def _balanced_step(loss_reduce=None):
    """A loss whose second term (a product of two batch means, like a mixture-of-experts
    load-balancing loss) is computed before a pipeline boundary and crosses it together
    with the batch's activations."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w0"])
            balance = jnp.sum(jnp.mean(h, 0) * jnp.mean(jax.nn.softmax(h), 0))
            meshshard.mark_pipeline_boundary()
            pred = h @ p["w1"]
            return jnp.mean((pred - batch["y"]) ** 2) + 0.01 * balance

        loss, grads = meshshard.value_and_grad(loss_fn, loss_reduce=loss_reduce)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def _balanced_params(x):
    keys = jax.random.split(jax.random.key(1))
    return {
        "w0": jax.random.normal(keys[0], (x.shape[1], 8)),
        "w1": jax.random.normal(keys[1], (8, 1)),
    }


def test_a_non_linear_term_crossing_a_boundary_with_activations_is_refused():
    """The boundary marker carries the batch's activations too: judged as one equation it
    hid the product of batch means behind it, the loss was taken as a mean, and the
    parallel step silently returned other numbers than jax.jit."""
    x = BATCHES[0]["x"]
    par = meshshard.parallelize(
        _balanced_step(), method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    with pytest.raises(
        MeshshardInputError,
        match=r"cannot tell how the loss combines .*: it applies mul to a value reduced over",
    ):
        par.lower(_balanced_params(x), BATCHES[0], cluster=CLUSTER)


def test_a_non_linear_term_is_taken_per_micro_batch_when_declared(threads_cluster):
    """Declared a mean, each micro-batch's loss (its own balance term included) is
    averaged, as a gradient-accumulation loop computes it."""
    x = BATCHES[0]["x"]
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    par = meshshard.parallelize(_balanced_step("mean"), method=method)
    params = _balanced_params(x)
    _, loss = par(params, BATCHES[0])
    halves = [jax.tree.map(lambda a, k=k: a[k * 8 : (k + 1) * 8], BATCHES[0]) for k in (0, 1)]
    plain = _balanced_step("mean")
    expected = np.mean([float(plain(params, h)[1]) for h in halves])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def ensemble_step(params, batch):
    """Three members' parameters stacked, each member's batch mean averaged (jax.vmap)."""

    def loss_fn(stacked):
        def member(p):
            return jnp.mean(
                (mlp.MLP(num_layers=4).apply({"params": p}, batch["x"]) - batch["y"]) ** 2
            )

        return jnp.mean(jax.vmap(member)(stacked))

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_an_ensemble_mean_of_batch_means_equals_jit(threads_cluster):
    batch = mlp.make_batch(batch_size=8)
    params = sgd_state(batch["x"]).params
    stacked = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a, -a]), params)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    check_step_parity(ensemble_step, method, stacked, [batch, batch], rtol=1e-5)
