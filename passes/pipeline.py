"""The compiler driver: run every pass in order and assemble the :class:`Plan`.

Pure: it reads a function, example arguments, a method and a described cluster, and
never touches Ray, so a plan for a GPU cluster can be made and inspected on a laptop.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.methods import DataParallel, Method, PipeshardParallel, sharding_mode
from meshshard.passes.annotate import annotate_costs
from meshshard.passes.apply_programs import plan_reductions
from meshshard.passes.checks import run_passes
from meshshard.passes.comm_schedule import schedule_comm
from meshshard.passes.emit import emit_streams
from meshshard.passes.forward_only import (
    build_forward_graph,
    check_forward_only,
    is_forward_only,
    slice_forward,
)
from meshshard.passes.fuse_forward_backward import fuse_forward_backward
from meshshard.passes.fuse_step import fuse_step
from meshshard.passes.meshes import (
    auto_layout,
    method_views,
    place_meshes,
    requested_stages,
    stage_layout,
    with_views,
)
from meshshard.passes.reductions import accumulator_reductions, reduction_notes
from meshshard.passes.replicas import replicate_stages
from meshshard.passes.schedules import check_runnable, make_schedule
from meshshard.passes.shard_accumulate import accumulation_comms, local_accumulation
from meshshard.passes.shard_plan import (
    infer_shardings,
    program_constraints,
    program_operand_constraints,
    sharding_notes,
    spec_lookup,
    zero_notes,
)
from meshshard.passes.sharding import build_buffers, unsplit_batch_notes
from meshshard.passes.slicing import (
    boundaries_inside,
    detached_notes,
    slice_layers,
    split_scan_notes,
)
from meshshard.passes.sparse_rows import find_sparse_rows, with_sparse_rows
from meshshard.passes.split_backward import split_backward
from meshshard.passes.stage_cost import step_layer_stats
from meshshard.passes.stage_graph import StageGraph, build_stage_graph
from meshshard.passes.state import CompileState, Pass
from meshshard.passes.trace import TracedStep, trace_step
from meshshard.passes.transfers import plan_transfers
from meshshard.passes.virtual_stages import virtual_layout
from meshshard.plan import InputSpec, OutputSpec, Plan, ProgramSpec, StageSpec
from meshshard.refs import LeafKind, Phase, ProgramRef


def plan_step(
    fn: Callable,
    args: Sequence,
    *,
    method: Method,
    cluster: ClusterSpec,
    batch_argnums: Sequence[int] = (1,),
    costs: bool = False,
) -> tuple[Plan, TracedStep]:
    """Compile ``fn(*args)`` under ``method`` for ``cluster``; returns the plan and the trace.

    ``costs=True`` also fills each program's FLOPs and bytes (for the simulator).
    """
    traced = trace_step(
        fn, args, batch_argnums=tuple(batch_argnums), num_micro_batches=method.num_micro_batches
    )
    return plan_traced(traced, method=method, cluster=cluster, costs=costs), traced


def _slice(st: CompileState) -> CompileState:
    if is_forward_only(st.traced.jaxpr):  # no meshshard.grad: an eval/inference step
        return replace(st, slicing=slice_forward(st.traced.jaxpr))
    return replace(st, slicing=slice_layers(st.traced.jaxpr))


@contextlib.contextmanager
def _naming_detached_markers(jaxpr):
    """Add to a refusal for too few layers that some of the user's markers cut nothing
    (:func:`~meshshard.passes.slicing.detached_notes`), so its count of boundaries
    agrees with the markers the user wrote."""
    try:
        yield
    except MeshshardInputError as exc:
        detached = detached_notes(jaxpr)
        if not detached:
            raise
        raise MeshshardInputError(f"{exc} (the step's {detached[0]})") from exc


def _layout(st: CompileState) -> CompileState:
    if getattr(st.method, "stages", None) == "auto":
        stats = step_layer_stats(st.traced, st.slicing)
        groups, meshes, workers, dp, measured = auto_layout(st.method, st.cluster, stats)
        notes = measured + tuple(str(dp).splitlines()) + _worker_notes(st.cluster, workers)
        return replace(st, cluster=workers, layer_groups=groups, meshes=meshes, layout_notes=notes)
    cluster = st.cluster
    d = getattr(st.method, "data_parallel", 1)
    if d > 1 and getattr(st.method, "stages", None) == "uniform":  # one replica's hosts
        cluster = replace(cluster, num_hosts=max(1, cluster.num_hosts // d))
    asked = requested_stages(st.method, cluster, st.slicing.num_layers)
    if asked is not None and is_forward_only(st.traced.jaxpr):
        # a jax.grad step is told so before "the model has no pipeline boundary":
        # meshshard.grad, not the markers, is what it lacks first
        check_forward_only(st.traced, asked)
    one_layer = asked is not None and asked > 1 and st.slicing.num_layers == 1
    hidden = boundaries_inside(st.traced.jaxpr) if one_layer else ""
    if hidden:
        raise MeshshardInputError(
            f"{asked} pipeline stages were asked for, but the model's pipeline boundaries "
            f"are all inside the body of {hidden} (a decode loop calling the model), "
            "which runs whole inside one stage: stages are cut at the "
            "step's top-level boundaries only; loop in Python instead (for i in range(n): "
            "...) so each iteration's boundaries are cut, or use one stage (DataParallel)"
        )
    with _naming_detached_markers(st.traced.jaxpr):
        groups, meshes, workers = stage_layout(st.method, cluster, st.slicing.num_layers)
    stages = getattr(st.method, "stages", "uniform")  # DataParallel has one mesh
    shapes = [] if isinstance(stages, str) else list(stages) * d
    if d > 1 and shapes and sum(h * n for h, n in shapes) <= cluster.num_devices:
        # replicas that need more hosts than there are share them (else replicas.py says)
        replicated, view = place_meshes(shapes, cluster)
        if view.worker_blocks:  # replica j's meshes follow on workers + j * H
            meshes, workers = replicated[: len(meshes)], view
    views = method_views(st.method)
    if views is not None:
        what = "PipeshardParallel.logical_shapes"
        what = what if isinstance(st.method, PipeshardParallel) else "ShardParallel.logical_shape"
        meshes = with_views(meshes, views, what)
    # meshes that share hosts are planned on the worker view (uniform stages never do)
    cluster = workers if workers.worker_blocks != cluster.worker_blocks else st.cluster
    v = getattr(st.method, "virtual_stages", 1)
    if v > 1:  # interleaved 1F1B: v logical stages per mesh
        chosen = st.method.stage_layers
        with _naming_detached_markers(st.traced.jaxpr):
            groups, meshes = virtual_layout(meshes, st.slicing.num_layers, v, chosen)
    notes = _worker_notes(st.cluster, cluster)
    return replace(st, cluster=cluster, layer_groups=groups, meshes=meshes, layout_notes=notes)


def _worker_notes(cluster: ClusterSpec, workers: ClusterSpec) -> tuple[str, ...]:
    """A plan note when meshes share hosts (the plan is made for the worker view)."""
    if workers.worker_blocks == cluster.worker_blocks:
        return ()
    return (f"meshes share hosts: one host-actor per mesh block, planned on {workers}",)


def _stage_graph(st: CompileState) -> CompileState:
    forward_only = is_forward_only(st.traced.jaxpr)
    if forward_only:
        check_forward_only(st.traced, len(st.layer_groups))
    build = build_forward_graph if forward_only else build_stage_graph
    return replace(st, graph=build(st.traced, st.slicing, st.layer_groups))


def _split_backward(st: CompileState) -> CompileState:
    """Zero-bubble schedules run B and W separately: split every backward program."""
    if getattr(st.method, "schedule", None) != "zb_h1" or st.graph.apply_phases == 0:
        return st
    return replace(st, graph=split_backward(st.traced, st.graph))


def _shard(st: CompileState) -> CompileState:
    mode = sharding_mode(st.method)
    shardings = infer_shardings(st.traced, st.graph, st.meshes, st.cluster, mode)
    specs = spec_lookup(shardings)
    return replace(
        st, shardings=shardings, buffers=build_buffers(st.traced, st.graph, st.meshes, specs)
    )


def _accumulate(st: CompileState) -> CompileState:
    specs = spec_lookup(st.shardings or ())
    zero = sharding_mode(st.method) in ("zero2", "zero3")
    reads = {
        s.mesh: {(e, pos): spec for e, pos, spec in s.solution.operand_specs}
        for s in st.shardings or ()
    }
    buffers, unreduced = local_accumulation(
        st.traced, st.graph, st.meshes, st.buffers, specs, keep_gradients_split=zero, reads=reads
    )
    shardings = accumulation_comms(
        st.traced, st.graph, st.meshes, buffers, unreduced, st.shardings or ()
    )
    return replace(st, buffers=buffers, unreduced=unreduced, shardings=shardings or st.shardings)


def _transfers(st: CompileState) -> CompileState:
    strategy = getattr(st.method, "resharding", "broadcast")
    transfers = plan_transfers(
        st.traced,
        st.graph,
        st.meshes,
        strategy=strategy,
        cluster=st.cluster,
        simulate=False,
        specs=spec_lookup(st.shardings or ()),
    )
    return replace(st, transfers=transfers)


def _schedule(st: CompileState) -> CompileState:
    name = "1f1b" if isinstance(st.method, DataParallel) else st.method.schedule
    name = "inference" if is_forward_only(st.traced.jaxpr) else name  # forward-only
    v = getattr(st.method, "virtual_stages", 1)
    d = getattr(st.method, "data_parallel", 1)  # each replica runs M/d micro-batches
    S, M = st.graph.num_stages // v, st.traced.num_micro_batches // d
    check_runnable(name, S, M)
    opts = {"steps": 1} if name == "2bw" else {}  # each 2BW call runs one step
    opts = {"virtual_stages": v} if name == "interleaved_1f1b" else opts
    return replace(st, schedule=make_schedule(name, S, M, **opts))


def _emit(st: CompileState) -> CompileState:
    reductions = plan_reductions(st.traced, st.graph, st.meshes)
    return replace(
        st, streams=emit_streams(st.graph, st.schedule, st.meshes, st.transfers, reductions)
    )


def _assemble(st: CompileState) -> CompileState:
    traced, graph = st.traced, st.graph
    programs = tuple(
        ProgramSpec(
            name=p.name,
            mesh=p.stage,
            eqns=p.eqns,
            inputs=tuple(g.ref for g in p.inputs),
            outputs=tuple(g.ref for g in p.outputs),
            constraints=program_constraints(st.traced, st.shardings or (), p.stage, p.eqns),
            operand_constraints=program_operand_constraints(st.shardings or (), p.stage, p.eqns),
            unreduced=(st.unreduced or {}).get(p.name, ()),
        )
        for p in graph.programs
    )
    notes = list(st.layout_notes) + list(graph.notes) + sharding_notes(st.shardings or (), programs)
    if st.slicing.num_layers > 1 and isinstance(st.method, DataParallel):
        notes.append(f"{st.slicing.num_layers - 1} pipeline boundaries ignored by DataParallel")
    notes += reduction_notes(traced.jaxpr, traced.num_micro_batches)
    notes += detached_notes(traced.jaxpr)
    notes += split_scan_notes(traced.jaxpr)
    notes += traced.coupled
    notes += traced.notes
    notes += unsplit_batch_notes(traced, st.meshes)
    notes += zero_notes(traced, graph, sharding_mode(st.method))
    plan = Plan(
        method=repr(st.method),
        cluster=st.cluster,
        num_micro_batches=traced.num_micro_batches,
        fingerprint=traced.fingerprint,
        meshes=st.meshes,
        stages=_stage_specs(traced, graph),
        programs=programs,
        buffers=st.buffers,
        transfers=st.transfers,
        schedule=st.schedule,
        streams=st.streams,
        inputs=_input_specs(traced, graph),
        outputs=_output_specs(traced, graph),
        notes=tuple(notes),
        reductions=plan_reductions(traced, graph, st.meshes),
    )
    # data-parallel replicas of the stages, in the same pass: the plan is whole only then
    d = getattr(st.method, "data_parallel", 1)
    plan = replicate_stages(plan, d, accumulator_reductions(traced.jaxpr) if d > 1 else None)
    return replace(st, plan=plan)


def _fuse(st: CompileState) -> CompileState:
    if not getattr(st.method, "fuse_forward_backward", True):
        return st
    return replace(st, plan=fuse_forward_backward(st.plan, st.traced))


def _fuse_step(st: CompileState) -> CompileState:
    if not getattr(st.method, "fuse_forward_backward", True):  # every program its own
        return st
    return replace(st, plan=fuse_step(st.plan))


def _comm_schedule(st: CompileState) -> CompileState:
    switches = getattr(st.method, "comm_schedule", frozenset())
    if not switches:
        return st
    chunk = getattr(st.method, "comm_chunk_bytes", 4 << 20)
    plan = st.plan
    if "sparse" in switches:  # embedding gradients of replicas as their touched rows
        plan = with_sparse_rows(plan, find_sparse_rows(plan, st.traced))
    return replace(st, plan=schedule_comm(plan, switches, chunk_bytes=chunk))


def _annotate_costs(st: CompileState) -> CompileState:
    return replace(st, plan=annotate_costs(st.plan, st.traced, st.graph, st.cluster))


#: The compiler's passes after tracing, in order.  Each is pure over the compile state.
PASSES: tuple[Pass, ...] = (
    Pass("slice_layers", _slice),
    Pass("stage_layout", _layout),
    Pass("stage_graph", _stage_graph),
    Pass("split_backward", _split_backward),
    Pass("sharding", _shard),
    Pass("local_accumulation", _accumulate),
    Pass("transfers", _transfers),
    Pass("schedule", _schedule),
    Pass("emit", _emit),
    Pass("assemble", _assemble),
    Pass("fuse_forward_backward", _fuse),
    Pass("fuse_step", _fuse_step),
    Pass("comm_schedule", _comm_schedule),
)

#: Annotation passes: add costs to a plan without changing what it runs.
COST_PASSES: tuple[Pass, ...] = (Pass("annotate_costs", _annotate_costs),)


def plan_traced(
    traced: TracedStep,
    *,
    method: Method,
    cluster: ClusterSpec,
    costs: bool = False,
    passes: tuple[Pass, ...] = PASSES,
    check: bool | None = None,
) -> Plan:
    """Run ``passes`` (every pass after tracing) and return the plan.

    ``costs`` adds the cost annotations (program FLOPs and bytes, simulated transfer
    times); the plan is otherwise identical.  With ``MESHSHARD_CHECKS=1`` the IR
    invariants and the verifier run after every pass and name the pass that broke them
    (``check`` overrides the environment).
    """
    state = CompileState(traced, method, cluster)
    state = run_passes(state, passes + (COST_PASSES if costs else ()), check)
    return state.plan


def _summary(traced: TracedStep, eqns: tuple[int, ...]) -> str:
    counts = Counter(traced.jaxpr.eqns[i].primitive.name for i in eqns)
    counts.pop("pipeline_boundary", None)
    top = ", ".join(
        f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:4]
    )
    return f"{len(eqns)} eqns ({top})"


def _stage_specs(traced: TracedStep, graph: StageGraph) -> tuple[StageSpec, ...]:
    out = []
    for s, layers in enumerate(graph.layer_groups):
        f = graph.program(ProgramRef(Phase.FORWARD, s))
        summary = f"F: {_summary(traced, f.eqns)}"
        if not any(p.name == ProgramRef(Phase.BACKWARD, s) for p in graph.programs):
            out.append(StageSpec(s, s, layers, f.name, None, summary))
            continue
        b = graph.program(ProgramRef(Phase.BACKWARD, s))
        summary += f"; B: {_summary(traced, b.eqns)}"
        out.append(StageSpec(s, s, layers, f.name, b.name, summary))
    return tuple(out)


def _input_specs(traced: TracedStep, graph: StageGraph) -> tuple[InputSpec, ...]:
    out = []
    for item in graph.input_slots:
        info = traced.inputs[item.leaf]
        if not item.slots:
            kind = LeafKind.UNUSED
        else:
            kind = LeafKind.BATCH if info.is_batch else LeafKind.STATE
        out.append(InputSpec(item.leaf, info.path, kind, info.shape, info.dtype, item.slots))
    return tuple(out)


def _output_specs(traced: TracedStep, graph: StageGraph) -> tuple[OutputSpec, ...]:
    out = []
    for o in graph.output_slots:
        info = traced.outputs[o.leaf]
        lit = o.literal.item() if hasattr(o.literal, "item") else o.literal
        out.append(
            OutputSpec(
                o.leaf,
                info.path,
                info.shape,
                info.dtype,
                o.source,
                o.slots,
                o.input_leaf,
                lit,
                info.weak_type,
            )
        )
    return tuple(out)
