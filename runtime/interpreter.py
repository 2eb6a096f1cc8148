"""A plain interpreter that runs one worker's instruction stream (no Ray here).

The Ray host-actor wraps it; tests run several of them in one process with an
in-memory transport.  It keeps named buffers (each a tuple of arrays), issues
communication through a :class:`~meshshard.runtime.transport.Transport`, and completes
it at ``WAIT``/``WAITALL``.  How a transferred array is read and rebuilt is a
:class:`Blocks` adapter: global ``jax.Array``s in a pipeline, per-device NumPy tiles in a
transfer-only run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np

from meshshard.errors import MeshshardRuntimeError
from meshshard.instructions import (
    Collective,
    Free,
    Load,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
    Zeros,
)
from meshshard.plan import Plan, TransferSpec
from meshshard.program_fn import reduction_identity
from meshshard.refs import BufferKind, BufferRef, TransferRef
from meshshard.runtime.device_blocks import DeviceBlocks
from meshshard.runtime.host_messages import read_message, received_parts
from meshshard.runtime.programs import CompiledProgram, sharding
from meshshard.runtime.trace_record import Recorder, RecordingTransport, clock_ns
from meshshard.runtime.transport import DEVICE, HOST, Transport


def message_tag(plan: Plan, transfer: TransferRef, mb: int, message: int) -> int:
    """A tag unique within a step for one message of one transfer of one micro-batch."""
    t_index = [t.name for t in plan.transfers].index(transfer)
    max_msgs = max(len(t.messages) for t in plan.transfers)
    return (t_index * plan.num_micro_batches + mb) * max_msgs + message


def group_key(transfer: TransferRef, group: tuple[int, ...]) -> str:
    """The channel of one transfer's broadcasts over one group of workers."""
    return f"{transfer}:" + ",".join(map(str, group))


def reduction_key(name: str, group: tuple[int, ...]) -> str:
    """The channel of one all-reduce over its group of workers."""
    return f"{name}:" + ",".join(map(str, group))


def broadcast_groups(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """Every (channel, ranks) the plan broadcasts over, in a fixed order all workers share.

    One channel per (transfer, group): the root issues a transfer's broadcasts in the
    same order as every receiver, so operations on a channel always match.
    """
    keys = {
        group_key(t.name, m.group): tuple(sorted(m.group))
        for t in plan.transfers
        for m in t.messages
        if m.is_broadcast
    }
    keys.update({reduction_key(r.name, r.group): tuple(sorted(r.group)) for r in plan.reductions})
    return sorted(keys.items())


def _block_of(index, starts, stops):
    if all(a <= lo and hi <= b for (lo, hi), a, b in zip(index, starts, stops, strict=True)):
        return tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(index, starts, strict=True))
    return None


def local_block(arr: jax.Array, index: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The block ``index`` of a global array, read from a shard this process holds."""
    for shard in arr.addressable_shards:
        starts = [s.start or 0 for s in shard.index] + [0] * (arr.ndim - len(shard.index))
        stops = [
            s.stop if s.stop is not None else n
            for s, n in zip(shard.index, arr.shape, strict=False)
        ] + list(arr.shape[len(shard.index) :])
        sl = _block_of(index, starts, stops)
        if sl is not None:
            return np.ascontiguousarray(np.asarray(shard.data)[sl])
    raise MeshshardRuntimeError(f"no local shard of {arr.shape} holds block {index}")


def array_from_host(full: np.ndarray, shard) -> jax.Array:
    """A global array with sharding ``shard`` built from a host copy of the value."""
    return jax.make_array_from_callback(full.shape, shard, lambda idx: full[idx])


class Blocks(Protocol):
    """How a worker reads blocks of a transferred value and rebuilds it from blocks."""

    def read(self, value, index) -> np.ndarray: ...

    def assemble(self, transfer: TransferSpec, parts: list[tuple[object, np.ndarray]]): ...


class JaxBlocks:
    """Transferred values are global ``jax.Array``s on this worker's mesh."""

    def __init__(self, mesh):
        self.mesh = mesh

    def read(self, value, index) -> np.ndarray:
        return local_block(value, index)

    def assemble(self, transfer: TransferSpec, parts) -> jax.Array:
        full = np.empty(transfer.tensor.shape, dtype=transfer.tensor.dtype)
        place_blocks(full, parts)
        return array_from_host(full, sharding(self.mesh, transfer.dst_spec))


def place_blocks(full: np.ndarray, parts) -> None:
    """Write received raw blocks into ``full`` at their indices."""
    for msg, raw in parts:
        shape = tuple(b - a for a, b in msg.index)
        full[tuple(slice(a, b) for a, b in msg.index)] = raw.view(full.dtype).reshape(shape)


class StreamInterpreter:
    """Runs a :class:`WorkerStream` step after step.

    Args:
        stream: this worker's instructions.
        plan: the plan (buffer layouts, transfers).
        programs: compiled programs of this worker's mesh, by name.
        mesh: the jax Mesh of this worker's mesh (None for transfer-only runs).
        transport: point-to-point transport to other workers.
        blocks: reads/rebuilds transferred values (default: global jax arrays on ``mesh``,
            kept on the devices when the transport takes the device path).
    """

    def __init__(
        self,
        stream: WorkerStream,
        plan: Plan,
        programs: dict[str, CompiledProgram],
        mesh,
        transport: Transport,
        blocks: Blocks | None = None,
    ):
        self.stream = stream
        self.plan = plan
        self.programs = programs
        self.mesh = mesh
        self.transport = transport
        if blocks is None:
            on_device = getattr(transport, "path", HOST) == DEVICE
            blocks = DeviceBlocks(mesh) if on_device else JaxBlocks(mesh)
        self.blocks = blocks
        self.worker = stream.worker
        self._transfers = {t.name: t for t in plan.transfers}
        self._buffers_spec = {b.name: b for b in plan.buffers}
        self._untimed = transport
        self.recorder: Recorder | None = None
        self._sync = False

    def record(self, on: bool, sync: bool = False) -> None:
        """Record every instruction's start and end (and communication completions)
        from the next step on; :attr:`recorder` holds the last step's stamps.

        ``sync`` (profiling) makes each ``RUN`` wait for its outputs, so its span is the
        program's run time rather than its asynchronous dispatch.
        """
        self._sync = on and sync
        if on:
            self.recorder = Recorder(len(self.stream.instructions))
            self.transport = RecordingTransport(self._untimed, self.recorder)
        else:
            self.recorder, self.transport = None, self._untimed

    def run(
        self, buffers: dict[BufferRef, tuple], load: Callable[[BufferRef, int], tuple]
    ) -> dict[BufferRef, tuple]:
        """Run one step.  ``buffers`` holds the persistent groups (P, S); returns all live buffers."""
        pending_recv: dict[str, list] = {}
        pending_send: list = []
        rec = self.recorder
        if rec is not None:
            rec.reset()
        for i, ins in enumerate(self.stream.instructions):
            if rec is not None:
                rec.current = i
                rec.start[i] = clock_ns()
            try:
                if isinstance(ins, Run):
                    prog = self.programs[ins.program]
                    outs = prog([buffers[name] for name in ins.inputs])
                    if self._sync:
                        jax.block_until_ready(outs)
                    for name, val in zip(ins.outputs, outs, strict=True):
                        buffers[name] = val
                elif isinstance(ins, Load):
                    buffers[ins.buffer] = load(ins.buffer.group, ins.mb)
                elif isinstance(ins, Zeros):
                    buffers[ins.buffer] = self._zeros(ins.buffer)
                elif isinstance(ins, Send):
                    msg = self._transfers[ins.transfer].messages[ins.message]
                    data = read_message(self.blocks, buffers[ins.buffer][0], msg)
                    tag = message_tag(self.plan, ins.transfer, ins.buffer.mb, ins.message)
                    pending_send.append(self.transport.isend(data, ins.peer, tag))
                elif isinstance(ins, Recv):
                    msg = self._transfers[ins.transfer].messages[ins.message]
                    tag = message_tag(self.plan, ins.transfer, ins.buffer.mb, ins.message)
                    handle = self.transport.irecv(msg.nbytes, ins.peer, tag)
                    pending_recv.setdefault(ins.buffer, []).append((msg, handle))
                elif isinstance(ins, Collective):
                    self._collective(ins, buffers, pending_send, pending_recv)
                elif isinstance(ins, Wait) and ins.buffer.kind is BufferKind.REDUCTION:
                    ((_, handle),) = pending_recv.pop(ins.buffer)
                    full = np.asarray(handle.wait())
                    buffers[ins.buffer] = (array_from_host(full, sharding(self.mesh, ())),)
                elif isinstance(ins, Wait):
                    t = self._transfers[ins.buffer.transfer]
                    size = jax.numpy.dtype(t.tensor.dtype).itemsize
                    parts = [
                        part
                        for msg, h in pending_recv.pop(ins.buffer)
                        for part in received_parts(msg, h.wait(), size)
                    ]
                    buffers[ins.buffer] = (self.blocks.assemble(t, parts),)
                elif isinstance(ins, Free):
                    del buffers[ins.buffer]
                elif isinstance(ins, WaitAll):
                    for h in pending_send:
                        h.wait()
                    pending_send.clear()
                else:
                    raise MeshshardRuntimeError(
                        f"instruction {ins} is not supported by this runtime"
                    )
            except Exception as exc:
                raise MeshshardRuntimeError(self._where(i, exc)) from exc
            if rec is not None:
                rec.end[i] = clock_ns()
        return buffers

    def _collective(self, ins: Collective, buffers, pending_send, pending_recv) -> None:
        if ins.kind == "allreduce":
            self._allreduce(ins, buffers, pending_recv)
            return
        if ins.kind != "broadcast":
            raise MeshshardRuntimeError(f"collective {ins.kind} is not supported by this runtime")
        msg = self._transfers[ins.transfer].messages[ins.message]
        tag = message_tag(self.plan, ins.transfer, ins.buffer.mb, ins.message)
        key = group_key(ins.transfer, msg.group)
        if self.worker == ins.root:
            data = read_message(self.blocks, buffers[ins.buffer][0], msg)
            pending_send.append(self.transport.ibroadcast(data, msg.nbytes, msg.group, key, tag))
        else:
            handle = self.transport.ibroadcast(None, msg.nbytes, msg.group, key, tag)
            pending_recv.setdefault(ins.buffer, []).append((msg, handle))

    def _allreduce(self, ins: Collective, buffers, pending_recv) -> None:
        """Contribute this mesh's partial (its leader worker) or the identity (the
        mesh's other workers) to the all-reduce of ``ins.buffer``."""
        r = self.plan.reduction(ins.buffer)
        value = buffers.pop(ins.buffer)[0]
        if self.worker in r.leaders:
            data = np.asarray(value.addressable_shards[0].data)
        else:
            data = reduction_identity(r.op, r.tensor.shape, r.tensor.dtype)
        key = reduction_key(r.name, r.group)
        handle = self.transport.iallreduce(data, r.op, r.group, key)
        pending_recv[ins.buffer] = [(None, handle)]

    def _zeros(self, name: BufferRef) -> tuple:
        spec = self._buffers_spec[name]
        return tuple(
            jax.device_put(np.zeros(t.shape, t.dtype), sharding(self.mesh, t.spec))
            for t in spec.tensors
        )

    def _where(self, i: int, exc: Exception) -> str:
        lo, hi = max(0, i - 3), min(len(self.stream.instructions), i + 4)
        import traceback

        tb = traceback.extract_tb(exc.__traceback__)
        at = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        lines = [
            f"worker w{self.worker} failed at instruction {i}: {type(exc).__name__}: {exc}{at}"
        ]
        for j in range(lo, hi):
            mark = "  <-- ERROR HERE" if j == i else ""
            lines.append(f"  {j:>4} w{self.worker}: {self.stream.instructions[j]}{mark}")
        return "\n".join(lines)
