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
from meshshard.passes.emit_apply import apply_instructions
from meshshard.passes.lower_transfer import lower_transfer, transfer_streams
from meshshard.passes.shared_grads import step_copies
from meshshard.passes.stage_graph import StageGraph
from meshshard.plan import MeshSpec, Plan, ReductionSpec, Schedule, Task, TransferSpec
from meshshard.refs import BufferKind, BufferRef, ProgramRef, TaskKind


def emit_streams(
    graph: StageGraph,
    schedule: Schedule,
    meshes: tuple[MeshSpec, ...],
    transfers: tuple[TransferSpec, ...],
    reductions: tuple[ReductionSpec, ...] = (),
) -> tuple[WorkerStream, ...]:
    """The per-worker instruction streams that run ``schedule`` over ``graph``."""
    streams: dict[int, list[Instruction]] = {w: [] for m in meshes for w in m.workers}
    progs = {p.name: p for p in graph.programs}
    by_ref = {t.name: t for t in transfers}
    for s in range(graph.num_stages):
        if graph.group(BufferRef(BufferKind.ACCUMULATORS, s)):
            for w in meshes[s].workers:
                streams[w].append(Zeros(buffer=BufferRef(BufferKind.ACCUMULATORS, s)))
    once = (frozenset(step_copies(graph)), schedule.num_micro_batches)
    for row in schedule.ticks:
        for task in row:
            if task is None:
                continue
            if task.virtual is not None:  # interleaved: chunk c of mesh r is stage c*S + r
                task = Task(task.logical(schedule.num_stages), task.mb, task.kind)
            for w in meshes[task.stage].workers:
                streams[w] += _task_instructions(graph, progs, by_ref, task, w, once)
    update = apply_instructions(graph, progs, meshes, by_ref, reductions, lower_transfer)
    for w, ins in update.items():
        streams[w] += ins + [WaitAll()]
    return tuple(WorkerStream(w, tuple(ins)) for w, ins in sorted(streams.items()))


def _readers(progs: dict, stage: int, group: BufferRef) -> list[TaskKind]:
    """The task kinds (F, B, W) of ``stage`` whose program reads buffer group ``group``."""
    return [
        kind
        for kind in (TaskKind.F, TaskKind.B, TaskKind.W)
        if ProgramRef(kind.phase, stage) in progs  # no B in a forward-only step, W if split
        and any(g.ref == group for g in progs[ProgramRef(kind.phase, stage)].inputs)
    ]


def _task_instructions(
    graph: StageGraph, progs: dict, by_ref: dict, task: Task, w: int, once=(frozenset(), 1)
) -> list[Instruction]:
    """What worker ``w`` runs for one task: load, receive, run, send, free.

    A per-micro-batch input is loaded or received by the first task kind of the stage
    that reads it and freed after the last (a split backward's B and W may share one).
    ``once``: (the transfers that move once per step, M): a shared parameter's copy is
    sent and received with micro-batch 0 and read by every micro-batch as ``t@0``.
    """
    s, k = task.stage, task.mb
    prog = progs[task.program]
    x = BufferRef(BufferKind.BATCH, s)
    readers = {g.ref: _readers(progs, s, g.ref) for g in prog.inputs}
    copies, m = once
    out: list[Instruction] = []
    if x in readers and readers[x][0] == task.kind:
        out.append(Load(buffer=x.at(k), mb=k))
    incoming = [g.ref for g in prog.inputs if g.ref.kind is BufferKind.TRANSFER]
    incoming_once = {g for g in incoming if g.owner in copies}
    for g in incoming:
        if readers[g][0] == task.kind and (g not in incoming_once or k == 0):
            out += lower_transfer(by_ref[g.transfer], g.at(k), w)
    out.append(
        Run(
            program=prog.name,
            mb=k,
            inputs=tuple(g.ref.at(0 if g.ref in incoming_once else k) for g in prog.inputs),
            outputs=tuple(g.ref.at(k) for g in prog.outputs),
        )
    )
    for g in (g.ref for g in prog.outputs if g.ref.kind is BufferKind.TRANSFER):
        if g.owner not in copies or k == 0:
            out += lower_transfer(by_ref[g.transfer], g.at(k), w)
            if by_ref[g.transfer].is_local:  # the consumer reads it here and frees it
                continue
        out.append(Free(buffer=g.at(k)))
    kinds = (BufferKind.TRANSFER, BufferKind.RESIDUALS, BufferKind.BACKWARD_CARRY, BufferKind.BATCH)
    for kind in kinds:
        for g in (g.ref for g in prog.inputs if g.ref.kind is kind):
            if readers[g][-1] != task.kind:
                continue
            if g not in incoming_once:
                out.append(Free(buffer=g.at(k)))
            elif k == m - 1:
                out.append(Free(buffer=g.at(0)))
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
