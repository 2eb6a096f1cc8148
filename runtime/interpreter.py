"""A plain interpreter that runs one worker's instruction stream (no Ray here).

The Ray host-actor wraps it; tests run several of them in one process with an
in-memory transport.  It keeps named buffers (each a tuple of ``jax.Array``), issues
communication through a :class:`~meshshard.runtime.transport.Transport`, and completes
it at ``WAIT``/``WAITALL``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from meshshard.errors import MeshshardRuntimeError
from meshshard.instructions import (
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
from meshshard.plan import Plan
from meshshard.runtime.programs import CompiledProgram, sharding
from meshshard.runtime.transport import Transport


def message_tag(plan: Plan, transfer: str, mb: int, message: int) -> int:
    """A tag unique within a step for one message of one transfer of one micro-batch."""
    t_index = [t.name for t in plan.transfers].index(transfer)
    max_msgs = max(len(t.messages) for t in plan.transfers)
    return (t_index * plan.num_micro_batches + mb) * max_msgs + message


def local_block(arr: jax.Array, index: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The block ``index`` of a global array, read from a shard this process holds."""
    for shard in arr.addressable_shards:
        starts = [s.start or 0 for s in shard.index]
        stops = [
            s.stop if s.stop is not None else n
            for s, n in zip(shard.index, arr.shape, strict=False)
        ]
        starts += [0] * (arr.ndim - len(starts))
        stops += list(arr.shape[len(stops) :])
        if all(a <= lo and hi <= b for (lo, hi), a, b in zip(index, starts, stops, strict=True)):
            local = np.asarray(shard.data)
            sl = tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(index, starts, strict=True))
            return np.ascontiguousarray(local[sl])
    raise MeshshardRuntimeError(f"no local shard of {arr.shape} holds block {index}")


def array_from_host(full: np.ndarray, shard) -> jax.Array:
    """A global array with sharding ``shard`` built from a host copy of the whole value."""
    return jax.make_array_from_callback(full.shape, shard, lambda idx: full[idx])


@dataclass
class StepIO:
    """What one step gives a worker and what it hands back."""

    load: Callable[[str, int], tuple]
    outputs: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


class StreamInterpreter:
    """Runs a :class:`WorkerStream` step after step.

    Args:
        stream: this worker's instructions.
        plan: the plan (buffer layouts, transfers).
        programs: compiled programs of this worker's mesh, by name.
        mesh: the jax Mesh of this worker's mesh.
        transport: point-to-point transport to other workers.
    """

    def __init__(
        self,
        stream: WorkerStream,
        plan: Plan,
        programs: dict[str, CompiledProgram],
        mesh,
        transport: Transport,
    ):
        self.stream = stream
        self.plan = plan
        self.programs = programs
        self.mesh = mesh
        self.transport = transport
        self.worker = stream.worker
        self.mesh_id = next(m.id for m in plan.meshes if self.worker in m.workers)
        self._transfers = {t.name: t for t in plan.transfers}
        self._buffers_spec = {b.name: b for b in plan.buffers}

    def run(self, buffers: dict[str, tuple], load: Callable[[str, int], tuple]) -> dict[str, tuple]:
        """Run one step.  ``buffers`` holds the persistent groups (P, S); returns all live buffers."""
        pending_recv: dict[str, list] = {}
        pending_send: list = []
        for i, ins in enumerate(self.stream.instructions):
            try:
                if isinstance(ins, Run):
                    prog = self.programs[ins.program]
                    outs = prog([buffers[name] for name in ins.inputs])
                    for name, val in zip(ins.outputs, outs, strict=True):
                        buffers[name] = val
                elif isinstance(ins, Load):
                    buffers[ins.buffer] = load(ins.buffer.split("@")[0], ins.mb)
                elif isinstance(ins, Zeros):
                    buffers[ins.buffer] = self._zeros(ins.buffer)
                elif isinstance(ins, Send):
                    msg = self._transfers[ins.transfer].messages[ins.message]
                    data = local_block(buffers[ins.buffer][0], msg.index)
                    tag = message_tag(self.plan, ins.transfer, _mb(ins.buffer), ins.message)
                    pending_send.append(self.transport.isend(data, ins.peer, tag))
                elif isinstance(ins, Recv):
                    msg = self._transfers[ins.transfer].messages[ins.message]
                    tag = message_tag(self.plan, ins.transfer, _mb(ins.buffer), ins.message)
                    handle = self.transport.irecv(msg.nbytes, ins.peer, tag)
                    pending_recv.setdefault(ins.buffer, []).append((msg, handle))
                elif isinstance(ins, Wait):
                    buffers[ins.buffer] = self._assemble(ins.buffer, pending_recv.pop(ins.buffer))
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
        return buffers

    def _zeros(self, name: str) -> tuple:
        spec = self._buffers_spec[name]
        return tuple(
            jax.device_put(np.zeros(t.shape, t.dtype), sharding(self.mesh, t.spec))
            for t in spec.tensors
        )

    def _assemble(self, buffer: str, parts: list) -> tuple:
        t = self._transfers[buffer.split("@")[0]]
        full = np.empty(t.tensor.shape, dtype=t.tensor.dtype)
        for msg, handle in parts:
            raw = handle.wait()
            shape = tuple(b - a for a, b in msg.index)
            full[tuple(slice(a, b) for a, b in msg.index)] = raw.view(full.dtype).reshape(shape)
        return (array_from_host(full, sharding(self.mesh, t.dst_spec)),)

    def _where(self, i: int, exc: Exception) -> str:
        lo, hi = max(0, i - 3), min(len(self.stream.instructions), i + 4)
        lines = [f"worker w{self.worker} failed at instruction {i}: {type(exc).__name__}: {exc}"]
        for j in range(lo, hi):
            mark = "  <-- ERROR HERE" if j == i else ""
            lines.append(f"  {j:>4} w{self.worker}: {self.stream.instructions[j]}{mark}")
        return "\n".join(lines)


def _mb(buffer: str) -> int:
    return int(buffer.split("@")[1])


def timed(fn, *args, **kwargs):
    """(result, seconds)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
