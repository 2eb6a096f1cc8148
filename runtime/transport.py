"""Point-to-point transports between workers.

``TorchTransport`` is the real data plane (torch.distributed: gloo on CPU, NCCL on
GPU); ``QueueTransport`` moves bytes between threads of one process for fast tests of
the interpreter.  Both send raw bytes: the plan knows every message's dtype and shape.

A torch transport takes one of two data paths, fixed when it is made (at plan compile
time, by :func:`data_path`):

``host``
    gloo: blocks are NumPy bytes (a device array is copied to the host first).
``device``
    NCCL with the worker's arrays on GPUs: a block is the JAX array itself, handed to
    torch by DLPack (no host round trip), and a received block is a JAX array on the
    worker's first device.

NCCL moves only GPU memory, so NCCL with host arrays (CPU devices, or the NumPy tiles
of a transfer-only plan) is refused with an error when the transport is made, rather
than failing or hanging at the first message.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from meshshard.errors import MeshshardInputError, MeshshardRuntimeError

HOST, DEVICE = "host", "device"
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def data_path(backend: str, platform: str | None) -> str:
    """The path (``HOST`` or ``DEVICE``) a torch transport over ``backend`` takes for a
    worker whose arrays live on ``platform`` devices (None: host NumPy data).

    Raises MeshshardInputError for NCCL with host data, which NCCL cannot send.
    """
    on_gpu = platform in GPU_PLATFORMS
    if backend != "nccl":
        return HOST
    if on_gpu:
        return DEVICE
    what = f"on {platform!r} devices" if platform else "host NumPy tiles (a transfer-only plan)"
    raise MeshshardInputError(
        f"the transfer backend is NCCL but this worker's data is {what}: NCCL moves only "
        "GPU memory, so the first message would fail or hang. Run the plan on GPU devices "
        "(jax with CUDA on every host-actor), or use the gloo backend for host data "
        "(a cluster whose actors have no GPUs uses gloo)"
    )


def _torch_device(device):
    """The torch device of JAX device ``device`` (its local CUDA ordinal)."""
    import torch

    return torch.device("cuda", device.local_hardware_id)


def _backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else "gloo"


class Handle(Protocol):
    def wait(self): ...


class Transport(Protocol):
    """Issue sends and receives of raw bytes; ``wait()`` on the handle completes them."""

    def isend(self, data: np.ndarray, peer: int, tag: int) -> Handle: ...

    def irecv(self, nbytes: int, peer: int, tag: int) -> Handle: ...

    def ibroadcast(
        self, data: np.ndarray | None, nbytes: int, group: tuple[int, ...], key: str, tag: int
    ) -> Handle:
        """Broadcast ``nbytes`` from ``group[0]`` (which passes ``data``) to the others;
        a receiver's ``wait()`` returns the bytes.  ``key`` names the group's channel."""
        ...

    def iallreduce(self, data: np.ndarray, op: str, group: tuple[int, ...], key: str) -> Handle:
        """Reduce ``data`` element-wise with ``op`` over every member of ``group``; each
        member's ``wait()`` returns the result (same shape and dtype as ``data``)."""
        ...

    def iallgather(self, data: np.ndarray, group: tuple[int, ...], key: str) -> Handle:
        """Gather every member's ``data`` (raw bytes, the same size on every member);
        each member's ``wait()`` returns the list of them in ``group`` order."""
        ...

    def sum_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype :meth:`iallreduce` sums ``dtype`` values in (so a sum done outside
        it, such as the sparse rows', gets the same bits)."""
        ...


def reduce_arrays(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """``op`` (sum, max, min, and, or) over ``arrays`` element-wise, in list order."""
    fn = {
        "sum": np.add,
        "max": np.maximum,
        "min": np.minimum,
        "and": np.logical_and,
        "or": np.logical_or,
    }[op]
    out = arrays[0]
    for a in arrays[1:]:
        out = fn(out, a)
    return np.asarray(out, dtype=arrays[0].dtype)


def _as_bytes(data: np.ndarray) -> np.ndarray:
    """A writable flat uint8 view of ``data`` (copied only if it is not already one)."""
    arr = np.ascontiguousarray(data)
    if not arr.flags.writeable:
        arr = arr.copy()
    return arr.reshape(-1).view(np.uint8)


class _Then:
    """A handle whose ``wait()`` returns ``fn`` of the wrapped handle's result."""

    def __init__(self, handle, fn: Callable):
        self.handle, self.fn = handle, fn

    def wait(self):
        return self.fn(self.handle.wait())


class _Done:
    def __init__(self, value=None):
        self.value = value

    def wait(self):
        return self.value


class _Abandon:
    """A step its workers abandon: set when one worker fails, so the others stop waiting
    for messages it will never send (within :data:`ABANDON_POLL_S`)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = reason
        self.event.set()


#: How often a waiting receive looks whether its step was abandoned (seconds).
ABANDON_POLL_S = 0.1


class QueueTransport:
    """In-process transport: one queue per (src, dst, tag), shared by all workers' views.

    A receive that waits ``timeout_s`` raises TimeoutError (a deadlock detector for
    tests).  The default is generous: on a loaded 2-core machine one worker thread of a
    GPT pipeline can spend over a minute between two messages.  When a worker fails,
    :meth:`abandon` makes every other worker's waiting receive fail at once instead.
    """

    def __init__(
        self,
        rank: int,
        queues: dict,
        lock: threading.Lock,
        timeout_s: float = 300.0,
        abandoned: _Abandon | None = None,
    ):
        self.rank = rank
        self._queues = queues
        self._lock = lock
        self.timeout_s = timeout_s
        self._abandoned = abandoned if abandoned is not None else _Abandon()

    @staticmethod
    def group(ranks) -> dict[int, QueueTransport]:
        """One transport per rank, all sharing the same queues."""
        queues: dict = {}
        lock = threading.Lock()
        abandoned = _Abandon()
        return {r: QueueTransport(r, queues, lock, abandoned=abandoned) for r in ranks}

    def abandon(self, reason: str) -> None:
        """Make every rank's waiting (and later) receives raise ``reason``: a worker
        failed, so messages it owes will not come."""
        self._abandoned.set(reason)

    def reset(self) -> None:
        """Before a step after an abandoned one: drop the messages it left queued."""
        if self._abandoned.event.is_set():
            with self._lock:
                self._queues.clear()
            self._abandoned.event.clear()

    def _q(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())

    def _get(self, q: queue.Queue, what: str):
        """The next item of ``q``; TimeoutError after ``timeout_s``, MeshshardRuntimeError
        as soon as the step is abandoned."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return q.get(timeout=max(0.0, min(ABANDON_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                if self._abandoned.event.is_set():
                    raise MeshshardRuntimeError(
                        f"w{self.rank} stopped waiting for {what}: {self._abandoned.reason}"
                    ) from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} did not arrive in {self.timeout_s}s") from None

    def isend(self, data: np.ndarray, peer: int, tag: int) -> Handle:
        self._q(self.rank, peer, tag).put(np.frombuffer(data.tobytes(), np.uint8))
        return _Done()

    def irecv(self, nbytes: int, peer: int, tag: int) -> Handle:
        q = self._q(peer, self.rank, tag)
        get = self._get

        class _Recv:
            def wait(self_inner):
                raw = get(q, f"message from w{peer} with tag {tag}")
                if raw.nbytes != nbytes:
                    raise ValueError(
                        f"expected {nbytes} bytes from w{peer} (tag {tag}), got {raw.nbytes}"
                    )
                return raw

        return _Recv()

    def ibroadcast(self, data, nbytes, group, key, tag):
        if self.rank == group[0]:
            for peer in group[1:]:
                self.isend(data, peer, tag)
            return _Done()
        return self.irecv(nbytes, group[0], tag)

    def iallreduce(self, data, op, group, key):
        """Every member sends its value to the others and reduces all of them in group
        order, so every member computes the same bits."""
        parts = self._exchange(np.array(data, copy=True), group, "all-reduce", key)
        return _Then(parts, lambda values: reduce_arrays(op, values))

    def iallgather(self, data, group, key):
        """Every member sends its bytes to the others; ``wait()`` lists all in group order."""
        mine = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8)
        return self._exchange(mine, group, "all-gather", key)

    def _exchange(self, mine: np.ndarray, group, what: str, key: str) -> Handle:
        """Send ``mine`` to every other member of ``group``; ``wait()`` lists every
        member's value in group order (a TimeoutError names a member that never sent)."""
        tag = (what, key)
        for peer in group:
            if peer != self.rank:
                self._q(self.rank, peer, tag).put(mine)
        queues = {p: self._q(p, self.rank, tag) for p in group if p != self.rank}
        get = self._get

        class _Exchange:
            def wait(self_inner):
                return [
                    mine if p not in queues else get(queues[p], f"{what} {key}: w{p}'s part")
                    for p in group
                ]

        return _Exchange()

    @staticmethod
    def sum_dtype(dtype) -> np.dtype:
        """Sums run in the values' own dtype (:func:`reduce_arrays`)."""
        return np.dtype(dtype)


class TorchTransport:
    """torch.distributed point-to-point over the default process group.

    Args:
        rank: this worker's rank (its host index).
        groups: broadcast channels by key (:meth:`create_groups`).
        devices: the JAX devices of this worker's arrays; None when it moves host
            NumPy data (transfer-only plans).  With the group's backend they fix the
            data path (module docstring); NCCL with host data raises here.
    """

    def __init__(self, rank: int, groups: dict | None = None, devices: Sequence | None = None):
        self.rank = rank
        self.groups = groups if groups is not None else {}
        self.backend = _backend()
        self.path = data_path(self.backend, devices[0].platform if devices else None)
        self.device = None
        if self.path == DEVICE:
            from meshshard.runtime.device_blocks import local_devices

            self.device = _torch_device(local_devices(devices)[0])

    def _wire(self, data):
        """``data`` as a flat torch uint8 tensor: a DLPack view of a device array, or
        NumPy bytes on the host path."""
        import torch

        if self.path == HOST:
            return torch.from_numpy(_as_bytes(np.asarray(data)))
        if isinstance(data, np.ndarray):
            raise MeshshardRuntimeError(
                "the NCCL transport was handed a host NumPy block; on the device path "
                "blocks must be JAX arrays on the worker's GPU (read them with DeviceBlocks)"
            )
        return torch.from_dlpack(data).reshape(-1).view(torch.uint8)

    def _empty(self, nbytes: int):
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device or "cpu")

    def _out(self, tensor):
        """A received tensor as the path's array type (NumPy, or a JAX array on device)."""
        if self.path == HOST:
            return tensor.numpy()
        import jax

        return jax.dlpack.from_dlpack(tensor)

    @staticmethod
    def create_groups(keys: list[tuple[str, tuple[int, ...]]]) -> dict:
        """Make one torch process group per (key, ranks), in the given order.

        Every process of the default group must call this with the same list (torch
        requires it); a process gets handles only for groups it belongs to.
        """
        import torch.distributed as dist

        out = {}
        for key, ranks in keys:
            g = dist.new_group(ranks=list(ranks))
            if dist.get_rank() in ranks:
                out[key] = g
        return out

    def isend(self, data, peer: int, tag: int) -> Handle:
        import torch.distributed as dist

        tensor = self._wire(data)  # the handle keeps it alive until the send completes
        return _TorchWork(dist.isend(tensor, dst=peer, tag=tag), tensor, _same)

    def irecv(self, nbytes: int, peer: int, tag: int) -> Handle:
        import torch.distributed as dist

        tensor = self._empty(nbytes)
        return _TorchWork(dist.irecv(tensor, src=peer, tag=tag), tensor, self._out)

    def ibroadcast(self, data, nbytes, group, key, tag):
        import torch.distributed as dist

        tensor = self._wire(data) if self.rank == group[0] else self._empty(nbytes)
        work = dist.broadcast(tensor, src=group[0], group=self.groups[key], async_op=True)
        return _TorchWork(work, tensor, self._out)

    def iallreduce(self, data, op, group, key):
        """``torch.distributed.all_reduce`` on the group's channel: values in float64
        (bools as 0/1 with and = min, or = max), converted back to ``data``'s dtype."""
        import torch
        import torch.distributed as dist

        dtype = np.asarray(data).dtype
        tensor = torch.from_numpy(np.array(data, dtype=np.float64, copy=True))
        red = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "and": dist.ReduceOp.MIN,
            "or": dist.ReduceOp.MAX,
        }[op]
        work = dist.all_reduce(tensor, op=red, group=self.groups[key], async_op=True)
        return _TorchWork(work, tensor, lambda t: t.numpy().astype(dtype))

    def iallgather(self, data, group, key):
        """``torch.distributed.all_gather`` of raw bytes on the group's channel (host
        tensors, as :meth:`iallreduce`)."""
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(_as_bytes(np.asarray(data)))
        outs = [torch.empty_like(tensor) for _ in group]
        work = dist.all_gather(outs, tensor, group=self.groups[key], async_op=True)
        return _TorchWork(work, outs, lambda ts: [t.numpy() for t in ts])

    @staticmethod
    def sum_dtype(dtype) -> np.dtype:
        """:meth:`iallreduce` sums in float64 and converts back."""
        return np.dtype(np.float64)


def _same(tensor):
    return tensor


class _TorchWork:
    """A torch.distributed op in flight: ``wait()`` returns ``out(tensor)`` once done."""

    __slots__ = ("work", "tensor", "out")

    def __init__(self, work, tensor, out: Callable):
        self.work, self.tensor, self.out = work, tensor, out

    def wait(self):
        self.work.wait()
        return self.out(self.tensor)


class CountingTransport:
    """Wraps a transport and counts the bytes this worker sends and receives."""

    def __init__(self, inner):
        self.inner = inner
        self.rank = inner.rank
        self.path = getattr(inner, "path", HOST)
        self.bytes_sent = 0
        self.bytes_received = 0

    def isend(self, data, peer, tag):
        self.bytes_sent += data.nbytes
        return self.inner.isend(data, peer, tag)

    def irecv(self, nbytes, peer, tag):
        return self._counted(self.inner.irecv(nbytes, peer, tag))

    def ibroadcast(self, data, nbytes, group, key, tag):
        if self.rank == group[0]:
            self.bytes_sent += nbytes * (len(group) - 1)
            return self.inner.ibroadcast(data, nbytes, group, key, tag)
        return self._counted(self.inner.ibroadcast(data, nbytes, group, key, tag))

    def iallreduce(self, data, op, group, key):
        self.bytes_sent += data.nbytes * (len(group) - 1)
        return self._counted(self.inner.iallreduce(data, op, group, key))

    def iallgather(self, data, group, key):
        self.bytes_sent += data.nbytes * (len(group) - 1)
        inner = self.inner.iallgather(data, group, key)
        outer = self

        class _Counted:
            def wait(self_inner):
                parts = inner.wait()
                outer.bytes_received += sum(p.nbytes for p in parts) - data.nbytes
                return parts

        return _Counted()

    def sum_dtype(self, dtype) -> np.dtype:
        return self.inner.sum_dtype(dtype)

    def _counted(self, handle):
        outer = self

        class _Counted:
            def wait(self_inner):
                raw = handle.wait()
                outer.bytes_received += raw.nbytes
                return raw

        return _Counted()
