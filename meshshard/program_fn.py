"""One program of a plan as a plain Python function over flat arrays.

Shared by the runtime (which jits it with the plan's shardings) and by planning (which
lowers it once to read JAX's cost analysis); no Ray, no devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
from jax.lax import with_sharding_constraint

from meshshard.accumulate import combine, finish
from meshshard.jaxpr_util import (
    bind_eqn,
    eval_eqns,
    is_dropvar,
    is_literal,
    is_marker,
    read_var,
    var_ids,
)
from meshshard.passes.shard_unreduced import eval_unreduced
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
    constrain: Callable | None = None,
    constrained: Sequence[int] = (),
    unreduced: Local | None = None,
    operand_constraints: Mapping[int, Mapping[int, object]] | None = None,
) -> Callable:
    """``fn(*flat_inputs) -> tuple(flat_outputs)`` evaluating the given equations.

    ``inputs``/``outputs`` are buffer groups with their var ids, in order.  Accumulator
    groups (``A*``) are special: a stage program combines its contribution into the input
    (added, or max/min), and the update program reads them finished (a mean divides by
    the number of micro-batches); the ``grad_end`` marker says which reduction each has.
    A program holding both a gradient part and the update that reads it (a whole step of
    one micro-batch, ``s{i}.step``) has no accumulator: the update reads the marker's
    results as one micro-batch leaves them (:mod:`meshshard.passes.fuse_step`).
    ``partials`` (var id -> (op, term var ids, literal terms)) are outputs computed as
    this mesh's part of a cross-mesh all-reduce.  ``constrain(var_id, value)`` is applied
    to each value of ``constrained`` as it is computed (the runtime passes
    ``with_sharding_constraint`` with the plan's inferred spec).  ``unreduced`` holds
    gradient contributions as per-device partial sums (see :class:`Local`).
    ``operand_constraints`` (equation index -> operand position -> sharding) pins an
    operand just before that equation reads it, where the inferred plan reshards it.
    """
    jaxpr = traced.jaxpr
    by_id = {i: v for v, i in var_ids(jaxpr).items()}
    consts = dict(zip(jaxpr.constvars, traced.closed.consts, strict=True))
    # grad_end, or the out marker of a forward-only step with micro-batches
    g_eqn = next((e for e in jaxpr.eqns if is_marker(e, "grad_end", "out")), None)
    result_to_operand = dict(zip(g_eqn.outvars, g_eqn.invars, strict=True)) if g_eqn else {}
    literal_results = {r: o.val for r, o in result_to_operand.items() if is_literal(o)}
    reduce_of = (
        {r: red for r, (_, red, _) in zip(g_eqn.outvars, _reductions(g_eqn), strict=True)}
        if g_eqn
        else {}
    )
    eqns = [jaxpr.eqns[i] for i in eqn_indices]
    defined = {v for e in eqns for v in e.outvars}
    # a whole one-micro-batch step (``s{i}.step``): the update part reads the results
    # its own gradient part computed, totalled here instead of in an accumulator
    marker_at = next((i for i, e in enumerate(jaxpr.eqns) if e is g_eqn), len(jaxpr.eqns))
    split = next((k for k, i in enumerate(eqn_indices) if i > marker_at), len(eqns))
    supplied = {by_id[i] for g in inputs for i in g.vars}
    read_after = [v for e in eqns[split:] for v in e.invars if not is_literal(v)]
    read_after += [by_id[i] for g in outputs if g.ref.kind is not ACC for i in g.vars]
    inside = [  # none in an update alone: it reads every result from its inputs
        r
        for r in dict.fromkeys(read_after if split else ())
        if r in result_to_operand and r not in literal_results and r not in supplied
    ]
    # a split backward's W reads contributions its B computed (``D`` group) as its own
    defined |= {by_id[i] for g in inputs if g.ref.kind is BufferKind.BACKWARD_CARRY for i in g.vars}
    in_groups = [(g.ref.kind is ACC, [by_id[i] for i in g.vars]) for g in inputs]
    out_groups = [(g.ref.kind is ACC, [by_id[i] for i in g.vars]) for g in outputs]
    m = num_micro_batches
    partial_vars = {
        by_id[i]: (op, [by_id[t] for t in terms], lits)
        for i, (op, terms, lits) in (partials or {}).items()
    }

    ids = var_ids(jaxpr)
    pinned = {by_id[i] for i in constrained} if constrain is not None else set()
    # local position in ``eqns`` -> {operand position: sharding}
    operand_pins = {
        k: operand_constraints[i]
        for k, i in enumerate(eqn_indices)
        if operand_constraints and i in operand_constraints
    }

    loc = unreduced or Local()

    def pin(i, eqn, env, held=None) -> bool:
        if held is not None and eval_unreduced(
            eqn, env, held, loc.values, ids, loc.axis_size, loc.shard
        ):
            return True
        at = operand_pins.get(i)
        if not at and not any(o in pinned for o in eqn.outvars):
            return False
        args = [read_var(env, v) for v in eqn.invars]
        for pos, sh in (at or {}).items():
            args[pos] = with_sharding_constraint(args[pos], sh)
        outs = bind_eqn(eqn, args)
        for o, x in zip(eqn.outvars, outs, strict=True):
            if not is_dropvar(o):
                env[o] = constrain(ids[o], x) if o in pinned else x
        return True

    def fn(*flat):
        held: dict = {}  # Var -> Unreduced of values held as partial sums
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
                    env[v] = finish(reduce_of[v], x.sum(0) if ids[v] in loc.accumulators else x, m)
                else:
                    acc_in[v] = x
        hook = (lambda i, e, env: pin(i, e, env, held)) if loc.values else pin
        hook = hook if pinned or loc.values or operand_pins else None
        eval_eqns(eqns[:split], env, on_eqn=hook)
        for r in inside:
            total = _own_total(r, env, held)
            env[r] = constrain(ids[r], total) if r in pinned else total
        later = None if hook is None else (lambda i, e, env: hook(i + split, e, env))
        eval_eqns(eqns[split:], env, on_eqn=later)
        outs = []
        for is_acc, vs in out_groups:
            for v in vs:
                if v in partial_vars:
                    outs.append(_partial(partial_vars[v], _dense(env, held), v.aval))
                elif is_acc and not is_apply:
                    outs.append(_accumulate(v, acc_in[v], env, held))
                else:
                    outs.append(_read(env, held, v))
        return tuple(outs)

    def _own_total(r, env, held):
        """Grad-end result ``r`` of one micro-batch, as ``ZEROS``, the stage program's
        combine and the update's finish would give it."""
        acc = jnp.zeros(r.aval.shape, r.aval.dtype)
        operand = result_to_operand[r]
        if operand in defined:
            acc = combine(reduce_of[r], acc, _read(env, held, operand))
        return finish(reduce_of[r], acc, m)

    def _accumulate(v, acc, env, held):
        operand = result_to_operand[v]
        if operand not in defined:
            return acc
        axes = loc.accumulators.get(ids[v])
        if axes is None:  # stored whole
            return combine(reduce_of[v], acc, _read(env, held, operand))
        if operand in held and held[operand].axes == axes:  # no collective
            return combine(reduce_of[v], acc, read_var(env, operand))
        return acc.at[0].add(_read(env, held, operand))  # a whole contribution counts once

    return fn


@dataclass(frozen=True)
class Local:
    """Values a program holds as per-device partial sums (``passes/shard_unreduced.py``).

    ``values``: var id -> Unreduced (the plan's, for this program); ``accumulators``: var
    id -> mesh axes of the accumulators stored that way (leading axis of partial sums,
    summed by the update); ``axis_size``: mesh axis -> size; ``shard(var, axes, x)`` pins a new
    unreduced value's leading axis.
    """

    values: Mapping = field(default_factory=dict)
    accumulators: Mapping = field(default_factory=dict)
    axis_size: Mapping = field(default_factory=dict)
    shard: Callable = lambda var, axes, x: x


def _read(env, held, v):
    """A value whole: the sum of its partial sums when held unreduced."""
    x = read_var(env, v)
    return x.sum(0) if not is_literal(v) and v in held else x


def _dense(env, held):
    return {v: (x.sum(0) if v in held else x) for v, x in env.items()}


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


def combine_partials(op: str, a, b):
    """Two partial results of one all-reduce combined by ``op``: what a worker running
    several meshes' update programs (interleaved chunks) contributes once."""
    return _REDUCERS[op](a, b)


def _reductions(g_eqn) -> tuple:
    """(label, reduction, source) per ``grad_end`` operand; legacy markers: float mean, int sum."""
    info = g_eqn.params.get("reduce")
    if info and all(red for _, red, _ in info):
        return info
    return tuple(
        ("", "mean" if jnp.issubdtype(v.aval.dtype, jnp.floating) else "sum", "")
        for v in g_eqn.invars
    )
