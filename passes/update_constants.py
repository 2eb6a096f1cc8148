"""Pass: the update part of a micro-batched step takes the full batch's constants.

The step is traced at micro-batch shape, and the update part (what follows
``meshshard.grad``) runs once per step from that trace.  A constant Python computed
from the batch's shape there is the micro-batch's: ``seen + x.shape[0]`` counted 8
examples per step of 16, ``grads / x.shape[0]`` doubled the gradients, an NNX
``Accuracy`` metric's count (``labels.size``) came out halved.  ``jax.jit`` on the whole
batch uses the full batch's size.

The full-batch trace runs the same equations; after the ``grad_end`` marker they pair up
by position.  Where a paired equation reads a literal (or a constant array) whose value
differs between the two traces, the micro-batch trace's update takes the full one's.

>>> import jax, jax.numpy as jnp
>>> import meshshard
>>> def step(w, x):
...     g = meshshard.grad(lambda w: jnp.sum(x @ w))(w)
...     return w - g / x.shape[0]
>>> micro = jax.make_jaxpr(step)(jnp.ones(3), jnp.ones((2, 3)))
>>> full = jax.make_jaxpr(step)(jnp.ones(3), jnp.ones((4, 3)))
>>> literals = lambda c: [float(v.val) for e in c.jaxpr.eqns[-2:] for v in e.invars if is_literal(v)]
>>> literals(micro)
[2.0]
>>> literals(use_full_batch_constants(micro, full))
[4.0]
"""

from __future__ import annotations

import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import _slice


def after_grad_end(jaxpr) -> int | None:
    """The index of the first equation after the ``grad_end`` marker (None: no marker)."""
    return next((i + 1 for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)


def _differs(a, b) -> bool:
    try:
        a, b = np.asarray(a), np.asarray(b)
    except TypeError:  # an extended dtype (a typed key): never computed from a shape
        return False
    return a.shape == b.shape and a.dtype == b.dtype and not np.array_equal(a, b)


def update_constant_overrides(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch=None) -> dict:
    """``{(equation index in micro, operand index): full value}`` for the update part's
    literals and constants whose value differs from the full-batch trace's; empty when
    the two update parts do not pair up (other primitives), or there is no update.  A
    forward-only step (no ``grad_end`` marker; ``is_batch`` flags the batch inputs) has
    no update, but its results that do not depend on the batch (``x.shape[0]``, a count
    of examples to weigh the step's mean by) are computed once, as the update is: the
    equations they are computed by take the full batch's constants."""
    mj, fj = micro.jaxpr, full.jaxpr
    start_m, start_f = after_grad_end(mj), after_grad_end(fj)
    if start_m is None and start_f is None and is_batch is not None:
        if [e.primitive for e in mj.eqns] != [e.primitive for e in fj.eqns]:
            return {}
        keep = _batch_free_result_slice(mj, is_batch)
        return {key: val for key, val in _overrides(micro, full, 0, 0).items() if key[0] in keep}
    if start_m is None or start_f is None:
        return {}
    me, fe = mj.eqns[start_m:], fj.eqns[start_f:]
    if [e.primitive for e in me] != [e.primitive for e in fe]:
        return {}
    return _overrides(micro, full, start_m, start_f)


def _batch_free_result_slice(jaxpr, is_batch) -> set:
    """Indices of the equations that the results not depending on the batch are
    computed by (none of which depends on the batch; a boundary marker they cross counts
    for their own position only: :func:`~meshshard.passes.reductions._slice`)."""
    dep = batch_dependent(jaxpr, is_batch, len(jaxpr.eqns))
    return {
        i for v in jaxpr.outvars if not is_literal(v) and v not in dep for i, _ in _slice(jaxpr, v)
    }


def _overrides(micro: ClosedJaxpr, full: ClosedJaxpr, start_m: int, start_f: int) -> dict:
    """:func:`update_constant_overrides` of the equations from ``start_m`` on in
    ``micro`` and ``start_f`` on in ``full``, which pair up by primitive."""
    mj, fj = micro.jaxpr, full.jaxpr
    me, fe = mj.eqns[start_m:], fj.eqns[start_f:]
    consts_m = dict(zip(mj.constvars, micro.consts, strict=True))
    consts_f = dict(zip(fj.constvars, full.consts, strict=True))
    found = {}
    for i, (em, ef) in enumerate(zip(me, fe, strict=True)):
        if len(em.invars) != len(ef.invars):
            return {}
        for k, (vm, vf) in enumerate(zip(em.invars, ef.invars, strict=True)):
            if is_literal(vm) and is_literal(vf):
                a, b = vm.val, vf.val
            elif vm in consts_m and vf in consts_f:
                a, b = consts_m[vm], consts_f[vf]
            else:
                continue
            if _differs(a, b):
                found[(start_m + i, k)] = b
    return found


def use_full_batch_constants(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch=None) -> ClosedJaxpr:
    """``micro`` whose update part reads the full-batch trace's constants where they
    differ (:func:`update_constant_overrides`), and whose results that are literals take
    the full trace's (a step returning ``x.shape[0]``); ``micro`` itself when none
    differs."""
    overrides = update_constant_overrides(micro, full, is_batch)
    results = _literal_results(micro, full)
    if not overrides and not results:
        return micro

    changed = {i for i, _ in overrides}

    def hook(i, eqn, env, extra) -> bool:
        if i not in changed:
            return False
        invals = [overrides.get((i, k), read_var(env, v)) for k, v in enumerate(eqn.invars)]
        for v, out in zip(eqn.outvars, bind_eqn(eqn, invals), strict=True):
            if not is_dropvar(v):
                env[v] = out
        return True

    def finish(values):
        return [results.get(k, x) for k, x in enumerate(values)]

    return retrace(micro, hook, finish=finish)


def _literal_results(micro: ClosedJaxpr, full: ClosedJaxpr) -> dict:
    """``{result position: full value}`` for the results that are literals in both
    traces, with other values (``x.shape[0]`` returned as it is)."""
    mo, fo = micro.jaxpr.outvars, full.jaxpr.outvars
    if len(mo) != len(fo):
        return {}
    return {
        k: b.val
        for k, (a, b) in enumerate(zip(mo, fo, strict=True))
        if is_literal(a) and is_literal(b) and _differs(a.val, b.val)
    }
