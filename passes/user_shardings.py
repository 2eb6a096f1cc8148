"""Pass 0: drop the step's own sharding constraints and device placements.

Code written for ``jax.jit`` over a ``Mesh`` often pins values inside the model:
``jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data")))``, Flax's
``nn.with_logical_constraint`` under axis rules, ``jax.device_put(x, sharding)``.
Each binds the value to the user's devices, and a stage program compiled for one of
meshshard's meshes cannot run it ("incompatible devices").  Each is an identity on the
value, so this pass removes them, everywhere in the step (inside ``jax.checkpoint``,
custom derivatives, loops and conditionals too), and names their lines so the user is
told: meshshard infers each value's sharding on the mesh that runs it, and
``meshshard.shard(x, P(...))`` pins one over its ``'host'``/``'device'`` axes.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
>>> pin = lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("data")))
>>> closed = jax.make_jaxpr(pin)(jnp.ones(4))
>>> [e.primitive.name for e in closed.jaxpr.eqns]
['mul', 'sharding_constraint']
>>> [e.primitive.name for e in drop_user_shardings(closed).jaxpr.eqns]
['mul']
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr, Jaxpr
from meshshard.jaxpr_util import is_dropvar, is_literal, sub_jaxprs, user_line

#: Primitives that place a value without changing it: each output is its operand.
PLACEMENTS = frozenset({"sharding_constraint", "device_put"})

#: The start of the plan note (and warning) naming the dropped placements.
NOTE = "sharding constraints of the step ignored"


def _has_placements(jaxpr: Jaxpr) -> bool:
    return any(
        e.primitive.name in PLACEMENTS or any(_has_placements(j) for j in sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def _strip_param(p):
    if isinstance(p, tuple | list):
        new = [_strip_param(x) for x in p]
        return p if all(a is b for a, b in zip(new, p, strict=True)) else type(p)(new)
    if isinstance(p, ClosedJaxpr):
        inner = _strip(p.jaxpr)
        return p if inner is p.jaxpr else p.replace(jaxpr=inner)
    if isinstance(p, Jaxpr):
        return _strip(p)
    return p


def _strip(jaxpr: Jaxpr) -> Jaxpr:
    if not _has_placements(jaxpr):
        return jaxpr
    alias: dict = {}

    def read(v):
        return v if is_literal(v) else alias.get(v, v)

    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name in PLACEMENTS:
            for out, src in zip(e.outvars, e.invars, strict=True):
                if not is_dropvar(out):
                    alias[out] = read(src)
            continue
        params = {k: _strip_param(p) for k, p in e.params.items()}
        eqns.append(e.replace(invars=[read(v) for v in e.invars], params=params))
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def drop_user_shardings(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` without its ``sharding_constraint`` and ``device_put`` equations, at
    any depth: each output reads the operand it placed.  The values are unchanged."""
    jaxpr = _strip(closed.jaxpr)
    return closed if jaxpr is closed.jaxpr else closed.replace(jaxpr=jaxpr)


def _placement_lines(jaxpr: Jaxpr, found: dict) -> None:
    for e in jaxpr.eqns:
        if e.primitive.name in PLACEMENTS:
            found.setdefault(user_line(e), None)
        for j in sub_jaxprs(e):
            _placement_lines(j, found)


def user_sharding_note(closed: ClosedJaxpr) -> str | None:
    """A note naming the lines of the step's own placements (``with_sharding_constraint``,
    ``device_put``) and what meshshard does instead, or None when it has none."""
    found: dict = {}
    _placement_lines(closed.jaxpr, found)
    if not found:
        return None
    return (
        f"{NOTE} at {', '.join(found)}: meshshard infers each value's sharding on the "
        "mesh that runs it; pin one with meshshard.shard(x, P(...)) over the mesh axes "
        "'host' and 'device'"
    )
