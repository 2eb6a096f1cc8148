"""Pass helper: accumulate gradients locally, reduce them once per step.

With the batch split over a mesh axis, a weight gradient is a contraction over the
batch: every device holds a partial sum and XLA all-reduces it as soon as the value is
needed whole.  Accumulated over ``M`` micro-batches that is ``M`` all-reduces per step
where one would do.  This module keeps such values *unreduced*: a contraction over a
split dim is rewritten so that the split becomes a leading axis of size ``n`` (the
number of shards), sharded over the same mesh axes, so each device keeps its own
partial sum and no collective runs.  Linear operations on unreduced values (sums,
reshapes, transposes, casts, products with a whole value) are mapped over the leading
axis; the accumulator ``A{s}`` holds ``n`` partial sums; the update program sums the
leading axis once per step, which XLA lowers to one all-reduce (or a reduce-scatter
when the update reads the gradient sharded).  A value read by anything else is summed
first (what XLA did before), so the result is unchanged up to summation order.

This is JAX's ``unreduced`` sharding, written with stock public JAX (a reshape, a
batched ``dot_general``/``reduce_sum``, ``jax.vmap`` and ``with_sharding_constraint``).

>>> import jax, jax.numpy as jnp
>>> from meshshard.jaxpr_util import var_ids
>>> def grad_w(x, dy):  # x^T dy over a batch of 8 split over the mesh's devices
...     return 2.0 * jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))
>>> jx = jax.make_jaxpr(grad_w)(jnp.ones((8, 3)), jnp.ones((8, 4)))
>>> ids = var_ids(jx.jaxpr)
>>> split = {ids[jx.jaxpr.invars[0]]: {0: ("device",)}, ids[jx.jaxpr.invars[1]]: {0: ("device",)}}
>>> eqns = range(len(jx.jaxpr.eqns))
>>> found = unreduced_values(jx.jaxpr, eqns, split.get, [jx.jaxpr.outvars[0]])
>>> [str(u) for u in found.values()]
['%2 unreduced[device] split(0,0)', '%3 unreduced[device]']
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import jax
import jax.numpy as jnp

from meshshard.jaxpr_util import bind_eqn, eval_eqns, is_dropvar, is_inexact, is_literal, var_ids
from meshshard.plan import Unreduced

__all__ = ["Unreduced", "unreduced_values", "eval_unreduced"]

#: Linear in their one array operand, so they map over the leading axis unchanged.
UNARY_LINEAR = frozenset(
    {
        "neg",
        "convert_element_type",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "reduce_sum",
        "copy",
        "copy_p",
        "slice",
        "rev",
        "reduce_precision",
    }
)
#: Our marker primitive: an identity on its operands.
IDENTITY = "pipeline_boundary"
#: Linear when every operand is unreduced (over the same axes).
ADDITIVE = frozenset({"add", "sub", "add_any"})
#: Linear in one operand when the others are whole.
PRODUCT = frozenset({"mul", "dot_general"})


def _zeros(eqn) -> bool:
    """``broadcast_in_dim 0.0``: what a scatter-add (an embedding gradient) starts from."""
    v = eqn.invars[0] if eqn.invars else None
    return eqn.primitive.name == "broadcast_in_dim" and is_literal(v) and v.val == 0


def _scatter_split(eqn, spl: list) -> tuple | None:
    """(axes, (indices dim, updates dim)) when a scatter-add's updates are split over
    mesh axes along a scatter (not window) dim and its indices along the matching dim,
    or not at all (each device then reads its own rows of the whole indices)."""
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims:
        return None
    upd_ndim = len(eqn.invars[2].aval.shape)
    scatter_dims = [d for d in range(upd_ndim) if d not in dn.update_window_dims]
    for j, axes in spl[2].items():
        if j in scatter_dims:
            i = scatter_dims.index(j)
            if i < len(eqn.invars[1].aval.shape) - 1 and spl[1].get(i, axes) == axes:
                return axes, (i, j)
    return None


def _mapped_rule(eqn, held: Mapping, zeros: set | frozenset = frozenset()) -> tuple | None:
    """(axes, ()) when ``eqn`` is linear in its unreduced operands, else None."""
    ops = [v for v in eqn.invars if not is_literal(v)]
    which = [k for k, v in enumerate(eqn.invars) if not is_literal(v) and v in held]
    axes = {held[eqn.invars[k]].axes for k in which}
    if len(axes) != 1 or not all(is_inexact(o) for o in eqn.outvars):
        return None
    name = eqn.primitive.name
    if name in UNARY_LINEAR and which == [0] and len(ops) == 1:
        return axes.pop(), ()
    if name == IDENTITY and len(eqn.invars) == 1:  # a loss/boundary marker
        return axes.pop(), ()
    if name in ADDITIVE and len(which) == len(eqn.invars):
        return axes.pop(), ()
    if name in PRODUCT and len(which) == 1 and len(eqn.invars) == 2:
        return axes.pop(), ()
    if name == "div" and which == [0]:
        return axes.pop(), ()
    if name == "scatter-add" and 2 in which and 1 not in which:
        if which == [0, 2] or eqn.invars[0] in zeros:  # zeros added n times stay zeros
            return axes.pop(), ()
    return None


def _made_rule(eqn, split_of: Callable, ids: Mapping, zeros=frozenset()) -> tuple | None:
    """(axes, split dims) when ``eqn`` contracts a dim split over mesh axes (in one
    operand, the other's matching dim split alike or whole), else None."""
    if not all(is_inexact(o) for o in eqn.outvars):
        return None
    spl = [(split_of(ids[v]) or {}) if not is_literal(v) and v in ids else {} for v in eqn.invars]
    name = eqn.primitive.name
    if name == "dot_general":  # one operand may be whole: each device reads its part
        (lc, rc), _ = eqn.params["dimension_numbers"]
        for a, b in zip(lc, rc, strict=True):
            axes = spl[0].get(a) or spl[1].get(b)
            if axes and spl[0].get(a, axes) == axes and spl[1].get(b, axes) == axes:
                return axes, (a, b)
    if name == "reduce_sum":
        for d in eqn.params["axes"]:
            if spl[0].get(d):
                return spl[0][d], (d,)
    if name == "scatter-add" and eqn.invars[0] in zeros:
        return _scatter_split(eqn, spl)
    return None


def _clashes(eqn, axes: tuple[str, ...], split_of: Callable, ids: Mapping) -> bool:
    """True when the plan splits an output over one of ``axes``: a value cannot be both
    split over an axis and a partial sum over it."""
    for o in eqn.outvars:
        got = split_of(ids[o]) if o in ids else None
        if got and any(a in axes for dim_axes in got.values() for a in dim_axes):
            return True
    return False


def unreduced_values(
    jaxpr,
    eqns: Iterable[int],
    split_of: Callable,
    targets: Iterable,
    keep_split: bool = False,
    made_by: Collection[int] | None = None,
    loop_split: Callable | None = None,
    held_in: Mapping | None = None,
) -> dict[int, Unreduced]:
    """Var id -> :class:`Unreduced` for the values of ``eqns`` that can be held unreduced
    and lead (through unreduced values only) to one of ``targets`` (Vars: the
    accumulated contributions).

    ``split_of(var id)`` is the value's split on this mesh: ``{dim: mesh axes}`` (or
    None).  ``keep_split``: a target split over an axis (a gradient ZeRO keeps split)
    is never held as a partial sum over it, which would take a whole gradient's memory
    per device.  Values on the way to a target are, whatever their split: they are no
    larger than the gradient, and no collective runs.  ``made_by`` (default: any): the
    equations that may make a partial sum.  ``loop_split(scan equation)`` (data
    parallelism's rule inside a loop body: ``(split_of of the body's var ids, mesh
    axes)``, or None) lets a ``lax.scan`` hold the carries that sum a partial sum per
    iteration (:func:`_scan_held`); without it a scan is read whole.  ``held_in``: Vars
    of ``jaxpr`` held on entry (a loop body's carries), Var -> mesh axes.  Pure: the
    plan records the answer and the runtime follows it.
    """
    ids = var_ids(jaxpr)
    order = list(eqns)
    targets = set(targets)
    held: dict = {v: Unreduced(ids[v], axes) for v, axes in (held_in or {}).items()}
    zeros = set()
    for i in order:
        e = jaxpr.eqns[i]
        if _zeros(e):
            zeros.update(e.outvars)
        if e.primitive.name == "scan" and loop_split is not None:
            for k, u in _scan_held(e, ids, held, zeros, loop_split).items():
                held[e.outvars[k]] = u
            continue
        if any(not is_literal(v) and v in held for v in e.invars):
            rule = _mapped_rule(e, held, zeros)
        elif made_by is None or i in made_by:
            rule = _made_rule(e, split_of, ids, zeros)
        else:
            rule = None
        clash = keep_split and any(o in targets for o in e.outvars)
        if rule is not None and not (clash and _clashes(e, rule[0], split_of, ids)):
            for o in e.outvars:
                if not is_dropvar(o):
                    held[o] = Unreduced(ids[o], rule[0], rule[1])
    # a loop's held carries stay held even when what reads them needs them whole: summed
    # once after the loop, not once per time step
    loops = {v for v, u in held.items() if u.loop_outs}
    keep = {v for v in targets if v in held} | {v for v in held if v in (held_in or {})} | loops
    for i in reversed(order):
        e = jaxpr.eqns[i]
        if any(o in keep for o in e.outvars):
            keep.update(o for o in e.outvars if o in held)
            keep.update(v for v in e.invars if not is_literal(v) and v in held)
    return {ids[v]: held[v] for v in sorted(keep, key=ids.__getitem__)}


def _scan_held(eqn, ids: Mapping, held: Mapping, zeros, loop_split: Callable) -> dict:
    """Output position -> :class:`Unreduced` for the outputs of a ``lax.scan`` that can
    stay partial sums through the loop: a float carry that starts at zeros (a zero
    literal, or held over the body's axes) and that the body returns held, once its
    held carries are held on entry (a weight gradient summed over time steps:
    ``dW + x_t^T dh_t``), and a scanned output the body returns held (a stacked layer's
    weight gradient, one per iteration).  Empty when none can: the loop then reads its
    operands whole."""
    got = loop_split(eqn)
    if got is None:
        return {}
    body_split, axes = got
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    body = eqn.params["jaxpr"].jaxpr
    body_ids = var_ids(body)
    slots = []
    for k, v in enumerate(eqn.invars[nc : nc + ncar]):
        if not is_inexact(v):
            continue
        if is_literal(v) and v.val == 0 or v in zeros or (v in held and held[v].axes == axes):
            slots.append(k)
    stacked = [ncar + k for k, v in enumerate(body.outvars[ncar:]) if not is_literal(v)]

    def kept(k, inner) -> bool:
        v = body.outvars[k]
        return not is_literal(v) and body_ids.get(v) in inner and inner[body_ids[v]].axes == axes

    while True:
        seed = {body.invars[nc + k]: axes for k in slots}
        outs = [body.outvars[k] for k in (*slots, *stacked)]
        inner = unreduced_values(body, range(len(body.eqns)), body_split, outs, held_in=seed)
        carried = [k for k in slots if kept(k, inner)]
        if carried == slots:
            break
        slots = carried
    positions = (*slots, *(k for k in stacked if kept(k, inner)))
    if not positions:
        return {}
    body_plan = tuple(inner[k] for k in sorted(inner))
    return {
        k: Unreduced(ids[eqn.outvars[k]], axes, (), positions, body_plan)
        for k in positions
        if not is_dropvar(eqn.outvars[k])
    }


def _split_dim(x, d: int, n: int):
    return x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :])


def _after(k: int, at: int) -> int:
    """Dim ``k``'s index once dim ``at`` is split in two (``at`` -> the inner part)."""
    return k if k < at else k + 1


def _made(eqn, u: Unreduced, args: list, n: int):
    """The equation's result as ``n`` partial sums (leading axis), no collective."""
    if eqn.primitive.name == "dot_general":
        a, b = u.split
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        dims = (
            (tuple(_after(k, a) for k in lc), tuple(_after(k, b) for k in rc)),
            ((a, *(_after(k, a) for k in lb)), (b, *(_after(k, b) for k in rb))),
        )
        new = eqn.replace(params={**eqn.params, "dimension_numbers": dims})
        return bind_eqn(new, [_split_dim(args[0], a, n), _split_dim(args[1], b, n)])[0]
    if eqn.primitive.name == "scatter-add":  # each device scatters its own rows
        i, j = u.split
        idx, upd = _split_dim(args[1], i, n), _split_dim(args[2], j, n)
        one = lambda ix, up: bind_eqn(eqn, [args[0], ix, up])[0]  # noqa: E731
        return jax.vmap(one, in_axes=(i, j))(idx, upd)
    (d,) = u.split
    axes = tuple(_after(k, d) for k in eqn.params["axes"])
    new = eqn.replace(params={**eqn.params, "axes": axes})
    out = bind_eqn(new, [_split_dim(args[0], d, n)])[0]
    return jnp.moveaxis(out, d - sum(k < d for k in eqn.params["axes"]), 0)


def eval_unreduced(
    eqn,
    env: dict,
    held: Mapping,
    plan: Mapping,
    ids: Mapping,
    axis_size: Mapping[str, int],
    shard: Callable,
) -> bool:
    """Evaluate ``eqn`` into ``env`` honouring the unreduced values; True when handled.

    ``plan``: var id -> :class:`Unreduced` (the program's, from the plan); ``held``:
    Var -> Unreduced of values already held unreduced in ``env`` (updated here).  An
    equation the plan does not name that reads a held value reads its sum.
    ``shard(var id, axes, x)`` pins the leading axis of a new unreduced value.
    """
    outs = [o for o in eqn.outvars if not is_dropvar(o)]
    mine = [plan[ids[o]] for o in outs if ids.get(o) in plan]
    reads_held = any(not is_literal(v) and v in held for v in eqn.invars)
    if not mine and not reads_held:
        return False
    args = [v.val if is_literal(v) else env[v] for v in eqn.invars]
    if not mine:  # a consumer that needs the whole value: sum the partial sums first
        args = [
            x.sum(0) if (not is_literal(v) and v in held) else x
            for v, x in zip(eqn.invars, args, strict=True)
        ]
        for o, x in zip(eqn.outvars, bind_eqn(eqn, args), strict=True):
            if not is_dropvar(o):
                env[o] = x
        return True
    u = mine[0]
    n = 1
    for a in u.axes:
        n *= axis_size[a]
    if u.loop_outs:
        _eval_scan(eqn, args, u, env, held, plan, ids, n, axis_size, shard)
        return True
    if u.split:
        vals = [_made(eqn, u, args, n)]
    elif eqn.primitive.name == IDENTITY:
        vals = args
    else:
        in_axes = [0 if (not is_literal(v) and v in held) else None for v in eqn.invars]
        vals = jax.vmap(lambda *xs: bind_eqn(eqn, list(xs)), in_axes=in_axes)(*args)
    for o, x in zip(eqn.outvars, vals, strict=True):
        if not is_dropvar(o):
            env[o] = shard(ids[o], u.axes, x)
            held[o] = plan[ids[o]]
    return True


def _eval_scan(eqn, args, u: Unreduced, env, held, plan, ids, n, axis_size, shard) -> None:
    """Run a ``lax.scan`` whose outputs ``u.loop_outs`` stay ``n`` partial sums (leading
    axis) through the loop, its body's values ``u.inner`` held likewise; the other
    outputs whole.  A held carry that starts at zeros starts as ``n`` zeros; a held
    scanned output is stacked with the partial sums' axis in front."""
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    closed = p["jaxpr"]
    body = closed.jaxpr
    body_ids = var_ids(body)
    inner = {x.var: x for x in u.inner}
    slots = set(u.loop_outs)
    carried = {k for k in slots if k < ncar}
    init = list(args[nc : nc + ncar])
    for k in carried:
        v = eqn.invars[nc + k]
        if is_literal(v) or v not in held:  # zeros: n partial sums of zeros
            x = jnp.zeros((n, *v.aval.shape), v.aval.dtype)
            init[k] = shard(None, u.axes, x)
    for k, v in enumerate(eqn.invars[nc : nc + ncar]):
        if k not in carried and not is_literal(v) and v in held:
            init[k] = init[k].sum(0)
    whole = [
        x.sum(0) if (not is_literal(v) and v in held) else x
        for v, x in zip(eqn.invars, args, strict=True)
    ]
    consts, xs = whole[:nc], whole[nc + ncar :]
    inner_shard = lambda var, axes, x: shard(None, axes, x)  # noqa: E731 (body ids)

    def step(carry, x):
        env_b = dict(zip(body.constvars, closed.consts, strict=True))
        for v, val in zip(body.invars, (*consts, *carry, *x), strict=True):
            env_b[v] = val
        held_b = {body.invars[nc + k]: inner[body_ids[body.invars[nc + k]]] for k in carried}
        eval_eqns(
            body.eqns,
            env_b,
            on_eqn=lambda _, e, env: eval_unreduced(
                e, env, held_b, inner, body_ids, axis_size, inner_shard
            ),
        )
        outs = []
        for k, v in enumerate(body.outvars):
            val = v.val if is_literal(v) else env_b[v]
            if k not in slots and not is_literal(v) and v in held_b:
                val = val.sum(0)
            outs.append(val)
        return tuple(outs[:ncar]), tuple(outs[ncar:])

    carry, ys = jax.lax.scan(
        step, tuple(init), tuple(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    ys = [jnp.moveaxis(y, 1, 0) if ncar + k in slots else y for k, y in enumerate(ys)]
    for k, (o, x) in enumerate(zip(eqn.outvars, (*carry, *ys), strict=True)):
        if is_dropvar(o):
            continue
        if k in slots and ids.get(o) in plan:
            env[o] = shard(ids[o], u.axes, x)
            held[o] = plan[ids[o]]
        else:
            env[o] = x.sum(0) if k in slots else x
