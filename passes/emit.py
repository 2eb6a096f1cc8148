"""Pass: emit one static instruction stream per worker from the schedule.

Per task of a stage, every worker of the stage's mesh gets, in order: ``LOAD`` of the
micro-batch's inputs, ``RECV``/``WAIT`` of incoming transfers, the ``RUN``, ``SEND`` of
outgoing transfers, and ``FREE`` of every per-micro-batch buffer after its last use.
A step starts with ``ZEROS`` of the gradient accumulators and ends with the update
``RUN`` of each mesh and a ``WAITALL`` for outstanding sends.
"""

from __future__ import annotations

from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Load,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
    Zeros,
)
from meshshard.passes.stage_graph import StageGraph
from meshshard.plan import MeshSpec, Plan, Schedule, Task, TransferSpec
from meshshard.refs import BufferKind, BufferRef, Phase, ProgramRef, TaskKind


def _ordered(t: TransferSpec) -> list[int]:
    """Message indices in issue order: by round, then plan order."""
    return sorted(range(len(t.messages)), key=lambda i: (t.messages[i].round, i))


def _issue(t: TransferSpec, buffer: BufferRef, w: int, sending: bool) -> list[Instruction]:
    """The communication worker ``w`` issues for ``buffer`` of transfer ``t``, in order:
    a broadcast it takes part in is one ``COLL`` on both sides; a point-to-point
    message is a ``SEND`` on its sender and a ``RECV`` on its receiver."""
    out: list[Instruction] = []
    for i in _ordered(t):
        msg = t.messages[i]
        if (msg.src != w) if sending else (w not in msg.receivers):
            continue
        if msg.is_broadcast:
            out.append(
                Collective(
                    kind="broadcast",
                    buffer=buffer,
                    transfer=t.name,
                    message=i,
                    group=msg.group,
                    root=msg.src,
                )
            )
        elif sending:
            out.append(Send(buffer=buffer, transfer=t.name, message=i, peer=msg.receivers[0]))
        else:
            out.append(Recv(buffer=buffer, transfer=t.name, message=i, peer=msg.src))
    return out


def send_side(t: TransferSpec, buffer: BufferRef, w: int) -> list[Instruction]:
    """What worker ``w`` of the source mesh issues to send ``buffer`` of transfer ``t``."""
    return _issue(t, buffer, w, sending=True)


def receive_side(t: TransferSpec, buffer: BufferRef, w: int) -> list[Instruction]:
    """What worker ``w`` of the destination mesh issues to receive ``buffer``, then waits."""
    return _issue(t, buffer, w, sending=False) + [Wait(buffer=buffer)]


def transfer_streams(
    t: TransferSpec, meshes: tuple[MeshSpec, ...], mb: int = 0
) -> tuple[WorkerStream, ...]:
    """Streams that run transfer ``t`` alone (micro-batch ``mb``): the source workers send
    and free, the destination workers receive and wait; every stream ends in WAITALL."""
    buffer = t.name.buffer(mb)
    streams = []
    for w in meshes[t.src_mesh].workers:
        streams.append(
            WorkerStream(w, tuple(send_side(t, buffer, w)) + (Free(buffer=buffer), WaitAll()))
        )
    for w in meshes[t.dst_mesh].workers:
        streams.append(WorkerStream(w, tuple(receive_side(t, buffer, w)) + (WaitAll(),)))
    return tuple(sorted(streams, key=lambda s: s.worker))


def emit_streams(
    graph: StageGraph,
    schedule: Schedule,
    meshes: tuple[MeshSpec, ...],
    transfers: tuple[TransferSpec, ...],
) -> tuple[WorkerStream, ...]:
    """The per-worker instruction streams that run ``schedule`` over ``graph``."""
    streams: dict[int, list[Instruction]] = {w: [] for m in meshes for w in m.workers}
    progs = {p.name: p for p in graph.programs}
    by_ref = {t.name: t for t in transfers}
    for s in range(graph.num_stages):
        if graph.group(BufferRef(BufferKind.ACCUMULATORS, s)):
            for w in meshes[s].workers:
                streams[w].append(Zeros(buffer=BufferRef(BufferKind.ACCUMULATORS, s)))
    for row in schedule.ticks:
        for task in row:
            if task is None:
                continue
            for w in meshes[task.stage].workers:
                streams[w] += _task_instructions(graph, progs, by_ref, task, w)
    for m in meshes:
        prog = progs[ProgramRef(Phase.APPLY, m.id)]
        for w in m.workers:
            out = streams[w]
            out.append(
                Run(
                    program=prog.name,
                    mb=None,
                    inputs=tuple(g.ref for g in prog.inputs),
                    outputs=tuple(g.ref for g in prog.outputs),
                )
            )
            if graph.group(BufferRef(BufferKind.ACCUMULATORS, m.id)):
                out.append(Free(buffer=BufferRef(BufferKind.ACCUMULATORS, m.id)))
            out.append(WaitAll())
    return tuple(WorkerStream(w, tuple(ins)) for w, ins in sorted(streams.items()))


def _batch_readers(graph: StageGraph, progs: dict, stage: int) -> list[TaskKind]:
    """The task kinds (F, B) of ``stage`` whose program reads its batch inputs ``X{s}``."""
    x = BufferRef(BufferKind.BATCH, stage)
    return [
        kind
        for kind in (TaskKind.F, TaskKind.B)
        if any(g.ref == x for g in progs[ProgramRef(kind.phase, stage)].inputs)
    ]


def _task_instructions(
    graph: StageGraph, progs: dict, by_ref: dict, task: Task, w: int
) -> list[Instruction]:
    """What worker ``w`` runs for one task: load, receive, run, send, free."""
    s, k = task.stage, task.mb
    prog = progs[task.program]
    readers = _batch_readers(graph, progs, s)
    out: list[Instruction] = []
    if readers and readers[0] == task.kind:
        out.append(Load(buffer=BufferRef(BufferKind.BATCH, s, k), mb=k))
    incoming = [g.ref for g in prog.inputs if g.ref.kind is BufferKind.TRANSFER]
    for g in incoming:
        out += receive_side(by_ref[g.transfer], g.at(k), w)
    out.append(
        Run(
            program=prog.name,
            mb=k,
            inputs=tuple(g.ref.at(k) for g in prog.inputs),
            outputs=tuple(g.ref.at(k) for g in prog.outputs),
        )
    )
    for g in (g.ref for g in prog.outputs if g.ref.kind is BufferKind.TRANSFER):
        out += send_side(by_ref[g.transfer], g.at(k), w)
        out.append(Free(buffer=g.at(k)))
    for g in incoming:
        out.append(Free(buffer=g.at(k)))
    if task.kind is TaskKind.B and graph.group(BufferRef(BufferKind.RESIDUALS, s)):
        out.append(Free(buffer=BufferRef(BufferKind.RESIDUALS, s, k)))
    if readers and readers[-1] == task.kind:
        out.append(Free(buffer=BufferRef(BufferKind.BATCH, s, k)))
    return out


def transfer_only_plan(t: TransferSpec, meshes: tuple[MeshSpec, ...], cluster) -> Plan:
    """A plan that runs nothing but transfer ``t`` (once): for resharding tests,
    benchmarks and the simulator."""
    return Plan(
        method=f"transfer {t.name} ({t.strategy})",
        cluster=cluster,
        num_micro_batches=1,
        fingerprint="",
        meshes=tuple(meshes),
        stages=(),
        programs=(),
        buffers=(),
        transfers=(t,),
        schedule=Schedule("none", 0, 1, ()),
        streams=transfer_streams(t, meshes),
        inputs=(),
        outputs=(),
    )
