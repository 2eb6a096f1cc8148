"""``meshshard.grad`` and ``meshshard.value_and_grad``.

They compute exactly what ``jax.grad``/``jax.value_and_grad`` compute.  In addition
they turn each ``mark_pipeline_boundary()`` in the loss function into a boundary that
carries the values crossing it, mark the loss, and mark the returned gradients.  The
compiler reads these markers to slice the step into forward and mirrored backward
stages and to tell the gradient computation (run per micro-batch) from the update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import eval_eqns, is_marker, read_var
from meshshard.primitives import boundary_p

__all__ = ["grad", "value_and_grad"]


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """Like ``jax.value_and_grad``, and marks the pipeline boundaries for meshshard.

    The loss must be a scalar mean over the batch: with micro-batching meshshard
    averages the per-micro-batch losses and gradients, which equals the full-batch
    value exactly when the loss is a mean.

    >>> import jax.numpy as jnp
    >>> value_and_grad(lambda w: jnp.sum(w ** 2))(jnp.ones(2))[1]
    Array([2., 2.], dtype=float32)
    """

    @functools.wraps(fun)
    def wrapped(*args):
        layered = _with_boundaries(fun, args, has_aux)
        out = jax.value_and_grad(layered, argnums=argnums, has_aux=has_aux)(*args)
        leaves, tree = jax.tree.flatten(out)
        leaves = boundary_p.bind(*leaves, kind="grad_end", index=0)
        return jax.tree.unflatten(tree, leaves)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """Like ``jax.grad``, and marks the pipeline boundaries for meshshard.

    >>> import jax.numpy as jnp
    >>> grad(lambda w: jnp.sum(w ** 2))(jnp.ones(2))
    Array([2., 2.], dtype=float32)
    """
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args):
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _with_boundaries(fun: Callable, args: tuple, has_aux: bool) -> Callable:
    """``fun`` re-expressed so each user marker carries the values that cross it."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    _check_loss(out_shape, has_aux)
    jaxpr = closed.jaxpr
    out_tree = jax.tree.structure(out_shape)
    marker_pos = [
        i
        for i, e in enumerate(jaxpr.eqns)
        if is_marker(e, "mark", "fwd") and e.params["index"] == -1
    ]
    live = _live_across(jaxpr, marker_pos)
    index_of = {pos: k for k, pos in enumerate(marker_pos)}

    def on_eqn(i, eqn, env):
        if i not in index_of:
            return False
        for src, dst in zip(eqn.invars, eqn.outvars, strict=True):  # explicit-value form
            env[dst] = read_var(env, src)
        crossing = live[i]
        vals = boundary_p.bind(*[env[v] for v in crossing], kind="fwd", index=index_of[i])
        env.update(zip(crossing, vals, strict=True))
        return True

    def layered(*call_args):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, jax.tree.leaves(call_args), strict=True))
        eval_eqns(jaxpr.eqns, env, on_eqn=on_eqn)
        out = jax.tree.unflatten(out_tree, [read_var(env, v) for v in jaxpr.outvars])
        loss, aux = out if has_aux else (out, None)
        (loss,) = boundary_p.bind(loss, kind="loss", index=0)
        return (loss, aux) if has_aux else loss

    return layered


def _live_across(jaxpr, positions: list[int]) -> dict[int, list]:
    """For each marker position, the values defined before it and used after it."""
    if not positions:
        return {}
    defined_at: dict = {}
    last_use: dict = {}
    n = len(jaxpr.eqns)
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not hasattr(v, "val"):
                last_use[v] = i
        for v in e.outvars:
            defined_at[v] = i
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            last_use[v] = n
    out = {}
    for p in positions:
        out[p] = [v for v, d in defined_at.items() if d < p and last_use.get(v, -1) > p]
    return out


def _check_loss(out_shape, has_aux: bool) -> None:
    if has_aux:
        if not (isinstance(out_shape, tuple) and len(out_shape) == 2):
            raise MeshshardInputError(
                "meshshard.grad(has_aux=True): the loss function must return (loss, aux); "
                f"it returned {jax.tree.structure(out_shape)}"
            )
        out_shape = out_shape[0]
    shape = getattr(out_shape, "shape", None)
    dtype = getattr(out_shape, "dtype", None)
    if shape != () or dtype is None or not np.issubdtype(dtype, np.floating):
        what = f"{dtype}{list(shape)}" if shape is not None else type(out_shape).__name__
        raise MeshshardInputError(
            f"meshshard.grad: the loss must be a scalar float, got {what}; "
            "reduce it to one number (e.g. jnp.mean over the batch) before returning it"
        )
