"""Pass 0a'': take the statistics a step computes from its batch data over the full batch.

A step may reduce its batch *data* (no parameter involved) to a value it then uses on
every example: a masked mean divides by the number of unmasked tokens::

    jnp.sum(loss * mask) / jnp.maximum(jnp.sum(mask), 1)

and per-example weights are normalized by their total, inputs centred on the batch's
mean.  Run per micro-batch, each micro-batch would use its own count or mean: its
examples weigh other than in the full batch (micro-batches hold different numbers of
tokens), and no combination of the micro-batches' masked means gives the batch's.

Such a value depends on the batch alone, so the driver can compute it from the whole
batch before any micro-batch runs.  This pass finds them: values computed only from
batch inputs and constants (through boundary markers, per position), without the batch
as a dimension, that an equation computing anything else reads (a division by the
count, in the forward pass and in its backward).  Each becomes a new input of the step,
after the user's leaves: the driver evaluates the full-batch trace's own equations for
it on every call (:class:`Statistics`), and every micro-batch reads the same value.
Each micro-batch then computes exactly the per-example values of the full-batch step,
and the masked mean above becomes ``sum(loss_i * mask_i) / C`` with ``C`` the batch's
count: a sum over micro-batches, which the reductions pass infers, exact in the
backward pass too (its cotangents are the full batch's).

A value whose reduction the user declared (``loss_reduce``, ``aux_reduce``,
``meshshard.aux_mean``...) keeps its per-micro-batch statistics: a declared mean of
masked means is the equal-weight average the user asked for.  Steps whose two traces do
not pair equation by equation, and one micro-batch, are left as they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from meshshard._compat import ClosedJaxpr, jaxpr_as_fun
from meshshard.jaxpr_util import (
    aval_size,
    bind_eqn,
    eval_eqns,
    is_dropvar,
    is_literal,
    is_marker,
    read_var,
    retrace,
    sub_jaxprs,
)
from meshshard.metrics import aux_reduce_p
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import _shape, _slice, marker_reductions, paired_prefix

#: The path of a statistic's input leaf in the plan (``{k}``: its position among them).
PATH = "<full-batch statistic {k}>"
#: Markers that end the per-micro-batch part: their results are combined values.
_COMBINING = ("grad_end", "out")
#: Markers a statistic passes through (the identity per position): layer boundaries,
#: not the loss and its backward seed, which the compiler rewrites.
_CARRYING = ("mark", "fwd", "bwd")


@dataclass(frozen=True)
class Statistics:
    """The driver's program for a step's full-batch statistics: ``closed`` maps the
    user's input leaves at ``leaves`` (positions among the flattened arguments, all
    batch leaves) to one value per statistic input, in order."""

    closed: ClosedJaxpr
    leaves: tuple[int, ...]

    def __str__(self) -> str:
        outs = ", ".join(f"{v.aval.str_short()}" for v in self.closed.jaxpr.outvars)
        return f"Statistics(leaves {list(self.leaves)} -> {outs})"

    def __call__(self, flat_leaves) -> list[np.ndarray]:
        """The statistics of one call's full batch (``flat_leaves``: every user leaf)."""
        args = [np.asarray(flat_leaves[i]) for i in self.leaves]
        return [np.asarray(x) for x in self._run(*args)]

    @functools.cached_property
    def _run(self):
        return jax.jit(jaxpr_as_fun(self.closed))


@dataclass(frozen=True)
class _Found:
    """Where the statistics are: ``(equation, output)`` positions of the values to
    replace, the new input each reads (one per distinct statistic: ``jnp.sum(mask)``
    written twice is one input), and the equations left computing nothing anyone reads
    once they are replaced."""

    positions: tuple[tuple[int, int], ...]
    inputs: tuple[int, ...]
    dead: frozenset[int]

    def __bool__(self) -> bool:
        return bool(self.positions)

    def first_positions(self) -> list[tuple[int, int]]:
        """One position per new input, in input order."""
        first: dict = {}
        for pos, n in zip(self.positions, self.inputs, strict=True):
            first.setdefault(n, pos)
        return [first[n] for n in sorted(first)]


def find_statistics(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch) -> _Found:
    """The full-batch statistics of a step traced at micro-batch and full-batch shape
    (``is_batch``: per input of ``micro``, whether it is a batch leaf), among the
    equations the two traces pair: all of them, or those before the first that differs
    (one-row micro-batches: JAX traces the transposes of size-1 broadcasts as other
    equations, in the backward, while a masked mean's token count is in the forward)."""
    none = _Found((), (), frozenset())
    if full is None:
        return none
    mj, fj = micro.jaxpr, full.jaxpr
    paired = paired_prefix(mj, fj)
    data = data_only(mj, is_batch)
    dep = batch_dependent(mj, is_batch, len(mj.eqns))
    where = {v: (i, k) for i, e in enumerate(mj.eqns) for k, v in enumerate(e.outvars)}

    def statistic(v) -> bool:
        if is_literal(v) or v not in data or v not in dep or v not in where:
            return False
        i, k = where[v]
        return i < paired and _shape(v) == _shape(fj.eqns[i].outvars[k])

    if _recomputed_inside(mj, data & dep):
        return none
    declared = declared_slices(mj)
    found = []
    for e in mj.eqns:
        if is_marker(e) or (_pure(e) and all(statistic(o) for o in _outs(e))):
            continue  # carries the statistic on, or is part of computing a larger one
        for v in e.invars:
            if statistic(v) and v not in declared and where[v] not in found:
                found.append(where[v])
    for v in mj.outvars:  # a statistic the step returns: the full batch's, as with jit
        if statistic(v) and where[v] not in found:
            found.append(where[v])
    if not found:
        return none
    key = _structure(mj)
    distinct: dict = {}
    inputs = tuple(distinct.setdefault(key(mj.eqns[i].outvars[k]), len(distinct)) for i, k in found)
    replaced = {mj.eqns[i].outvars[k] for i, k in found}
    return _Found(tuple(found), inputs, _dead(mj, replaced, data))


def _structure(jaxpr):
    """``key(var)``: equal for two vars the same equations compute from the same inputs."""
    producer = {v: (e, k) for e in jaxpr.eqns for k, v in enumerate(e.outvars)}
    memo: dict = {}

    def key(v):
        if is_literal(v):
            return ("literal", str(v.aval), np.asarray(v.val).tobytes())
        if v not in producer:
            return ("input", id(v))
        if v not in memo:
            e, k = producer[v]
            params = tuple(sorted((n, str(p)) for n, p in e.params.items()))
            memo[v] = (e.primitive.name, params, k, tuple(key(a) for a in e.invars))
        return memo[v]

    return key


def _recomputed_inside(jaxpr, batch_data: set) -> bool:
    """Whether an equation holding a sub-jaxpr (a user's ``jax.checkpoint`` layer, a
    custom derivative, a scan) reduces batch data inside it: a statistic computed there,
    and again where its backward recomputes it, would stay the micro-batch's while the
    same statistic outside became the full batch's.  No statistic is taken over the full
    batch then (the step keeps its per-micro-batch statistics, as before)."""
    for e in jaxpr.eqns:
        reads = [not is_literal(v) and v in batch_data for v in e.invars]
        if is_marker(e) or not any(reads):
            continue
        for body in sub_jaxprs(e):
            if len(body.invars) == len(e.invars):
                inner = {v for v, r in zip(body.invars, reads, strict=True) if r}
            else:  # operands laid out otherwise (cond, while): assume any may be data
                inner = set(body.invars)
            if _reduces(body, inner):
                return True
    return False


def _reduces(jaxpr, data: set) -> bool:
    """Whether ``jaxpr`` computes, from ``data`` vars (and constants) alone, a value
    smaller than what it is computed from (a reduction), at any depth."""
    data = set(data)
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not is_literal(v)]
        if not ins or not all(v in data for v in ins):
            continue
        biggest = max(aval_size(v.aval) for v in ins)
        if any(aval_size(o.aval) < biggest for o in _outs(e)) or any(
            _reduces(b, set(b.invars)) for b in sub_jaxprs(e)
        ):
            return True
        data.update(_outs(e))
    return False


def _outs(e) -> list:
    return [o for o in e.outvars if not is_dropvar(o)]


def _pure(e) -> bool:
    return not e.effects and not is_marker(e)


def data_only(jaxpr, is_batch) -> set:
    """Vars computed from batch inputs, constants and literals alone (per position
    through layer boundaries)."""
    data = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    data.update(jaxpr.constvars)
    for e in jaxpr.eqns:
        if is_marker(e, *_CARRYING):
            pairs = zip(e.invars, e.outvars, strict=True)
            data.update(o for a, o in pairs if is_literal(a) or a in data)
        elif _pure(e) and all(is_literal(v) or v in data for v in e.invars):
            data.update(_outs(e))
    return data


def declared_slices(jaxpr) -> set:
    """Every var some value with a declared reduction is computed from."""
    roots = [e.invars[0] for e in jaxpr.eqns if e.primitive is aux_reduce_p]
    for e in jaxpr.eqns:
        if is_marker(e, *_COMBINING):
            info = marker_reductions(e) if e.params["kind"] == "grad_end" else ()
            roots += [v for (_, red, _), v in zip(info, e.invars, strict=False) if red]
    out: set = set()
    for root in roots:
        out.add(root)
        for _, e in _slice(jaxpr, root):
            out.update(v for v in e.invars if not is_literal(v))
    return out


def _dead(jaxpr, replaced: set, data: set) -> frozenset[int]:
    """Equations no one reads once the ``replaced`` vars are inputs: those computing
    ``data`` values (:func:`data_only`) that only the statistics' own computation read."""
    live = {v for v in jaxpr.outvars if not is_literal(v) and v not in replaced}
    dead = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        outs = _outs(e)
        if _pure(e) and outs and all(o in data and o not in live for o in outs):
            dead.add(i)
            continue
        live.update(v for v in e.invars if not is_literal(v) and v not in replaced)
    return frozenset(dead)


def hoist_statistics(closed: ClosedJaxpr, found: _Found) -> ClosedJaxpr:
    """``closed`` reading each statistic from a new input (after its own inputs) instead
    of computing it, and without the equations that computed only those."""
    if not found.positions:
        return closed
    eqns = closed.jaxpr.eqns
    replaced = {
        eqns[i].outvars[k]: n for (i, k), n in zip(found.positions, found.inputs, strict=True)
    }
    firsts = [eqns[i].outvars[k] for i, k in found.first_positions()]
    extra_avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in firsts
    ]

    def hook(i, eqn, env, extra) -> bool:
        if is_marker(eqn, "grad_end"):
            return _bypass_inputs(eqn, env, extra)
        dead = i in found.dead
        if not dead and not any(v in replaced for v in eqn.outvars):
            return False
        if dead:  # what it computed is replaced or read by no one: not computed
            outs = [None] * len(eqn.outvars)
        else:
            outs = bind_eqn(eqn, [read_var(env, v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs, strict=True):
            if v in replaced:  # every reader (the step's results too) reads the input
                env[v] = extra[replaced[v]]
            elif not is_dropvar(v) and o is not None:
                env[v] = o
        return True

    return retrace(closed, hook, extra_avals)


def _bypass_inputs(marker, env: dict, inputs) -> bool:
    """Bind the ``grad_end`` marker without the operands that are now statistic
    ``inputs`` (a token count computed after the grad, passed through the marker as a
    batch metric): those outputs read the input itself, as the update may.  False (the
    marker bound as is) when it carries none."""
    vals = [read_var(env, v) for v in marker.invars]
    ids = {id(x) for x in inputs}
    keep = [k for k, x in enumerate(vals) if id(x) not in ids]
    if len(keep) == len(vals):
        return False
    info = marker_reductions(marker)
    narrow = marker.replace(params=dict(marker.params, reduce=tuple(info[k] for k in keep)))
    outs = dict(zip(keep, bind_eqn(narrow, [vals[k] for k in keep]), strict=True))
    for k, v in enumerate(marker.outvars):
        if not is_dropvar(v):
            env[v] = outs.get(k, vals[k])
    return True


def statistics_program(full: ClosedJaxpr, found: _Found, is_batch) -> Statistics | None:
    """The driver's program computing ``found``'s statistics from the full batch: the
    full-batch trace's own equations for them (None when there are none)."""
    if not found.positions:
        return None
    fj = full.jaxpr
    targets = [fj.eqns[i].outvars[k] for i, k in found.first_positions()]
    needed = sorted({i for t in targets for i, _ in _slice(fj, t)})
    reads = {v for i in needed for v in fj.eqns[i].invars if not is_literal(v)}
    leaves = tuple(
        n for n, (v, b) in enumerate(zip(fj.invars, is_batch, strict=True)) if b and v in reads
    )

    def run(*args):
        env = dict(zip(fj.constvars, full.consts, strict=True))
        env.update(zip((fj.invars[n] for n in leaves), args, strict=True))

        def markers_pass(i, e, env) -> bool:  # the identity per position
            if not is_marker(e):
                return False
            for a, o in zip(e.invars, e.outvars, strict=True):
                if not is_dropvar(o) and (is_literal(a) or a in env):
                    env[o] = read_var(env, a)
            return True

        eval_eqns([fj.eqns[i] for i in needed], env, on_eqn=markers_pass)
        return [env[t] for t in targets]

    avals = [jax.ShapeDtypeStruct(fj.invars[n].aval.shape, fj.invars[n].aval.dtype) for n in leaves]
    return Statistics(jax.make_jaxpr(run)(*avals), leaves)
