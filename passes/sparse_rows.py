"""Pass: embedding gradients of data-parallel replicas moved as their touched rows.

TriRace's *sparse* dimension on a real plan.  A stage's data-parallel replicas
all-reduce their gradient accumulators ``A`` (:mod:`meshshard.passes.replicas`).  An
embedding table's gradient is zero outside the rows the replica's lookups read, so a
replica can send ``(row indices, rows)`` of those rows only, and every member adds them
up in replica order (:mod:`meshshard.runtime.replica_grads`).

Which tensors qualify is read off the traced step, not guessed from shapes: the
per-micro-batch gradient :func:`row_bound` accepts is a ``scatter-add`` of whole rows
into zeros (the transpose of a row ``gather``: ``embed[ids]``, ``jnp.take``,
``nn.Embed``), sums of such, their dtype conversions and their scaling by a scalar.  A
table also read any other way (tied output head, a regulariser in the loss) has a
dense gradient and stays in the all-reduce.  The rows a replica's step touches are at
most the rows its lookups read per micro-batch times the micro-batches it accumulates
(the ``RUN``s writing ``A``), capped at the table's rows: ``max_rows``, the padded size
every member sends.  A tensor moves as rows only where the all-gather of ``max_rows``
rows (and their int32 indices) per member moves fewer bytes than the ring all-reduce of
the dense table (:func:`meshshard.passes.comm_schedule.rows_are_cheaper`).

Pure: :func:`find_sparse_rows` reads a plan and its trace; :func:`with_sparse_rows`
returns the plan with ``sparse_rows`` set and, before each group's first
``COLL allreduce A``, a ``COLL allgather A`` of its rows (every member of the group
issues it at the same point, so the collectives still match).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from meshshard.instructions import Collective, Run, WorkerStream
from meshshard.jaxpr_util import is_literal, is_marker, var_ids
from meshshard.passes.trace import TracedStep
from meshshard.plan import Plan, SparseRows, TensorSpec
from meshshard.refs import BufferKind, BufferRef, CollectiveKind

__all__ = ["find_sparse_rows", "row_bound", "with_sparse_rows"]

_SAME_ROWS = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
_SCALED = frozenset({"mul", "div", "neg"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def row_bound(jaxpr, var: int) -> int | None:
    """How many rows of traced value ``var`` (by :func:`~meshshard.jaxpr_util.var_ids`)
    can be nonzero, or None when it is not provably a sum of whole-row scatters into
    zeros (module docstring)."""
    by_id = {i: v for v, i in var_ids(jaxpr).items()}
    if var not in by_id:
        return None
    return _Scope(jaxpr).rows(by_id[var])


class _Scope:
    """One jaxpr's equations by output, and (inside a call) how its inputs map to the
    caller's operands, so a walk follows a value into and out of ``jit`` calls."""

    def __init__(self, jaxpr, outer: _Scope | None = None, args: dict | None = None):
        self.made = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.outer, self.args = outer, args or {}
        self.memo: dict = {}

    def rows(self, v) -> int | None:
        if is_literal(v):
            return 0 if _is_zero(v.val) else None
        if v in self.args:
            return self.outer.rows(self.args[v])
        if v not in self.memo:
            e = self.made.get(v)
            self.memo[v] = None if e is None else self._eqn(e, e.outvars.index(v))
        return self.memo[v]

    def _eqn(self, e, k: int) -> int | None:
        name = e.primitive.name
        if is_marker(e) and len(e.invars) == len(e.outvars):
            return self.rows(e.invars[k])
        if name in _SAME_ROWS:
            return self.rows(e.invars[0])
        if name == "broadcast_in_dim" and is_literal(e.invars[0]):
            return 0 if _is_zero(e.invars[0].val) else None
        if name in ("add", "add_any"):
            parts = [self.rows(x) for x in e.invars]
            return None if None in parts else sum(parts)
        if name in _SCALED:
            return self._scaled(e)
        if name == "scatter-add":
            return self._scatter(e)
        if name in _CALLS and "jaxpr" in e.params:
            inner = getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"])
            scope = _Scope(inner, self, dict(zip(inner.invars, e.invars, strict=True)))
            return scope.rows(inner.outvars[k])
        return None

    def _scaled(self, e) -> int | None:
        """``x * s``, ``s * x``, ``x / s``, ``-x`` with ``s`` a scalar: the rows of ``x``."""
        if e.primitive.name == "neg":
            return self.rows(e.invars[0])
        x, s = e.invars
        if _is_scalar(s):
            return self.rows(x)
        if e.primitive.name == "mul" and _is_scalar(x):
            return self.rows(s)
        return None

    def _scatter(self, e) -> int | None:
        """A scatter-add of whole rows (dimension 0) into a row-sparse operand."""
        operand, _indices, updates = e.invars
        dn = e.params["dimension_numbers"]
        shape = operand.aval.shape
        if (
            len(shape) < 1
            or tuple(dn.inserted_window_dims) != (0,)
            or tuple(dn.scatter_dims_to_operand_dims) != (0,)
            or getattr(dn, "operand_batching_dims", ())
            or len(dn.update_window_dims) != len(shape) - 1
            or tuple(updates.aval.shape[d] for d in dn.update_window_dims) != tuple(shape[1:])
        ):
            return None
        base = self.rows(operand)
        if base is None:
            return None
        return base + math.prod(updates.aval.shape) // max(math.prod(shape[1:]), 1)


def _is_scalar(v) -> bool:
    return getattr(getattr(v, "aval", None), "shape", None) == ()


def _is_zero(val) -> bool:
    try:
        return bool(np.all(np.asarray(val) == 0))
    except (TypeError, ValueError):
        return False


def rows_are_cheaper(dense_bytes: int, rows_bytes: int, replicas: int) -> bool:
    """True when an all-gather of every member's rows moves fewer bytes per member than a
    ring all-reduce of the dense tensor: ``(p-1) rows < 2 (p-1)/p dense``."""
    p = max(replicas, 1)
    return (p - 1) * rows_bytes < 2 * (p - 1) / p * dense_bytes


def _replica_allreduces(plan: Plan) -> dict[BufferRef, tuple[Collective, WorkerStream]]:
    """Each replicas' accumulator group, with its all-reduce and the stream issuing it."""
    out: dict = {}
    for st in plan.streams:
        for x in st.instructions:
            if (
                isinstance(x, Collective)
                and x.kind is CollectiveKind.ALLREDUCE
                and x.buffer.kind is BufferKind.ACCUMULATORS
            ):
                out.setdefault(x.buffer.group, (x, st))
    return out


def _accumulations(stream: WorkerStream, group: BufferRef) -> int:
    """How many ``RUN``s of ``stream`` add into accumulator group ``group``."""
    return sum(
        1
        for x in stream.instructions
        if isinstance(x, Run) and any(o.group == group for o in x.outputs)
    )


def _candidate(t: TensorSpec) -> bool:
    return (
        len(t.shape) >= 2
        and not t.unreduced
        and np.issubdtype(np.dtype(t.dtype), np.floating)
        and t.shape[0] > 1
    )


def find_sparse_rows(plan: Plan, traced: TracedStep) -> tuple[SparseRows, ...]:
    """The accumulator tensors of ``plan``'s replicas that should move as rows (module
    docstring): provably row-sparse in ``traced``, and cheaper as rows."""
    out = []
    bounds: dict[int, int | None] = {}
    for group, (coll, stream) in sorted(_replica_allreduces(plan).items(), key=lambda g: str(g[0])):
        k = _accumulations(stream, group)
        keys = plan.gathered_tensors(group)
        for i, t in enumerate(plan.buffer(group).tensors):
            if not _candidate(t) or i in keys:
                continue
            if t.var not in bounds:
                bounds[t.var] = row_bound(traced.jaxpr, t.var)
            per_mb = bounds[t.var]
            if per_mb is None:
                continue
            rows = SparseRows(group, i, max(1, min(t.shape[0], per_mb * max(k, 1))))
            if rows_are_cheaper(t.nbytes, rows.payload_nbytes(t), len(coll.group)):
                out.append(rows)
    return tuple(out)


def with_sparse_rows(plan: Plan, rows: Sequence[SparseRows]) -> Plan:
    """``plan`` with ``rows`` recorded and a ``COLL allgather A`` issued just before the
    first ``COLL allreduce A`` of each group that has rows (one that already has it, for
    its max/min accumulators, sends its rows in the same all-gather)."""
    if not rows:
        return plan
    groups = {r.group for r in rows}
    streams = []
    for st in plan.streams:
        ins = []
        done = {
            x.buffer.group
            for x in st.instructions
            if isinstance(x, Collective) and x.kind is CollectiveKind.ALLGATHER
        }
        for x in st.instructions:
            if (
                isinstance(x, Collective)
                and x.kind is CollectiveKind.ALLREDUCE
                and x.buffer.group in groups
                and x.buffer.group not in done
            ):
                done.add(x.buffer.group)
                ins.append(replace(x, kind=CollectiveKind.ALLGATHER, message=0))
            ins.append(x)
        streams.append(WorkerStream(st.worker, tuple(ins)))
    note = f"sparse gradients: {len(rows)} tensor(s) move as touched rows (all-gather)"
    return replace(
        plan, streams=tuple(streams), sparse_rows=tuple(rows), notes=plan.notes + (note,)
    )
