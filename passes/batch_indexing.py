"""Pass 0a'''': find batch data that address the batch's own rows (a graph batch).

A batch leaf whose values are row numbers of the batch (a graph's edge lists, where
``senders`` and ``receivers`` name node rows; a partner index per example) couples the
examples by position.  Micro-batches number their rows from 0, so with
``num_micro_batches > 1`` a gather of ``h[senders]`` reads other rows (or clamps out of
range) and a ``segment_sum`` over ``receivers`` adds into other rows or drops the update:
different numbers with no error.  Such a step is refused before it is planned, naming the
leaf and the line of user code.

Found from the step traced at micro-batch and full-batch shape, paired equation by
equation: a gather or scatter whose operand's indexed dimension changes size with the
batch (it is the batch axis of an activation or of the batch data), with indices computed
from batch leaves and literals alone: the numbers the data hold.  Positions the step
computes from the micro-batch itself are consistent within it and fine: ``iota``
(``logits[jnp.arange(n), labels]`` is per example), an ``argsort`` (it sorts an iota
along), an ``argmax`` or ``top_k`` over the batch.  Indices into a table that does not
grow with the batch (an embedding, a running total) are fine too.
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import is_literal, sub_jaxprs, user_line
from meshshard.passes.reductions import same_program

__all__ = ["batch_row_indexing", "batch_row_indexing_message"]

#: Primitives that address rows of their first operand by the values of their second,
#: and the field of their ``dimension_numbers`` naming the operand dimensions addressed.
_INDEXING = {
    "gather": "start_index_map",
    "scatter": "scatter_dims_to_operand_dims",
    "scatter-add": "scatter_dims_to_operand_dims",
    "scatter_add": "scatter_dims_to_operand_dims",
    "scatter-mul": "scatter_dims_to_operand_dims",
    "scatter_mul": "scatter_dims_to_operand_dims",
    "scatter-min": "scatter_dims_to_operand_dims",
    "scatter_min": "scatter_dims_to_operand_dims",
    "scatter-max": "scatter_dims_to_operand_dims",
    "scatter_max": "scatter_dims_to_operand_dims",
}


#: Primitives whose results are positions or orders computed from the data they read,
#: not numbers the data hold: indices made by them are the micro-batch's own.
_POSITIONS = {
    "argmax",
    "argmin",
    "top_k",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
}


def batch_row_indexing(
    micro: ClosedJaxpr, full: ClosedJaxpr, is_batch, wheres
) -> tuple[tuple[str, str], ...]:
    """``(batch leaf, user line)`` per gather or scatter whose indices, computed from the
    batch leaf ``wheres[i]`` alone, address the rows of a value that grows with the batch;
    none when the two traces do not pair."""
    if not same_program(micro, full):
        return ()
    sources = {
        v: frozenset([i])
        for i, (v, b) in enumerate(zip(micro.jaxpr.invars, is_batch, strict=False))
        if b
    }
    found: dict[tuple[str, str], None] = {}
    _find(micro.jaxpr, full.jaxpr, sources, wheres, found)
    return tuple(found)


def _find(mj, fj, sources: dict, wheres, found: dict) -> None:
    """Add to ``found`` each row-addressing equation of ``mj`` (paired with ``fj``'s);
    ``sources`` maps a value computed from batch leaves and literals alone to those
    leaves, and grows as the walk goes."""
    for em, ef in zip(mj.eqns, fj.eqns, strict=True):
        ins = [v for v in em.invars if not is_literal(v)]
        held = em.primitive.name not in _POSITIONS  # (iota has no inputs: never held)
        if held and ins and all(v in sources for v in ins):  # numbers the batch data hold
            leaves = frozenset().union(*(sources[v] for v in ins))
            sources.update((o, leaves) for o in em.outvars)
        for bm, bf in zip(sub_jaxprs(em), sub_jaxprs(ef), strict=False):
            if len(bm.invars) != len(em.invars) or len(bm.eqns) != len(bf.eqns):
                continue  # not the call's own inputs (a cond's branches), or unpaired
            inner = {
                b: sources[v]
                for v, b in zip(em.invars, bm.invars, strict=True)
                if not is_literal(v) and v in sources
            }
            _find(bm, bf, inner, wheres, found)
            if len(bm.outvars) == len(em.outvars):  # a call: its body says what it holds
                for o, b in zip(em.outvars, bm.outvars, strict=True):
                    if not is_literal(b) and b in inner:
                        sources[o] = inner[b]
                    else:
                        sources.pop(o, None)
        numbers = em.params.get("dimension_numbers")
        dims = getattr(numbers, _INDEXING.get(em.primitive.name, ""), None)
        if dims is not None and len(em.invars) > 1:
            operand, indices = em.invars[0], em.invars[1]
            grown = _grown_dims(operand, ef.invars[0])
            if grown.intersection(dims) and not is_literal(indices) and indices in sources:
                for leaf in sorted(sources[indices]):
                    found[(wheres[leaf], user_line(em))] = None


def _grown_dims(micro_var, full_var) -> set[int]:
    """The dimensions of a value whose size differs between the two traces."""
    a, b = getattr(micro_var.aval, "shape", ()), getattr(full_var.aval, "shape", ())
    if len(a) != len(b):
        return set()
    return {d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y}


def batch_row_indexing_message(found: tuple[tuple[str, str], ...], m: int) -> str:
    """The refusal for :func:`batch_row_indexing`'s findings, with the fixes."""
    where = "; ".join(f"{leaf} at {line}" for leaf, line in found)
    return (
        f"the batch data address the batch's own rows ({where}): num_micro_batches={m} "
        "numbers each micro-batch's rows from 0, so these indices would read and write "
        "other rows and the step would differ from jax.jit on the whole batch; use "
        "num_micro_batches=1 for a batch whose leaves index each other's rows (a graph's "
        "edge lists into its nodes), or give each example its own rows (graphs padded to "
        "a fixed size, nodes of shape (batch, nodes, ...), edges indexing axis 1)"
    )
