"""Sharding strategies of control flow: a ``lax.scan`` over time split like its body,
and a ``lax.cond`` / ``lax.switch`` split like its branches.

A scan whose body runs the same computation on every example (an LSTM or GRU over the
steps of a sequence, ``nn.RNN``) can split the batch over a mesh axis for the whole
loop: each device runs every time step on its own rows.  Without a rule the sharding
ILP ran such a scan replicated (every device computing the whole batch, its inputs
gathered first).  This module finds the loop's *parallel* layouts by propagating one
operand's split through the body with the rule table's own strategies
(:func:`meshshard.passes.shard_rules.strategies`), choosing for each body equation the
strategy that matches the layouts already known with the fewest collectives, and
keeping the result only where every carry leaves the body as it entered it.

The strategy's collectives are its body's, once per time step, except the reduces
that local accumulation holds as partial sums through the loop (a weight gradient
summed in a carry that starts at zeros, :mod:`meshshard.passes.shard_unreduced`): those
run once, after the loop.  Its work is the body's contractions times the trip count,
divided as the body's strategies divide them.

A ``cond`` (``lax.cond``, ``lax.switch``) is laid out the same way, through every
branch at once: the branches must read the operands and return the results in one
layout (zeros a branch returns for the other's residuals, and operands it passes
through unread, take the others' layout); its work and collectives are its costliest
branch's.

    >>> import jax, jax.numpy as jnp
    >>> from meshshard.passes.shard_costs import LogicalMesh
    >>> mesh = LogicalMesh(("host", "device"), (1, 2), (0.0, 0.0), (0.0, 0.0))
    >>> def rnn(w, h, xs):
    ...     return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h), h, xs)
    >>> closed = jax.make_jaxpr(rnn)(jnp.ones((3, 3)), jnp.ones((4, 3)), jnp.ones((5, 4, 3)))
    >>> (scan,) = closed.jaxpr.eqns
    >>> [s.ins for s in scan_strategies(scan, mesh)]  # replicated; the batch split
    [(((), ()), ((), ()), ((), (), ())), (((), ()), (('device',), ()), ((), ('device',), ()))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshshard.jaxpr_util import contraction_flops, is_dropvar, is_inexact, is_literal, var_ids
from meshshard.passes.shard_costs import Comm, LogicalMesh
from meshshard.passes.shard_unreduced import unreduced_values

__all__ = ["scan_strategies", "cond_strategies", "body_layouts", "loop_flops"]

#: A collective run once per time step is priced as at most this many (their bytes
#: summing to every step's), each paying its latency.
_MAX_COPIES = 32


def _whole(v) -> tuple:
    return tuple(() for _ in getattr(v.aval, "shape", ()))


def _axes_of(layouts) -> set:
    return {a for lay in layouts if lay for dim in lay for a in dim}


def loop_flops(eqn) -> float:
    """FLOPs of one run of a ``scan``: its body's matmuls and convolutions (nested loops
    and branches included) times its trip count; of a ``cond``: its costliest branch's."""
    if eqn.primitive.name == "cond":
        return max(sum(loop_flops(e) for e in b.jaxpr.eqns) for b in eqn.params["branches"])
    if eqn.primitive.name != "scan":
        return contraction_flops(eqn) or 0.0
    body = eqn.params["jaxpr"].jaxpr
    return eqn.params["length"] * sum(loop_flops(e) for e in body.eqns)


def _operand_layout(eqn, k: int, body_lay: tuple) -> tuple:
    """The layout of the scan's operand ``k`` whose body value has ``body_lay`` (a
    scanned operand has the time dim in front, whole)."""
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    return ((), *body_lay) if k >= nc + ncar else body_lay


def _body_layout(eqn, k: int, op_lay: tuple) -> tuple | None:
    """The body value's layout of the scan's operand ``k`` in ``op_lay`` (None: the
    time dim is split, which no parallel strategy does)."""
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    if k < nc + ncar:
        return op_lay
    return None if op_lay and op_lay[0] else tuple(op_lay[1:])


def _propagate(eqn, strats: Sequence, fixed: dict, axes: set, free: bool):
    """A scan body's layouts (Var -> layout, every input set) and the strategy chosen per
    body equation (:func:`_flow`, the loop's carries leaving as they entered, its
    constants the weights), or None."""
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    body = eqn.params["jaxpr"].jaxpr
    carries = [(body.invars[nc + k], body.outvars[k]) for k in range(ncar)]
    found = _flow(body, strats, fixed, axes, free, set(body.invars[:nc]), carries)
    if found is None:
        return None
    lay, chosen = found
    for v in body.invars:
        lay.setdefault(v, _whole(v))
    return lay, chosen


def _flow(jaxpr, strats: Sequence, fixed: dict, axes: set, free: bool, consts=(), carries=()):
    """Layouts (Var -> layout) of ``jaxpr``'s values and the strategy chosen per
    equation, from the inputs' layouts in ``fixed`` (the others free when ``free``, else
    whole; a free input no equation reads is left out), or None when some equation has
    no strategy over ``axes`` that fits or a carry ``(input, output)`` leaves in another
    layout than it entered.  Per equation the strategy that fits with the fewest
    collectives, then the fewest ``consts`` (weights) split, then the fewest whole
    values sliced, then the most split.  A whole value, or one made from literals alone
    (``zeros``), fits any layout its readers need: each device slices its part locally
    (a dropout mask drawn whole)."""
    inputs = set(jaxpr.invars)
    fixed = dict(fixed)
    for _ in range(len(carries) + 2):
        lay = dict(fixed)
        chosen = []
        made = set()  # values made from literals alone (zeros, iota): any layout is free
        for e, options in zip(jaxpr.eqns, strats, strict=True):
            best, best_rank = None, None
            for s in options:
                if not _axes_of((*s.ins, *s.outs)) <= axes:
                    continue
                fits, assigns, weights, slices = True, 0, 0, 0
                for v, need in zip(e.invars, s.ins, strict=True):
                    if need is None or is_literal(v):
                        continue
                    have = lay.get(v)
                    if v in made or (have is not None and have == _whole(v)):
                        slices += need != _whole(v)
                        continue  # slicing a whole value is local: any layout fits
                    if have is None and free and v in inputs:
                        assigns += need != _whole(v)
                        weights += v in consts and need != _whole(v)
                        continue
                    if (have if have is not None else _whole(v)) != need:
                        fits = False
                        break
                if not fits:
                    continue
                rank = (len(s.comms), weights, slices, -s.split, assigns)
                if best_rank is None or rank < best_rank:
                    best, best_rank = s, rank
            if best is None:
                return None
            for v, need in zip(e.invars, best.ins, strict=True):
                if need is not None and not is_literal(v) and v not in lay:
                    lay[v] = need
            for o, out in zip(e.outvars, best.outs, strict=True):
                if not is_dropvar(o):
                    lay[o] = out
            if all(is_literal(v) or v in made for v in e.invars):
                made.update(e.outvars)
            chosen.append(best)
        moved = False
        for i, o in carries:
            out = _whole(o) if is_literal(o) else lay.get(o, _whole(o))
            if lay.get(i, _whole(i)) != out:
                if i in fixed and fixed[i] != _whole(i):
                    return None  # a carry split on entry must leave split alike
                fixed[i] = out
                moved = True
        if not moved:
            return lay, chosen
    return None


def body_layouts(eqn, mesh: LogicalMesh, operand_layouts: Sequence) -> dict | None:
    """Body var id (:func:`~meshshard.jaxpr_util.var_ids` of the body) -> layout, for a
    scan whose operands arrive in ``operand_layouts`` (None: the operand whole), as
    :func:`scan_strategies` laid the body out; None when no parallel strategy fits."""
    from meshshard.passes.shard_rules import strategies

    body = eqn.params["jaxpr"].jaxpr
    fixed, axes = {}, set()
    for k, (v, lay) in enumerate(zip(body.invars, operand_layouts, strict=True)):
        got = _body_layout(eqn, k, lay) if lay is not None else None
        if got is None and lay is not None:
            return None
        fixed[v] = got if got is not None else _whole(v)
        axes |= _axes_of([got])
    if not axes:
        return None
    strats = [strategies(e, mesh) for e in body.eqns]
    found = _propagate(eqn, strats, fixed, axes, free=False)
    if found is None:
        return None
    ids = var_ids(body)
    return {ids[v]: lay for v, lay in found[0].items() if v in ids}


def _held_reduces(eqn, lay: Mapping, chosen: Sequence) -> dict[int, int]:
    """Body equation -> how many iterations' worth its one reduce moves, for the reduces
    local accumulation holds through the loop: 1 where the partial sum reaches a float
    carry (a weight gradient summed over time, reduced once after the loop), the trip
    count where it reaches a scanned output (a stacked layer's weight gradient: the
    whole stack is reduced once)."""
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    body = eqn.params["jaxpr"].jaxpr
    ids = var_ids(body)
    split = {
        ids[v]: {d: a for d, a in enumerate(layout) if a} for v, layout in lay.items() if v in ids
    }
    seed = {}
    for k in range(ncar):
        i, init = body.invars[nc + k], eqn.invars[nc + k]
        if is_literal(init) and init.val != 0:
            continue  # the runtime holds a carry that starts at zeros only: a literal
            # says; a value is taken as zeros (the gradient carries autodiff makes are)
        if lay.get(i) == _whole(i) and is_inexact(i):
            seed[i] = ()
    carried = [body.outvars[k] for k in range(ncar) if body.invars[nc + k] in seed]
    stacked = [v for v in body.outvars[ncar:] if not is_literal(v)]
    reduces = {
        j
        for j, s in enumerate(chosen)
        if any(c.kind in ("all-reduce", "reduce-scatter") for c in s.comms)
    }
    out: dict[int, int] = {}
    for axes in {a for j in reduces for c in chosen[j].comms for a in [c.axes]}:
        for targets, held_in, times in (
            (carried, {v: axes for v in seed}, 1),
            (stacked, {}, eqn.params["length"]),
        ):
            if not targets:
                continue
            found = unreduced_values(
                body,
                range(len(body.eqns)),
                lambda vid, axes=axes: (
                    {d: a for d, a in split.get(vid, {}).items() if a == axes} or None
                ),
                targets,
                held_in=held_in,
            )
            for j in reduces:
                e = body.eqns[j]
                if any(not is_dropvar(o) and ids[o] in found for o in e.outvars):
                    out[j] = max(out.get(j, 0), times)
    return out


def scan_strategies(eqn, mesh: LogicalMesh) -> list:
    """The strategies of a ``scan`` equation: replicated, and for each group of mesh
    axes each distinct parallel layout found by splitting one carry or scanned operand
    along one dim and propagating through the body."""
    from meshshard.passes.shard_rules import Strategy, strategies

    body = eqn.params["jaxpr"].jaxpr
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    whole_ins = tuple(None if is_literal(v) else _whole(v) for v in eqn.invars)
    # "replicated" only when nothing else fits: the plan then notes the loop runs so
    out = [Strategy("loop whole", tuple(_whole(o) for o in eqn.outvars), whole_ins)]
    strats = None
    seen = set()
    values = [
        (k, v)
        for k, v in enumerate(body.invars)
        if k >= nc + ncar or (k >= nc and is_inexact(v))  # a carry or a scanned operand
    ]
    for _, v, axes, seed in _seeds(mesh, values):
        if strats is None:
            strats = [strategies(e, mesh) for e in body.eqns]
        found = _propagate(eqn, strats, {v: seed}, set(axes), free=True)
        if found is None:
            continue
        lay, chosen = found
        ins = tuple(
            None if is_literal(x) else _operand_layout(eqn, j, lay[b])
            for j, (x, b) in enumerate(zip(eqn.invars, body.invars, strict=True))
        )
        outs = tuple(
            _operand_layout(eqn, nc + j if j < ncar else nc + ncar, _out(lay, o))
            for j, o in enumerate(body.outvars)
        )
        if (ins, outs) in seen or not _axes_of(ins):
            continue
        seen.add((ins, outs))
        out.append(_strategy(eqn, lay, chosen, ins, outs, mesh.size(axes)))
    if len(out) == 1:
        out[0] = Strategy("replicated", out[0].outs, out[0].ins)
    return out


def _seeds(mesh: LogicalMesh, values):
    """``(k, v, axes, seed)`` for each value ``(k, v)`` of ``values`` and each group of
    the mesh's split axes that divides one of its dims: ``seed`` splits that dim alone."""
    from meshshard.passes.shard_rules import _assignments

    for groups in _assignments(1, mesh):
        if not groups:
            continue
        axes = groups[0]
        size = mesh.size(axes)
        for k, v in values:
            shape = getattr(v.aval, "shape", ())
            for d, n in enumerate(shape):
                if n % size or n < size:
                    continue
                yield k, v, axes, tuple(axes if j == d else () for j in range(len(shape)))


def _work_split(eqns, chosen, size: int) -> int:
    """How many devices share ``eqns``' contractions under the strategies ``chosen``
    (their FLOPs over the per-device FLOPs); ``size`` when they hold none."""
    total = sum(loop_flops(e) for e in eqns)
    work = sum(loop_flops(e) / s.split for e, s in zip(eqns, chosen, strict=True))
    return max(1, round(total / work)) if total and work else size


def _out(lay: Mapping, o) -> tuple:
    return _whole(o) if is_literal(o) else lay.get(o, _whole(o))


def _strategy(eqn, lay, chosen, ins, outs, size: int):
    """The scan's strategy from its body's: collectives once per time step (a held
    gradient's reduce once), work divided as the body's contractions are."""
    from meshshard.passes.shard_rules import Strategy

    body = eqn.params["jaxpr"].jaxpr
    length = eqn.params["length"]
    held = _held_reduces(eqn, lay, chosen)
    comms: list[Comm] = []
    for j, s in enumerate(chosen):
        # held: one reduce after the loop (of the whole stack for a scanned output);
        # else one per time step, each paying its latency
        times, copies = (held[j], 1) if j in held else (length, min(length, _MAX_COPIES))
        for c in s.comms:
            if c.nbytes:
                comms += [Comm(c.kind, c.axes, c.nbytes * times / copies, c.var)] * copies
    split = _work_split(body.eqns, chosen, size)
    name = "loop " + " ".join(str(x) for x in ins if x is not None and any(x))
    return Strategy(name, outs, ins, tuple(comms), split)


def cond_strategies(eqn, mesh: LogicalMesh) -> list:
    """The strategies of a ``cond`` (``lax.cond``, ``lax.switch``): replicated, and each
    layout found by splitting one operand along one dim and propagating through every
    branch, kept when the branches read the operands and return their results in the
    same layouts (an operand a branch does not read takes the others' layout).  Its
    collectives and work are its costliest branch's."""
    from meshshard.passes.shard_rules import Strategy, strategies

    branches = [b.jaxpr for b in eqn.params["branches"]]
    ops = eqn.invars[1:]
    whole_ins = tuple(None if is_literal(v) else _whole(v) for v in eqn.invars)
    out = [Strategy("branch whole", tuple(_whole(o) for o in eqn.outvars), whole_ins)]
    strats, seen = None, set()
    operands = [(k, v) for k, v in enumerate(ops) if not is_literal(v)]
    for k, _, axes, seed in _seeds(mesh, operands):
        if strats is None:
            strats = [[strategies(e, mesh) for e in b.eqns] for b in branches]
        got = _branches(eqn, branches, strats, k, seed, set(axes), mesh.size(axes))
        if got is None or got[:2] in seen:
            continue
        seen.add(got[:2])
        ins, outs, comms, split = got
        name = "branch " + " ".join(str(x) for x in ins if x is not None and any(x))
        out.append(Strategy(name, outs, (whole_ins[0], *ins), comms, split))
    arrays = any(not is_literal(v) and getattr(v.aval, "shape", ()) for v in ops)
    if len(out) == 1 and arrays:  # a branch of constants alone has nothing to split
        out[0] = Strategy("replicated", out[0].outs, out[0].ins)
    return out


def _branches(eqn, branches, strats, k: int, seed: tuple, axes: set, size: int):
    """(operand layouts, result layouts, collectives, split) of a ``cond`` with operand
    ``k`` split as ``seed``, or None when its branches disagree or one cannot follow."""
    ops = eqn.invars[1:]
    found = []
    for b, st in zip(branches, strats, strict=True):
        got = _flow(b, st, {b.invars[k]: seed}, axes, free=True)
        if got is None:
            return None
        found.append(got)
    # each result's layout, from the branches that compute it: a filler (zeros) takes
    # any layout, and an operand a branch passes through unread takes the result's
    outs, passed = [], {}
    for j, o in enumerate(eqn.outvars):
        got = set()
        for b, (lay, _) in zip(branches, found, strict=True):
            v = b.outvars[j]
            if _filler(b, v):
                continue
            if v in b.invars and v not in lay:
                passed.setdefault(b.invars.index(v), []).append(j)
                continue
            got.add(_out(lay, v))
        if len(got) > 1:
            return None
        outs.append(got.pop() if got else _whole(o))
    ins = []
    for j, v in enumerate(ops):
        used = {
            lay[b.invars[j]]
            for b, (lay, _) in zip(branches, found, strict=True)
            if b.invars[j] in lay
        } | {outs[r] for r in passed.get(j, ())}
        if len(used) > 1:
            return None
        ins.append(None if is_literal(v) else (used.pop() if used else _whole(v)))
    if not _axes_of(ins):
        return None
    flops = [sum(loop_flops(e) for e in b.eqns) for b in branches]
    costly = flops.index(max(flops))
    split = _work_split(branches[costly].eqns, found[costly][1], size)
    comms = max(
        (tuple(c for s in chosen for c in s.comms if c.nbytes) for _, chosen in found),
        key=lambda cs: sum(c.nbytes for c in cs),
    )
    return tuple(ins), tuple(outs), comms, split


def _filler(jaxpr, v) -> bool:
    """Whether ``v`` is a literal or a scalar broadcast in ``jaxpr`` (what a branch
    returns in place of another branch's residuals): any layout of it costs nothing."""
    if is_literal(v):
        return True
    made = next((e for e in jaxpr.eqns if v in e.outvars), None)
    return (
        made is not None
        and made.primitive.name == "broadcast_in_dim"
        and getattr(made.invars[0].aval, "shape", None) == ()
    )
