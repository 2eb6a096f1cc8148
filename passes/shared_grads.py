"""Pass 0f: a shared parameter's gradient as one ``meshshard.grad`` result per layer,
and its copies moved once per step.

A parameter read by several layers (tied input/output embeddings) gets its gradient
from JAX as a sum of contributions, ``add_any(ct_layer3, ct_layer0)``, computed in the
backward of the layer that runs last.  Left as it is, the later layer's contribution
would cross stages once per micro-batch.  This pass cuts that sum at its layer
boundaries: every maximal sub-sum computed inside one layer becomes its own operand of
the ``grad_end`` marker (so each stage accumulates its own contribution over the
micro-batches, in its own ``A{s}``), and the contributions are added right after the
marker, in the update, in the order JAX adds them.  The update placement then moves
the other stages' accumulated sums to the owner once per step (or all-reduces them),
before the parameter's one update.

The result is what JAX computes, up to summation order: ``sum_k a_k + sum_k b_k``
instead of ``sum_k (a_k + b_k)``.

The forward copies of a shared parameter do not change between micro-batches:
:func:`step_copies` names their transfers, which the emitter sends and receives once,
with micro-batch 0, and frees after the consumer's last micro-batch.
"""

from __future__ import annotations

from collections import Counter

from jax import lax

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace
from meshshard.passes.reductions import marker_reductions
from meshshard.passes.slicing import slice_layers
from meshshard.refs import BufferKind, Phase

_ADD = "add_any"


def split_shared_gradients(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with each cross-layer gradient sum split into per-layer ``grad_end``
    operands (unchanged when no gradient sums contributions of several layers)."""
    jaxpr = closed.jaxpr
    g = next((i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)
    if g is None:
        return closed
    layer_of = dict(enumerate(slice_layers(jaxpr).layer))
    splits, dropped = _gradient_sums(jaxpr, g, layer_of)
    if not splits:
        return closed
    return terms_through_grad_end(closed, g, splits, dropped)


def terms_through_grad_end(closed, g: int, splits: dict, dropped: set, source=None, combine=None):
    """``closed`` with each operand ``pos`` of its ``grad_end`` marker (equation ``g``)
    passed through as the terms ``splits[pos]``, each its own operand with the operand's
    reduction, and recombined right after the marker; the equations ``dropped`` (the
    sums the recombination replaces) are left out.

    ``source(t)`` names what passes for term ``t``: ``(variable, tag)``, by default
    ``(t, None)``.  ``combine([(value, tag), ...])`` makes the operand's value from the
    terms' marker outputs, by default their sum in order."""
    info = marker_reductions(closed.jaxpr.eqns[g])
    source = source or (lambda t: (t, None))
    combine = combine or _sum_in_order

    def hook(i, eqn, env, extra) -> bool:
        if i in dropped:
            return True  # a sum: done after the marker instead
        if i != g:
            return False
        operands = [None if k in splits else read_var(env, v) for k, v in enumerate(eqn.invars)]
        reduce, parts_of = list(info), {}
        for pos, terms in splits.items():
            parts = []
            for k, t in enumerate(terms):
                var, tag = source(t)
                at = pos if k == 0 else len(operands)
                if k == 0:
                    operands[pos] = read_var(env, var)
                else:
                    operands.append(read_var(env, var))
                    reduce.append(info[pos])
                parts.append((at, tag))
            parts_of[pos] = parts
        e = eqn.replace(params=dict(eqn.params, reduce=tuple(reduce)))
        outs = bind_eqn(e, operands)
        for pos, parts in parts_of.items():
            outs[pos] = combine([(outs[k], tag) for k, tag in parts])
        for v, x in zip(eqn.outvars, outs, strict=False):
            if not is_dropvar(v):
                env[v] = x
        return True

    return retrace(closed, hook)


def _sum_in_order(parts: list):
    total = parts[0][0]
    for x, _ in parts[1:]:
        total = lax.add(total, x)
    return total


def _gradient_sums(jaxpr, g: int, layer_of: dict) -> tuple[dict, set]:
    """``({grad_end operand position: per-layer terms}, {add equations to drop})``."""
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns[:g]) for v in e.outvars}
    uses = Counter(v for e in eqns for v in e.invars if not is_literal(v))
    uses.update(v for v in jaxpr.outvars if not is_literal(v))
    splits, dropped = {}, set()

    def terms(v) -> tuple[list, set, set] | None:
        """(terms, their layers, add eqns crossing layers) of the sum that makes ``v``."""
        if is_literal(v) or v not in producer:
            return None
        i = producer[v]
        if eqns[i].primitive.name != _ADD or uses[v] != 1:
            return [v], {layer_of[i]}, set()
        parts = [terms(x) for x in eqns[i].invars]
        if any(p is None for p in parts):
            return None
        layers = set().union(*(p[1] for p in parts))
        if layers == {layer_of[i]}:  # a sum inside one layer stays one term
            return [v], layers, set()
        return [t for p in parts for t in p[0]], layers, {i}.union(*(p[2] for p in parts))

    for pos, v in enumerate(eqns[g].invars):
        found = terms(v)
        if found is not None and len(found[1]) > 1:
            splits[pos] = found[0]
            dropped |= found[2]
    return splits, dropped


def step_copies(graph) -> frozenset[int]:
    """Indices of the transfers that copy a state input (a shared parameter) from its
    owner stage to another stage's compute program: the same value every micro-batch."""
    state = {v for g in graph.groups if g.ref.kind is BufferKind.PARAMS for v in g.vars}
    return frozenset(
        k
        for k, e in enumerate(graph.edges)
        if e.var in state
        and e.producer.phase is not Phase.APPLY
        and e.consumer.phase is not Phase.APPLY
    )
