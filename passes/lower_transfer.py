"""Pass: lower one planned transfer to the instructions one worker issues for it.

This is the only place a transfer's messages become ``SEND``/``RECV``/``COLL``: the
pipeline emitter, transfer-only plans, the resharding simulator and the simulator's
synthetic pipelines all call :func:`lower_transfer`, so the streams the simulator
times are the streams the runtime runs.

A worker issues its share of the messages in ``(round, position)`` order.  A message
whose group has three or more members is a broadcast: one ``COLL broadcast`` on every
member.  Any other message (no group, or a group of root and one receiver) is
point-to-point: a ``SEND`` on its sender and a ``RECV`` on its receiver.  A worker
that received anything then ``WAIT`` s for the buffer.

>>> from meshshard.plan import Message, TensorSpec, TransferSpec
>>> t = TransferSpec("t0", TensorSpec(0, "x", (8,), "int32", ()), (), 0, 1, "-", "-", (
...     Message(0, 1, ((0, 8),), 32, group=(0, 1)),
...     Message(0, 2, ((0, 8),), 32, group=(0, 2, 3), round=1)))
>>> for w in range(4):
...     print(f"w{w}:", " | ".join(map(str, lower_transfer(t, "t0@0", w))))
w0: SEND t0@0 #0 -> w1 | COLL broadcast t0@0 #1 [w0,w2,w3] root=w0
w1: RECV t0@0 #0 <- w0 | WAIT t0@0
w2: COLL broadcast t0@0 #1 [w0,w2,w3] root=w0 | WAIT t0@0
w3: COLL broadcast t0@0 #1 [w0,w2,w3] root=w0 | WAIT t0@0
"""

from __future__ import annotations

from collections.abc import Sequence

from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Recv,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
)
from meshshard.plan import MeshSpec, Message, TransferSpec
from meshshard.refs import BufferRef, CollectiveKind

__all__ = ["issue_order", "lower_transfer", "transfer_streams"]


def issue_order(messages: Sequence[Message]) -> list[int]:
    """Indices of ``messages`` in the order workers issue them: by round, then position."""
    return sorted(range(len(messages)), key=lambda i: (messages[i].round, i))


def _lower_message(
    t: TransferSpec, i: int, buffer: BufferRef, worker: int
) -> tuple[Instruction, ...]:
    """What ``worker`` issues for message ``i`` of ``t`` (nothing when it takes no part)."""
    msg = t.messages[i]
    if msg.is_broadcast:
        if worker not in msg.group:
            return ()
        coll = Collective(
            kind=CollectiveKind.BROADCAST,
            buffer=buffer,
            transfer=t.name,
            message=i,
            group=msg.group,
            root=msg.src,
        )
        return (coll,)
    peer = msg.receivers[0]
    out: tuple[Instruction, ...] = ()
    if worker == msg.src:
        out += (Send(buffer=buffer, transfer=t.name, message=i, peer=peer),)
    if worker == peer:
        out += (Recv(buffer=buffer, transfer=t.name, message=i, peer=msg.src),)
    return out


def _receives(ins: Instruction, worker: int) -> bool:
    return isinstance(ins, Recv) or (isinstance(ins, Collective) and ins.root != worker)


def lower_transfer(t: TransferSpec, buffer: BufferRef, worker: int) -> tuple[Instruction, ...]:
    """The instructions ``worker`` issues to move ``buffer`` by transfer ``t``.

    Its sends, receives and broadcasts in ``(round, position)`` order (module
    docstring), then ``WAIT buffer`` when it receives anything.  Where in a stream they
    go (after the producer's ``RUN``, before the consumer's) and what frees the buffer
    is the caller's choice; what runs on the wire is decided here only.
    """
    out = tuple(
        ins for i in issue_order(t.messages) for ins in _lower_message(t, i, buffer, worker)
    )
    if any(_receives(ins, worker) for ins in out):
        out += (Wait(buffer=buffer),)
    return out


def transfer_streams(
    t: TransferSpec, meshes: Sequence[MeshSpec], mb: int = 0
) -> tuple[WorkerStream, ...]:
    """The streams that run transfer ``t`` alone (micro-batch ``mb``), one per worker of
    its two meshes: the worker's share (:func:`lower_transfer`), ``FREE`` of the buffer
    on a worker that only sends, then ``WAITALL``.  Transfer-only plans run these, and
    the resharding simulator times them."""
    buffer = t.name.buffer(mb)
    src, dst = meshes[t.src_mesh].workers, meshes[t.dst_mesh].workers
    streams = []
    for w in sorted(set(src) | set(dst)):
        ins = lower_transfer(t, buffer, w)
        if w in src and w not in dst:
            ins += (Free(buffer=buffer),)
        streams.append(WorkerStream(w, ins + (WaitAll(),)))
    return tuple(streams)
