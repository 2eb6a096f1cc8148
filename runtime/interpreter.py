"""A plain interpreter that runs one worker's instruction stream (no Ray here).

The Ray host-actor wraps it; tests run several of them in one process with an
in-memory transport.  It keeps named buffers (each a tuple of arrays), issues
communication through a :class:`~meshshard.runtime.transport.Transport`, and completes
it at ``WAIT``/``WAITALL``.  How a transferred array is read and rebuilt is a
:class:`Blocks` adapter: global ``jax.Array``s in a pipeline, per-device NumPy tiles in a
transfer-only run.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np

from meshshard.admission import PROCESS_TABLE, comm_links, plan_admits
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
from meshshard.program_fn import combine_partials, reduction_identity
from meshshard.refs import BufferKind, BufferRef, TransferRef
from meshshard.runtime.device_blocks import DeviceBlocks
from meshshard.runtime.host_messages import read_message, received_parts
from meshshard.runtime.overlap import CommQueue, Lazy, Prefetcher, Timeline
from meshshard.runtime.programs import CompiledProgram, sharding
from meshshard.runtime.recv_ahead import receives_ahead
from meshshard.runtime.replica_grads import (
    chunk_counts,
    grads_groups,
    issue_chunk,
    issue_gather,
    wait_grads,
)
from meshshard.runtime.trace_record import Recorder, RecordingTransport, _TimedHandle, clock_ns
from meshshard.runtime.transport import DEVICE, HOST, Transport


def default_overlap() -> bool:
    """Whether interpreters overlap communication with compute unless told otherwise
    (``MESHSHARD_OVERLAP=0`` turns it off, e.g. to measure what overlap buys)."""
    return os.environ.get("MESHSHARD_OVERLAP", "1") != "0"


def default_recv_ahead() -> bool:
    """Whether interpreters post each peer's next receive ahead of its ``RECV``
    (``runtime.recv_ahead``) unless told otherwise (``MESHSHARD_RECV_AHEAD=0``: at the
    ``RECV``, as written)."""
    return os.environ.get("MESHSHARD_RECV_AHEAD", "1") != "0"


def default_prefetch() -> bool:
    """Whether overlapped interpreters complete received messages on a prefetch thread
    before their readers ask (``MESHSHARD_PREFETCH=1``).  Off unless told: the reading
    ``RUN`` completes its receive itself, one thread hand-off less per message; the
    prefetch thread rarely gets to a message first, since each ``WAIT`` stands just
    before its reader (benchmarks/RESULTS.md, "The prefetch thread")."""
    return os.environ.get("MESHSHARD_PREFETCH", "0") == "1"


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
    keys.update(grads_groups(plan.streams))  # data-parallel replicas' gradients
    return sorted(keys.items())


def _block_of(index, starts, stops):
    if all(a <= lo and hi <= b for (lo, hi), a, b in zip(index, starts, stops, strict=True)):
        return tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(index, starts, strict=True))
    return None


def covers(index: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    """True when block ``index`` is the whole of an array of ``shape``."""
    return len(index) == len(shape) and all(
        lo == 0 and hi == n for (lo, hi), n in zip(index, shape, strict=True)
    )


def local_block(arr: jax.Array, index: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The block ``index`` of a global array, read from a shard this process holds."""
    shards = arr.addressable_shards
    if len(shards) == 1 and covers(index, arr.shape) and shards[0].data.shape == arr.shape:
        return np.asarray(shards[0].data)  # the whole array on one device: no slicing
    for shard in shards:
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
    """Transferred values are global ``jax.Array``s on this worker's mesh.

    A value received as one message holding the whole array is built straight from the
    received bytes (no staging copy).
    """

    def __init__(self, mesh):
        self.mesh = mesh

    def read(self, value, index) -> np.ndarray:
        return local_block(value, index)

    def assemble(self, transfer: TransferSpec, parts) -> jax.Array:
        shape, dtype = transfer.tensor.shape, np.dtype(transfer.tensor.dtype)
        if len(parts) == 1 and covers(parts[0][0].index, shape):
            full = np.asarray(parts[0][1]).view(dtype).reshape(shape)
        else:
            full = np.empty(shape, dtype=dtype)
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
        overlap: run communication concurrently with compute (module docstring);
            default from ``MESHSHARD_OVERLAP`` (on unless ``0``).
        recv_ahead: post each peer's next receive ahead of its ``RECV``
            (``runtime.recv_ahead``); default from ``MESHSHARD_RECV_AHEAD`` (on unless
            ``0``).
        prefetch: overlapped, complete each received message on the prefetch thread
            rather than in its reader; default from ``MESHSHARD_PREFETCH`` (off unless
            ``1``).  A recording step always prefetches, so its arrival times are the
            messages' own, not their readers'.
    """

    def __init__(
        self,
        stream: WorkerStream,
        plan: Plan,
        programs: dict[str, CompiledProgram],
        mesh,
        transport: Transport,
        blocks: Blocks | None = None,
        overlap: bool | None = None,
        recv_ahead: bool | None = None,
        prefetch: bool | None = None,
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
        self._zero_fns: dict[BufferRef, Callable] = {}  # ZEROS: one program per buffer
        self._t_index = {t.name: i for i, t in enumerate(plan.transfers)}
        self._max_msgs = max((len(t.messages) for t in plan.transfers), default=1)
        self.grad_chunks = chunk_counts(stream)  # replicas' gradient all-reduce chunks
        self.admission = plan_admits(plan)  # topology-aware comm thread (overlap.py)
        self.overlap = default_overlap() if overlap is None else overlap
        self._ahead = receives_ahead(stream.instructions)
        self._posted_ahead = frozenset(j for js in self._ahead.values() for j in js)
        self.recv_ahead = default_recv_ahead() if recv_ahead is None else recv_ahead
        self.prefetch = default_prefetch() if prefetch is None else prefetch
        self.timeline = os.environ.get("MESHSHARD_TIMELINE", "0") == "1"
        self.last_timeline: Timeline | None = None
        self.timelines: deque = deque(maxlen=8)  # (seq, Timeline) of the last steps
        #: tags of two pipelined steps in flight differ by this much (step parity)
        self.tag_span = len(plan.transfers) * plan.num_micro_batches * self._max_msgs
        self._untimed = transport
        self.recorder: Recorder | None = None
        self._sync = False
        self._threads: list = []  # comm and prefetch threads (overlapped mode)
        self._active = 0  # steps running now (two when pipelined)
        self._active_lock = threading.Lock()
        self._helpers_lock = threading.Lock()  # two pipelined steps may start at once
        #: instructions done and messages arrived, all steps: a shutdown waits for a
        #: step as long as this moves (ThreadsCluster.close)
        self.progress = 0
        # stop the helpers when the interpreter is dropped, but not at interpreter exit:
        # weakref's exit hook (registered with the first finalizer, after meshshard.init
        # registered the shutdown) runs before the shutdown, which waits for the steps
        # in flight; a pipelined 2BW step whose comm thread it had stopped never sent
        # its next message, and both workers of that step waited in their receives.
        # At exit overlap.stop_helpers stops them, after that wait.
        weakref.finalize(self, _close_all, self._threads).atexit = False

    def set_options(
        self,
        overlap: bool | None = None,
        timeline: bool | None = None,
        recv_ahead: bool | None = None,
        prefetch: bool | None = None,
    ) -> None:
        """Switch overlapped execution, timeline recording, receives posted ahead and
        the prefetch thread for the next steps."""
        if overlap is not None:
            self.overlap = overlap
        if recv_ahead is not None:
            self.recv_ahead = recv_ahead
        if prefetch is not None:
            self.prefetch = prefetch
        if timeline is not None:
            self.timeline = timeline

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
        self,
        buffers: dict[BufferRef, tuple],
        load: Callable[[BufferRef, int], tuple],
        seq: int | None = None,
    ) -> dict[BufferRef, tuple]:
        """Run one step.  ``buffers`` holds the persistent groups (P, S), each a tuple of
        arrays or a :class:`Lazy` of one (waited for when first read); returns all live
        buffers.  ``seq``: the number of a pipelined step, which may run beside step
        ``seq - 1`` (its messages carry other tags)."""
        with self._active_lock:
            self._active += 1
        try:
            return self._run(buffers, load, seq)
        finally:
            with self._active_lock:
                self._active -= 1

    def _run(self, buffers: dict, load: Callable, seq: int | None) -> dict[BufferRef, tuple]:
        step = _Step(self, buffers, load, seq)
        rec = self.recorder
        if rec is not None:
            rec.reset()
        try:
            for i, ins in enumerate(self.stream.instructions):
                if rec is not None:
                    rec.current = i
                    rec.start[i] = clock_ns()
                try:
                    step.check()
                    if step.ahead:
                        step.post_ahead(step.ahead.get(i, ()))
                    step.do(i, ins)
                except Exception as exc:
                    raise step.failure(i, exc) from exc
                self.progress += 1
                if rec is not None:
                    rec.end[i] = clock_ns()
            step.finish()
        except BaseException:
            step.close(failed=True)
            raise
        step.close(failed=False)
        return step.buffers

    def _helpers(self) -> tuple[CommQueue, Prefetcher]:
        """This worker's comm and prefetch threads, started once and kept across steps
        (stopped when the interpreter is dropped)."""
        with self._helpers_lock:
            if not self._threads:
                w = self.worker
                table = PROCESS_TABLE if self.admission else None
                self._threads.extend([CommQueue(f"w{w}-comm", table), Prefetcher(f"w{w}-recv")])
            return self._threads[0], self._threads[1]

    def _drop_helpers(self) -> None:
        """After a failed step: stop the comm and prefetch threads (ops of that step may
        still be queued), unless another (pipelined) step still uses them."""
        with self._active_lock, self._helpers_lock:
            if self._active <= 1:
                _close_all(self._threads, "a step failed on this worker")

    def tag(self, transfer: TransferRef, mb: int, message: int) -> int:
        """:func:`message_tag` from tables built once per plan."""
        return (
            self._t_index[transfer] * self.plan.num_micro_batches + mb
        ) * self._max_msgs + message

    def _zeros(self, name: BufferRef) -> tuple:
        """Fresh zeros for every tensor of buffer ``name`` (accumulators), from one compiled
        program per buffer: a ``device_put`` per tensor cost a quarter of a small GPT
        stage's step (benchmarks/RESULTS.md, "Peer side by side again ... fixed costs")."""
        make = self._zero_fns.get(name)
        if make is None:
            spec = self._buffers_spec[name]
            stored = [t.stored(self.mesh.shape) for t in spec.tensors]  # unreduced: (n, *shape)
            shapes = [(shape, t.dtype) for t, (shape, _) in zip(spec.tensors, stored, strict=True)]
            outs = tuple(sharding(self.mesh, sp) for _, sp in stored)
            make = jax.jit(
                lambda: tuple(jax.numpy.zeros(s, d) for s, d in shapes), out_shardings=outs
            )
            self._zero_fns[name] = make
        return make()

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


def _ready(arrays: list) -> None:
    """Wait until ``arrays`` are computed (an array a later program already consumed
    by donation counts as done)."""
    for a in arrays:
        try:
            a.block_until_ready()
        except Exception:  # deleted: donated to a program dispatched after it
            pass


def _close_all(threads: list, reason: str = "its interpreter was dropped") -> None:
    """Stop and forget helper threads (each exits once its queue is done)."""
    for t in threads:
        t.close(reason)
    threads.clear()


class _Sent:
    """A handle already issued on the dispatching thread (sequential mode)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def result(self):
        return self.handle


class _Step:
    """One step of one worker's stream.

    Sequential mode (``overlap=False``) is the plain interpreter: each instruction
    completes before the next starts (a ``SEND`` reads its block, ``WAIT`` blocks
    until the bytes are there).  Overlapped mode keeps the stream's order of ``RUN``s
    but lets communication proceed beside them: sends and collectives are issued by a
    :class:`CommQueue` in priority order, a ``WAIT`` only registers the receive (with a
    :class:`Prefetcher`, or, with ``prefetch`` off, for its reader to complete), and a
    ``RUN`` waits only for the buffers it reads.
    """

    def __init__(self, interp: StreamInterpreter, buffers: dict, load: Callable, seq=None):
        self.interp, self.buffers, self.load = interp, buffers, load
        self.seq = seq
        self.tag_base = 0 if seq is None else (seq % 2) * interp.tag_span
        self.later: dict[BufferRef, Lazy] = {}  # buffers still being received
        # persistent groups a previous pipelined step has not stored yet
        self.pending = {n: buffers.pop(n) for n, v in list(buffers.items()) if type(v) is Lazy}
        self.posted: dict[BufferRef, list] = {}  # (message, handle future, key) per buffer
        self.sends: list = []  # futures of issued send handles
        self.grads: dict = {}  # replicas' gradient all-reduces in flight (replica_grads)
        w = interp.worker
        self.comm, self.prefetch = interp._helpers() if interp.overlap else (None, None)
        # receives posted ahead of their RECV (runtime.recv_ahead): where, and which
        self.ahead = interp._ahead if interp.recv_ahead else {}
        self.posted_ahead = interp._posted_ahead if interp.recv_ahead else frozenset()
        self.tl = Timeline(w) if interp.timeline else None
        self.watch = Prefetcher(f"w{w}-watch") if self.tl is not None else None
        # received messages completed ahead of their readers (recording: always, so
        # a message's arrival is stamped when it arrives, not when it is read)
        recording = self.tl is not None or interp.recorder is not None
        self.prefetching = interp.prefetch or recording
        self.runs: list[tuple[int, int, Lazy]] = []

    # --- helpers ------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error of a communication op that failed on the comm thread."""
        if self.comm is not None and self.comm.error is not None:
            raise self.comm.error

    def failure(self, i: int, exc: Exception) -> MeshshardRuntimeError:
        """The error to raise for ``exc`` at instruction ``i`` (with the comm thread's
        own failure, which often explains a wait that timed out)."""
        if isinstance(exc, MeshshardRuntimeError) and "failed at instruction" in str(exc):
            return exc  # already placed (raised by a comm op)
        text = self.interp._where(i, exc)
        err = self.comm.error if self.comm is not None else None
        if err is not None and err is not exc:
            text += f"\nearlier, on the comm thread: {err}"
        return MeshshardRuntimeError(text)

    def value(self, name: BufferRef) -> tuple:
        """Buffer ``name``, waiting for its receive if it is still arriving."""
        lazy = self.later.pop(name, None)
        if lazy is not None:
            grads = name.kind is BufferKind.ACCUMULATORS  # already a tuple (replica_grads)
            self.buffers[name] = lazy.get() if grads else (lazy.get(),)
        elif self.pending:
            group = self.pending.pop(name, None)
            if group is not None:
                self.buffers[name] = group.get()
        return self.buffers[name]

    def tag(self, transfer: TransferRef, mb: int, message: int) -> int:
        """This step's tag of one message (:func:`message_tag`, offset by step parity)."""
        return self.interp.tag(transfer, mb, message) + self.tag_base

    def issue(self, i: int, priority: int, fn: Callable, channel: str | None = None, peers=()):
        """Issue one communication op: on the comm thread, or here when sequential.
        ``peers``: the workers it talks to (its links, when the comm thread admits)."""
        if self.comm is None:
            return _Sent(fn())
        interp = self.interp
        links = ()
        if interp.admission:  # a SEND's peer is its receiver; a collective's group both ways
            send = isinstance(interp.stream.instructions[i], Send)
            links = comm_links(interp.plan.cluster, interp.worker, peers, both_ways=not send)
        log = None
        if self.tl is not None:  # (index, traffic kind, priority, queued, issued)
            ins = interp.stream.instructions[i]
            kind = "allreduce" if ins.buffer.kind is BufferKind.ACCUMULATORS else "p2p"
            kind = "sparse" if kind == "allreduce" and ins.kind == "allgather" else kind
            kind = "reduction" if ins.buffer.kind is BufferKind.REDUCTION else kind
            log = [i, kind, priority, time.perf_counter_ns(), 0]
            self.tl.issues.append(log)

        def at_i():
            try:
                if log is not None:
                    log[4] = time.perf_counter_ns()
                handle = fn()
                if type(handle) is _TimedHandle:
                    handle.index = i  # issued here, not at the recorder's current index
                return handle
            except Exception as exc:
                raise MeshshardRuntimeError(interp._where(i, exc)) from exc

        return self.comm.submit(priority, at_i, channel, links)

    def stamp(self, table: str, key) -> None:
        if self.tl is not None:
            getattr(self.tl, table)[key] = time.perf_counter_ns()

    # --- instructions ---------------------------------------------------------------
    def do(self, i: int, ins) -> None:
        """Execute (or, overlapped, start) instruction ``ins`` at position ``i``."""
        kind = type(ins)
        if kind is Run:
            self.run(i, ins)
        elif kind is Load:
            self.buffers[ins.buffer] = self.load(ins.buffer.group, ins.mb)
        elif kind is Zeros:
            self.buffers[ins.buffer] = self.interp._zeros(ins.buffer)
        elif kind is Send:
            self.send(i, ins)
        elif kind is Recv:
            if i not in self.posted_ahead:
                self.recv(ins)
        elif kind is Collective:
            self.collective(i, ins)
        elif kind is Wait:
            self.wait(ins)
        elif kind is Free:
            self.value(ins.buffer)  # a buffer freed unread still completes its receive
            del self.buffers[ins.buffer]
        elif kind is WaitAll:
            for s in self.sends:
                s.result().wait()
            self.sends.clear()
        else:
            raise MeshshardRuntimeError(f"instruction {ins} is not supported by this runtime")

    def run(self, i: int, ins: Run) -> None:
        inputs = [self.value(name) for name in ins.inputs]
        rec = self.interp.recorder
        if rec is not None:  # the span is the program's run, not its wait for inputs
            rec.start[i] = clock_ns()
        t0 = time.perf_counter_ns() if self.tl is not None else 0
        sync = self.interp._sync
        cpu0 = time.process_time_ns() if sync else 0
        outs = self.interp.programs[ins.program](inputs)
        if sync:  # profiling: the span is the run; its CPU time says how many cores it kept busy
            jax.block_until_ready(outs)
            rec.cpu[i] = max(1, time.process_time_ns() - cpu0)
        for name, val in zip(ins.outputs, outs, strict=True):
            if name.kind is BufferKind.REDUCTION and name in self.buffers:
                # another mesh's partial on this worker (interleaved chunks): one
                # contribution to the all-reduce, combined here
                op = self.interp.plan.reduction(name).op
                val = [
                    combine_partials(op, a, b) for a, b in zip(self.value(name), val, strict=True)
                ]
            self.buffers[name] = val
        if self.tl is not None:
            # accumulators are donated to the next program: watch the other outputs
            kept = [
                v
                for n, val in zip(ins.outputs, outs, strict=True)
                if n.kind is not BufferKind.ACCUMULATORS
                for v in val
            ]
            done = Lazy(lambda: _ready(kept))
            self.watch.add(done)
            self.runs.append((i, t0, done))

    def send(self, i: int, ins: Send) -> None:
        interp = self.interp
        value = self.value(ins.buffer)[0]
        msg = interp._transfers[ins.transfer].messages[ins.message]
        mb = ins.buffer.mb
        tag = self.tag(ins.transfer, mb, ins.message)
        key = (str(ins.transfer), mb, ins.message)

        def fn():
            data = read_message(interp.blocks, value, msg)
            self.stamp("sent", key)
            return interp.transport.isend(data, ins.peer, tag)

        self.sends.append(self.issue(i, ins.priority, fn, peers=(ins.peer,)))

    def post_ahead(self, positions: tuple[int, ...]) -> None:
        """Post the receives of the ``RECV``s at ``positions`` now, ahead of where they
        stand (``runtime.recv_ahead``); an error names the ``RECV``'s own position."""
        for j in positions:
            try:
                self.recv(self.interp.stream.instructions[j], at=j)
            except Exception as exc:
                raise self.failure(j, exc) from exc

    def recv(self, ins: Recv, at: int | None = None) -> None:
        """Post the receive now (it moves no bytes until the sender's are there); ``at``:
        the ``RECV``'s own position when it is posted ahead of it (its completion is
        recorded there)."""
        interp = self.interp
        msg = interp._transfers[ins.transfer].messages[ins.message]
        mb = ins.buffer.mb
        handle = interp.transport.irecv(
            msg.nbytes, ins.peer, self.tag(ins.transfer, mb, ins.message)
        )
        if at is not None and type(handle) is _TimedHandle:
            handle.index = at
        key = (str(ins.transfer), mb, ins.message)
        self.posted.setdefault(ins.buffer, []).append((msg, _Sent(handle), key))

    def collective(self, i: int, ins: Collective) -> None:
        if ins.kind == "allreduce":
            self.allreduce(i, ins)
            return
        if ins.kind == "allgather" and ins.buffer.kind is BufferKind.ACCUMULATORS:
            issue_gather(self, i, ins)  # replicas' sparse gradient rows, max/min keys
            return
        if ins.kind != "broadcast":
            raise MeshshardRuntimeError(f"collective {ins.kind} is not supported by this runtime")
        interp = self.interp
        msg = interp._transfers[ins.transfer].messages[ins.message]
        mb = ins.buffer.mb
        tag = self.tag(ins.transfer, mb, ins.message)
        chan = group_key(ins.transfer, msg.group)
        key = (str(ins.transfer), mb, ins.message)
        if interp.worker == ins.root:
            value = self.value(ins.buffer)[0]

            def root():
                data = read_message(interp.blocks, value, msg)
                self.stamp("sent", key)
                return interp.transport.ibroadcast(data, msg.nbytes, msg.group, chan, tag)

            self.sends.append(self.issue(i, ins.priority, root, chan, msg.group))
        else:
            fn = lambda: interp.transport.ibroadcast(None, msg.nbytes, msg.group, chan, tag)  # noqa: E731
            self.posted.setdefault(ins.buffer, []).append(
                (msg, self.issue(i, ins.priority, fn, chan, msg.group), key)
            )

    def allreduce(self, i: int, ins: Collective) -> None:
        """Contribute this mesh's partial (its leader worker) or the identity (the
        mesh's other workers) to the all-reduce of ``ins.buffer``."""
        if ins.buffer.kind is BufferKind.ACCUMULATORS:  # data-parallel replicas
            issue_chunk(self, i, ins)
            return
        interp = self.interp
        r = interp.plan.reduction(ins.buffer)
        value = self.value(ins.buffer)[0]
        del self.buffers[ins.buffer]
        chan = reduction_key(r.name, r.group)

        def fn():
            if interp.worker in r.leaders:
                data = np.asarray(value.addressable_shards[0].data)
            else:
                data = reduction_identity(r.op, r.tensor.shape, r.tensor.dtype)
            self.stamp("sent", (chan, None, 0))
            return interp.transport.iallreduce(data, r.op, r.group, chan)

        handle = self.issue(i, ins.priority, fn, chan, r.group)
        self.posted[ins.buffer] = [(None, handle, (chan, None, 0))]

    def wait(self, ins: Wait) -> None:
        interp, name = self.interp, ins.buffer
        if name.kind is BufferKind.ACCUMULATORS:  # data-parallel replicas' gradients
            fn = wait_grads(self, name)
            if self.prefetch is None:
                self.buffers[name] = fn()
            else:
                self.later[name] = lazy = Lazy(fn)
                self.prefetch.add(lazy)
            return
        posted = self.posted.pop(name)

        def arrived(handle, key):
            raw = handle.result().wait()
            self.stamp("arrived", key)
            interp.progress += 1
            return raw

        if name.kind is BufferKind.REDUCTION:
            ((_, h, key),) = posted

            def fn():
                full = np.asarray(arrived(h, key))
                return array_from_host(full, sharding(interp.mesh, ()))
        else:
            t = interp._transfers[name.transfer]
            size = jax.numpy.dtype(t.tensor.dtype).itemsize

            def fn():
                parts = [
                    part
                    for msg, h, key in posted
                    for part in received_parts(msg, arrived(h, key), size)
                ]
                return interp.blocks.assemble(t, parts)

        if self.prefetch is None:
            self.buffers[name] = (fn(),)
            return
        self.later[name] = lazy = Lazy(fn)
        if self.prefetching:
            self.prefetch.add(lazy)

    # --- end of step -------------------------------------------------------------------
    def finish(self) -> None:
        """Complete what the stream left in flight; keep the timeline when recording."""
        for name in list(self.later) + list(self.pending):
            self.value(name)
        if self.tl is not None:
            for i, t0, done in self.runs:
                done.get()  # computed here if the watcher was stopped before it
                self.tl.runs.append((i, t0, done.at_ns))
            self.interp.last_timeline = self.tl
            self.interp.timelines.append((self.seq, self.tl))

    def close(self, failed: bool) -> None:
        """Stop this step's watcher; after a failure also the interpreter's helpers
        (ops of the failed step may still be queued there)."""
        if self.watch is not None:
            self.watch.close()
        if failed:
            self.interp._drop_helpers()
