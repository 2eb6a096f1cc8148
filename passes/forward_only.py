"""Forward-only steps (evaluation, inference): a pipeline of forward tasks only.

A step without ``meshshard.grad`` has no backward and no update.  Its user markers
(``mark_pipeline_boundary()``) carry no values yet, so :func:`with_forward_boundaries`
re-traces the step with each marker carrying the values live across it (as
``meshshard.grad`` does for a loss function).  :func:`slice_forward` cuts it into
layers, and :func:`build_forward_graph` makes one forward program ``s{i}.F`` per stage:
batch inputs ``X{s}``, state ``P{s}`` (a state input read by several stages lives on
the first and is copied to the others by a transfer), cross-stage edges, and the step
results each stage computes in ``O{s}``.  Results are per micro-batch, so a
forward-only step runs one micro-batch (``num_micro_batches=1``).
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_literal, is_marker, read_var, retrace, var_ids
from meshshard.passes.slicing import FWD, LayerSlicing
from meshshard.primitives import boundary_p
from meshshard.refs import BufferGroup, BufferKind, BufferRef, OutputSource, Phase, ProgramRef

X, P, OUT = BufferKind.BATCH, BufferKind.PARAMS, BufferKind.APPLY_OUTPUTS


def is_forward_only(jaxpr) -> bool:
    """True for a step with no ``meshshard.grad`` (no ``grad_end`` marker)."""
    return not any(is_marker(e, "grad_end") for e in jaxpr.eqns)


#: The plan note of every forward-only step.
FORWARD_ONLY_NOTE = (
    "forward-only step (no meshshard.grad): the inference schedule runs forward tasks "
    "only; a gradient taken with jax.grad inside it is not pipelined (use "
    "meshshard.grad / meshshard.value_and_grad for training)"
)


def with_forward_boundaries(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with each user marker turned into a ``fwd`` boundary carrying the
    values live across it (unchanged when it has no user markers)."""
    from meshshard.autodiff import _live_across

    jaxpr = closed.jaxpr
    marks = [
        i
        for i, e in enumerate(jaxpr.eqns)
        if is_marker(e, "mark", "fwd") and e.params["index"] == -1
    ]
    if not marks:
        return closed
    live = _live_across(jaxpr, marks)
    index_of = {pos: k for k, pos in enumerate(marks)}

    def on_eqn(i, eqn, env) -> bool:
        if i not in index_of:
            return False
        for src, dst in zip(eqn.invars, eqn.outvars, strict=True):
            env[dst] = read_var(env, src)
        vals = boundary_p.bind(*[env[v] for v in live[i]], kind="fwd", index=index_of[i])
        env.update(zip(live[i], vals, strict=True))
        return True

    return retrace(closed, lambda i, eqn, env, extra: on_eqn(i, eqn, env))


def check_forward_only(traced) -> None:
    """A forward-only step's results are per micro-batch: it must run one."""
    if traced.num_micro_batches != 1:
        raise MeshshardInputError(
            f"this step computes no gradient through meshshard.grad, so it runs as a "
            f"forward-only pipeline, which returns one micro-batch's results: "
            f"num_micro_batches={traced.num_micro_batches} is not supported there; use "
            "num_micro_batches=1 for an eval/inference step, or, for a train step, compute "
            "its gradients with meshshard.grad or meshshard.value_and_grad (not jax.grad)"
        )


def slice_forward(jaxpr) -> LayerSlicing:
    """Every equation is forward; ``fwd k`` markers start layer ``k + 1``."""
    cuts = {e.params["index"]: i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "fwd")}
    if sorted(cuts) != list(range(len(cuts))):
        raise MeshshardInputError(
            f"pipeline boundary indices {sorted(cuts)} are not 0..{len(cuts) - 1}"
        )
    positions = [cuts[k] for k in range(len(cuts))]
    layer = tuple(sum(1 for c in positions if c <= i) for i in range(len(jaxpr.eqns)))
    return LayerSlicing(len(cuts) + 1, layer, (FWD,) * len(jaxpr.eqns), len(jaxpr.eqns))


def build_forward_graph(traced, slicing: LayerSlicing, layer_groups):
    """The stage graph of a forward-only step (see the module docstring)."""
    from meshshard.passes.stage_graph import Edge, InputSlots, ProgramIO, StageGraph

    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    n = len(layer_groups)
    stage_of = {ly: s for s, g in enumerate(layer_groups) for ly in g}
    invar_leaf = {v: i for i, v in enumerate(jaxpr.invars)}
    is_batch = [leaf.is_batch for leaf in traced.inputs]
    stage_of_eqn = [stage_of[ly] for ly in slicing.layer]
    producer = {v: stage_of_eqn[i] for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    reads: dict[int, list] = {s: [] for s in range(n)}
    for i, e in enumerate(jaxpr.eqns):
        s = stage_of_eqn[i]
        for v in e.invars:
            if not is_literal(v) and v not in jaxpr.constvars and producer.get(v) != s:
                if v not in reads[s]:
                    reads[s].append(v)
    owner = {}
    for s in range(n):
        for v in reads[s]:
            if v in invar_leaf and not is_batch[invar_leaf[v]]:
                owner.setdefault(v, s)
    groups: dict[BufferRef, list[int]] = {}
    edges: list = []
    for s in range(n):
        groups[BufferRef(X, s)], groups[BufferRef(P, s)] = [], []
        for v in reads[s]:
            if v in invar_leaf and (is_batch[invar_leaf[v]] or owner[v] == s):
                groups[BufferRef(X if is_batch[invar_leaf[v]] else P, s)].append(ids[v])
            else:
                src = owner[v] if v in invar_leaf else producer[v]
                edges.append(
                    Edge(ids[v], ProgramRef(Phase.FORWARD, src), ProgramRef(Phase.FORWARD, s))
                )
    edges.sort(key=lambda e: (e.var, e.consumer.sort_key))
    output_slots = _output_slots(traced, ids, producer, invar_leaf, groups, n)
    programs = []
    for s in range(n):
        name = ProgramRef(Phase.FORWARD, s)
        ins = [BufferGroup(r, tuple(sorted(groups[r]))) for r in (BufferRef(P, s), BufferRef(X, s))]
        ins = [g for g in ins if g.vars]
        outs = []
        for k, e in enumerate(edges):
            if e.consumer == name:
                ins.append(BufferGroup(BufferRef(BufferKind.TRANSFER, k), (e.var,)))
            if e.producer == name:
                outs.append(BufferGroup(BufferRef(BufferKind.TRANSFER, k), (e.var,)))
        if groups[BufferRef(OUT, s)]:
            outs.append(BufferGroup(BufferRef(OUT, s), tuple(groups[BufferRef(OUT, s)])))
        own = tuple(i for i, st in enumerate(stage_of_eqn) if st == s)
        programs.append(ProgramIO(name, s, own, tuple(ins), tuple(outs)))
    final = {r: tuple(sorted(v)) if r.kind in (X, P) else tuple(v) for r, v in groups.items()}
    input_slots = tuple(
        InputSlots(
            leaf,
            tuple(
                (r, content.index(leaf))
                for r, content in final.items()
                if r.kind in (X, P) and leaf in content
            ),
        )
        for leaf in range(len(jaxpr.invars))
    )
    return StageGraph(
        num_stages=n,
        layer_groups=layer_groups,
        programs=tuple(programs),
        groups=tuple(BufferGroup(r, v) for r, v in final.items()),
        edges=tuple(edges),
        input_slots=input_slots,
        output_slots=output_slots,
        grad_pairs=(),
        batch_dependent=frozenset(_batch_dependent(jaxpr, is_batch, ids)),
        apply_phases=0,
        notes=(FORWARD_ONLY_NOTE,),
    )


def _output_slots(traced, ids, producer, invar_leaf, groups, n) -> tuple:
    from meshshard.passes.stage_graph import OutputSlots

    for s in range(n):
        groups[BufferRef(OUT, s)] = []
    out = []
    for j, v in enumerate(traced.jaxpr.outvars):
        if is_literal(v):
            out.append(OutputSlots(j, OutputSource.LITERAL, literal=v.val))
        elif v in invar_leaf:
            out.append(OutputSlots(j, OutputSource.INPUT, input_leaf=invar_leaf[v]))
        elif v in producer:
            content = groups[BufferRef(OUT, producer[v])]
            if ids[v] not in content:
                content.append(ids[v])
            slot = (BufferRef(OUT, producer[v]), content.index(ids[v]))
            out.append(OutputSlots(j, OutputSource.BUFFER, (slot,)))
        else:  # a constant of the step
            raise MeshshardInputError(
                f"step output {traced.outputs[j].path} is a constant of the step; "
                "return it outside the parallelized function"
            )
    return tuple(out)


def _batch_dependent(jaxpr, is_batch, ids) -> set:
    dep = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    for e in jaxpr.eqns:
        if any((not is_literal(v)) and v in dep for v in e.invars):
            dep.update(e.outvars)
    return {ids[v] for v in dep if v in ids}
