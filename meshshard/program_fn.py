"""One program of a plan as a plain Python function over flat arrays.

Shared by the runtime (which jits it with the plan's shardings) and by planning (which
lowers it once to read JAX's cost analysis); no Ray, no devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from meshshard.accumulate import combine, finish
from meshshard.jaxpr_util import eval_eqns, is_literal, is_marker, read_var, var_ids
from meshshard.refs import BufferGroup, BufferKind

ACC = BufferKind.ACCUMULATORS


def program_function(
    traced,
    eqn_indices: Sequence[int],
    inputs: Sequence[BufferGroup],
    outputs: Sequence[BufferGroup],
    num_micro_batches: int,
    is_apply: bool,
    partials: dict | None = None,
) -> Callable:
    """``fn(*flat_inputs) -> tuple(flat_outputs)`` evaluating the given equations.

    ``inputs``/``outputs`` are buffer groups with their var ids, in order.  Accumulator
    groups (``A*``) are special: a stage program combines its contribution into the input
    (added, or max/min), and the update program reads them finished (a mean divides by
    the number of micro-batches); the ``grad_end`` marker says which reduction each has.
    ``partials`` (var id -> (op, term var ids, literal terms)) are outputs computed as
    this mesh's part of a cross-mesh all-reduce.
    """
    jaxpr = traced.jaxpr
    by_id = {i: v for v, i in var_ids(jaxpr).items()}
    consts = dict(zip(jaxpr.constvars, traced.closed.consts, strict=True))
    g_eqn = next((e for e in jaxpr.eqns if is_marker(e, "grad_end")), None)  # None: forward-only
    result_to_operand = dict(zip(g_eqn.outvars, g_eqn.invars, strict=True)) if g_eqn else {}
    literal_results = {r: o.val for r, o in result_to_operand.items() if is_literal(o)}
    reduce_of = (
        {r: red for r, (_, red, _) in zip(g_eqn.outvars, _reductions(g_eqn), strict=True)}
        if g_eqn
        else {}
    )
    eqns = [jaxpr.eqns[i] for i in eqn_indices]
    defined = {v for e in eqns for v in e.outvars}
    # a split backward's W reads contributions its B computed (``D`` group) as its own
    defined |= {by_id[i] for g in inputs if g.ref.kind is BufferKind.BACKWARD_CARRY for i in g.vars}
    in_groups = [(g.ref.kind is ACC, [by_id[i] for i in g.vars]) for g in inputs]
    out_groups = [(g.ref.kind is ACC, [by_id[i] for i in g.vars]) for g in outputs]
    m = num_micro_batches
    partial_vars = {
        by_id[i]: (op, [by_id[t] for t in terms], lits)
        for i, (op, terms, lits) in (partials or {}).items()
    }

    def fn(*flat):
        env = dict(consts)
        env.update(literal_results)
        acc_in = {}
        pos = 0
        for is_acc, vs in in_groups:
            vals = flat[pos : pos + len(vs)]
            pos += len(vs)
            for v, x in zip(vs, vals, strict=True):
                if not is_acc:
                    env[v] = x
                elif is_apply:  # accumulators -> the combined value (mean: sum / m)
                    env[v] = finish(reduce_of[v], x, m)
                else:
                    acc_in[v] = x
        eval_eqns(eqns, env)
        outs = []
        for is_acc, vs in out_groups:
            for v in vs:
                if v in partial_vars:
                    outs.append(_partial(partial_vars[v], env, v.aval))
                elif is_acc and not is_apply:
                    operand = result_to_operand[v]
                    contribution = read_var(env, operand) if operand in defined else None
                    outs.append(
                        acc_in[v]
                        if contribution is None
                        else combine(reduce_of[v], acc_in[v], contribution)
                    )
                else:
                    outs.append(read_var(env, v))
        return tuple(outs)

    return fn


_REDUCERS = {
    "sum": jnp.add,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "and": jnp.logical_and,
    "or": jnp.logical_or,
}


def _partial(spec, env, aval):
    """This mesh's part of an all-reduce: ``op`` over its terms, or the identity."""
    op, terms, literals = spec
    vals = [env[t] for t in terms] + [jnp.asarray(x, aval.dtype) for x in literals]
    if not vals:
        return jnp.asarray(reduction_identity(op, aval.shape, aval.dtype))
    out = vals[0]
    for x in vals[1:]:
        out = _REDUCERS[op](out, x)
    return jnp.asarray(out, aval.dtype)


def reduction_identity(op: str, shape, dtype) -> np.ndarray:
    """The value that leaves ``op`` unchanged: what a mesh without a part contributes."""
    dtype = np.dtype(dtype)
    if op in ("and", "or"):
        return np.full(shape, op == "and", dtype)
    if op == "sum":
        return np.zeros(shape, dtype)
    info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
    big = np.inf if np.issubdtype(dtype, np.floating) else info.max
    return np.full(shape, -big if op == "max" else big, dtype)


def _reductions(g_eqn) -> tuple:
    """(label, reduction, source) per ``grad_end`` operand; legacy markers: float mean, int sum."""
    info = g_eqn.params.get("reduce")
    if info and all(red for _, red, _ in info):
        return info
    return tuple(
        ("", "mean" if jnp.issubdtype(v.aval.dtype, jnp.floating) else "sum", "")
        for v in g_eqn.invars
    )
