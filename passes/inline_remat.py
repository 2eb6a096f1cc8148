"""Pass: write the user's rematerialized layers (``jax.checkpoint`` / ``nn.remat``) out
as XLA lowers them, so the sharding solver and local accumulation see their equations.

After differentiation, each rematerialized layer's backward is one ``remat2`` equation:
recompute the layer's forward from its inputs, then transpose it.  As one opaque
equation it ran replicated under the sharding ILP (every device recomputing the whole
layer on the whole batch, its inputs all-gathered first), and its weight gradients
could not stay per-device partial sums across micro-batches (an all-reduce per
micro-batch under data parallelism too).

XLA lowers a differentiated ``remat2`` as an ``optimization_barrier`` on its inputs
followed by its body: the barrier keeps XLA from merging the recompute with the
forward (and from starting it before the cotangent arrives), which is what saves the
memory.  This pass writes exactly that into the step: one barrier on the same inputs,
then the body's equations.  A ``remat2`` that was not differentiated lowers as its body
alone.  Nothing is computed differently and XLA compiles the same program; the
sharding rules treat the barrier as an identity on each operand.

>>> import jax, jax.numpy as jnp
>>> f = jax.checkpoint(lambda w, x: jnp.sin(x @ w).sum())
>>> closed = jax.make_jaxpr(jax.grad(f))(jnp.ones((3, 3)), jnp.ones((2, 3)))
>>> [e.primitive.name for e in closed.jaxpr.eqns if e.primitive.name == "remat2"]
['remat2']
>>> names = [e.primitive.name for e in inline_remat(closed).jaxpr.eqns]
>>> "remat2" in names, names.count("optimization_barrier")
(False, 1)
"""

from __future__ import annotations

import jax

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import read_var, retrace
from meshshard.passes.inline import called_jaxpr, eval_inlined

__all__ = ["REMAT_PRIMITIVES", "inline_remat"]

#: ``jax.checkpoint``'s primitive (``checkpoint`` in older JAX releases).
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def _barriered(eqn, args: list) -> list:
    """``args``, the ones ``prevent_cse`` names passed through one optimization barrier
    (for a differentiated remat only, as XLA's lowering does)."""
    prevent = eqn.params.get("prevent_cse", True)
    if not eqn.params.get("differentiated", False):
        return args
    flags = prevent if isinstance(prevent, tuple) else (prevent,) * len(args)
    picked = [k for k, f in enumerate(flags) if f]
    if not picked:
        return args
    through = jax.lax.optimization_barrier([args[k] for k in picked])
    out = list(args)
    for k, x in zip(picked, through, strict=True):
        out[k] = x
    return out


def _hook(i, eqn, env, extra=()) -> bool:
    """A remat written out; inside one, a ``jit`` call inlined as the step's own were
    (``passes/inline.py``), and a remat inside it written out too."""
    if eqn.primitive.name in REMAT_PRIMITIVES:
        body = eqn.params["jaxpr"]
        callee = body if hasattr(body, "consts") else ClosedJaxpr(body, ())
        args = _barriered(eqn, [read_var(env, v) for v in eqn.invars])
    elif extra == _INSIDE and (callee := called_jaxpr(eqn)) is not None:
        args = [read_var(env, v) for v in eqn.invars]
    else:
        return False
    inner = lambda k, e, env: _hook(k, e, env, _INSIDE)  # noqa: E731
    outs = eval_inlined(callee, eqn, args, inner)
    env.update(zip(eqn.outvars, outs, strict=True))
    return True


#: ``_hook``'s marker for equations of a remat's body.
_INSIDE = ("inside a remat",)


def inline_remat(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with every top-level ``remat2`` equation replaced by its lowering: an
    optimization barrier on its inputs (when differentiated) and its body."""
    if not any(e.primitive.name in REMAT_PRIMITIVES for e in closed.jaxpr.eqns):
        return closed
    return retrace(closed, _hook)
