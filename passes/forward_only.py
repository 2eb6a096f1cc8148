"""Forward-only steps (evaluation, inference): a pipeline of forward tasks only.

A step without ``meshshard.grad`` has no backward and no update.  Its user markers
(``mark_pipeline_boundary()``) carry no values yet, so :func:`with_forward_boundaries`
re-traces the step with each marker carrying the values live across it (as
``meshshard.grad`` does for a loss function).  :func:`slice_forward` cuts it into
layers, and :func:`build_forward_graph` makes one forward program ``s{i}.F`` per stage:
batch inputs ``X{s}``, state ``P{s}`` (a state input read by several stages lives on
the first and is copied to the others by a transfer), cross-stage edges, and the step
results each stage computes in ``O{s}``.

With micro-batches (``num_micro_batches=M > 1``) each stage runs ``F0 .. F(M-1)`` and
the step's results are combined over micro-batches as the full-batch step computes
them: :func:`output_reductions` compares the step traced at micro-batch and at
full-batch shape (the same detection as the loss and aux values of a train step,
:mod:`~meshshard.passes.reductions`): ``mean``, ``sum``, ``max``, ``min``; ``concat``
for a per-example result (logits: the batch is its first dimension and no example
reads another); ``same`` for a result that does not depend on the batch.  An ``out``
marker around the results carries them; each stage accumulates its results in
``A{s}`` and a closing program ``m{s}.apply`` finishes them into ``O{s}``.

A step that differentiates with ``jax.grad`` (not ``meshshard.grad``) traces to a
forward-only step holding transposed equations; it is refused with micro-batches or
several stages (:func:`check_forward_only`), since its backward would not be pipelined.
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_literal, is_marker, read_var, retrace, sub_jaxprs, var_ids
from meshshard.metrics import aux_reduce_p
from meshshard.passes.slicing import FWD, GRAD_END, LayerSlicing, boundaries_inside
from meshshard.passes.unroll_scans import marked_scans, split_scans
from meshshard.primitives import boundary_p
from meshshard.refs import BufferGroup, BufferKind, BufferRef, OutputSource, Phase, ProgramRef

X, P, OUT, ACC = (
    BufferKind.BATCH,
    BufferKind.PARAMS,
    BufferKind.APPLY_OUTPUTS,
    BufferKind.ACCUMULATORS,
)


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
    values live across it (unchanged when it has no user markers); a scan whose body
    marks boundaries is unrolled first (:mod:`meshshard.passes.unroll_scans`)."""
    from meshshard.autodiff import _live_across

    closed = split_scans(closed, marked_scans(closed.jaxpr))  # nn.scan layers that mark
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


def with_auto_layers(micro: ClosedJaxpr, full: ClosedJaxpr, layers, weights: list[bool]):
    """``PipeshardParallel(layers=...)`` for a forward-only step: ``micro`` and ``full``
    (the step traced at micro-batch and full-batch shape, ``full`` may be ``micro``) cut
    into ``layers`` layers by :func:`~meshshard.passes.layer_cluster.cluster_layers`,
    chosen on ``micro`` and applied to both so they pair equation by equation, as
    ``meshshard.grad`` cuts a loss; scans over stacked layers (of the state leaves flagged
    in ``weights``) are split first.  Returns ``(micro, full, notes)``."""
    from meshshard.autodiff import _auto_cuts, _live_across, _split_layer_scans

    marks = sum(is_marker(e, "fwd") for e in micro.jaxpr.eqns)
    split, notes = _split_layer_scans(micro, weights, layers, False)
    cuts = _auto_cuts(split.jaxpr, marks, layers, "step")
    other = split if full is micro else _split_layer_scans(full, weights, layers, False)[0]
    index_of = {p: k for k, p in enumerate(cuts)}

    def cut(closed: ClosedJaxpr) -> ClosedJaxpr:
        live = _live_across(closed.jaxpr, list(cuts), before=True)

        def on_eqn(i, eqn, env, extra) -> bool:
            if i in index_of:  # a boundary before equation i, then equation i itself
                vals = boundary_p.bind(*[env[v] for v in live[i]], kind="fwd", index=index_of[i])
                env.update(zip(live[i], vals, strict=True))
            return False

        return retrace(closed, on_eqn)

    cut_micro = cut(split)
    return cut_micro, cut_micro if full is micro else cut(other), notes


def has_transposed_eqns(closed: ClosedJaxpr) -> bool:
    """True if ``closed`` (or a sub-jaxpr) holds equations JAX's autodiff transposed:
    a backward pass, as ``jax.grad`` leaves it (their name stack reads ``transpose(...)``).

    Read on the step's first trace, before any rewrite re-traces it.
    """

    def walk(jaxpr) -> bool:
        for e in jaxpr.eqns:
            if "transpose(" in str(e.source_info.name_stack):
                return True
            if any(walk(inner) for inner in sub_jaxprs(e)):
                return True
        return False

    return walk(closed.jaxpr)


def several_grads_message(grad_calls: int, asked: str) -> str:
    """Why a step that calls ``meshshard.grad`` more than once cannot run as ``asked``
    (``"num_micro_batches=2"``, ``"2 stages"``)."""
    return (
        f"the train step calls meshshard.grad {grad_calls} times (e.g. a GAN's "
        f"discriminator and generator updates, SAM's ascent and descent gradients), and "
        f"{asked} asks for a pipeline, which accumulates one gradient per step; such a "
        "step runs only with one stage and num_micro_batches=1 (ShardParallel, "
        "DataParallel or PipeshardParallel with one stage), as one program; else combine "
        "the losses into one function or make each update its own step (for SAM: one "
        "parallelized step returns meshshard.grad's ascent gradient and a second takes it "
        "as an argument; or take the ascent gradient with jax.grad, which each "
        "micro-batch then computes from its own examples, as SAM's m-sharpness does)"
    )


def check_forward_only(traced, num_stages: int) -> None:
    """Refuse a step that differentiates with ``jax.grad`` when it would be pipelined.

    Its transposed equations would run as forward work of the last stage, reading every
    stage's activations, and its gradients would be combined over micro-batches as
    results: not a pipelined backward.  One micro-batch on one stage runs it as is.
    """
    m = traced.num_micro_batches
    if traced.grad_calls > 1 and num_stages > 1:  # (more micro-batches: refused by the trace)
        raise MeshshardInputError(several_grads_message(traced.grad_calls, f"{num_stages} stages"))
    inside = boundaries_inside(traced.jaxpr, ("grad_end",))
    if inside and (m > 1 or num_stages > 1):
        raise MeshshardInputError(
            f"meshshard.grad is called inside the body of {inside} (gradients "
            "accumulated by hand over chunks of the batch?), where its backward cannot be "
            f"pipelined over {num_stages} stage(s) with num_micro_batches={m}: call "
            "meshshard.grad once per step on the whole batch and set num_micro_batches to "
            "the number of chunks (meshshard accumulates the micro-batches' gradients "
            "itself), or run the step with one stage and num_micro_batches=1"
        )
    if traced.transposed and (m > 1 or num_stages > 1):
        raise MeshshardInputError(
            f"this step differentiates with jax.grad or jax.value_and_grad (its jaxpr holds "
            f"transposed equations) instead of meshshard.grad, so meshshard sees no backward "
            f"pass to pipeline over {num_stages} stage(s) with num_micro_batches={m}; compute "
            "the gradients with meshshard.grad or meshshard.value_and_grad, or run the step "
            "with one stage and num_micro_batches=1 (Flax NNX's nnx.value_and_grad and "
            "nnx.grad are jax's too: meshshard.value_and_grad takes an NNX module the same "
            "way, differentiating its nnx.Param variables; Flax's "
            "DynamicScale.value_and_grad is jax.value_and_grad: use meshshard.DynamicScale, "
            "the same class for meshshard)"
        )


def output_reductions(
    micro: ClosedJaxpr, full: ClosedJaxpr, is_batch, m: int, labels, allow_shares: bool = False
) -> tuple[tuple[str, str, str] | None, ...]:
    """Per step result of a forward-only step: (label, reduction, source), or None for a
    result that is a literal or an input (nothing to combine).  With ``allow_shares``,
    results that add a batch sum to a batch mean or a constant raise
    :class:`~meshshard.passes.reductions.LossTermShares` naming them (the step is traced
    again with those terms as 1/M shares) instead of being refused."""
    from meshshard.passes.hoist import batch_dependent
    from meshshard.passes.reductions import LossTermShares, same_program, term_share_paths

    mj = micro.jaxpr
    dep = batch_dependent(mj, is_batch, len(mj.eqns))
    invars = set(mj.invars)
    producer = {v: e for e in mj.eqns for v in e.outvars}
    out, shared = [], {}
    for label, v in zip(labels, mj.outvars, strict=True):
        if is_literal(v) or v in invars:
            out.append(None)
        elif producer[v].primitive is aux_reduce_p:
            out.append((label, producer[v].params["reduce"], "declared"))
        elif v not in dep:
            out.append((label, "same", "does not depend on the batch"))
        elif not same_program(micro, full):
            raise MeshshardInputError(
                f"step result {label} depends on the batch, and the step traces differently at "
                "micro-batch and full-batch shape, so meshshard cannot tell how to combine it "
                "over micro-batches; declare it with meshshard.aux_sum/aux_mean/aux_max/aux_min "
                "or use num_micro_batches=1"
            )
        else:
            try:
                out.append((label, *_output_reduction(micro, full, v, m, dep, label)))
            except MeshshardInputError:
                paths = term_share_paths(micro, full, v, m, dep) if allow_shares else ()
                if not paths:
                    raise
                shared[len(out)] = paths
                out.append(None)
    if shared:
        raise LossTermShares(outputs=shared)
    return tuple(out)


def _output_reduction(micro, full, var, m: int, dep, label: str) -> tuple[str, str]:
    from meshshard.passes.reductions import classify, concat_problem, fix_for

    red, why = classify(micro, full, var, m, dep)
    if red == "batch":
        problem = concat_problem(micro, full, var, m)
        if problem is None:
            return "concat", "traced: per-example values (concatenated over micro-batches)"
        why = problem
    elif red:
        return red, f"traced: {why}"
    fix = fix_for(
        why,
        "return a mean, sum, max or min over the batch or per-example values (the batch "
        "as the first dimension), declare it with meshshard.aux_sum/aux_mean/aux_max/"
        "aux_min",
    )
    raise MeshshardInputError(
        f"step result {label}: meshshard cannot tell how to combine it over micro-batches "
        f"({why}); {fix}, or use num_micro_batches=1"
    )


def combine_outputs(closed: ClosedJaxpr, reduce: tuple, m: int) -> ClosedJaxpr:
    """``closed`` with its computed results wrapped in one ``out`` marker carrying
    ``reduce`` (see :func:`output_reductions`); unchanged when nothing is combined."""
    wrapped = [k for k, r in enumerate(reduce) if r is not None]
    if not wrapped:
        return closed
    info = tuple(reduce[k] for k in wrapped)

    def finish(outs):
        vals = boundary_p.bind(
            *[outs[k] for k in wrapped], kind="out", index=0, reduce=info, num_micro_batches=m
        )
        outs = list(outs)
        for k, x in zip(wrapped, vals, strict=True):
            outs[k] = x
        return outs

    return retrace(closed, finish=finish)


def output_marker(jaxpr):
    """Index of the ``out`` marker of a forward-only step (None without micro-batches)."""
    return next((i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "out")), None)


def slice_forward(jaxpr) -> LayerSlicing:
    """Every equation is forward (but the ``out`` marker); ``fwd k`` markers start layer
    ``k + 1``."""
    cuts = {e.params["index"]: i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "fwd")}
    if sorted(cuts) != list(range(len(cuts))):
        raise MeshshardInputError(
            f"pipeline boundary indices {sorted(cuts)} are not 0..{len(cuts) - 1}"
        )
    positions = [cuts[k] for k in range(len(cuts))]
    out = output_marker(jaxpr)
    layer = tuple(
        -1 if i == out else sum(1 for c in positions if c <= i) for i in range(len(jaxpr.eqns))
    )
    phase = tuple(GRAD_END if i == out else FWD for i in range(len(jaxpr.eqns)))
    return LayerSlicing(len(cuts) + 1, layer, phase, len(jaxpr.eqns) if out is None else out)


def build_forward_graph(traced, slicing: LayerSlicing, layer_groups):
    """The stage graph of a forward-only step (see the module docstring)."""
    from meshshard.passes.stage_graph import InputSlots, StageGraph

    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    n = len(layer_groups)
    stage_of = {ly: s for s, g in enumerate(layer_groups) for ly in g}
    invar_leaf = {v: i for i, v in enumerate(jaxpr.invars)}
    is_batch = [leaf.is_batch for leaf in traced.inputs]
    stage_of_eqn = [stage_of.get(ly) for ly in slicing.layer]  # None: the out marker
    producer = {
        v: s
        for s, e in zip(stage_of_eqn, jaxpr.eqns, strict=True)
        if s is not None
        for v in e.outvars
    }
    groups, edges = _forward_groups_and_edges(jaxpr, ids, stage_of_eqn, producer, is_batch, n)
    acc = _accumulators(jaxpr, ids, producer, n)
    output_slots = _output_slots(traced, ids, producer, invar_leaf, groups, acc, n)
    programs = _forward_programs(stage_of_eqn, groups, edges, n)
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
    closing = [p for p in programs if p.name.phase is Phase.APPLY]
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
        apply_phases=1 if closing else 0,
        notes=(FORWARD_ONLY_NOTE,),
    )


def _forward_groups_and_edges(jaxpr, ids, stage_of_eqn, producer, is_batch, n):
    """Batch inputs ``X{s}`` and state ``P{s}`` of each stage, and the cross-stage edges
    (a value of another stage, or a copy of a state input another stage owns)."""
    from meshshard.passes.stage_graph import Edge

    invar_leaf = {v: i for i, v in enumerate(jaxpr.invars)}
    reads: dict[int, list] = {s: [] for s in range(n)}
    for s, e in zip(stage_of_eqn, jaxpr.eqns, strict=True):
        if s is None:
            continue
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
    return groups, edges


def _accumulators(jaxpr, ids, producer, n) -> dict:
    """Result var -> stage whose forward accumulates it (the ``out`` marker's results)."""
    k = output_marker(jaxpr)
    if k is None:
        return {}
    marker = jaxpr.eqns[k]
    return {r: producer[o] for o, r in zip(marker.invars, marker.outvars, strict=True)}


def _forward_programs(stage_of_eqn, groups, edges, n) -> list:
    """Each stage's forward ``s{i}.F`` and, for combined results, ``m{i}.apply``."""
    from meshshard.passes.stage_graph import ProgramIO

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
        acc = BufferGroup(BufferRef(ACC, s), tuple(groups.get(BufferRef(ACC, s), ())))
        res = BufferGroup(BufferRef(OUT, s), tuple(groups[BufferRef(OUT, s)]))
        if acc.vars:  # per micro-batch contributions, combined by m{s}.apply into O{s}
            ins.append(acc)
            outs.append(acc)
        elif res.vars:
            outs.append(res)
        own = tuple(i for i, st in enumerate(stage_of_eqn) if st == s)
        programs.append(ProgramIO(name, s, own, tuple(ins), tuple(outs)))
        if acc.vars:
            programs.append(ProgramIO(ProgramRef(Phase.APPLY, s), s, (), (acc,), (res,)))
    return programs


def _output_slots(traced, ids, producer, invar_leaf, groups, acc, n) -> tuple:
    from meshshard.passes.stage_graph import OutputSlots

    for s in range(n):
        groups[BufferRef(OUT, s)] = []
        if any(st == s for st in acc.values()):
            groups[BufferRef(ACC, s)] = []
    out = []
    for j, v in enumerate(traced.jaxpr.outvars):
        if is_literal(v):
            out.append(OutputSlots(j, OutputSource.LITERAL, literal=v.val))
        elif v in invar_leaf:
            out.append(OutputSlots(j, OutputSource.INPUT, input_leaf=invar_leaf[v]))
        elif v in producer or v in acc:
            s = acc[v] if v in acc else producer[v]
            content = groups[BufferRef(OUT, s)]
            if ids[v] not in content:
                content.append(ids[v])
                if v in acc:
                    groups[BufferRef(ACC, s)].append(ids[v])
            out.append(
                OutputSlots(j, OutputSource.BUFFER, ((BufferRef(OUT, s), content.index(ids[v])),))
            )
        else:  # a constant of the step
            raise MeshshardInputError(
                f"step output {traced.outputs[j].path} is a constant of the step; "
                "return it outside the parallelized function"
            )
    return tuple(out)


def _batch_dependent(jaxpr, is_batch, ids) -> set:
    dep = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    for e in jaxpr.eqns:
        if is_marker(e, "out"):
            continue
        if any((not is_literal(v)) and v in dep for v in e.invars):
            dep.update(e.outvars)
    return {ids[v] for v in dep if v in ids}
