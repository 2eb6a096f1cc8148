"""Run time of the replicas' gradient exchange (``COLL allreduce A{s} #c [group]``).

A stage's data-parallel replicas (:mod:`meshshard.passes.replicas`) each hold the
stage's accumulator group ``A`` (a tuple of arrays).  The plan all-reduces it in the
chunks its ``COLL``s number (``#0 .. #n-1``; communication scheduling cuts a large
group into several so that higher-priority traffic passes between them): the first
chunk to run reads the arrays off the devices into one flat host vector, each chunk
sums one contiguous slice of it (:func:`numpy.array_split` into ``n``) over the group,
and ``WAIT A`` puts the sums back into arrays of the group's shapes and shardings.  An
accumulator a multi-device mesh holds as per-device partial sums (stored ``(n, *shape)``,
:meth:`~meshshard.plan.TensorSpec.stored`) enters the vector summed to its traced shape,
so the group moves the bytes the plan prices, and comes back as partial 0 of zeros.

Tensors the plan moves as touched rows (``plan.sparse_rows``, an embedding table's
gradient; :mod:`meshshard.passes.sparse_rows`) stay out of the flat vector: a
``COLL allgather A{s}`` before the chunks sends each member's rows in one fixed-size
payload (:func:`~meshshard.sparse_grads.pack_rows`), and ``WAIT A`` adds them up in
member order in the dtype the transport's all-reduce sums in
(:func:`~meshshard.sparse_grads.sum_rows`), so they equal the dense sum bit for bit.
Max- and min-reduced accumulators (``plan.gathered``: ``aux_max`` / ``aux_min``) and
per-example values concatenated over micro-batches stay out of it too, since a sum of
them is wrong: their bytes ride in the same all-gather and ``WAIT A`` takes the maximum
of the members' order keys (:func:`_max_keys`) or the members' rows in order
(:func:`_rows_in_order`).  A value that does not depend on the batch (``same``) is kept
as each member holds it.

Every member flattens the same tensors in the same order and issues the collectives on
one channel per group (:func:`grads_channel`), in stream order, so the operations match;
the transports reduce in a fixed order, so every replica gets the same bits.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from meshshard.instructions import Collective, WorkerStream
from meshshard.refs import BufferKind, BufferRef, CollectiveKind
from meshshard.sparse_grads import pack_rows, sum_rows, unpack_rows

__all__ = [
    "chunk_counts",
    "grads_channel",
    "grads_groups",
    "issue_chunk",
    "issue_gather",
    "wait_grads",
]


def is_replica_allreduce(ins) -> bool:
    """True for a gradient all-reduce of the replicas (not a cross-mesh reduction)."""
    return (
        isinstance(ins, Collective)
        and ins.kind is CollectiveKind.ALLREDUCE
        and ins.buffer.kind is BufferKind.ACCUMULATORS
    )


def chunk_counts(stream: WorkerStream) -> dict[BufferRef, int]:
    """Chunks per accumulator group: how many ``COLL allreduce`` the stream has for it."""
    return dict(Counter(x.buffer for x in stream.instructions if is_replica_allreduce(x)))


def grads_channel(group: tuple[int, ...]) -> str:
    """The channel of the gradient all-reduces over ``group``."""
    return "grads:" + ",".join(map(str, sorted(group)))


def grads_groups(streams) -> dict[str, tuple[int, ...]]:
    """Every gradient channel the streams use (for transports that create groups)."""
    return {
        grads_channel(x.group): tuple(sorted(x.group))
        for s in streams
        for x in s.instructions
        if is_replica_allreduce(x)
    }


def _wire_dtype(tensors) -> np.dtype:
    """One dtype for the flat vector: the tensors' own when they agree, else float64
    (exact for the float32/int32 sums of two replicas)."""
    dtypes = {np.dtype(t.dtype) for t in tensors}
    if not dtypes:
        return np.dtype(np.float32)  # every tensor moves as rows: an empty vector
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64)


def _whole(array, t) -> np.ndarray:
    """Accumulator ``t``'s value on the host with its traced shape: an accumulator held
    as per-device partial sums (``t.unreduced``, stored ``(n, *t.shape)``) is summed over
    its leading axis here, so the replicas exchange ``t.nbytes``, what the plan prices."""
    x = np.asarray(array)
    return x.sum(axis=0, dtype=x.dtype) if t.unreduced else x


def _stored(x: np.ndarray, t, axis_size) -> tuple[np.ndarray, tuple]:
    """(host array, spec) of whole value ``x`` in ``t``'s stored form: for a partial-sum
    accumulator ``x`` is partial 0 and the others are zeros (the update adds them up, as
    :func:`~meshshard.program_fn.program_function` adds a whole contribution once)."""
    shape, spec = t.stored(axis_size)
    if not t.unreduced:
        return x, spec
    full = np.zeros(shape, x.dtype)
    full[0] = x
    return full, spec


def _flatten(arrays, tensors, dtype) -> np.ndarray:
    parts = [
        np.asarray(_whole(a, t), dtype=dtype).reshape(-1)
        for a, t in zip(arrays, tensors, strict=True)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class _Pending:
    """One accumulator group's exchange in flight on this worker: the arrays, the flat
    vector of its dense tensors (made lazily), the positions that move as rows
    (:class:`~meshshard.plan.SparseRows`) or whole, not summed
    (:class:`~meshshard.plan.GatheredAccumulator`) and the handles issued so far."""

    def __init__(self, value, lazy_flat, n: int, sparse: dict, keys: dict):
        self.value = value
        self.flat = lazy_flat
        self.n = n
        self.sparse = sparse
        self.keys = keys
        self.handles: list = []
        self.gather = None  # (handle, key) of the all-gather of the rows and keys


def _pending(step, name: BufferRef) -> _Pending:
    """The exchange of ``name`` on this worker, begun by whichever of its collectives
    runs first (it takes the arrays out of the step's buffers)."""
    from meshshard.runtime.overlap import Lazy

    pend = step.grads.get(name)
    if pend is None:
        interp = step.interp
        value = step.value(name)
        del step.buffers[name]
        sparse = interp.plan.sparse_tensors(name)
        keys = interp.plan.gathered_tensors(name)
        tensors = interp._buffers_spec[name.group].tensors
        dense = [k for k in range(len(tensors)) if k not in sparse and k not in keys]
        dtype = _wire_dtype([tensors[k] for k in dense])
        lazy = Lazy(lambda: _flatten([value[k] for k in dense], [tensors[k] for k in dense], dtype))
        pend = _Pending(value, lazy, interp.grad_chunks.get(name, 0), sparse, keys)
        step.grads[name] = pend
    return pend


def issue_chunk(step, i: int, ins: Collective) -> None:
    """Issue chunk ``ins.message`` of the all-reduce of ``ins.buffer`` (see module doc)."""
    interp = step.interp
    name = ins.buffer
    pend = _pending(step, name)
    chan = grads_channel(ins.group)
    c, n = ins.message, pend.n
    key = (str(name), None, c)

    def fn():
        part = np.array_split(pend.flat.get(), n)[c]
        step.stamp("sent", key)
        return interp.transport.iallreduce(part, "sum", ins.group, chan)

    pend.handles.append((c, step.issue(i, ins.priority, fn, chan, ins.group), key))


def issue_gather(step, i: int, ins: Collective) -> None:
    """Issue the all-gather of ``ins.buffer``'s sparse tensors' touched rows and its
    max/min/concat accumulators' bytes: one fixed-size byte payload per member (each
    sparse tensor's :func:`~meshshard.sparse_grads.pack_rows`, then each key tensor's
    bytes, in position order)."""
    interp = step.interp
    name = ins.buffer
    pend = _pending(step, name)
    chan = grads_channel(ins.group)
    key = (f"{name}:rows", None, 0)
    tensors = interp._buffers_spec[name.group].tensors

    def fn():
        rows = [
            pack_rows(np.asarray(pend.value[k]), r.max_rows, f"{tensors[k].name} of {name}")
            for k, r in sorted(pend.sparse.items())
        ]
        keys = [_bytes(np.asarray(pend.value[k])) for k in _sent(pend)]
        payload = np.concatenate([_bytes(p) for p in rows + keys])
        step.stamp("sent", key)
        return interp.transport.iallgather(payload, ins.group, chan)

    pend.gather = (step.issue(i, ins.priority, fn, chan, ins.group), key)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _dense(step, pend: _Pending, tensors) -> dict[int, np.ndarray]:
    """The all-reduced dense tensors, by position."""
    parts = []
    for _c, h, key in sorted(pend.handles, key=lambda p: p[0]):
        parts.append(np.asarray(h.result().wait()))
        step.stamp("arrived", key)
    flat = np.concatenate(parts) if parts else np.zeros(0)
    out, at = {}, 0
    for k, t in enumerate(tensors):
        if k in pend.sparse or k in pend.keys:
            continue
        size = int(np.prod(t.shape, dtype=np.int64))
        out[k] = flat[at : at + size].astype(t.dtype).reshape(t.shape)
        at += size
    return out


def _gathered(step, pend: _Pending, tensors) -> dict[int, np.ndarray]:
    """The sparse tensors, summed over the members from their gathered rows, and the
    max/min/concat accumulators, combined over the members by :func:`_max_keys` or
    :func:`_rows_in_order`."""
    kept = {k: np.asarray(pend.value[k]) for k, e in pend.keys.items() if not e.sent}
    if pend.gather is None:
        return kept
    handle, key = pend.gather
    payloads = handle.result().wait()
    step.stamp("arrived", key)
    sum_dtype = step.interp.transport.sum_dtype
    out, split, keys = {}, {}, {}
    for payload in payloads:
        raw, at = np.ascontiguousarray(payload).view(np.uint8), 0
        for k, r in sorted(pend.sparse.items()):
            size = r.payload_nbytes(tensors[k])
            t = tensors[k]
            split.setdefault(k, []).append(
                unpack_rows(raw[at : at + size], t.shape, t.dtype, r.max_rows)
            )
            at += size
        for k in _sent(pend):
            t = tensors[k]
            keys.setdefault(k, []).append(raw[at : at + t.nbytes].view(t.dtype).reshape(t.shape))
            at += t.nbytes
    for k, parts in split.items():
        t = tensors[k]
        out[k] = sum_rows(parts, t.shape, t.dtype, sum_dtype(np.dtype(t.dtype)))
    for k, parts in keys.items():
        concat = pend.keys[k].reduce == "concat"
        out[k] = _rows_in_order(parts) if concat else _max_keys(parts)
    return out | kept


def _sent(pend: _Pending) -> list[int]:
    """Positions of the not-summed tensors the members send, in order (a ``same`` one is
    kept as it is)."""
    return sorted(k for k, e in pend.keys.items() if e.sent)


def _max_keys(parts: list[np.ndarray]) -> np.ndarray:
    """The members' max/min accumulators combined: the maximum of their order keys (the
    bits read as unsigned ints, :mod:`meshshard.accumulate`), what one accumulator over
    every member's micro-batches holds."""
    dtype = parts[0].dtype
    unsigned = np.dtype(f"u{dtype.itemsize}")
    top = np.maximum.reduce([p.view(unsigned) for p in parts])
    return np.asarray(top).view(dtype).reshape(parts[0].shape)


def _rows_in_order(parts: list[np.ndarray]) -> np.ndarray:
    """The members' concatenating accumulators combined: each holds the full batch's
    shape with its own micro-batches' rows at its end (:func:`meshshard.accumulate.combine`),
    and member ``j`` ran the ``j``-th run of micro-batches, so the batch's rows are each
    member's last ``1/d`` of the rows, in member order."""
    rows = parts[0].shape[0] // len(parts)
    return np.concatenate([p[p.shape[0] - rows :] for p in parts])


def wait_grads(step, name: BufferRef):
    """A function that completes the exchange of ``name`` into its arrays."""
    from meshshard.runtime.interpreter import array_from_host
    from meshshard.runtime.programs import sharding

    interp = step.interp
    pend = step.grads.pop(name)
    tensors = interp._buffers_spec[name.group].tensors

    def fn():
        host = _dense(step, pend, tensors) | _gathered(step, pend, tensors)
        stored = [_stored(host[k], t, interp.mesh.shape) for k, t in enumerate(tensors)]
        return tuple(array_from_host(x, sharding(interp.mesh, spec)) for x, spec in stored)

    return fn
