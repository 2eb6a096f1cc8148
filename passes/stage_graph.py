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
from meshshard.passes.apply_programs import (
    ApplyGraph,
    PlannedReduction,
    apply_program_ios,
    build_apply_graph,
)
from meshshard.passes.pre_grad_values import update_reads_batch_message
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
    reductions: tuple[PlannedReduction, ...] = ()
    apply_phases: int = 1  #: 0 for a forward-only step
    notes: tuple[str, ...] = ()

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


def checked_stage_layers(groups: tuple[tuple[int, ...], ...], num_layers: int) -> tuple:
    """The user's ``stage_layers``, or an error when they do not cover the step's layers."""
    covered = sum(len(g) for g in groups)
    if covered != num_layers:
        raise MeshshardInputError(
            f"PipeshardParallel.stage_layers covers layers 0..{covered - 1}, but the step has "
            f"{num_layers} pipeline layers (layers are the pieces between "
            "mark_pipeline_boundary() calls, or layers=N); list every layer once"
        )
    return groups


@dataclass(frozen=True)
class _Step:
    """What every sub-step of :func:`build_stage_graph` reads about the traced step."""

    traced: TracedStep
    ids: dict
    invar_leaf: dict
    is_batch: tuple[bool, ...]
    num_stages: int

    @property
    def eqns(self):
        return self.traced.jaxpr.eqns

    def describe(self, v) -> str:
        """A value as users know it: an input leaf's path, else ``%id``."""
        if v in self.invar_leaf:
            return self.traced.inputs[self.invar_leaf[v]].path
        return f"%{self.ids.get(v, '?')}"


@dataclass(frozen=True)
class _Grads:
    """What ``meshshard.grad`` returns: results by stage, literal results, pairs."""

    stage: dict  # grad_end result Var -> stage
    literals: dict  # grad_end result Var -> literal value
    pairs: tuple[GradPair, ...]


def build_stage_graph(
    traced: TracedStep, slicing: LayerSlicing, layer_groups: tuple[tuple[int, ...], ...]
) -> StageGraph:
    """Derive programs, buffer groups, cross-stage edges and step input/output slots."""
    jaxpr = traced.jaxpr
    st = _Step(
        traced,
        var_ids(jaxpr),
        {v: i for i, v in enumerate(jaxpr.invars)},
        tuple(leaf.is_batch for leaf in traced.inputs),
        len(layer_groups),
    )
    prog_of_eqn, producer = _programs_of_values(st, slicing, layer_groups)
    grads = _grad_results(st, jaxpr.eqns[slicing.grad_end], producer)
    reads = _reads(st, jaxpr, prog_of_eqn, producer)
    owner = _state_owners(st, reads)
    per_stage, edges, state_read_by, copy_reads = _classify_reads(st, reads, producer, owner)
    placement = _place_update(st, slicing, producer, grads, state_read_by)
    groups = _compute_groups(st, per_stage, grads)
    update = _update_graph(st, placement, groups, grads)
    groups.update(update.groups)
    output_slots = _output_slots(st, placement, update, grads, groups, producer)
    acc_of_prog = {producer[v] for v in jaxpr.eqns[slicing.grad_end].invars if not is_literal(v)}
    programs = _stage_programs(st, prog_of_eqn, reads, edges, groups, acc_of_prog, copy_reads)
    first_move = len(edges)
    edges += [Edge(var, prod, cons) for var, prod, cons in update.moves]
    programs += apply_program_ios(update, groups, first_move)
    return StageGraph(
        num_stages=st.num_stages,
        layer_groups=layer_groups,
        programs=tuple(programs),
        groups=tuple(BufferGroup(ref, content) for ref, content in groups.items()),
        edges=tuple(edges),
        input_slots=_input_slots(st, groups),
        output_slots=output_slots,
        grad_pairs=grads.pairs,
        batch_dependent=_batch_dependent(jaxpr, st.is_batch, st.ids, slicing),
        reductions=update.reductions,
        apply_phases=placement.num_phases,
        notes=_shared_notes(st, edges, owner),
    )


def _programs_of_values(st: _Step, slicing: LayerSlicing, layer_groups) -> tuple[dict, dict]:
    """Equation index -> the F/B program it belongs to, and value -> program defining it."""
    stage_of_layer = {ly: s for s, g in enumerate(layer_groups) for ly in g}
    prog_of_eqn: dict[int, ProgramRef] = {}
    for i, (ly, ph) in enumerate(zip(slicing.layer, slicing.phase, strict=True)):
        if ph in _PHASE:
            prog_of_eqn[i] = ProgramRef(_PHASE[ph], stage_of_layer[ly])
    producer: dict = {}
    for i, name in prog_of_eqn.items():
        for v in st.eqns[i].outvars:
            producer[v] = name
    return prog_of_eqn, producer


def _grad_results(st: _Step, g_eqn, producer: dict) -> _Grads:
    """Which stage computes each gradient ``meshshard.grad`` returns."""
    pairs, stage, literals = [], {}, {}
    for operand, result in zip(g_eqn.invars, g_eqn.outvars, strict=True):
        if is_dropvar(result):
            continue
        if is_literal(operand):
            literals[result] = operand.val
            continue
        if operand not in producer:
            raise MeshshardInputError(
                f"meshshard.grad returns {st.describe(operand)} unchanged from its inputs; "
                "return only values computed from the loss function"
            )
        stage[result] = producer[operand].owner
        pairs.append(GradPair(st.ids[operand], st.ids[result]))
    return _Grads(stage, literals, tuple(pairs))


def _reads(st: _Step, jaxpr, prog_of_eqn: dict, producer: dict) -> dict[ProgramRef, list]:
    """Values each compute program reads from outside itself, in first-use order."""
    constvars = set(jaxpr.constvars)
    reads: dict[ProgramRef, list] = {}
    for i, name in prog_of_eqn.items():
        lst = reads.setdefault(name, [])
        for v in st.eqns[i].invars:
            if (
                not is_literal(v)
                and v not in constvars
                and producer.get(v) != name
                and v not in lst
            ):
                lst.append(v)
    return reads


def _state_owners(st: _Step, reads: dict) -> dict:
    """Var -> owner stage of each state input: the first stage whose forward reads it.

    Other stages reading it get a copy (a transfer from the owner's forward); its
    gradient contributions are summed on the owner (JAX adds them in the owner's
    backward, which runs last), so its one update runs there.
    """
    readers: dict = {}
    for name, values in reads.items():
        for v in values:
            if v in st.invar_leaf and not st.is_batch[st.invar_leaf[v]]:
                readers.setdefault(v, set()).add(name)
    owner = {}
    for v, progs in readers.items():
        stages = sorted({p.owner for p in progs})
        if len(stages) > 1 and ProgramRef(Phase.FORWARD, stages[0]) not in progs:
            raise MeshshardInputError(
                f"state input {st.describe(v)} is read by stages {stages} but not by the "
                f"forward of stage {stages[0]}, so no stage can own it and send copies; "
                "read it in the forward pass of its first stage, or move the layers that "
                "use it into one stage"
            )
        owner[v] = stages[0]
    return owner


def _shared_notes(st: _Step, edges, owner: dict) -> tuple[str, ...]:
    """One plan note per shared parameter: its owner, its copies, its gradient sum."""
    notes = []
    for v, o in sorted(owner.items(), key=lambda kv: st.ids[kv[0]]):
        copies = [(k, e) for k, e in enumerate(edges) if e.var == st.ids[v]]
        if not copies:
            continue
        where = ", ".join(f"t{k} -> {e.consumer}" for k, e in copies)
        stages = sorted({e.consumer.owner for _, e in copies})
        notes.append(
            f"shared parameter {st.describe(v)}: owner stage {o} (P{o}); copies {where} "
            f"(once per step); gradient contributions of stages {stages} are accumulated "
            f"there over the micro-batches and summed on stage {o} once per step, before "
            "its one update"
        )
    return tuple(notes)


def _classify_reads(st: _Step, reads: dict, producer: dict, owner: dict):
    """Sort each read into batch inputs, parameters, residuals or a cross-stage edge
    (a value of another stage, or a copy of a parameter another stage owns).

    Returns ``({kind: {stage: [leaf or var id]}}, edges, {state leaf: reading stages},
    {backward program: ids of the shared parameters it reads from its forward's copy}``.
    """
    per_stage = {kind: {s: [] for s in range(st.num_stages)} for kind in (X, P, R)}
    state_read_by: dict[int, set] = {}
    edges: list[Edge] = []
    copy_reads: dict[ProgramRef, set[int]] = {}
    for name in sorted(reads, key=lambda p: p.sort_key):
        s = name.owner
        for v in reads[name]:
            if v in owner and owner[v] != s and _reads_forward_copy(reads, name, v):
                copy_reads.setdefault(name, set()).add(st.ids[v])
                continue  # the backward reads the copy its stage's forward receives
            if v in owner and owner[v] != s:  # a copy of a shared parameter
                edges.append(Edge(st.ids[v], ProgramRef(Phase.FORWARD, owner[v]), name))
            elif v in st.invar_leaf:
                leaf = st.invar_leaf[v]
                per_stage[X if st.is_batch[leaf] else P][s].append(leaf)
                if not st.is_batch[leaf]:
                    state_read_by.setdefault(leaf, set()).add(s)
            elif producer[v] == ProgramRef(Phase.FORWARD, s) and name == ProgramRef(
                Phase.BACKWARD, s
            ):
                per_stage[R][s].append(st.ids[v])
            else:
                edges.append(Edge(st.ids[v], producer[v], name))
    edges.sort(key=lambda e: (e.var, e.consumer.sort_key))
    return per_stage, edges, state_read_by, copy_reads


def _reads_forward_copy(reads: dict, name: ProgramRef, v) -> bool:
    """Whether backward program ``name`` reads shared parameter ``v`` that its stage's
    forward reads too: the one copy the forward receives (once per step) serves both,
    held until the stage's last backward (:func:`_stage_programs`)."""
    forward = ProgramRef(Phase.FORWARD, name.owner)
    return name.phase is Phase.BACKWARD and v in reads.get(forward, ())


def _made_by(st: _Step, v, producer: dict) -> str:
    """``%12 (reduce_sum in s1.F)``: a value, the operation and the program that make it."""
    eqn = next((e for e in st.traced.jaxpr.eqns if v in e.outvars), None)
    if eqn is None:
        return st.describe(v)
    where = f" in {producer[v]}" if v in producer else ""
    return f"{st.describe(v)} ({eqn.primitive.name}{where})"


def _check_update_reads(st: _Step, apply_eqns, producer: dict) -> None:
    """The update may read neither batch leaves nor per-micro-batch values."""
    for i in apply_eqns:
        for v in st.eqns[i].invars:
            if is_literal(v):
                continue
            if v in st.invar_leaf and st.is_batch[st.invar_leaf[v]]:
                raise MeshshardInputError(update_reads_batch_message(st.describe(v), st.eqns[i]))
            if v in producer:
                raise MeshshardInputError(
                    f"the update part of the step reads {_made_by(st, v, producer)}, a value "
                    "computed from the batch per micro-batch outside what meshshard.grad "
                    "returns; compute it inside the loss function and return it as aux "
                    "(has_aux=True)"
                )


def _place_update(st: _Step, slicing, producer, grads: _Grads, state_read_by) -> ApplyPlacement:
    """Where and in which phase each update equation runs (seeded by where gradients
    and state live; see :mod:`~meshshard.passes.apply_placement`)."""
    jaxpr = st.traced.jaxpr
    seeds: dict = dict(grads.stage)
    for leaf, stages in state_read_by.items():
        seeds[jaxpr.invars[leaf]] = next(iter(stages))
    _check_update_reads(st, slicing.apply_eqns, producer)
    _check_outputs(st, producer, grads)
    return place_apply(jaxpr, st.ids, slicing.apply_eqns, seeds, st.num_stages, st.describe)


def _check_outputs(st: _Step, producer: dict, grads: _Grads) -> None:
    """A step output must not be a per-micro-batch value outside what meshshard.grad returns."""
    for j, v in enumerate(st.traced.jaxpr.outvars):
        if is_literal(v) or v in grads.stage or v in grads.literals or v in st.invar_leaf:
            continue
        if v in producer:
            raise MeshshardInputError(
                f"step output {st.traced.outputs[j].path} = {_made_by(st, v, producer)} is "
                "computed from the batch per micro-batch outside meshshard.grad; return it "
                "from the loss function as aux (has_aux=True)"
            )


def _compute_groups(st: _Step, per_stage, grads: _Grads) -> dict:
    """Buffer groups ``X P R A`` of each stage (the update adds ``S K O``)."""
    groups: dict[BufferRef, tuple[int, ...]] = {}
    for s in range(st.num_stages):
        groups[BufferRef(X, s)] = tuple(sorted(set(per_stage[X][s])))
        groups[BufferRef(P, s)] = tuple(sorted(set(per_stage[P][s])))
        groups[BufferRef(R, s)] = tuple(dict.fromkeys(per_stage[R][s]))
        # grad_end result ids, in grad_end order
        groups[BufferRef(A, s)] = tuple(st.ids[r] for r, g in grads.stage.items() if g == s)
    return groups


def _update_graph(st: _Step, placement, groups: dict, grads: _Grads) -> ApplyGraph:
    """The update's programs and groups (see :mod:`~meshshard.passes.apply_programs`)."""
    jaxpr = st.traced.jaxpr
    outputs = tuple(
        dict.fromkeys(
            st.ids[v]
            for v in jaxpr.outvars
            if not is_literal(v) and v not in grads.literals and v not in st.invar_leaf
        )
    )
    state_reads = {m: dict.fromkeys(groups[BufferRef(P, m)], P) for m in range(st.num_stages)}
    grad_mesh = {st.ids[r]: g for r, g in grads.stage.items()}
    return build_apply_graph(
        jaxpr, st.ids, placement, st.num_stages, grad_mesh, state_reads, outputs
    )


def _output_slots(
    st: _Step, placement, update: ApplyGraph, grads: _Grads, groups: dict, producer: dict
):
    """Where each step output comes from (the ``O{m}`` groups hold update results)."""
    computed = {st.ids[v] for i, _ in placement.runs for v in st.eqns[i].outvars if v in st.ids}
    computed |= {r.var for r in placement.reductions}
    out_meshes = dict(update.out_meshes)
    output_slots = []
    for j, v in enumerate(st.traced.jaxpr.outvars):
        if is_literal(v):
            output_slots.append(OutputSlots(j, OutputSource.LITERAL, literal=v.val))
        elif v in grads.literals:
            output_slots.append(OutputSlots(j, OutputSource.LITERAL, literal=grads.literals[v]))
        elif v in st.invar_leaf:
            output_slots.append(OutputSlots(j, OutputSource.INPUT, input_leaf=st.invar_leaf[v]))
        elif st.ids[v] in computed or v in grads.stage:
            slots = tuple(
                (BufferRef(O, m), groups[BufferRef(O, m)].index(st.ids[v]))
                for m in out_meshes[st.ids[v]]
            )
            output_slots.append(OutputSlots(j, OutputSource.BUFFER, slots))
        else:
            raise MeshshardInputError(
                f"step output {st.traced.outputs[j].path} = {_made_by(st, v, producer)} is "
                "computed from the batch per micro-batch outside meshshard.grad; return it "
                "from the loss function as aux (has_aux=True)"
            )
    return tuple(output_slots)


def _stage_programs(
    st: _Step, prog_of_eqn, reads, edges, groups, acc_of_prog, copy_reads: dict
) -> list:
    """The forward and backward program of every stage with its buffer groups; a
    backward also reads the shared parameters' copies of ``copy_reads`` that its
    forward receives."""
    edge_out: dict[ProgramRef, list] = {}
    edge_in: dict[ProgramRef, list] = {}
    for k, e in enumerate(edges):
        edge_out.setdefault(e.producer, []).append(k)
        edge_in.setdefault(e.consumer, []).append(k)

    def group(kind, s) -> BufferGroup:
        return BufferGroup(BufferRef(kind, s), groups[BufferRef(kind, s)])

    def transfer(k) -> BufferGroup:
        return BufferGroup(BufferRef(BufferKind.TRANSFER, k), (edges[k].var,))

    programs = []
    for s in range(st.num_stages):
        for ph in (Phase.FORWARD, Phase.BACKWARD):
            name = ProgramRef(ph, s)
            own = tuple(i for i, p in prog_of_eqn.items() if p == name)
            read_set = {st.ids[v] for v in reads.get(name, [])}
            ins = [group(k, s) for k in (P, X) if any(x in read_set for x in group(k, s).vars)]
            outs: list[BufferGroup] = []
            if ph is Phase.BACKWARD and group(R, s).vars:
                ins.append(group(R, s))
            ins += [transfer(k) for k in edge_in.get(name, [])]
            if name in copy_reads:  # shared parameters' copies its forward receives
                ins += [
                    transfer(k)
                    for k in edge_in.get(ProgramRef(Phase.FORWARD, s), [])
                    if edges[k].var in copy_reads[name]
                ]
            if name in acc_of_prog:
                ins.append(group(A, s))
                outs.append(group(A, s))
            if ph is Phase.FORWARD and group(R, s).vars:
                outs.append(group(R, s))
            outs += [transfer(k) for k in edge_out.get(name, [])]
            programs.append(ProgramIO(name, s, own, tuple(ins), tuple(outs)))
    return programs


def _input_slots(st: _Step, groups: dict) -> tuple[InputSlots, ...]:
    """For every step input leaf, the (group, position) places that hold it."""
    out = []
    for leaf in range(len(st.traced.jaxpr.invars)):
        slots = []
        for s in range(st.num_stages):
            for kind in (X, P, S):
                content = groups[BufferRef(kind, s)]
                if leaf in content:
                    slots.append((BufferRef(kind, s), content.index(leaf)))
        out.append(InputSlots(leaf, tuple(slots)))
    return tuple(out)


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
