"""A check at trace time: find where a step relies on rows' positions in the whole batch.

Three ways, all refused with ``num_micro_batches > 1``: batch data that address the
batch's own rows (a graph batch), random keys made from row numbers, and rows flipped,
shifted or cut by position (:mod:`~meshshard.passes.batch_order`).

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

A random key per example made from its row number (``jax.random.fold_in(key, i)`` under
``jax.vmap`` over ``jnp.arange(n)``) is the other: every micro-batch would number its
rows from 0 and draw the first rows' numbers.  Found as a ``random_fold_in`` (or
``random_seed``) whose keys grow with the batch from numbers that depend on no batch
leaf.  ``jax.random.split(key, n)`` is fine (:mod:`~meshshard.passes.random_draws`
slices the full batch's keys), and so is folding in an example id the batch carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import is_literal, paired_bodies, user_line
from meshshard.passes.batch_order import grown_dims, reordered_rows
from meshshard.passes.reductions import same_program

__all__ = ["BatchPositions", "batch_positions"]

#: Primitives that address rows of their first operand by the values of their second,
#: and the field of their ``dimension_numbers`` naming the operand dimensions addressed.
_INDEXING = {"gather": "start_index_map"} | {
    name: "scatter_dims_to_operand_dims"
    for name in ("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max")
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


#: Primitives that make random keys from numbers, and the operand holding the numbers.
_KEYS_FROM_NUMBERS = {"random_fold_in": 1, "random_seed": 0}


@dataclass(frozen=True)
class BatchPositions:
    """What :func:`batch_positions` found: ``rows``, ``(batch leaf, user line)`` per
    gather or scatter addressing the batch's rows by numbers that leaf holds; ``keys``,
    the user lines that make one random key per row from the row's position."""

    rows: tuple[tuple[str, str], ...] = ()
    keys: tuple[str, ...] = ()
    order: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rows or self.keys or self.order)

    def message(self, m: int) -> str:
        """The refusal, with the fixes."""
        parts = []
        if self.rows:
            where = "; ".join(f"{leaf} at {line}" for leaf, line in self.rows)
            parts.append(
                f"the batch data address the batch's own rows ({where}): "
                f"num_micro_batches={m} numbers each micro-batch's rows from 0, so these "
                "indices would read and write other rows and the step would differ from "
                "jax.jit on the whole batch; a table indexed by the batch's values (class "
                "weights looked up by label, with as many rows as the batch by chance) "
                "belongs in a non-batch argument; use num_micro_batches=1 for a batch whose "
                "leaves index each other's rows (a graph's edge lists into its nodes), or "
                "give each example its own rows (graphs padded to a fixed size, nodes of "
                "shape (batch, nodes, ...), edges indexing axis 1)"
            )
        if self.keys:
            parts.append(
                f"the step makes a random key per example from its row number "
                f"({'; '.join(self.keys)}, e.g. jax.random.fold_in(key, i) over "
                f"jnp.arange(batch)): num_micro_batches={m} numbers each micro-batch's rows "
                "from 0, so every micro-batch would draw the first rows' numbers; use "
                "jax.random.split(key, batch) (each micro-batch gets its slice of the "
                "full batch's keys), fold in an example id carried in the batch, or use "
                "num_micro_batches=1"
            )
        if self.order:
            parts.append(
                f"the step pairs or picks examples by their position in the batch "
                f"({'; '.join(self.order)}: a flip x[::-1] or jnp.roll along the batch, as "
                "a mixup partner; h[1:] - h[:-1]; a cut such as h[: n // 2] or "
                f"jnp.split(h, k)): num_micro_batches={m} would flip, shift or cut each "
                "micro-batch's own rows, other examples than jax.jit's; mix or cut the "
                "batch before the step (in the input pipeline), let num_micro_batches cut "
                "it instead of the step, or use num_micro_batches=1"
            )
        return "; and ".join(parts)


def batch_positions(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch, wheres) -> BatchPositions:
    """The ways ``micro`` (the step at micro-batch shape, paired with ``full``'s) relies on
    rows' positions in the whole batch; nothing when the two traces do not pair."""
    if not same_program(micro, full):
        return BatchPositions()
    invars = micro.jaxpr.invars
    walk = _Walk(
        sources={v: frozenset([i]) for i, v in enumerate(invars) if _flag(is_batch, i)},
        dep={v for i, v in enumerate(invars) if _flag(is_batch, i)},
    )
    walk.run(micro.jaxpr, full.jaxpr, wheres)
    order = reordered_rows(micro, full, is_batch)
    return BatchPositions(tuple(walk.rows), tuple(walk.keys), order)


def _flag(is_batch, i: int) -> bool:
    return i < len(is_batch) and bool(is_batch[i])


@dataclass
class _Walk:
    """One walk over a step's equations: ``sources`` maps a value computed from batch
    leaves and literals alone to those leaves; ``dep`` holds the values that depend on
    the batch at all; ``rows`` and ``keys`` collect the findings."""

    sources: dict
    dep: set
    rows: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)

    def run(self, mj, fj, wheres) -> None:
        for em, ef in zip(mj.eqns, fj.eqns, strict=True):
            ins = [v for v in em.invars if not is_literal(v)]
            held = em.primitive.name not in _POSITIONS  # (iota has no inputs: never held)
            if held and ins and all(v in self.sources for v in ins):  # numbers the data hold
                leaves = frozenset().union(*(self.sources[v] for v in ins))
                self.sources.update((o, leaves) for o in em.outvars)
            if any(v in self.dep for v in ins):
                self.dep.update(em.outvars)
            for bm, bf in paired_bodies(em, ef):
                self._enter(em, bm, bf, wheres)
            self._check(em, ef, wheres)

    def _enter(self, em, bm, bf, wheres) -> None:
        """Walk the body ``bm`` of a call, a checkpoint or a scan with its operands' facts;
        a call's results hold what its body's do."""
        pairs = [(v, b) for v, b in zip(em.invars, bm.invars, strict=True) if not is_literal(v)]
        outer = self.sources
        self.sources = {b: outer[v] for v, b in pairs if v in outer}
        self.dep.update(b for v, b in pairs if v in self.dep)
        try:
            self.run(bm, bf, wheres)
            inner = self.sources
        finally:
            self.sources = outer
        if len(bm.outvars) == len(em.outvars):
            for o, b in zip(em.outvars, bm.outvars, strict=True):
                if not is_literal(b) and b in inner:
                    outer[o] = inner[b]
                else:
                    outer.pop(o, None)

    def _check(self, em, ef, wheres) -> None:
        name = em.primitive.name
        numbers = em.params.get("dimension_numbers")
        dims = getattr(numbers, _INDEXING.get(name, ""), None)
        if dims is not None and len(em.invars) > 1:
            operand, indices = em.invars[0], em.invars[1]
            grown = grown_dims(operand, ef.invars[0])
            if grown.intersection(dims) and not is_literal(indices) and indices in self.sources:
                for leaf in sorted(self.sources[indices]):
                    self.rows[(wheres[leaf], user_line(em))] = None
        if name in _KEYS_FROM_NUMBERS and em.outvars:
            numbers_in = em.invars[_KEYS_FROM_NUMBERS[name]]
            grown = grown_dims(em.outvars[0], ef.outvars[0])
            if grown and not is_literal(numbers_in) and numbers_in not in self.dep:
                self.keys[user_line(em)] = None
