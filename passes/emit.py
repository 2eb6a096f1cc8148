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
from meshshard.passes.emit_apply import apply_instructions
from meshshard.passes.stage_graph import StageGraph
from meshshard.plan import MeshSpec, Plan, ReductionSpec, Schedule, TransferSpec

PER_MB_PREFIXES = ("X", "R", "t")


def _ordered(t: TransferSpec) -> list[int]:
    """Message indices in issue order: by round, then plan order."""
    return sorted(range(len(t.messages)), key=lambda i: (t.messages[i].round, i))


def _issue(t: TransferSpec, buffer: str, w: int, sending: bool) -> list[Instruction]:
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


def send_side(t: TransferSpec, buffer: str, w: int) -> list[Instruction]:
    """What worker ``w`` of the source mesh issues to send ``buffer`` of transfer ``t``."""
    return _issue(t, buffer, w, sending=True)


def receive_side(t: TransferSpec, buffer: str, w: int) -> list[Instruction]:
    """What worker ``w`` of the destination mesh issues to receive ``buffer``, then waits."""
    return _issue(t, buffer, w, sending=False) + [Wait(buffer=buffer)]


def transfer_streams(
    t: TransferSpec, meshes: tuple[MeshSpec, ...], mb: int = 0
) -> tuple[WorkerStream, ...]:
    """Streams that run transfer ``t`` alone (micro-batch ``mb``): the source workers send
    and free, the destination workers receive and wait; every stream ends in WAITALL."""
    buffer = f"{t.name}@{mb}"
    streams = []
    for w in meshes[t.src_mesh].workers:
        streams.append(
            WorkerStream(w, tuple(send_side(t, buffer, w)) + (Free(buffer=buffer), WaitAll()))
        )
    for w in meshes[t.dst_mesh].workers:
        streams.append(WorkerStream(w, tuple(receive_side(t, buffer, w)) + (WaitAll(),)))
    return tuple(sorted(streams, key=lambda s: s.worker))


def _name(group: str, mb: int) -> str:
    return f"{group}@{mb}" if group[0] in PER_MB_PREFIXES else group


def emit_streams(
    graph: StageGraph,
    schedule: Schedule,
    meshes: tuple[MeshSpec, ...],
    transfers: tuple[TransferSpec, ...],
    reductions: tuple[ReductionSpec, ...] = (),
) -> tuple[WorkerStream, ...]:
    """The per-worker instruction streams that run ``schedule`` over ``graph``."""
    streams: dict[int, list[Instruction]] = {w: [] for m in meshes for w in m.workers}
    by_name = {t.name: t for t in transfers}
    progs = {p.name: p for p in graph.programs}
    groups = dict(graph.groups)
    # the phases (F, B) of each stage whose program reads the batch inputs X{s}
    x_readers = {
        s: [ph for ph in ("F", "B") if any(g == f"X{s}" for g, _ in progs[f"s{s}.{ph}"].inputs)]
        for s in range(graph.num_stages)
    }

    for s in range(graph.num_stages):
        if groups.get(f"A{s}"):
            for w in meshes[s].workers:
                streams[w].append(Zeros(buffer=f"A{s}"))

    for row in schedule.ticks:
        for task in row:
            if task is None:
                continue
            s, k, ph = task.stage, task.mb, task.kind
            prog = progs[f"s{s}.{ph}"]
            for w in meshes[s].workers:
                out = streams[w]
                if x_readers[s] and x_readers[s][0] == ph:
                    out.append(Load(buffer=f"X{s}@{k}", mb=k))
                incoming = [g for g, _ in prog.inputs if g.startswith("t")]
                for g in incoming:
                    out += receive_side(by_name[g], f"{g}@{k}", w)
                out.append(
                    Run(
                        program=prog.name,
                        mb=k,
                        inputs=tuple(_name(g, k) for g, _ in prog.inputs),
                        outputs=tuple(_name(g, k) for g, _ in prog.outputs),
                    )
                )
                outgoing = [g for g, _ in prog.outputs if g.startswith("t")]
                for g in outgoing:
                    out += send_side(by_name[g], f"{g}@{k}", w)
                    out.append(Free(buffer=f"{g}@{k}"))
                for g in incoming:
                    out.append(Free(buffer=f"{g}@{k}"))
                if ph == "B" and groups.get(f"R{s}"):
                    out.append(Free(buffer=f"R{s}@{k}"))
                if x_readers[s] and x_readers[s][-1] == ph:
                    out.append(Free(buffer=f"X{s}@{k}"))

    update = apply_instructions(
        progs, groups, meshes, graph.apply_phases, by_name, reductions, send_side, receive_side
    )
    for w, ins in update.items():
        streams[w] += ins + [WaitAll()]
    return tuple(WorkerStream(w, tuple(ins)) for w, ins in sorted(streams.items()))


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
