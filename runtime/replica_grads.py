"""Run time of the replicas' gradient all-reduce (``COLL allreduce A{s} #c [group]``).

A stage's data-parallel replicas (:mod:`meshshard.passes.replicas`) each hold the
stage's accumulator group ``A`` (a tuple of arrays).  The plan all-reduces it in the
chunks its ``COLL``s number (``#0 .. #n-1``; communication scheduling cuts a large
group into several so that higher-priority traffic passes between them): the first
chunk to run reads the arrays off the devices into one flat host vector, each chunk
sums one contiguous slice of it (:func:`numpy.array_split` into ``n``) over the group,
and ``WAIT A`` puts the sums back into arrays of the group's shapes and shardings.

Every member flattens the same tensors in the same order and issues the chunks on one
channel per group (:func:`grads_channel`), in stream order, so the operations match;
the transports reduce in a fixed order, so every replica gets the same bits.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from meshshard.instructions import Collective, WorkerStream
from meshshard.refs import BufferKind, BufferRef, CollectiveKind

__all__ = ["chunk_counts", "grads_channel", "grads_groups", "issue_chunk", "wait_grads"]


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
    return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64)


def _flatten(arrays, dtype) -> np.ndarray:
    parts = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class _Pending:
    """One accumulator group's all-reduce in flight on this worker."""

    def __init__(self, lazy_flat, n: int):
        self.flat = lazy_flat
        self.n = n
        self.handles: list = []


def issue_chunk(step, i: int, ins: Collective) -> None:
    """Issue chunk ``ins.message`` of the all-reduce of ``ins.buffer`` (see module doc)."""
    from meshshard.runtime.overlap import Lazy

    interp = step.interp
    name = ins.buffer
    pend = step.grads.get(name)
    if pend is None:
        value = step.value(name)
        del step.buffers[name]
        dtype = _wire_dtype(interp._buffers_spec[name.group].tensors)
        pend = _Pending(Lazy(lambda: _flatten(value, dtype)), interp.grad_chunks[name])
        step.grads[name] = pend
    chan = grads_channel(ins.group)
    c, n = ins.message, pend.n
    key = (str(name), None, c)

    def fn():
        part = np.array_split(pend.flat.get(), n)[c]
        step.stamp("sent", key)
        return interp.transport.iallreduce(part, "sum", ins.group, chan)

    pend.handles.append((c, step.issue(i, ins.priority, fn, chan, ins.group), key))


def wait_grads(step, name: BufferRef):
    """A function that completes the all-reduce of ``name`` into its arrays."""
    from meshshard.runtime.interpreter import array_from_host
    from meshshard.runtime.programs import sharding

    interp = step.interp
    pend = step.grads.pop(name)
    tensors = interp._buffers_spec[name.group].tensors

    def fn():
        parts = []
        for _c, h, key in sorted(pend.handles, key=lambda p: p[0]):
            parts.append(np.asarray(h.result().wait()))
            step.stamp("arrived", key)
        flat = np.concatenate(parts)
        out, at = [], 0
        for t in tensors:
            size = int(np.prod(t.shape, dtype=np.int64))
            full = flat[at : at + size].astype(t.dtype).reshape(t.shape)
            at += size
            out.append(array_from_host(full, sharding(interp.mesh, t.spec)))
        return tuple(out)

    return fn
