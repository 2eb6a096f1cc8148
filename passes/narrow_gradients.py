"""Pass (after 0e, before 0f): accumulate a gradient that is a zero-padded slice at the slice's size.

A layer that reads rows of a parameter (``stack[i]`` for layer ``i`` of weights stacked
for ``nn.scan``, ``pos_emb[:T]``) gets from JAX a gradient padded with zeros to the
whole parameter's shape (the transpose of a slice is a ``pad``).  Accumulated over the
micro-batches as it is, every micro-batch writes and adds the whole array, zeros and
all, and a stage holding a few of the stacked layers keeps a whole-size accumulator
and sends it to the parameter's owner.

Padding is linear, so the sum of padded gradients is the padded sum.  This pass passes
each zero-padded term of a ``grad_end`` operand through the marker at its own size (a
sum of such terms, one each) and pads it right after the marker, in the update, once
per step.  Terms that fill disjoint rows (the layers of a stacked weight) are joined by
one ``concatenate``, so the update moves each stage's rows, not their padding, to the
parameter's owner (``passes/apply_placement.py``); other terms are padded and added in
the order JAX added them.  What is computed is unchanged: the added zeros are exact.

    >>> import jax, jax.numpy as jnp
    >>> from meshshard.primitives import boundary_p
    >>> def step(w, x):
    ...     g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[1])))(w)
    ...     return boundary_p.bind(g, kind="grad_end", index=0, reduce=(("grad", "", ""),))
    >>> closed = jax.make_jaxpr(step)(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
    >>> narrowed = narrow_padded_gradients(closed)
    >>> [v.aval.shape for e in narrowed.jaxpr.eqns if e.params.get("kind") == "grad_end" for v in e.invars]
    [(1, 3, 3)]
"""

from __future__ import annotations

from collections import Counter

from jax import lax

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import aval_size, is_literal, is_marker
from meshshard.passes.reductions import marker_reductions
from meshshard.passes.shared_grads import terms_through_grad_end

__all__ = ["narrow_padded_gradients", "padded_terms"]

_ADD = "add_any"


def _zero_pad(eqn) -> bool:
    """A ``pad`` with zeros that makes its operand larger."""
    if eqn.primitive.name != "pad":
        return False
    fill = eqn.invars[1]
    return (
        is_literal(fill)
        and fill.val == 0
        and aval_size(eqn.invars[0].aval) < aval_size(eqn.outvars[0].aval)
    )


def padded_terms(jaxpr, g: int) -> dict[int, tuple[list, set]]:
    """``{grad_end operand position: (terms, add equations)}`` for the gradients that
    sum (with single-use ``add_any``s) at least one zero-padded term: each term is a
    variable, and the adds are what the pass drops to add the terms after the marker."""
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns[:g]) for v in e.outvars}
    uses = Counter(v for e in eqns for v in e.invars if not is_literal(v))
    uses.update(v for v in jaxpr.outvars if not is_literal(v))

    def terms(v) -> tuple[list, set]:
        i = producer.get(v)
        if i is None or eqns[i].primitive.name != _ADD or uses[v] != 1:
            return [v], set()
        parts = [terms(x) for x in eqns[i].invars if not is_literal(x)]
        if len(parts) != len(eqns[i].invars):
            return [v], set()
        return [t for p in parts for t in p[0]], {i}.union(*(p[1] for p in parts))

    labels = marker_reductions(eqns[g])
    found = {}
    for pos, v in enumerate(eqns[g].invars):
        if is_literal(v) or labels[pos][0] != "grad":  # aux may combine by concatenation
            continue
        ts, adds = terms(v)
        if any(t in producer and _zero_pad(eqns[producer[t]]) for t in ts):
            found[pos] = (ts, adds)
    return found


def _rows(pad) -> tuple[int, int] | None:
    """``(first, end)`` rows of axis 0 that a zero pad fills from its operand, when it
    pads along axis 0 only (a layer's slice of stacked weights); else None."""
    (lo, hi, interior), *rest = pad.params["padding_config"]
    if interior or lo < 0 or hi < 0 or any(tuple(r) != (0, 0, 0) for r in rest):
        return None
    return int(lo), int(lo) + int(pad.invars[0].aval.shape[0])


def _combine(parts: list) -> object:
    """The sum of ``parts`` (value, zero pad that grows it or None), in order.  Slices of
    disjoint rows of axis 0 are joined by one ``concatenate`` (zeros between them), so
    the update moves each slice to where the whole gradient is used, not its padding."""
    rows = [None if pad is None else _rows(pad) for _, pad in parts]
    if len(parts) > 1 and all(r is not None for r in rows):
        order = sorted(range(len(parts)), key=lambda k: rows[k])
        spans = [rows[k] for k in order]
        if all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)):
            full = parts[0][1].outvars[0].aval
            pieces, at = [], 0
            for k in order:
                first, end = rows[k]
                if first > at:
                    pieces.append(lax.full((first - at, *full.shape[1:]), 0, full.dtype))
                pieces.append(parts[k][0])
                at = end
            if at < full.shape[0]:
                pieces.append(lax.full((full.shape[0] - at, *full.shape[1:]), 0, full.dtype))
            return _joined(pieces)
    total = None
    for x, pad in parts:
        if pad is not None:
            x = lax.pad(x, lax.full((), 0, x.dtype), pad.params["padding_config"])
        total = x if total is None else lax.add(total, x)
    return total


def _joined(pieces: list) -> object:
    """``pieces`` joined along axis 0 by a balanced tree of ``concatenate``s.  The update
    placement runs each join where its operands are, so the adjacent rows one stage
    holds are joined there and move as one message, not one per piece (XLA flattens
    the nested joins within a program)."""
    if len(pieces) == 1:
        return pieces[0]
    mid = len(pieces) // 2
    return lax.concatenate([_joined(pieces[:mid]), _joined(pieces[mid:])], 0)


def narrow_padded_gradients(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with the zero-padded gradient terms passed through its ``grad_end``
    marker unpadded and padded after it (unchanged when there are none)."""
    jaxpr = closed.jaxpr
    g = next((i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)
    if g is None:
        return closed
    found = padded_terms(jaxpr, g)
    if not found:
        return closed
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns[:g]) for v in e.outvars}
    dropped = set().union(*(adds for _, adds in found.values()))

    def unpadded(t):
        pad = eqns[producer[t]] if t in producer else None
        return (pad.invars[0], pad) if pad is not None and _zero_pad(pad) else (t, None)

    splits = {pos: ts for pos, (ts, _) in found.items()}
    return terms_through_grad_end(closed, g, splits, dropped, unpadded, _combine)
