"""Pass 0a': compute per micro-batch the batch metrics a step derives after ``meshshard.grad``.

Flax's examples return the logits as aux and score them after the grad::

    (loss, logits), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])

The update part of a step (after the grad) runs once per step, on the meshes, so it
reads neither the batch nor per-example values of one micro-batch.  This pass moves
such equations in front of the ``grad_end`` marker: those that read the batch, or an
aux value that carries the batch (per-example logits), and read nothing the grad
computes (the gradients, or the update's own values).  Their results that the rest of
the step reads pass through the marker as new aux values, so each is combined over
micro-batches with the reduction the compiler infers for aux values (the accuracy
above: a mean over the batch).  A per-example aux value that only they read is dropped
from the marker.  Equations that read only combined values (``jnp.exp(loss)``) stay in
the update, where they see the full batch's loss.  So do those whose results would
combine no known way over micro-batches and that read no batch leaf
(:func:`kept_after_grad`: a MoCo queue built from aux keys), reading the aux value's
concatenated rows there.
"""

from __future__ import annotations

import enum

import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.pre_grad_values import LABEL as PRE_GRAD
from meshshard.passes.reductions import (
    AFTER_GRAD_LABEL,
    _shape,
    classify,
    full_batch_shape,
    marker_reductions,
    same_program,
)

#: The label of a value this pass passes through the ``grad_end`` marker (``#k`` in order).
LABEL = AFTER_GRAD_LABEL


def batch_aux_positions(micro: ClosedJaxpr, full: ClosedJaxpr) -> frozenset:
    """Positions of the ``grad_end`` marker's aux operands whose shape changes with the
    batch size (per-example values), from the micro-batch and full-batch traces."""
    gm, gf = _marker(micro.jaxpr), _marker(full.jaxpr)
    if gm is None or gf is None or len(gm[1].invars) != len(gf[1].invars):
        return frozenset()
    info = marker_reductions(gm[1])
    return frozenset(
        k
        for k, (a, b) in enumerate(zip(gm[1].invars, gf[1].invars, strict=True))
        if info[k][0].startswith(("aux", PRE_GRAD)) and _shape(a) != _shape(b)
    )


def sink_batch_metrics(
    closed: ClosedJaxpr,
    is_batch,
    batch_aux: frozenset = frozenset(),
    keep: frozenset = frozenset(),
    combined: frozenset = frozenset(),
):
    """``closed`` with the after-grad equations that need the batch (``is_batch`` inputs,
    or the marker's ``batch_aux`` positions) computed before the ``grad_end`` marker;
    not those at the indices ``keep`` (:func:`kept_after_grad`), nor what reads them,
    nor those at ``combined`` (:func:`combined_after_grad`)."""
    jaxpr = closed.jaxpr
    found = _marker(jaxpr)
    if found is None:
        return closed
    g_idx, g = found
    sunk, copies, exported, read_later = _to_sink(
        jaxpr, g_idx, g, is_batch, batch_aux, keep, combined
    )
    if not sunk:
        return closed
    info = marker_reductions(g)
    # a per-example aux value read only by the sunk equations leaves the marker
    keep = [k for k, v in enumerate(g.outvars) if k not in batch_aux or v in read_later]
    labels = tuple((f"{LABEL} #{j}", "", "") for j in range(len(exported)))

    def hook(i, eqn, env, extra) -> bool:
        if i in sunk:
            return True  # evaluated at the marker
        if i != g_idx:
            return False
        before = {v: read_var(env, a) for v, a in zip(g.outvars, g.invars, strict=True)}
        local = dict(env)
        local.update(before)
        for j in sorted(sunk | copies):
            e = jaxpr.eqns[j]
            outs = bind_eqn(e, [read_var(local, v) for v in e.invars])
            for v, o in zip(e.outvars, outs, strict=True):
                if not is_dropvar(v):
                    local[v] = o
        operands = [before[g.outvars[k]] for k in keep] + [local[v] for v in exported]
        reduce = tuple(info[k] for k in keep) + labels
        marker = g.replace(params=dict(g.params, reduce=reduce))
        outs = bind_eqn(marker, operands)
        for k, o in zip(keep, outs[: len(keep)], strict=True):
            if not is_dropvar(g.outvars[k]):
                env[g.outvars[k]] = o
        for v, o in zip(exported, outs[len(keep) :], strict=True):
            env[v] = o
        return True

    return retrace(closed, hook)


def _marker(jaxpr):
    return next(((i, e) for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)


def kept_after_grad(
    micro: ClosedJaxpr, full: ClosedJaxpr, is_batch, batch_aux, m: int, combined=frozenset()
):
    """Indices of after-grad equations that read per-example aux values and are better
    left in the update, where they read the batch's concatenated rows, than computed per
    micro-batch: those whose results combine no known way over micro-batches (a MoCo
    queue, ``jnp.concatenate([keys, queue])[:K]``: its micro-batches' queues neither
    add nor average to the batch's), when neither they nor what reads them reads a batch
    leaf (the update cannot), and when every one of them is the same equation in both
    traces: one whose parameters hold the batch size (``jax.nn.one_hot``'s
    ``broadcast_in_dim`` to ``(rows, 1)``) would not run on the concatenated rows.
    ``combined`` (:func:`combined_after_grad`) stay in the update as they do in the sink.
    Needs the micro-batch and full-batch traces to pair."""
    found = _marker(micro.jaxpr)
    if found is None or not batch_aux or not same_program(micro, full):
        return frozenset()
    jaxpr = micro.jaxpr
    g_idx, g = found
    sunk, _, exported, _ = _to_sink(jaxpr, g_idx, g, is_batch, batch_aux, combined=combined)
    sized = {j for j in sunk if _holds_batch_size(jaxpr.eqns[j], full.jaxpr.eqns[j])}
    producer = {v: j for j in sunk for v in jaxpr.eqns[j].outvars}
    batch_in = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    tainted = set()  # sunk equations that read a batch leaf, themselves or upstream
    for j in sorted(sunk):
        ins = [v for v in jaxpr.eqns[j].invars if not is_literal(v)]
        if any(v in batch_in or producer.get(v) in tainted for v in ins):
            tainted.add(j)
    dep = batch_dependent(jaxpr, list(is_batch), len(jaxpr.eqns))
    keep: set[int] = set()
    for v in exported:
        if classify(micro, full, v, m, dep)[0]:
            continue
        up = _upstream(jaxpr, v, producer)
        chain = {j for j in sunk if any(o in up for o in jaxpr.eqns[j].outvars)}
        chain |= _downstream(jaxpr, chain, sunk)
        if not chain & (tainted | sized):
            keep |= chain
    return frozenset(keep)


def _holds_batch_size(em, ef) -> bool:
    """Whether equation ``em`` of the micro-batch trace differs from its full-batch twin
    ``ef`` in a parameter: a shape or size (``broadcast_in_dim`` to ``(rows, 1)``), or a
    body whose shapes do (``jax.nn.relu``'s ``custom_jvp_call``).  Functions and thunks,
    which each trace makes anew, are not compared."""
    return any(_comparable(a) != _comparable(ef.params.get(k)) for k, a in em.params.items())


def _comparable(value):
    """A parameter as data: jaxprs as their text, numbers, strings, dtypes and enums as
    themselves, tuples item by item, any other object (a function, an array) as None."""
    if isinstance(value, tuple | list):
        return tuple(_comparable(v) for v in value)
    if hasattr(value, "eqns") or hasattr(value, "jaxpr"):  # Jaxpr, ClosedJaxpr
        return str(value)
    if value is None or isinstance(value, int | float | str | np.dtype | enum.Enum):
        return value
    return None


#: How a batch reduction read after the grad combines exactly over micro-batches.
EXACT = frozenset({"sum", "mean", "max", "min"})


def combined_after_grad(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch, batch_aux, m: int):
    """Indices of after-grad equations whose batch-carrying operands are all reductions
    over the batch that combine exactly over micro-batches (:data:`EXACT`, as the
    compiler infers for aux values): a running confusion matrix ``cm +
    jnp.zeros((C, C)).at[y, pred].add(1)``, per-class totals ``seen + one_hot(pred).sum(0)``.
    Like :func:`_reads_reduced_only`'s scalars, they stay in the update and read the
    combined reductions, which are the full batch's; computed per micro-batch, ``cm +
    part`` summed over micro-batches counted ``cm`` M times.  An array that only looks
    reduced (a queue ``concatenate([keys, queue])[:K]`` mixes per-example rows) is
    not classified exact, and stays with the old rule.  Needs the two traces to pair."""
    found = _marker(micro.jaxpr)
    if found is None or not same_program(micro, full):
        return frozenset()
    jaxpr = micro.jaxpr
    g_idx, g = found
    sunk, _, _, _ = _to_sink(jaxpr, g_idx, g, is_batch, batch_aux)
    made = {v for j in sunk for v in jaxpr.eqns[j].outvars}
    batch_in = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    seeds = batch_in | {g.outvars[k] for k in batch_aux}
    dep = batch_dependent(jaxpr, list(is_batch), len(jaxpr.eqns))
    memo: dict = {}

    def exact(v) -> bool:
        if v not in memo:
            kind = ""
            if full_batch_shape(micro, full, v) == _shape(v):
                kind = classify(micro, full, v, m, dep)[0]
            memo[v] = kind in EXACT
        return memo[v]

    carrying = made | seeds
    out = set()
    for j in sorted(sunk):
        carried = [v for v in jaxpr.eqns[j].invars if not is_literal(v) and v in carrying]
        arrays = [v for v in carried if _shape(v)]
        if arrays and not any(v in seeds for v in carried) and all(map(exact, arrays)):
            out.add(j)
    return frozenset(out)


def _upstream(jaxpr, v, producer: dict) -> set:
    """``v`` and the values of the equations in ``producer`` it is computed from."""
    seen, stack = set(), [v]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in producer:
            stack += [a for a in jaxpr.eqns[producer[x]].invars if not is_literal(a)]
    return seen


def _downstream(jaxpr, chain: set, sunk: set) -> set:
    """The equations of ``sunk`` that read, transitively, what ``chain`` computes."""
    made = {v for j in chain for v in jaxpr.eqns[j].outvars}
    out = set()
    for j in sorted(sunk):
        if j not in chain and any(not is_literal(a) and a in made for a in jaxpr.eqns[j].invars):
            out.add(j)
            made.update(jaxpr.eqns[j].outvars)
    return out


def _to_sink(
    jaxpr,
    g_idx: int,
    g,
    is_batch,
    batch_aux,
    keep: frozenset = frozenset(),
    combined: frozenset = frozenset(),
) -> tuple[set, set, list, set]:
    """The after-grad equation indices to move before the marker (those that carry the
    batch), those to compute there too (what they read that does not: a learning rate
    from the step count, ``exp(loss)``; these also stay after it, on the combined
    values), the moved ones' results read by what stays after it (in order), and
    everything what stays after it reads (:func:`_read_after`)."""
    info = marker_reductions(g)
    batch_in = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    seeds = batch_in | {g.outvars[k] for k in batch_aux}
    # what exists before the marker: inputs, constants, earlier results, loss and aux
    ready = set(jaxpr.invars) | set(jaxpr.constvars)
    ready |= {v for e in jaxpr.eqns[:g_idx] for v in e.outvars}
    ready |= {v for k, v in enumerate(g.outvars) if info[k][0] != "grad"}
    carries, sunk, producer = set(seeds), set(), {}
    for j in range(g_idx + 1, len(jaxpr.eqns)):
        e = jaxpr.eqns[j]
        ins = [v for v in e.invars if not is_literal(v)]
        if not all(v in ready for v in ins):
            continue  # reads what the grad or the update computes
        if j in keep or is_marker(e) or e.primitive.name in ("random_bits", "random_wrap"):
            continue
        outs = [v for v in e.outvars if not is_dropvar(v)]
        ready.update(outs)
        producer.update((v, j) for v in outs)
        reduced = j in combined or _reads_reduced_only(e, carries)
        if any(v in carries for v in ins) and not reduced:
            sunk.add(j)
            carries.update(outs)
    copies: set[int] = set()
    stack = [v for j in sunk for v in jaxpr.eqns[j].invars if not is_literal(v)]
    while stack:  # what they read that is computed after the grad without the batch
        j = producer.get(stack.pop())
        if j is not None and j not in sunk and j not in copies:
            copies.add(j)
            stack += [v for v in jaxpr.eqns[j].invars if not is_literal(v)]
    made = {v for j in sunk for v in jaxpr.eqns[j].outvars}
    later = _read_after(jaxpr, g_idx, sunk)
    exported = [v for j in sorted(sunk) for v in jaxpr.eqns[j].outvars if v in made & later]
    return sunk, copies, exported, later


def _reads_reduced_only(e, carries: set) -> bool:
    """Whether every batch-carrying operand of ``e`` is a scalar, so already reduced over
    the batch: ``total + right.sum()``, ``2 * tp / (2 * tp + fp + fn)``, ``mean(x ** 2) -
    mean(x) ** 2``.  Such an equation stays in the update and reads the operands
    combined over micro-batches, which are the full batch's: only the reductions run per
    micro-batch.  (Computed per micro-batch, ``total + part`` summed over micro-batches
    counted the total M times, and a ratio of sums combined no known way.)  Arrays take
    :func:`combined_after_grad`, which needs both traces to tell a batch reduction from
    an array that still carries examples (a queue of per-example keys)."""
    carried = [v for v in e.invars if not is_literal(v) and v in carries]
    return bool(carried) and all(not _shape(v) for v in carried)


def _read_after(jaxpr, g_idx: int, sunk: set) -> set:
    """Values read by the after-grad equations not in ``sunk``, or returned."""
    read = {
        v
        for j in range(g_idx + 1, len(jaxpr.eqns))
        if j not in sunk
        for v in jaxpr.eqns[j].invars
        if not is_literal(v)
    }
    return read | {v for v in jaxpr.outvars if not is_literal(v)}
