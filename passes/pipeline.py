"""The compiler driver: run every pass in order and assemble the :class:`Plan`.

Pure: it reads a function, example arguments, a method and a described cluster, and
never touches Ray, so a plan for a GPU cluster can be made and inspected on a laptop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from meshshard.cluster import ClusterSpec
from meshshard.methods import DataParallel, Method
from meshshard.passes.costs import program_costs
from meshshard.passes.emit import emit_streams
from meshshard.passes.meshes import stage_layout
from meshshard.passes.reductions import reduction_notes
from meshshard.passes.schedules import make_schedule
from meshshard.passes.sharding import build_buffers
from meshshard.passes.slicing import slice_layers
from meshshard.passes.stage_graph import StageGraph, build_stage_graph
from meshshard.passes.trace import TracedStep, trace_step
from meshshard.passes.transfers import plan_transfers
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


def plan_traced(
    traced: TracedStep, *, method: Method, cluster: ClusterSpec, costs: bool = False
) -> Plan:
    """Every pass after tracing."""
    slicing = slice_layers(traced.jaxpr)
    layer_groups, meshes = stage_layout(method, cluster, slicing.num_layers)
    graph = build_stage_graph(traced, slicing, layer_groups)
    buffers = build_buffers(traced, graph, meshes)
    strategy = getattr(method, "resharding", "broadcast")
    transfers = plan_transfers(
        traced, graph, meshes, strategy=strategy, cluster=cluster, simulate=costs
    )
    sched_name = "1f1b" if isinstance(method, DataParallel) else method.schedule
    schedule = make_schedule(sched_name, graph.num_stages, traced.num_micro_batches)
    streams = emit_streams(graph, schedule, meshes, transfers)
    cost = program_costs(traced, graph) if costs else {}
    programs = tuple(
        ProgramSpec(
            name=p.name,
            mesh=p.stage,
            eqns=p.eqns,
            inputs=tuple(g.ref for g in p.inputs),
            outputs=tuple(g.ref for g in p.outputs),
            flops=cost.get(p.name, (None, None))[0],
            bytes_accessed=cost.get(p.name, (None, None))[1],
        )
        for p in graph.programs
    )
    notes = []
    if slicing.num_layers > 1 and isinstance(method, DataParallel):
        notes.append(f"{slicing.num_layers - 1} pipeline boundaries ignored by DataParallel")
    notes += reduction_notes(traced.jaxpr, traced.num_micro_batches)
    return Plan(
        method=repr(method),
        cluster=cluster,
        num_micro_batches=traced.num_micro_batches,
        fingerprint=traced.fingerprint,
        meshes=meshes,
        stages=_stage_specs(traced, graph),
        programs=programs,
        buffers=buffers,
        transfers=transfers,
        schedule=schedule,
        streams=streams,
        inputs=_input_specs(traced, graph),
        outputs=_output_specs(traced, graph),
        notes=tuple(notes),
    )


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
        b = graph.program(ProgramRef(Phase.BACKWARD, s))
        summary = f"F: {_summary(traced, f.eqns)}; B: {_summary(traced, b.eqns)}"
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
                o.leaf, info.path, info.shape, info.dtype, o.source, o.slots, o.input_leaf, lit
            )
        )
    return tuple(out)
