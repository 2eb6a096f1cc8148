"""Annotation pass: costs added to a finished plan, never a different plan.

``lower()`` shows costs (each program's FLOPs and bytes from JAX's cost analysis, each
transfer's simulated time); a call runs the same plan without them.  This pass only
fills those fields, so ``strip_annotations(annotate_costs(plan, ...)) == plan``.
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.passes.costs import program_costs
from meshshard.passes.stage_graph import ProgramIO, StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import Plan, TransferSpec
from meshshard.resharding import simulate_resharding
from meshshard.tiles import resharding_problem

__all__ = ["annotate_costs", "strip_annotations"]


def annotate_costs(plan: Plan, traced: TracedStep, graph: StageGraph, cluster: ClusterSpec) -> Plan:
    """``plan`` with program FLOPs/bytes and simulated transfer times filled in."""
    n = graph.num_stages  # data-parallel replica j of program s is s + n j (passes/replicas)
    base = {p.name: replace(p.name, owner=p.name.owner % n) for p in plan.programs}
    cost = program_costs(traced, graph, _later_programs(plan, graph, set(base.values())))
    programs = tuple(
        replace(p, flops=cost[base[p.name]][0], bytes_accessed=cost[base[p.name]][1])
        for p in plan.programs
    )
    transfers = tuple(_simulated(plan, t, cluster) for t in plan.transfers)
    return replace(plan, programs=programs, transfers=transfers)


def _later_programs(plan: Plan, graph: StageGraph, names: set) -> tuple[ProgramIO, ...]:
    """Programs of ``plan`` that passes after the stage graph made (fused ``FB``s), over
    the graph's buffer groups (replica 0's, whose names are the base names)."""
    known = {p.name for p in graph.programs}
    groups = {g.ref: g for p in graph.programs for g in (*p.inputs, *p.outputs)}
    return tuple(
        ProgramIO(
            p.name,
            p.name.owner,
            p.eqns,
            tuple(groups[r] for r in p.inputs),
            tuple(groups[r] for r in p.outputs),
        )
        for p in plan.programs
        if p.name in names and p.name not in known
    )


def _simulated(plan: Plan, t: TransferSpec, cluster: ClusterSpec) -> TransferSpec:
    """``t`` with the simulator's time for exactly its messages (none for a local one)."""
    if t.is_local:
        return replace(t, sim_time_s=0.0)
    src, dst = plan.meshes[t.src_mesh], plan.meshes[t.dst_mesh]
    problem = resharding_problem(
        t.tensor.shape, t.tensor.dtype, src, t.tensor.spec, dst, t.dst_spec
    )
    return replace(t, sim_time_s=simulate_resharding(problem, t.messages, cluster))


def strip_annotations(plan: Plan) -> Plan:
    """``plan`` without cost annotations (what a call of the step runs)."""
    programs = tuple(replace(p, flops=None, bytes_accessed=None) for p in plan.programs)
    transfers = tuple(replace(t, sim_time_s=None) for t in plan.transfers)
    return replace(plan, programs=programs, transfers=transfers)
