"""Pass: the update part of every worker's stream, phase by phase.

Per mesh and phase: receive the values moved to it (``RECV``/``WAIT``), wait for the
all-reduces the previous phase issued, ``RUN`` the phase, then issue what ends the
phase: the sends of moved values and one ``COLL allreduce`` per reduction (every
worker of every mesh takes part, so the collective matches by construction; a worker
running several meshes, interleaved chunks, takes part once, after its last partial,
which its runtime combines with the earlier ones).  The
accumulators ``A{m}`` and the carry ``K{m}`` are freed after the last phase.
"""

from __future__ import annotations

from meshshard.instructions import Collective, Free, Instruction, Run, Wait, Zeros
from meshshard.plan import MeshSpec, ReductionSpec
from meshshard.refs import BufferKind, BufferRef, CollectiveKind, Phase, ProgramRef

_T, _R = BufferKind.TRANSFER, BufferKind.REDUCTION


def apply_instructions(
    graph,
    progs: dict,
    meshes: tuple[MeshSpec, ...],
    transfers: dict,
    reductions: tuple[ReductionSpec, ...],
    lower_transfer,
) -> dict[int, list[Instruction]]:
    """The update instructions of each worker (before its final ``WAITALL``)."""
    n_ph = graph.apply_phases
    out: dict[int, list[Instruction]] = {w: [] for m in meshes for w in m.workers}
    for m in meshes:
        carry = BufferRef(BufferKind.CARRY, m.id)
        if graph.group(carry):
            for w in m.workers:
                out[w].append(Zeros(buffer=carry))
    by_name = {r.name: r for r in reductions}
    for ph in range(n_ph):
        phase_progs = [
            (m, progs.get(ProgramRef(Phase.APPLY, m.id, part=None if n_ph == 1 else ph)))
            for m in meshes
        ]
        ends = _reduction_ends(phase_progs)
        for m, prog in phase_progs:
            if prog is None:  # a forward-only stage whose results need no combining
                continue
            for w in m.workers:
                out[w] += _phase(prog, w, transfers, by_name, lower_transfer, ends)
                if ph == n_ph - 1:
                    for kind in (BufferKind.ACCUMULATORS, BufferKind.CARRY):
                        if graph.group(BufferRef(kind, m.id)):
                            out[w].append(Free(buffer=BufferRef(kind, m.id)))
    return out


def _reduction_ends(phase_progs) -> dict:
    """(worker, all-reduce buffer, read?) -> the phase's first and last program on that
    worker that reads (read? True) or writes (False) the buffer.  A worker running
    several meshes (interleaved chunks) combines their partials and takes part once: it
    issues the ``COLL`` after the last writer, ``WAIT`` s before the first reader and
    frees after the last reader."""
    ends: dict = {}
    for m, prog in phase_progs:
        if prog is None:
            continue
        for w in m.workers:
            for g in (*prog.inputs, *prog.outputs):
                if g.ref.kind is _R:
                    first, _ = ends.get((w, g.ref, g in prog.inputs), (prog.name, None))
                    ends[(w, g.ref, g in prog.inputs)] = (first, prog.name)
    return ends


def _phase(prog, w, transfers, reductions: dict, lower_transfer, ends) -> list[Instruction]:
    ins = [g.ref for g in prog.inputs]
    outs = [g.ref for g in prog.outputs]
    out: list[Instruction] = []

    def first(g, reads: bool) -> bool:
        return ends[(w, g, reads)][0] == prog.name

    def last(g, reads: bool) -> bool:
        return ends[(w, g, reads)][1] == prog.name

    for g in ins:
        if g.kind is _T:
            out += lower_transfer(transfers[g.transfer], g.at(0), w)
        elif g.kind is _R and first(g, True):
            out.append(Wait(buffer=g))
    out.append(
        Run(
            program=prog.name,
            mb=None,
            inputs=tuple(g.at(0) for g in ins),
            outputs=tuple(g.at(0) for g in outs),
        )
    )
    for g in outs:
        if g.kind is _T:
            out += lower_transfer(transfers[g.transfer], g.at(0), w)
            if not transfers[g.transfer].is_local:  # else the consumer here frees it
                out.append(Free(buffer=g.at(0)))
        elif g.kind is _R and last(g, False):
            group = reductions[str(g)].group
            out.append(
                Collective(
                    kind=CollectiveKind.ALLREDUCE,
                    buffer=g,
                    transfer=None,
                    message=0,
                    group=group,
                    root=None,
                )
            )
    for g in ins:
        if g.kind is _T or (g.kind is _R and last(g, True)):
            out.append(Free(buffer=g.at(0)))
    return out
