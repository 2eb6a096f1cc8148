"""Peak device memory from buffer sizes and the live ranges the streams give them.

A buffer instance (``R1@3``, ``P0``) lives on a worker from the start of the first
instruction that writes it (``LOAD``, ``ZEROS``, ``RUN`` output, ``RECV``, ``COLL``)
until its ``FREE``, or later if a ``SEND`` reading it is still in flight then, or to
the end of the iteration if never freed.  Buffers a worker reads but never writes
(parameters, optimizer state) are resident all along.

Bytes per device: a tensor of ``nbytes`` sharded by its spec over the mesh axes
(``host`` = mesh rows, ``device`` = mesh columns) holds ``nbytes / prod(axis sizes)``
on each device; a transfer's array is sharded by its source spec on the sending mesh
and by ``dst_spec`` on the receiving mesh.  Categories follow the buffer naming
convention of :mod:`meshshard.instructions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from meshshard.instructions import Free
from meshshard.plan import MeshSpec, Plan, Spec
from meshshard.refs import BufferKind, BufferRef
from meshshard.sim.engine import OpRecord

__all__ = ["category", "bytes_per_device", "memory_profile"]

_CATEGORIES = {
    BufferKind.PARAMS: "params",
    BufferKind.APPLY_STATE: "optimizer",
    BufferKind.APPLY_OUTPUTS: "optimizer",
    BufferKind.ACCUMULATORS: "grads",
    BufferKind.BATCH: "activations",
    BufferKind.RESIDUALS: "activations",
    BufferKind.TRANSFER: "activations",
    BufferKind.BACKWARD_CARRY: "activations",
}
CATEGORY_ORDER = ("params", "optimizer", "grads", "activations", "other")


def category(buffer: BufferRef) -> str:
    """The memory category of a buffer by its kind (``R1@3`` -> activations)."""
    return _CATEGORIES.get(buffer.kind, "other")


def _shards(spec: Spec, mesh: MeshSpec | None) -> int:
    if mesh is None:
        return 1
    size = dict(zip(("host", "device"), mesh.axis_shape, strict=True))
    n = 1
    for entry in spec:
        if entry is None:
            continue
        for axis in (entry,) if isinstance(entry, str) else entry:
            n *= size.get(axis, 1)
    return n


def bytes_per_device(plan: Plan, buffer: BufferRef, worker: int) -> float | None:
    """Bytes one device of ``worker`` holds for ``buffer`` (None when the plan does not describe it)."""
    meshes = {m.id: m for m in plan.meshes}
    base = buffer.group
    transfer = None
    if base.kind is BufferKind.TRANSFER:
        transfer = next((t for t in plan.transfers if t.name == base.transfer), None)
    if transfer is not None:
        dst = meshes.get(transfer.dst_mesh)
        if dst is not None and worker in dst.hosts:
            return transfer.tensor.nbytes / _shards(transfer.dst_spec, dst)
        src = meshes.get(transfer.src_mesh)
        return transfer.tensor.nbytes / _shards(transfer.tensor.spec, src)
    spec = next((b for b in plan.buffers if b.name == base), None)
    if spec is None:
        return None
    mesh = meshes.get(spec.mesh)
    return float(sum(t.nbytes / _shards(t.spec, mesh) for t in spec.tensors))


_EVENT_ORDER = itemgetter(0, 1, 2)  # (time, index, direction): not the buffer


def _buffer_events(recs: Sequence[OpRecord], end: float) -> list[tuple[float, int, int, BufferRef]]:
    """``(time, index, +1/-1, buffer)`` of every allocation and release on one worker: a
    buffer is held from its first write (or from 0 when read before any write) until
    its ``FREE`` and the end of its last in-flight reader, else until ``end``."""
    alive: dict[BufferRef, float] = {}  # buffer -> alloc time
    readers_end: dict[BufferRef, float] = {}  # latest end of an in-flight reader (sends)
    events: list[tuple[float, int, int, BufferRef]] = []  # (time, index, +1/-1, buffer)
    written: set[BufferRef] = set()
    for r in recs:
        ins = r.instruction
        reads = ins.reads
        if reads:
            r_end = r.end
            for b in reads:
                end_b = readers_end.get(b)
                if end_b is None:  # its first read: held from 0 unless written before
                    readers_end[b] = r_end
                    if b not in written and b not in ins.writes:
                        alive[b] = 0.0
                        written.add(b)
                        events.append((0.0, -1, 1, b))
                elif r_end > end_b:
                    readers_end[b] = r_end
        if isinstance(ins, Free):
            b = ins.buffer
            if b in alive:
                t = max(r.start, readers_end.get(b, 0.0))
                events.append((t, r.index, -1, b))
                del alive[b]
            continue
        for b in ins.writes:
            if b not in alive:
                alive[b] = r.start
                written.add(b)
                events.append((r.start, r.index, 1, b))
    for b in alive:
        events.append((end, len(recs), -1, b))
    return events


def memory_profile(
    plan: Plan, records: Sequence[Sequence[OpRecord]], end: float
) -> tuple[
    dict[int, tuple[float, float, dict[str, float]]],
    dict[int, list[tuple[float, float]]],
    list[str],
]:
    """Per worker: (peak bytes per device, time of the peak, breakdown at the peak), the
    step function of bytes held over time, and notes on undescribed buffers."""
    peaks: dict[int, tuple[float, float, dict[str, float]]] = {}
    curves: dict[int, list[tuple[float, float]]] = {}
    unknown: set[BufferRef] = set()
    group_sizes: dict[tuple[BufferRef, int], float] = {}  # one buffer group on one worker

    def group_size(buf: BufferRef, w: int) -> float:
        group = buf.group
        n = group_sizes.get((group, w))
        if n is None:
            n = bytes_per_device(plan, buf, w)
            if n is None:
                unknown.add(group)
                n = 0.0
            group_sizes[(group, w)] = n
        return n

    for recs in records:
        if not recs:
            continue
        w = recs[0].worker
        sizes: dict[BufferRef, float] = {}  # this worker's buffers
        events = _buffer_events(recs, end)
        # at one instant, stream order decides (a FREE before the next RUN releases first)
        # ties (one instant, one instruction, one direction) leave the peak unchanged
        events.sort(key=_EVENT_ORDER)
        held = 0.0
        by_cat: dict[str, float] = {}
        best = (-1.0, 0.0, {})
        curve: list[tuple[float, float]] = []
        for t, _, sign, b in events:
            n = sizes.get(b)
            if n is None:
                n = sizes[b] = group_size(b, w)
            held += sign * n
            c = category(b)
            by_cat[c] = by_cat.get(c, 0.0) + sign * n
            if held > best[0] + 1e-9:
                best = (held, t, dict(by_cat))
            if curve and curve[-1][0] == t:
                curve[-1] = (t, held)
            else:
                curve.append((t, held))
        peaks[w] = (max(best[0], 0.0), best[1], best[2])
        curves[w] = curve
    notes = []
    if unknown:
        notes.append(
            "memory: buffers not described in the plan counted as 0 bytes: "
            + ", ".join(sorted(map(str, unknown)))
        )
    return peaks, curves, notes
