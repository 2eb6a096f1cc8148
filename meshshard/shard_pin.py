"""``meshshard.shard(x, P(...))``: pin a value's sharding inside a step.

Like ``jax.lax.with_sharding_constraint``, but the step is traced without a mesh: the
pin is an identity primitive that records the spec, and the sharding ILP
(``passes/shard_ilp.py``) gives that value exactly this spec (axes ``'host'`` and
``'device'`` of the mesh that runs it).  A single-device ``jax.jit`` of the step
computes the same as without it.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> shard(jnp.ones((4, 2)), P("device", None)).shape
    (4, 2)
"""

from __future__ import annotations

from meshshard._compat import Primitive, instantiate_zeros, register_identity_rules
from meshshard.errors import MeshshardInputError

__all__ = ["shard", "shard_p"]

shard_p = Primitive("meshshard_shard")


def _spec_data(spec) -> tuple:
    entries = tuple(spec)
    for e in entries:
        ok = (
            e is None
            or isinstance(e, str)
            or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))
        )
        if not ok:
            raise MeshshardInputError(
                f"meshshard.shard spec entry {e!r} must be None, an axis name or a tuple of "
                "axis names, e.g. P('device', None) or P(('host', 'device'))"
            )
    return entries


shard_p.def_impl(lambda x, *, spec, name=None: x)
shard_p.def_abstract_eval(lambda x, *, spec, name=None: x)


def _jvp(primals, tangents, *, spec, name=None):
    (x,), (t,) = primals, tangents
    return shard_p.bind(x, spec=spec, name=name), shard_p.bind(
        instantiate_zeros(t), spec=spec, name=name
    )


def _transpose(ct, x, *, spec, name=None):
    return [shard_p.bind(instantiate_zeros(ct), spec=spec, name=name)]


register_identity_rules(shard_p, _jvp, _transpose)


def shard(x, spec, name: str | None = None):
    """Return ``x``, pinned to ``spec`` (a ``PartitionSpec`` over ``'host'``/``'device'``).

    ``name`` labels the value in the plan's errors (e.g. a pin that does not divide).
    """
    if name is not None and not isinstance(name, str):
        raise MeshshardInputError(f"meshshard.shard name={name!r} must be a str or None")
    return shard_p.bind(x, spec=_spec_data(spec), name=name)
