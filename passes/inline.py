"""Pass 0a: inline ``jax.jit`` calls, so markers and gradients inside them are visible.

A step or loss already wrapped in ``jax.jit`` traces to one ``jit`` equation whose
sub-jaxpr holds everything (pipeline boundaries, the ``meshshard.grad`` markers, random
draws).  Pipelining cuts the program at those markers, so this pass replaces each
call equation by the equations of its callee, recursively.  What the callee computes is
unchanged; XLA compiles each program whole anyway.  ``jax.checkpoint`` (remat) and
custom derivative rules are left alone: they carry meaning the inlining would lose.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(jax.jit(lambda x: jnp.sin(x) * 2))(1.0)
>>> [e.primitive.name for e in closed.jaxpr.eqns]
['jit']
>>> [e.primitive.name for e in inline_calls(closed).jaxpr.eqns]
['sin', 'mul']
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import eval_eqns, read_var, retrace, with_caller_source

#: Call primitives whose sub-jaxpr (param ``jaxpr`` or ``call_jaxpr``) is inlined.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def called_jaxpr(eqn) -> ClosedJaxpr | None:
    """The callee of a ``jit``/call equation (None for any other equation)."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if sub is None:
        return None
    return sub if hasattr(sub, "consts") else ClosedJaxpr(sub, ())


def _inline_hook(i, eqn, env, extra=()) -> bool:
    callee = called_jaxpr(eqn)
    if callee is None:
        return False
    invals = [read_var(env, v) for v in eqn.invars]
    outs = eval_inlined(callee, eqn, invals, _inline_hook)
    env.update(zip(eqn.outvars, outs, strict=True))
    return True


def eval_inlined(callee: ClosedJaxpr, caller, invals: list, on_eqn=None) -> list:
    """``callee``'s outputs on ``invals``, its equations evaluated in the current trace
    (``on_eqn`` as in ``eval_eqns``); each keeps ``caller``'s line where its own names
    no user code."""
    inner = dict(zip(callee.jaxpr.constvars, callee.consts, strict=True))
    inner.update(zip(callee.jaxpr.invars, invals, strict=True))
    body = [with_caller_source(e, caller) for e in callee.jaxpr.eqns]
    eval_eqns(body, inner, on_eqn=on_eqn)
    return [read_var(inner, v) for v in callee.jaxpr.outvars]


def has_calls(closed: ClosedJaxpr) -> bool:
    """True if ``closed`` has a call equation at its top level."""
    return any(called_jaxpr(e) is not None for e in closed.jaxpr.eqns)


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with every ``jit``/call equation replaced by its callee's equations."""
    if not has_calls(closed):
        return closed
    return retrace(closed, _inline_hook)


def inline_hook(i, eqn, env, extra=()) -> bool:
    """The inlining rule as an ``eval_eqns`` hook, for passes that evaluate a jaxpr."""
    return _inline_hook(i, eqn, env, extra)
