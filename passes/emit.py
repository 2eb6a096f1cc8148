"""Pass: emit one static instruction stream per worker from the schedule.

Per task of a stage, every worker of the stage's mesh gets, in order: ``LOAD`` of the
micro-batch's inputs, ``RECV``/``WAIT`` of incoming transfers, the ``RUN``, ``SEND`` of
outgoing transfers, and ``FREE`` of every per-micro-batch buffer after its last use.
A step starts with ``ZEROS`` of the gradient accumulators and ends with the update
``RUN`` of each mesh and a ``WAITALL`` for outstanding sends.  What a transfer puts on
the wire comes from :func:`~meshshard.passes.lower_transfer.lower_transfer`.
"""

from __future__ import annotations

from meshshard.instructions import (
    Free,
    Instruction,
    Load,
    Run,
    WaitAll,
    WorkerStream,
    Zeros,
)
from meshshard.passes.lower_transfer import lower_transfer, transfer_streams
from meshshard.passes.stage_graph import StageGraph
from meshshard.plan import MeshSpec, Plan, Schedule, TransferSpec

PER_MB_PREFIXES = ("X", "R", "t")


def _name(group: str, mb: int) -> str:
    return f"{group}@{mb}" if group[0] in PER_MB_PREFIXES else group


def emit_streams(
    graph: StageGraph,
    schedule: Schedule,
    meshes: tuple[MeshSpec, ...],
    transfers: tuple[TransferSpec, ...],
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
                    out += lower_transfer(by_name[g], f"{g}@{k}", w)
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
                    out += lower_transfer(by_name[g], f"{g}@{k}", w)
                    out.append(Free(buffer=f"{g}@{k}"))
                for g in incoming:
                    out.append(Free(buffer=f"{g}@{k}"))
                if ph == "B" and groups.get(f"R{s}"):
                    out.append(Free(buffer=f"R{s}@{k}"))
                if x_readers[s] and x_readers[s][-1] == ph:
                    out.append(Free(buffer=f"X{s}@{k}"))

    for m in meshes:
        prog = progs[f"m{m.id}.apply"]
        for w in m.workers:
            out = streams[w]
            out.append(
                Run(
                    program=prog.name,
                    mb=None,
                    inputs=tuple(g for g, _ in prog.inputs),
                    outputs=tuple(g for g, _ in prog.outputs),
                )
            )
            if groups.get(f"A{m.id}"):
                out.append(Free(buffer=f"A{m.id}"))
            out.append(WaitAll())
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
