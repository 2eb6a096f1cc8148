"""passes/scatter_totals.py: which scatters it rewrites, and that the rewrite computes
the same values."""

import jax
import jax.numpy as jnp
import numpy as np

import meshshard
from meshshard._compat import jaxpr_as_fun
from meshshard.passes.scatter_totals import split_scatter_totals

X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)


def _grad(w, x):
    return meshshard.value_and_grad(
        lambda w: (jnp.sum(jnp.tanh(x @ w)), jnp.argmax(x @ w, 1)), has_aux=True
    )(w)


def test_a_running_total_becomes_total_plus_a_histogram_with_the_same_values():
    def step(w, counts, hist, x):
        (_, pred), g = _grad(w, x)
        return w - g, counts.at[pred].add(1), hist.at[pred].add(x[:, 0])

    args = (jnp.ones((3, 3)), jnp.arange(3), jnp.linspace(0.0, 1.0, 3), X)
    closed = jax.make_jaxpr(step)(*args)
    split = split_scatter_totals(closed, [False, False, False, True])
    names = [e.primitive.name for e in split.jaxpr.eqns]
    assert names.count("scatter-add") == 2 and names[-1] == "add"
    assert (
        sum(n == "add" for n in names)
        == sum(n == "add" for n in (e.primitive.name for e in closed.jaxpr.eqns)) + 2
    )
    want = jaxpr_as_fun(closed)(*args)
    got = jaxpr_as_fun(split)(*args)
    np.testing.assert_array_equal(got[1], want[1])  # integer counts: exact
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)


def test_scatters_that_need_no_rewrite_are_left_alone():
    def into_zeros(w, x):
        (_, pred), g = _grad(w, x)
        return w - g, jnp.zeros(3).at[pred].add(1.0)

    def before_the_grad(w, counts, x):
        counts = counts.at[jnp.argmax(x, 1)].add(1)
        _, g = _grad(w, x)
        return w - g, counts

    def of_state_only(w, counts, x):  # nothing of the batch is scattered
        _, g = _grad(w, x)
        return w - g, counts.at[jnp.arange(3)].add(counts)

    cases = [
        (into_zeros, (jnp.ones((3, 3)), X), [False, True]),
        (before_the_grad, (jnp.ones((3, 3)), jnp.arange(3), X), [False, False, True]),
        (of_state_only, (jnp.ones((3, 3)), jnp.arange(3), X), [False, False, True]),
    ]
    for fn, args, is_batch in cases:
        closed = jax.make_jaxpr(fn)(*args)
        assert split_scatter_totals(closed, is_batch) is closed, fn.__name__
