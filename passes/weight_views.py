"""Pass: the backward recomputes the views of the weights it reads, rather than keeping them.

A forward pass often reads its weights through a cheap view: the row of a stacked weight
that one layer of an unrolled ``nn.scan`` uses (``W[i]``), a weight cast to the compute
dtype, a kernel reshaped or transposed.  When the backward reads the same view, the
stage slicing finds a value made by the forward and read by the backward: a residual,
kept per micro-batch from the forward until its backward.  So every micro-batch in flight
held its own copy of its layers' weights (for a stacked stage, most of what it keeps), and
the forward copied them out each time.

This pass re-emits the view's equations in the backward, right before their first reader
in each backward layer, from the weights themselves: the backward then reads the weights
(``P``, or the once-per-step copy of a shared one) and the view costs a slice per
micro-batch, not a residual.  Only views of state (no batch, no random draw) through
the primitives in :data:`VIEW_PRIMITIVES` qualify, none larger than its operand.  A
view never reaches another layer's backward directly: a boundary marker carries every
value live across it, so the backward reads the weights only where its own layer's
forward does (or its stage receives the once-per-step copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace

#: Primitives that only select, reshape or cast their first operand.
VIEW_PRIMITIVES = frozenset(
    {
        "slice",
        "dynamic_slice",
        "squeeze",
        "reshape",
        "expand_dims",
        "transpose",
        "convert_element_type",
        "copy",
        "copy_p",
    }
)


def _size(v) -> int:
    return int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64))


def weight_views(jaxpr, is_batch: Sequence[bool], stop: int) -> dict:
    """Var -> equation index of each view of state made by equations ``[0, stop)``."""
    state = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if not b}
    state.update(jaxpr.constvars)
    views: dict = {}
    for i, e in enumerate(jaxpr.eqns[:stop]):
        if e.primitive.name not in VIEW_PRIMITIVES or len(e.outvars) != 1:
            continue
        operands = [v for v in e.invars if not is_literal(v)]
        if not operands or not all(v in state or v in views for v in operands):
            continue
        if _size(e.outvars[0]) > _size(e.invars[0]):
            continue
        views[e.outvars[0]] = i
    return views


def recompute_weight_views(closed: ClosedJaxpr, is_batch: Sequence[bool]) -> ClosedJaxpr:
    """``closed`` whose backward recomputes the weight views it reads (module docstring);
    unchanged when its backward reads none."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    loss = next((i for i, e in enumerate(eqns) if is_marker(e, "loss")), None)
    end = next((i for i, e in enumerate(eqns) if is_marker(e, "grad_end")), None)
    if loss is None or end is None:
        return closed
    views = weight_views(jaxpr, is_batch, loss)
    read_back = {
        v
        for e in eqns[loss + 1 : end]
        if not is_marker(e)
        for v in e.invars
        if not is_literal(v) and v in views
    }
    if not read_back:
        return closed
    mirrors = [i for i, e in enumerate(eqns) if loss < i < end and is_marker(e, "bwd")]
    made: dict = {}  # (backward layer, view var) -> its value recomputed there

    def value(region: int, v, env):
        if is_literal(v) or v not in views:
            return read_var(env, v)
        if (region, v) not in made:
            e = eqns[views[v]]
            (made[(region, v)],) = bind_eqn(e, [value(region, u, env) for u in e.invars])
        return made[(region, v)]

    def hook(i, eqn, env, extra) -> bool:
        reads = [v for v in eqn.invars if not is_literal(v)]
        if not loss < i < end or is_marker(eqn) or not any(v in read_back for v in reads):
            return False
        region = sum(1 for m in mirrors if m < i)
        outs = bind_eqn(eqn, [value(region, v, env) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not is_dropvar(v):
                env[v] = o
        return True

    return retrace(closed, hook)
