"""Pass 4b: turn an update placement into per-mesh update programs and their buffers.

A one-phase update gives each mesh one program ``m{m}.apply`` reading ``A{m}`` (its
gradients), ``P{m}``/``S{m}`` (state) and writing ``O{m}`` (step results).  With
cross-mesh communication the update of mesh ``m`` is ``m{m}.apply0``, ``m{m}.apply1``,
...: a phase writes the partials of the all-reduces ``r{j}`` and the moved values
(transfers) that end it, and the next phase reads them.  Values a mesh computes or
receives in one phase and reads in a later one are carried in ``K{m}`` (zeroed at the
start of the update, read and rewritten by every phase).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.jaxpr_util import is_literal
from meshshard.passes.apply_placement import ApplyPlacement
from meshshard.refs import BufferGroup, BufferKind, BufferRef, Phase, ProgramRef

A, P, S, K, OUT = (  # buffer kinds (OUT prints as O)
    BufferKind.ACCUMULATORS,
    BufferKind.PARAMS,
    BufferKind.APPLY_STATE,
    BufferKind.CARRY,
    BufferKind.APPLY_OUTPUTS,
)


@dataclass(frozen=True)
class ApplyProgram:
    """One update phase of one mesh: equations and the groups it reads and writes."""

    name: ProgramRef
    mesh: int
    phase: int
    eqns: tuple[int, ...]
    inputs: tuple[tuple[BufferRef, tuple[int, ...] | None], ...]
    outputs: tuple[tuple[BufferRef, tuple[int, ...] | None], ...]


@dataclass(frozen=True)
class PlannedReduction:
    """An all-reduce ``name`` with the programs that make and read it."""

    name: str
    var: int
    op: str
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    literals: tuple[float, ...]
    producer: str
    consumer: str


@dataclass(frozen=True)
class ApplyGraph:
    """Everything the update adds to the stage graph."""

    programs: tuple[ApplyProgram, ...]
    groups: tuple[tuple[BufferRef, tuple[int, ...]], ...]
    moves: tuple[tuple[int, ProgramRef, ProgramRef], ...]  # (var, producer, consumer)
    reductions: tuple[PlannedReduction, ...]
    out_meshes: tuple[tuple[int, tuple[int, ...]], ...]  # output var id -> meshes


def program_name(mesh: int, phase: int, num_phases: int) -> ProgramRef:
    """``m{mesh}.apply`` for a one-phase update, else ``m{mesh}.apply{phase}``."""
    return ProgramRef(Phase.APPLY, mesh, part=None if num_phases == 1 else phase)


class _Sources:
    """Where each value read by the update comes from, on one mesh."""

    def __init__(self, placement: ApplyPlacement, eqn_outs: dict, grad_mesh: dict):
        self.computed: dict[tuple[int, int], int] = {}  # (var, mesh) -> phase
        for i, where in placement.runs:
            for var in eqn_outs[i]:
                for m, ph in where:
                    self.computed[(var, m)] = ph
        self.received: dict[tuple[int, int], tuple[str, int]] = {}  # -> (kind, phase)
        for mv in placement.moves:
            self.received.setdefault((mv.var, mv.dst), ("t", mv.phase + 1))
        self.reduced = {r.var: r.phase + 1 for r in placement.reductions}
        self.grad_mesh = grad_mesh

    def arrival(self, var: int, mesh: int) -> tuple[str, int] | None:
        """(how, phase) ``var`` becomes readable on ``mesh``: computed here (``c``),
        moved (``t``) or reduced (``r``); None for step inputs and gradients."""
        if var in self.reduced:
            return ("r", self.reduced[var])
        if (var, mesh) in self.computed:
            return ("c", self.computed[(var, mesh)])
        return self.received.get((var, mesh))


def build_apply_graph(
    jaxpr,
    ids: dict,
    placement: ApplyPlacement,
    num_meshes: int,
    grad_mesh: dict[int, int],
    state_reads: dict[int, dict[int, str]],
    outputs: tuple[int, ...],
) -> ApplyGraph:
    """Programs, groups and communication of the update.

    ``grad_mesh``: gradient var id -> mesh of its accumulator ``A{m}``;
    ``state_reads``: mesh -> {var id of a step input: the kind of group (``P``/``S``)
    holding it}, extended here with the ``S{m}`` reads the update adds;
    ``outputs``: var ids of step results the update computes.
    """
    eqns = jaxpr.eqns
    n_ph = placement.num_phases
    eqn_outs = {i: [ids[v] for v in eqns[i].outvars if v in ids] for i, _ in placement.runs}
    src = _Sources(placement, eqn_outs, grad_mesh)
    reads: dict[tuple[int, int], list[int]] = {}

    def read(var: int, mesh: int, phase: int) -> None:
        reads.setdefault((mesh, phase), [])
        if var not in reads[(mesh, phase)]:
            reads[(mesh, phase)].append(var)

    by_id = {i: v for v, i in ids.items()}
    for i, where in placement.runs:
        for v in eqns[i].invars:
            if not is_literal(v) and v in ids:
                for m, ph in where:
                    read(ids[v], m, ph)
    for r in placement.reductions:
        for m, vs in r.parts:
            for var in vs:
                read(var, m, r.phase)
    for mv in placement.moves:
        read(mv.var, mv.src, mv.phase)
    arrivals = dict(placement.arrivals)
    out_meshes = []
    for var in outputs:
        if var in grad_mesh and var not in arrivals:
            meshes = (grad_mesh[var],)
        else:
            meshes = tuple(m for m, _ in arrivals[var])
        out_meshes.append((var, meshes))
        for m in meshes:
            read(var, m, n_ph - 1)

    carry: dict[int, list[int]] = {m: [] for m in range(num_meshes)}
    for (m, ph), vs in sorted(reads.items()):
        for var in vs:
            how = src.arrival(var, m)
            if how is None:
                if var not in grad_mesh and var not in state_reads[m]:
                    if by_id[var] not in jaxpr.constvars:
                        state_reads[m][var] = S
            elif how[1] < ph and var not in carry[m]:
                carry[m].append(var)

    moves = tuple(
        (mv.var, program_name(mv.src, mv.phase, n_ph), program_name(mv.dst, mv.phase + 1, n_ph))
        for mv in placement.moves
    )
    reductions = tuple(
        PlannedReduction(
            f"r{j}",
            r.var,
            r.op,
            r.parts,
            r.literals,
            f"apply{r.phase}",
            f"apply{r.phase + 1}",
        )
        for j, r in enumerate(placement.reductions)
    )
    groups = _groups(num_meshes, state_reads, carry, out_meshes)
    programs = _programs(placement, eqns, n_ph, num_meshes, groups, moves, reductions)
    return ApplyGraph(programs, groups, moves, reductions, tuple(out_meshes))


def _groups(num_meshes, state_reads, carry, out_meshes) -> tuple:
    out = []
    for m in range(num_meshes):
        s_leaves = sorted(v for v, kind in state_reads[m].items() if kind is S)
        out.append((BufferRef(S, m), tuple(s_leaves)))
    out += [(BufferRef(K, m), tuple(carry[m])) for m in range(num_meshes)]
    out += [
        (BufferRef(OUT, m), tuple(v for v, ms in out_meshes if m in ms)) for m in range(num_meshes)
    ]
    return tuple(out)


def _programs(placement, eqns, n_ph, num_meshes, groups, moves, reductions) -> tuple:
    g = dict(groups)
    runs = {i: dict(where) for i, where in placement.runs}
    progs = []
    for ph in range(n_ph):
        for m in range(num_meshes):
            name = program_name(m, ph, n_ph)
            own = tuple(i for i, where in runs.items() if where.get(m) == ph)
            ins: list = [(BufferRef(kind, m), None) for kind in (A, P, S)]
            outs: list = []
            carry = BufferRef(K, m)
            if g[carry]:
                ins.append((carry, g[carry]))
                if ph < n_ph - 1:
                    outs.append((carry, g[carry]))
            for k, (var, prod, cons) in enumerate(moves):
                if cons == name:
                    ins.append((_move_ref(k), (var,)))
                if prod == name:
                    outs.append((_move_ref(k), (var,)))
            for j, r in enumerate(reductions):
                ref = BufferRef(BufferKind.REDUCTION, j)
                if r.consumer == f"apply{ph}":
                    ins.append((ref, (r.var,)))
                if r.producer == f"apply{ph}":
                    outs.append((ref, (r.var,)))
            if ph == n_ph - 1 and g[BufferRef(OUT, m)]:
                outs.append((BufferRef(OUT, m), g[BufferRef(OUT, m)]))
            progs.append(ApplyProgram(name, m, ph, own, tuple(ins), tuple(outs)))
    return tuple(progs)


def _move_ref(k: int) -> BufferRef:
    """Placeholder for move ``k`` (renumbered after the stage graph's own transfers)."""
    return BufferRef(BufferKind.TRANSFER, -1 - k)


def apply_program_ios(apply: ApplyGraph, groups: dict, first_move: int) -> list:
    """The update programs as stage-graph programs: ``A``/``P``/``S`` inputs with their
    contents (dropped when empty), the moves as transfers ``t{first_move + k}``."""
    from meshshard.passes.stage_graph import ProgramIO

    def resolve(pairs):
        out = []
        for ref, content in pairs:
            if ref.kind is BufferKind.TRANSFER and ref.owner < 0:
                ref = BufferRef(BufferKind.TRANSFER, first_move - 1 - ref.owner)
            if content is None:
                content = groups.get(ref, ())
                if not content:
                    continue
            out.append(BufferGroup(ref, content))
        return tuple(out)

    return [
        ProgramIO(p.name, p.mesh, p.eqns, resolve(p.inputs), resolve(p.outputs))
        for p in apply.programs
    ]


def plan_reductions(traced, graph, meshes) -> tuple:
    """A :class:`~meshshard.plan.ReductionSpec` per all-reduce of the update: every
    worker of every mesh takes part (once, however many meshes it runs); each mesh's
    first worker contributes its partial."""
    from meshshard.passes.sharding import tensor_specs
    from meshshard.plan import ReductionSpec, TensorSpec

    if not graph.reductions:
        return ()
    info = tensor_specs(traced)
    # meshes on the same workers (interleaved chunks) combine their partials on the
    # worker, which takes part once
    group = tuple(sorted({w for m in meshes for w in m.workers}))
    leaders = tuple(dict.fromkeys(m.workers[0] for m in meshes))
    out = []
    for r in graph.reductions:
        label, shape, dtype = info[r.var]
        out.append(
            ReductionSpec(
                name=r.name,
                tensor=TensorSpec(r.var, label, shape, dtype, ()),
                op=r.op,
                group=group,
                leaders=leaders,
                parts=r.parts,
                producer=r.producer,
                consumer=r.consumer,
                literals=r.literals,
            )
        )
    return tuple(out)


def program_partials(reductions, outputs, mesh: int) -> dict:
    """Var id -> (op, this mesh's term var ids, literal terms) of each all-reduce partial
    among a program's ``outputs`` (buffer references or groups)."""
    names = {str(getattr(g, "ref", g)) for g in outputs}
    out = {}
    for r in reductions:
        if r.name in names:
            first = r.parts[0][0] if r.parts else 0  # adds the literal terms, once
            out[r.var] = (r.op, dict(r.parts).get(mesh, ()), r.literals if mesh == first else ())
    return out
