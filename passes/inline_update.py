"""Pass 1b: inline calls and conditionals of the update part of a traced step.

The update (everything after ``meshshard.grad``'s ``grad_end`` marker) is placed
equation by equation on the meshes that hold its operands.  A ``jit`` call or a
``cond`` whose operands span every parameter (``optax.MultiSteps`` wraps the whole
inner update in one ``cond``; optax jit-compiles helpers) would be one equation on
every mesh at once, so this pass re-traces the step with those equations expanded:
a call becomes its body; a ``cond`` computes every branch and keeps one with
``select_n`` (the same result, since update branches have no side effects).  The
gradient part is re-traced unchanged.  A step without such equations is returned as is.
"""

from __future__ import annotations

from jax import lax

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import eval_eqns, is_marker, read_var, retrace

#: Call primitives whose body is inlined (``jit`` is ``pjit``'s name in current JAX).
CALLS = ("jit", "pjit", "closed_call", "core_call")


def _expandable(eqn) -> bool:
    return eqn.primitive.name in CALLS or eqn.primitive.name == "cond"


def inline_update_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with every call and ``cond`` after the ``grad_end`` marker expanded
    (a step without ``grad_end`` gets its forward boundaries instead)."""
    eqns = closed.jaxpr.eqns
    ends = [i for i, e in enumerate(eqns) if is_marker(e, "grad_end")]
    if not ends:  # a forward-only step: its markers carry the values crossing them
        from meshshard.passes.forward_only import with_forward_boundaries

        return with_forward_boundaries(closed)
    if len(ends) != 1 or not any(_expandable(e) for e in eqns[ends[0] + 1 :]):
        return closed
    start = ends[0] + 1

    def on_eqn(i, eqn, env) -> bool:
        if i < start or not _expandable(eqn):
            return False
        outs = _expand(eqn, [read_var(env, v) for v in eqn.invars])
        env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True))
        return True

    return retrace(closed, lambda i, eqn, env, extra: on_eqn(i, eqn, env))


def _eval_closed(body: ClosedJaxpr, args: list) -> list:
    """Evaluate ``body`` on ``args`` with its own calls and conds expanded."""
    env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
    env.update(zip(body.jaxpr.invars, args, strict=True))

    def on_eqn(i, eqn, env) -> bool:
        if not _expandable(eqn):
            return False
        outs = _expand(eqn, [read_var(env, v) for v in eqn.invars])
        env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True))
        return True

    eval_eqns(body.jaxpr.eqns, env, on_eqn=on_eqn)
    return [read_var(env, v) for v in body.jaxpr.outvars]


def _expand(eqn, args: list) -> list:
    if eqn.primitive.name == "cond":
        index, operands = args[0], args[1:]
        results = [_eval_closed(b, operands) for b in eqn.params["branches"]]
        if len(results) == 1:
            return results[0]
        return [lax.select_n(index, *outs) for outs in zip(*results, strict=True)]
    body = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if not isinstance(body, ClosedJaxpr):
        body = ClosedJaxpr(body, ())
    return _eval_closed(body, args)
