"""A memory bank written by example id after the grad (``bank.at[idx].set(features)``):
refused with micro-batches, whose banks each hold one micro-batch's rows; equal to
``jax.jit`` in one micro-batch, and through the refusal's fix (return the rows and their
ids, write them outside the step) in several."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from meshshard import DataParallel
from meshshard.errors import MeshshardInputError
from tests.random_parity import check_step_parity

BANK_ROWS = 16


def features_and_grads(p, batch):
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w"])
        return jnp.mean((h @ p["out"] - batch["y"]) ** 2), h

    (loss, h), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss, jax.lax.stop_gradient(h)


def bank_step(state, batch):
    """Features written into the bank inside the step."""
    p, bank = state
    p, loss, h = features_and_grads(p, batch)
    return (p, bank.at[batch["idx"]].set(h)), loss


def rows_step(p, batch):
    """The fix: the step returns the features and their ids."""
    p, loss, h = features_and_grads(p, batch)
    return p, loss, h, batch["idx"]


def case():
    rng = np.random.default_rng(7)
    p = {
        "w": rng.normal(size=(6, 8)).astype(np.float32) * 0.3,
        "out": rng.normal(size=(8, 1)).astype(np.float32) * 0.3,
    }
    batches = [
        {
            "x": rng.normal(size=(8, 6)).astype(np.float32),
            "y": rng.normal(size=(8, 1)).astype(np.float32),
            "idx": np.arange(8 * i, 8 * i + 8, dtype=np.int32),
        }
        for i in range(2)
    ]
    return p, np.zeros((BANK_ROWS, 8), np.float32), batches


def test_a_bank_written_after_the_grad_is_refused_with_micro_batches(threads_cluster):
    """Before, each micro-batch wrote its 4 rows into its own bank and the banks were
    averaged (a default mean, with a warning): every written row came back halved."""
    p, bank, batches = case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    step = meshshard.parallelize(bank_step, method=method)
    with pytest.raises(MeshshardInputError) as err:
        step((p, bank), batches[0])
    msg = str(err.value)
    assert "(test_memory_bank.py:32) writes the batch's rows into an array by index" in msg
    assert "write them outside it" in msg


def test_a_bank_written_in_one_micro_batch_equals_jit(threads_cluster):
    p, bank, batches = case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=1)
    check_step_parity(bank_step, method, (p, bank), batches)


def test_the_rows_written_outside_the_step_equal_jit_in_micro_batches(threads_cluster):
    p, bank, batches = case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    step = meshshard.parallelize(rows_step, method=method)
    write = jax.jit(lambda bank, rows, idx: bank.at[idx].set(rows))
    want_p, want_bank, got_p, got_bank = p, bank, p, bank
    for batch in batches:
        (want_p, want_bank), _ = jax.jit(bank_step)((want_p, want_bank), batch)
        got_p, _, rows, idx = step(got_p, batch)
        got_bank = write(got_bank, rows, idx)
    np.testing.assert_allclose(np.asarray(got_bank), np.asarray(want_bank), rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(np.asarray(got_bank).any(axis=1)) == BANK_ROWS


def running_extreme_step(fold):
    """A step keeping each class's best (or worst) prediction so far, folded in by
    ``fold(best, classes, predictions)``."""

    def step(state, batch):
        p, best = state
        p, loss, h = features_and_grads(p, batch)
        return (p, fold(best, batch["idx"] % 3, h[:, 0])), loss

    return step


@pytest.mark.parametrize(
    "fold",
    [lambda b, i, s: b.at[i].max(s), lambda b, i, s: b.at[i].min(s)],
    ids=["max", "min"],
)
def test_a_running_max_or_min_by_index_equals_jit_in_micro_batches(threads_cluster, fold):
    """Before, the micro-batches' arrays were averaged (a default, warned), 40-60% off;
    the maximum of their running maxima is the batch's."""
    p, _, batches = case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    best = np.full(3, 0.05, np.float32)
    check_step_parity(running_extreme_step(fold), method, (p, best), batches)


def test_a_product_folded_in_by_index_is_refused_with_micro_batches(threads_cluster):
    p, _, batches = case()
    step = running_extreme_step(lambda b, i, s: b.at[i].mul(1.0 + 0.1 * s))
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    with pytest.raises(MeshshardInputError, match="writes the batch's rows into an array"):
        meshshard.parallelize(step, method=method)((p, np.ones(3, np.float32)), batches[0])


def best_example_step(p, batch):
    """The position of the batch's best-scored example, taken after the grad."""
    p, loss, h = features_and_grads(p, batch)
    return p, loss, jnp.argmax(h[:, 0] + 10.0 * (batch["idx"] % 8 == 5))


def test_the_position_of_the_best_example_is_refused_with_micro_batches(threads_cluster):
    """Row 5 is the best; each micro-batch's argmax is a position among its own 4 rows,
    which were summed by default (with a warning; in a probe, 4 where jax.jit said 5)."""
    p, _, batches = case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    with pytest.raises(MeshshardInputError, match=r"\(test_memory_bank.py:\d+\) is a position"):
        meshshard.parallelize(best_example_step, method=method)(p, batches[0])
    whole = DataParallel(mesh_shape=(1, 2), num_micro_batches=1)
    check_step_parity(best_example_step, whole, p, batches)
