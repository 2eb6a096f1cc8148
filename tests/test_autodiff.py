"""The boundary primitive and meshshard.grad: identities that survive jit, grad and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from meshshard.passes.slicing import slice_layers
from meshshard.primitives import boundary_p


def loss(w, x):
    h = jnp.tanh(x @ w["a"])
    meshshard.mark_pipeline_boundary()
    h = jnp.tanh(h @ w["b"])
    meshshard.mark_pipeline_boundary()
    return jnp.mean((h @ w["c"]) ** 2)


W = {k: jnp.full((3, 3), 0.1 * (i + 1)) for i, k in enumerate("abc")}
X = jnp.arange(12.0).reshape(4, 3) / 10


def markers(jaxpr):
    return [(e.params["kind"], e.params["index"]) for e in jaxpr.eqns if e.primitive is boundary_p]


def test_grad_equals_jax_grad():
    ref_v, ref_g = jax.value_and_grad(loss)(W, X)
    v, g = meshshard.value_and_grad(loss)(W, X)
    np.testing.assert_array_equal(v, ref_v)
    for k in W:
        np.testing.assert_array_equal(g[k], ref_g[k])
    np.testing.assert_array_equal(meshshard.grad(loss)(W, X)["b"], ref_g["b"])


def test_backward_mirrors_every_forward_boundary():
    jaxpr = jax.make_jaxpr(meshshard.grad(loss))(W, X).jaxpr
    assert markers(jaxpr) == [
        ("fwd", 0),
        ("fwd", 1),
        ("loss", 0),
        ("loss_bwd", 0),
        ("bwd", 1),
        ("bwd", 0),
        ("grad_end", 0),
    ]
    sl = slice_layers(jaxpr)
    assert sl.num_layers == 3
    assert all(sl.eqns(layer, ph) for layer in range(3) for ph in ("F", "B"))


def test_markers_survive_jit_and_vmap():
    jitted = jax.jit(meshshard.grad(loss))
    np.testing.assert_allclose(jitted(W, X)["a"], jax.grad(loss)(W, X)["a"], rtol=1e-6)
    inner = jax.make_jaxpr(jitted)(W, X).jaxpr.eqns[0].params["jaxpr"].jaxpr
    assert ("bwd", 0) in markers(inner)
    batched = jax.vmap(meshshard.grad(loss), in_axes=(None, 0))(W, jnp.stack([X, 2 * X]))
    np.testing.assert_allclose(batched["c"][1], jax.grad(loss)(W, 2 * X)["c"], rtol=1e-6)


def test_explicit_value_form_is_identity_under_grad():
    def f(x):
        (y,) = meshshard.mark_pipeline_boundary(jnp.sin(x))
        return jnp.sum(y**2)

    np.testing.assert_allclose(
        jax.grad(f)(X), jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(X), rtol=1e-6
    )
    kinds = [k for k, _ in markers(jax.make_jaxpr(jax.grad(f))(X).jaxpr)]
    assert kinds == ["fwd", "bwd"]


def explicit_loss(w, x):
    (h,) = meshshard.mark_pipeline_boundary(jnp.tanh(x @ w["a"]))
    (h,) = meshshard.mark_pipeline_boundary(jnp.tanh(h @ w["b"]))
    return jnp.mean((h @ w["c"]) ** 2)


def test_explicit_value_form_crosses_with_its_values_under_meshshard_grad():
    """``(h,) = mark_pipeline_boundary(h)``: what follows reads the marker's results, so
    they are what crosses; the boundary carried nothing, had no backward mirror, and
    the step was refused ("have no backward mirror")."""
    jaxpr = jax.make_jaxpr(meshshard.grad(explicit_loss))(W, X).jaxpr
    crossing = [len(e.invars) for e in jaxpr.eqns if e.primitive is boundary_p]
    kinds = markers(jaxpr)
    assert kinds[:2] == [("fwd", 0), ("fwd", 1)] and ("bwd", 0) in kinds and ("bwd", 1) in kinds
    assert crossing[:2] == [1, 1]  # each carries its one value forward
    ref = jax.grad(explicit_loss)(W, X)
    got = meshshard.grad(explicit_loss)(W, X)
    for k in W:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6)


def test_explicit_value_form_pipelines_equal_to_jit(threads_cluster):
    def step(w, x):
        g = meshshard.grad(explicit_loss)(w, x)
        return jax.tree.map(lambda p, d: p - 0.5 * d, w, g)

    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 3)
    par = meshshard.parallelize(step, method=method)
    got, ref = par(W, X), jax.jit(step)(W, X)
    for k in W:
        np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=1e-6)
    assert len(par.plan.stages) == 3


def test_has_aux():
    def f(w, x):
        return loss(w, x), {"n": x.shape[0]}

    (v, aux), g = meshshard.value_and_grad(f, has_aux=True)(W, X)
    assert aux["n"] == 4 and g["a"].shape == (3, 3)


def test_non_scalar_loss_is_rejected():
    with pytest.raises(
        meshshard.MeshshardInputError, match=r"loss must be a scalar float, got float32\[4, 3\]"
    ):
        meshshard.grad(lambda w, x: jnp.tanh(x @ w["a"]))(W, X)
