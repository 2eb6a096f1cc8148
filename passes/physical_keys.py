"""Pass 0b: hold every random key between equations as its raw ``uint32`` key data.

Typed keys (``jax.random.key``) have an extended dtype such as ``key<fry>`` that NumPy,
buffers and transports cannot hold.  This pass rewrites the step so that a key-typed
value never crosses from one equation to another: each equation that makes a key is
followed by ``random_unwrap`` and each equation that reads one is preceded by
``random_wrap``.  A wrap sits right before its reader, so no key-typed value crosses a
program boundary; buffers, transfers and the plan only ever see ``uint32[..., 2]``.
Boundary markers are identities and carry the raw data as it is.  XLA removes the
wrap/unwrap pairs: they are bit-identical reinterpretations.
"""

from __future__ import annotations

import jax

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, retrace
from meshshard.primitives import boundary_p


def is_key_aval(aval) -> bool:
    """True for a typed-key value (dtype ``key<impl>``)."""
    return jax.dtypes.issubdtype(getattr(aval, "dtype", None), jax.dtypes.prng_key)


def has_typed_keys(closed: ClosedJaxpr) -> bool:
    """True if any value of ``closed`` (top level) is a typed key."""
    j = closed.jaxpr
    vs = [*j.invars, *j.outvars, *(v for e in j.eqns for v in (*e.invars, *e.outvars))]
    return any(not is_literal(v) and is_key_aval(v.aval) for v in vs)


class _Raw:
    """A key held as its data, with the implementation needed to wrap it again."""

    def __init__(self, data, impl):
        self.data, self.impl = data, impl


def _unwrap(val):
    return _Raw(jax.random.key_data(val), jax.random.key_impl(val))


def _wrap(val):
    return jax.random.wrap_key_data(val.data, impl=val.impl) if isinstance(val, _Raw) else val


def _hook(i, eqn, env, extra=()) -> bool:
    vals = [v.val if is_literal(v) else env[v] for v in eqn.invars]
    if eqn.primitive is boundary_p:  # identity: carry the raw data
        outs = bind_eqn(eqn, [x.data if isinstance(x, _Raw) else x for x in vals])
        raw = [x.impl if isinstance(x, _Raw) else None for x in vals]
        outs = [o if r is None else _Raw(o, r) for o, r in zip(outs, raw, strict=True)]
    else:
        outs = bind_eqn(eqn, [_wrap(x) for x in vals])
        outs = [_unwrap(o) if is_key_aval(o.aval) else o for o in outs]
    for v, o in zip(eqn.outvars, outs, strict=True):
        if not is_dropvar(v):
            env[v] = o
    return True


def physical_keys(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with keys held as raw data between equations.

    Key-typed inputs stay inputs (unwrapped once, up front); key-typed outputs become
    their raw data.
    """
    if not has_typed_keys(closed):
        return closed

    def prepare(env):
        for v in closed.jaxpr.invars:
            if is_key_aval(v.aval):
                env[v] = _unwrap(env[v])

    def finish(outs):
        return [o.data if isinstance(o, _Raw) else o for o in outs]

    return retrace(closed, _hook, prepare=prepare, finish=finish)
