"""Pass: cut a loss function's scans over stacked layers into pieces a pipeline can split.

Large models stack their layers' weights and run them with one ``lax.scan`` (Flax
``nn.scan``, MaxText's ``scan_layers``).  Stages are cut only between top-level
equations, so such a scan is one indivisible equation: every layer lands in one stage,
and a ``mark_pipeline_boundary()`` in the scanned layer could not be honoured.  This
pass rewrites those scans as equivalent top-level code:

* a scan whose body calls ``mark_pipeline_boundary()`` is unrolled, one copy of the
  body per iteration, so each iteration's marker becomes a boundary (as if the layers
  had been written in a Python loop);
* for ``PipeshardParallel(layers=N)``, a scan over stacked layers (a float operand it
  scans over comes from the differentiated weights alone, and its body holds a matmul
  or convolution) is split into consecutive shorter scans over slices of its operands,
  which the layer clustering may cut between; under the sharding ILP (which has no
  rule for a scan and would run it replicated) it is unrolled.  A scan over time or
  over the batch is left whole.

What is computed is unchanged: the pieces run the same body over the same slices, in
the same order, carrying the same values.  The stacked weights stay one array, read by
every stage holding a piece; their gradient is the sum of the pieces' (as for a weight
shared between stages).

    >>> import jax, jax.numpy as jnp
    >>> def f(ws, x):
    ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()
    >>> closed = jax.make_jaxpr(f)(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
    >>> [e.params["length"] for e in split_scans(closed, {0: 2}).jaxpr.eqns if e.primitive.name == "scan"]
    [2, 2]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import (
    bind_eqn,
    is_literal,
    is_marker,
    read_var,
    retrace,
    source_of,
    sub_jaxprs,
    user_line,
)
from meshshard.passes.inline import eval_inlined, inline_hook
from meshshard.passes.layer_cluster import is_heavy

__all__ = [
    "has_marker",
    "marked_scans",
    "layer_stack_scans",
    "split_scans",
    "piece_bounds",
    "split_note",
]


def has_marker(jaxpr, kinds: tuple[str, ...] = ("mark",)) -> bool:
    """True if ``jaxpr`` holds a marker of ``kinds`` anywhere, nested calls included (by
    default a ``mark_pipeline_boundary()`` call)."""
    return any(
        is_marker(e, *kinds) or any(has_marker(j, kinds) for j in sub_jaxprs(e)) for e in jaxpr.eqns
    )


def _unrolls(eqn) -> bool:
    """A scan whose body marks a boundary, and takes no ``meshshard.grad`` (gradients
    accumulated by hand over chunks are refused by name, not unrolled into many grads)."""
    if not _is_scan(eqn):
        return False
    body = eqn.params["jaxpr"].jaxpr
    return has_marker(body) and not has_marker(body, ("grad_end",))


def _is_scan(eqn) -> bool:
    return eqn.primitive.name == "scan"


def marked_scans(jaxpr) -> dict[int, int]:
    """``{equation index: length}`` of the top-level scans whose body calls
    ``mark_pipeline_boundary()``: each is to be unrolled completely."""
    return {i: e.params["length"] for i, e in enumerate(jaxpr.eqns) if _unrolls(e)}


def layer_stack_scans(jaxpr, weights: Sequence[bool]) -> list[int]:
    """Indices of the top-level scans over stacked layers: a float operand scanned over
    is computed from the inputs flagged in ``weights`` alone (the differentiated
    arguments), and the body holds a matmul or convolution."""
    pure = {v for v, w in zip(jaxpr.invars, weights, strict=True) if w}
    found = []
    for i, e in enumerate(jaxpr.eqns):
        reads = [v for v in e.invars if not is_literal(v)]
        if reads and all(v in pure for v in reads):
            pure.update(e.outvars)
        if not _is_scan(e) or not is_heavy(e):
            continue
        start = e.params["num_consts"] + e.params["num_carry"]
        xs = e.invars[start:]
        if any(
            not is_literal(v) and v in pure and jnp.issubdtype(v.aval.dtype, jnp.floating)
            for v in xs
        ):
            found.append(i)
    return found


def piece_bounds(length: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` consecutive ranges covering ``range(length)``, sizes differing by at most one."""
    pieces = max(1, min(pieces, length))
    edges = np.linspace(0, length, pieces + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def split_scans(closed: ClosedJaxpr, pieces: Mapping[int, int]) -> ClosedJaxpr:
    """``closed`` with the top-level scan at each index of ``pieces`` run as that many
    consecutive scans; a piece of one iteration is the body itself, inlined.  Scans
    nested in an inlined body that call ``mark_pipeline_boundary()`` are unrolled too."""
    if not pieces:
        return closed

    def hook(i, eqn, env, extra=()) -> bool:
        if i not in pieces:
            return False
        _run_in_pieces(eqn, env, pieces[i])
        return True

    return retrace(closed, hook)


def _unroll_marked(i, eqn, env, extra=()) -> bool:
    """``eval_eqns`` hook inside an inlined body: calls inlined, marked scans unrolled."""
    if _unrolls(eqn):
        _run_in_pieces(eqn, env, eqn.params["length"])
        return True
    return inline_hook(i, eqn, env, extra)


def _run_in_pieces(eqn, env: dict, pieces: int) -> None:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    vals = [read_var(env, v) for v in eqn.invars]
    consts, carry, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    bounds = piece_bounds(p["length"], pieces)
    ys_of: dict[tuple[int, int], list] = {}
    for a, b in reversed(bounds) if p["reverse"] else bounds:
        if b - a == 1:
            with source_of(eqn):
                x_i = [x[a] for x in xs]
            outs = eval_inlined(p["jaxpr"], eqn, [*consts, *carry, *x_i], _unroll_marked)
            with source_of(eqn):
                ys = [y[None] for y in outs[nk:]]
        else:
            with source_of(eqn):
                part = [x[a:b] for x in xs]
            outs = bind_eqn(eqn.replace(params=dict(p, length=b - a)), [*consts, *carry, *part])
            ys = outs[nk:]
        carry = outs[:nk]
        ys_of[(a, b)] = ys
    with source_of(eqn):
        if bounds:
            stacked = [
                jnp.concatenate(col) for col in zip(*(ys_of[c] for c in bounds), strict=True)
            ]
        else:
            stacked = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[nk:]]
    for var, val in zip(eqn.outvars, [*carry, *stacked], strict=True):
        env[var] = val


def split_note(eqn, pieces: int, why: str) -> str:
    """The plan's note for a scan split into ``pieces``."""
    length = eqn.params["length"]
    how = "unrolled" if pieces >= length else f"split into {pieces} scans"
    return f"lax.scan at {user_line(eqn)} ({length} iterations) {how}: {why}"
