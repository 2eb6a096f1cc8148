"""Pass: the update part of every worker's stream, phase by phase.

Per mesh and phase: receive the values moved to it (``RECV``/``WAIT``), wait for the
all-reduces the previous phase issued, ``RUN`` the phase, then issue what ends the
phase: the sends of moved values and one ``COLL allreduce`` per reduction (every
worker of every mesh takes part, so the collective matches by construction).  The
accumulators ``A{m}`` and the carry ``K{m}`` are freed after the last phase.
"""

from __future__ import annotations

from meshshard.instructions import Collective, Free, Instruction, Run, Wait, Zeros
from meshshard.plan import MeshSpec, ReductionSpec, TransferSpec


def apply_instructions(
    programs: dict,
    groups: dict,
    meshes: tuple[MeshSpec, ...],
    num_phases: int,
    transfers: dict[str, TransferSpec],
    reductions: tuple[ReductionSpec, ...],
    send_side,
    receive_side,
) -> dict[int, list[Instruction]]:
    """The update instructions of each worker (before its final ``WAITALL``)."""
    from meshshard.passes.apply_programs import program_name

    out: dict[int, list[Instruction]] = {w: [] for m in meshes for w in m.workers}
    for m in meshes:
        if groups.get(f"K{m.id}"):
            for w in m.workers:
                out[w].append(Zeros(buffer=f"K{m.id}"))
    for ph in range(num_phases):
        for m in meshes:
            prog = programs[program_name(m.id, ph, num_phases)]
            for w in m.workers:
                out[w] += _phase(prog, w, transfers, reductions, send_side, receive_side)
                if ph == num_phases - 1:
                    for g in (f"A{m.id}", f"K{m.id}"):
                        if groups.get(g):
                            out[w].append(Free(buffer=g))
    return out


def _phase(prog, w, transfers, reductions, send_side, receive_side) -> list[Instruction]:
    ins_names = [g for g, _ in prog.inputs]
    out_names = [g for g, _ in prog.outputs]
    out: list[Instruction] = []
    for g in ins_names:
        if g.startswith("t"):
            out += receive_side(transfers[g], f"{g}@0", w)
        elif g.startswith("r"):
            out.append(Wait(buffer=g))
    out.append(
        Run(
            program=prog.name,
            mb=None,
            inputs=tuple(_buf(g) for g in ins_names),
            outputs=tuple(_buf(g) for g in out_names),
        )
    )
    by_name = {r.name: r for r in reductions}
    for g in out_names:
        if g.startswith("t"):
            out += send_side(transfers[g], f"{g}@0", w)
            out.append(Free(buffer=f"{g}@0"))
        elif g.startswith("r"):
            r = by_name[g]
            out.append(
                Collective(
                    kind="allreduce", buffer=g, transfer=g, message=0, group=r.group, root=None
                )
            )
    for g in ins_names:
        if g.startswith(("t", "r")):
            out.append(Free(buffer=_buf(g)))
    return out


def _buf(group: str) -> str:
    return f"{group}@0" if group.startswith("t") else group
