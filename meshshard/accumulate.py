"""Accumulators for values combined over micro-batches (sum, mean, max, min).

Gradient accumulators start as zeros and each micro-batch adds its contribution; the
update reads them finished (a mean divides by the number of micro-batches).  A maximum
or minimum cannot start from zero, so it is kept *encoded*: an order-preserving map to
unsigned integers (stored in the accumulator's own dtype, bit for bit) under which zero
is below every value, so ``max(0, enc(x)) == enc(x)`` and zeros stay the identity.

>>> import jax.numpy as jnp
>>> acc = jnp.zeros((), jnp.float32)
>>> for x in (-3.0, -1.5, -2.0):
...     acc = combine("max", acc, jnp.float32(x))
>>> finish("max", acc, 3)
Array(-1.5, dtype=float32)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _encode(x):
    """Order-preserving map of ``x`` to unsigned ints (0 below everything)."""
    u_t = _UINT[x.dtype.itemsize]
    sign = u_t(1) << u_t(8 * x.dtype.itemsize - 1)
    u = lax.bitcast_convert_type(x, u_t)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.where((u & sign) != 0, ~u, u | sign)
    return u ^ sign


def _decode(k, dtype):
    u_t = _UINT[np.dtype(dtype).itemsize]
    sign = u_t(1) << u_t(8 * np.dtype(dtype).itemsize - 1)
    if jnp.issubdtype(dtype, jnp.floating):
        u = jnp.where((k & sign) != 0, k ^ sign, ~k)
    else:
        u = k ^ sign
    return lax.bitcast_convert_type(u, dtype)


def combine(reduce: str, acc, x):
    """The accumulator after adding micro-batch value ``x`` under ``reduce``.

    ``concat`` keeps the full batch's rows: the oldest ``len(x)`` rows leave at the front
    and ``x`` enters at the back, so after micro-batches ``0 .. M-1`` in order the
    accumulator holds their rows in order.  ``same`` keeps the latest value.
    """
    if reduce == "concat":
        return jnp.concatenate([acc[x.shape[0] :], x.astype(acc.dtype)])
    if reduce == "same":
        return x
    if reduce in ("max", "min"):
        if x.dtype == jnp.bool_:
            return acc | x if reduce == "max" else acc | ~x
        u_t = _UINT[x.dtype.itemsize]
        k = _encode(x) if reduce == "max" else ~_encode(x)
        a = lax.bitcast_convert_type(acc, u_t)
        return lax.bitcast_convert_type(jnp.maximum(a, k), x.dtype)
    return acc + x


def finish(reduce: str, acc, m: int):
    """The combined value from the accumulator after ``m`` micro-batches (one
    micro-batch's value as it is, in its own dtype: a boolean stays boolean)."""
    if m == 1 and reduce in ("mean", "sum"):
        return acc
    if reduce == "mean":
        return acc / m if jnp.issubdtype(acc.dtype, jnp.floating) else acc // m
    if reduce in ("max", "min"):
        if acc.dtype == jnp.bool_:
            return acc if reduce == "max" else ~acc
        k = lax.bitcast_convert_type(acc, _UINT[acc.dtype.itemsize])
        return _decode(k if reduce == "max" else ~k, acc.dtype)
    return acc
