"""Pass 3: group layers into stages and derive every program's inputs and outputs.

From the per-equation (layer, phase) slicing and a layer -> stage grouping, build for
each stage a forward program ``s{i}.F`` and a backward program ``s{i}.B``, and for each
mesh an update program ``m{i}.apply``.  Values are grouped into named buffers:

* ``X{s}`` batch leaves stage ``s`` reads (per micro-batch), ``P{s}`` state it reads;
* ``R{s}`` residuals its forward keeps for its backward (per micro-batch);
* ``A{s}`` gradient accumulators (what ``meshshard.grad`` returns that ``s`` computes);
* ``S{m}`` other state the update on mesh ``m`` reads, ``O{m}`` step results it makes;
* one cross-stage edge per (value, producer program, consumer program).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_dropvar, is_literal, is_marker, var_ids
from meshshard.passes.apply_placement import ApplyPlacement, place_apply
from meshshard.passes.slicing import APPLY, BWD, FWD, LayerSlicing
from meshshard.passes.trace import TracedStep
from meshshard.refs import BufferGroup, BufferKind, BufferRef, OutputSource, Phase, ProgramRef

_PHASE = {FWD: Phase.FORWARD, BWD: Phase.BACKWARD}
X, P, R, A, S, O = (  # noqa: E741 (buffer kinds by their print letter)
    BufferKind.BATCH,
    BufferKind.PARAMS,
    BufferKind.RESIDUALS,
    BufferKind.ACCUMULATORS,
    BufferKind.APPLY_STATE,
    BufferKind.APPLY_OUTPUTS,
)


@dataclass(frozen=True)
class ProgramIO:
    """A program's equations and the var ids it reads and writes, by buffer group."""

    name: ProgramRef
    stage: int
    eqns: tuple[int, ...]
    inputs: tuple[BufferGroup, ...]
    outputs: tuple[BufferGroup, ...]

    def __str__(self) -> str:
        ins = " ".join(str(g.ref) for g in self.inputs)
        outs = " ".join(str(g.ref) for g in self.outputs)
        return f"{self.name}: {len(self.eqns)} eqns ({ins}) -> ({outs})"


@dataclass(frozen=True)
class Edge:
    """Value ``var`` made by program ``producer`` and read by program ``consumer`` (another stage)."""

    var: int
    producer: ProgramRef
    consumer: ProgramRef


@dataclass(frozen=True)
class InputSlots:
    """Step input leaf ``leaf`` and the (buffer group, position) places that hold it."""

    leaf: int
    slots: tuple[tuple[BufferRef, int], ...]


@dataclass(frozen=True)
class OutputSlots:
    """Where step output leaf ``leaf`` comes from (see :class:`~meshshard.plan.OutputSpec`)."""

    leaf: int
    source: OutputSource
    slots: tuple[tuple[BufferRef, int], ...] = ()
    input_leaf: int | None = None
    literal: object = None


@dataclass(frozen=True)
class GradPair:
    """A ``meshshard.grad`` result (var id ``result``) and the value it returns (``operand``)."""

    operand: int
    result: int


@dataclass(frozen=True)
class StageGraph:
    """Stages, their programs and buffers, and the cross-stage edges of one step."""

    num_stages: int
    layer_groups: tuple[tuple[int, ...], ...]
    programs: tuple[ProgramIO, ...]
    groups: tuple[BufferGroup, ...]
    edges: tuple[Edge, ...]
    input_slots: tuple[InputSlots, ...]
    output_slots: tuple[OutputSlots, ...]
    grad_pairs: tuple[GradPair, ...]
    batch_dependent: frozenset

    def program(self, ref: ProgramRef) -> ProgramIO:
        """The program ``ref``."""
        return next(p for p in self.programs if p.name == ref)

    def group(self, ref: BufferRef) -> tuple[int, ...]:
        """The var ids buffer group ``ref`` holds (empty when the group is absent)."""
        return next((g.vars for g in self.groups if g.ref == ref), ())


def group_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Split layers ``0..L-1`` into ``num_stages`` contiguous groups, sizes differing by <= 1."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def build_stage_graph(
    traced: TracedStep, slicing: LayerSlicing, layer_groups: tuple[tuple[int, ...], ...]
) -> StageGraph:
    """Derive programs, buffer groups, cross-stage edges and step input/output slots."""
    jaxpr = traced.jaxpr
    eqns = jaxpr.eqns
    ids = var_ids(jaxpr)
    num_stages = len(layer_groups)
    stage_of_layer = {ly: s for s, g in enumerate(layer_groups) for ly in g}
    n_in = len(jaxpr.invars)
    invar_leaf = {v: i for i, v in enumerate(jaxpr.invars)}
    constvars = set(jaxpr.constvars)
    is_batch = [leaf.is_batch for leaf in traced.inputs]

    def describe(v) -> str:
        if v in invar_leaf:
            return traced.inputs[invar_leaf[v]].path
        return f"%{ids.get(v, '?')}"

    def made_by(v) -> str:  # "%12 (reduce_sum in s1.F)" for errors
        i = next((k for k, e in enumerate(eqns) if v in e.outvars), None)
        where = f" in {prog_of_eqn[i]}" if i in prog_of_eqn else ""
        return describe(v) + (f" ({eqns[i].primitive.name}{where})" if i is not None else "")

    # --- which program defines each value --------------------------------------------
    prog_of_eqn: dict[int, ProgramRef] = {}
    for i, (ly, ph) in enumerate(zip(slicing.layer, slicing.phase, strict=True)):
        if ph in _PHASE:
            prog_of_eqn[i] = ProgramRef(_PHASE[ph], stage_of_layer[ly])
    producer: dict = {}
    for i, name in prog_of_eqn.items():
        for v in eqns[i].outvars:
            producer[v] = name
    g_eqn = eqns[slicing.grad_end]
    grad_pairs = []  # (operand var id, result var id)
    grad_stage: dict = {}  # grad_end result Var -> stage
    literal_grads: dict = {}
    for operand, result in zip(g_eqn.invars, g_eqn.outvars, strict=True):
        if is_dropvar(result):
            continue
        if is_literal(operand):
            literal_grads[result] = operand.val
            continue
        if operand not in producer:
            raise MeshshardInputError(
                f"meshshard.grad returns {describe(operand)} unchanged from its inputs; "
                "return only values computed from the loss function"
            )
        grad_stage[result] = producer[operand].owner
        grad_pairs.append(GradPair(ids[operand], ids[result]))

    # --- reads of each compute program ---------------------------------------------
    reads: dict[ProgramRef, list] = {}
    for i, name in prog_of_eqn.items():
        lst = reads.setdefault(name, [])
        for v in eqns[i].invars:
            if (
                not is_literal(v)
                and v not in constvars
                and producer.get(v) != name
                and v not in lst
            ):
                lst.append(v)
    # grad_end operands are "read" by the accumulator of their producing program
    acc_of_prog: dict[ProgramRef, list] = {}
    for operand in g_eqn.invars:
        if not is_literal(operand):
            acc_of_prog.setdefault(producer[operand], []).append(operand)

    state_read_by: dict[int, set] = {}
    x_groups: dict[int, list] = {s: [] for s in range(num_stages)}
    p_groups: dict[int, list] = {s: [] for s in range(num_stages)}
    r_groups: dict[int, list] = {s: [] for s in range(num_stages)}
    edges: list[Edge] = []
    for name in sorted(reads, key=lambda p: p.sort_key):
        s = name.owner
        for v in reads[name]:
            if v in invar_leaf:
                leaf = invar_leaf[v]
                (x_groups if is_batch[leaf] else p_groups)[s].append(leaf)
                if not is_batch[leaf]:
                    state_read_by.setdefault(leaf, set()).add(s)
            elif producer[v] == ProgramRef(Phase.FORWARD, s) and name == ProgramRef(
                Phase.BACKWARD, s
            ):
                r_groups[s].append(ids[v])
            else:
                edges.append(Edge(ids[v], producer[v], name))
    edges.sort(key=lambda e: (e.var, e.consumer.sort_key))
    for leaf, stages in state_read_by.items():
        if len(stages) > 1 and not traced.inputs[leaf].is_key:  # keys: a copy per stage
            raise MeshshardInputError(
                f"parameter {traced.inputs[leaf].path} is read by stages {sorted(stages)}; "
                "a parameter must belong to one stage (tied weights across stages are not "
                "supported yet): untie it or put the layers that use it in one stage"
            )

    # --- apply-gradient placement ----------------------------------------------------
    seeds: dict = {r: stage for r, stage in grad_stage.items()}
    for leaf, stages in state_read_by.items():
        seeds[jaxpr.invars[leaf]] = next(iter(stages))
    state_leaves = tuple(i for i in range(n_in) if not is_batch[i])
    apply_eqns = slicing.apply_eqns
    compute_vars = set(producer)
    for i in apply_eqns:
        for v in eqns[i].invars:
            if is_literal(v):
                continue
            if v in invar_leaf and is_batch[invar_leaf[v]]:
                raise MeshshardInputError(
                    f"the update part of the step (after meshshard.grad) reads the batch "
                    f"leaf {describe(v)}; compute everything that needs the batch inside "
                    "the loss function (return it as aux with has_aux=True)"
                )
            if v in compute_vars:
                raise MeshshardInputError(
                    f"the update part of the step reads {made_by(v)}, a value computed from "
                    "the batch per micro-batch outside what meshshard.grad returns; compute "
                    "it inside the loss function and return it as aux (has_aux=True)"
                )
    placement: ApplyPlacement = place_apply(jaxpr, apply_eqns, seeds, state_leaves, describe)
    apply_by_mesh: dict[int, list[int]] = {m: [] for m in range(num_stages)}
    for i, meshes in placement.eqn_meshes:
        for m in meshes:
            apply_by_mesh[m].append(i)

    # --- groups ----------------------------------------------------------------------
    groups: dict[BufferRef, tuple[int, ...]] = {}
    for s in range(num_stages):
        groups[BufferRef(X, s)] = tuple(sorted(set(x_groups[s])))
        groups[BufferRef(P, s)] = tuple(sorted(set(p_groups[s])))
        groups[BufferRef(R, s)] = tuple(dict.fromkeys(r_groups[s]))
        groups[BufferRef(A, s)] = tuple(
            ids[r] for r, st in grad_stage.items() if st == s
        )  # grad_end result ids, in grad_end order
    # state inputs the apply on mesh m reads that are not already in P{m}
    for m in range(num_stages):
        need = []
        for i in apply_by_mesh[m]:
            for v in eqns[i].invars:
                if (
                    not is_literal(v)
                    and v in invar_leaf
                    and invar_leaf[v] not in groups[BufferRef(P, m)]
                ):
                    need.append(invar_leaf[v])
        groups[BufferRef(S, m)] = tuple(sorted(set(need)))

    # --- step outputs ------------------------------------------------------------------
    apply_producer: dict = {}
    for m in range(num_stages):
        for i in apply_by_mesh[m]:
            for v in eqns[i].outvars:
                apply_producer.setdefault(v, []).append(m)
    o_groups: dict[int, list[int]] = {m: [] for m in range(num_stages)}
    output_slots = []
    for j, v in enumerate(jaxpr.outvars):
        if is_literal(v):
            output_slots.append(OutputSlots(j, OutputSource.LITERAL, literal=v.val))
        elif v in literal_grads:
            output_slots.append(OutputSlots(j, OutputSource.LITERAL, literal=literal_grads[v]))
        elif v in invar_leaf:
            output_slots.append(OutputSlots(j, OutputSource.INPUT, input_leaf=invar_leaf[v]))
        elif v in apply_producer or v in grad_stage:
            meshes = apply_producer.get(v) or [grad_stage[v]]
            slots = []
            for m in meshes:
                if ids[v] not in o_groups[m]:
                    o_groups[m].append(ids[v])
                slots.append((BufferRef(O, m), o_groups[m].index(ids[v])))
            output_slots.append(OutputSlots(j, OutputSource.BUFFER, tuple(slots)))
        else:
            raise MeshshardInputError(
                f"step output {traced.outputs[j].path} = {made_by(v)} is computed from the "
                "batch per micro-batch outside meshshard.grad; return it from the loss "
                "function as aux (has_aux=True)"
            )
    for m in range(num_stages):
        groups[BufferRef(O, m)] = tuple(o_groups[m])

    # --- programs --------------------------------------------------------------------
    programs = []
    edge_out: dict[ProgramRef, list] = {}
    edge_in: dict[ProgramRef, list] = {}
    for k, e in enumerate(edges):
        edge_out.setdefault(e.producer, []).append(k)
        edge_in.setdefault(e.consumer, []).append(k)
    for s in range(num_stages):
        for ph in (Phase.FORWARD, Phase.BACKWARD):
            name = ProgramRef(ph, s)
            own = tuple(i for i, p in prog_of_eqn.items() if p == name)
            ins: list[BufferGroup] = []
            outs: list[BufferGroup] = []
            read_set = {ids[v] for v in reads.get(name, [])}
            for kind in (P, X):
                content = groups[BufferRef(kind, s)]
                if any(leaf in read_set for leaf in content):
                    ins.append(BufferGroup(BufferRef(kind, s), content))
            residuals = BufferGroup(BufferRef(R, s), groups[BufferRef(R, s)])
            if ph is Phase.BACKWARD and residuals.vars:
                ins.append(residuals)
            for k in edge_in.get(name, []):
                ins.append(BufferGroup(BufferRef(BufferKind.TRANSFER, k), (edges[k].var,)))
            if acc_of_prog.get(name):
                acc = BufferGroup(BufferRef(A, s), groups[BufferRef(A, s)])
                ins.append(acc)
                outs.append(acc)
            if ph is Phase.FORWARD and residuals.vars:
                outs.append(residuals)
            for k in edge_out.get(name, []):
                outs.append(BufferGroup(BufferRef(BufferKind.TRANSFER, k), (edges[k].var,)))
            programs.append(ProgramIO(name, s, own, tuple(ins), tuple(outs)))
    for m in range(num_stages):
        ins = [
            BufferGroup(BufferRef(kind, m), groups[BufferRef(kind, m)])
            for kind in (A, P, S)
            if groups[BufferRef(kind, m)]
        ]
        out_group = BufferGroup(BufferRef(O, m), groups[BufferRef(O, m)])
        outs = [out_group] if out_group.vars else []
        programs.append(
            ProgramIO(
                ProgramRef(Phase.APPLY, m), m, tuple(apply_by_mesh[m]), tuple(ins), tuple(outs)
            )
        )

    # --- step input slots ------------------------------------------------------------
    input_slots = []
    for leaf in range(n_in):
        slots = []
        for s in range(num_stages):
            for kind in (X, P, S):
                content = groups[BufferRef(kind, s)]
                if leaf in content:
                    slots.append((BufferRef(kind, s), content.index(leaf)))
        input_slots.append(InputSlots(leaf, tuple(slots)))

    return StageGraph(
        num_stages=num_stages,
        layer_groups=layer_groups,
        programs=tuple(programs),
        groups=tuple(BufferGroup(ref, content) for ref, content in groups.items()),
        edges=tuple(edges),
        input_slots=tuple(input_slots),
        output_slots=tuple(output_slots),
        grad_pairs=tuple(grad_pairs),
        batch_dependent=_batch_dependent(jaxpr, is_batch, ids, slicing),
    )


def _batch_dependent(jaxpr, is_batch, ids, slicing) -> frozenset:
    """Ids of values computed (transitively) from batch leaves, within compute-grad."""
    dep = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    for i, e in enumerate(jaxpr.eqns):
        if slicing.phase[i] == APPLY:
            break
        if is_marker(e, "loss_bwd"):
            continue
        if any((not is_literal(v)) and v in dep for v in e.invars):
            dep.update(v for v in e.outvars if not is_dropvar(v))
    return frozenset(ids[v] for v in dep if v in ids)
