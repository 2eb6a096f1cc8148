"""Pass: plan every cross-mesh transfer with the method's resharding strategy.

Each cross-stage value becomes a :class:`~meshshard.tiles.ReshardingProblem` (its
sharding on the producer's mesh -> its sharding on the consumer's mesh), which the
resharding planner turns into messages: point-to-point sends, or broadcasts that
cross each destination host boundary once.  The planner is a pure function of the
problem, strategy and cluster, so each process plans a problem once (a step's
boundaries often carry same-shaped values, and a step is re-planned under other
schedules and methods).
"""

from __future__ import annotations

import functools

from meshshard.cluster import ClusterSpec
from meshshard.passes.sharding import data_parallel_spec, micro_batch_sizes, tensor_specs
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import MeshSpec, TensorSpec, TransferSpec
from meshshard.refs import TransferRef
from meshshard.resharding import plan_resharding
from meshshard.tiles import resharding_problem


def plan_transfers(
    traced: TracedStep,
    graph: StageGraph,
    meshes: tuple[MeshSpec, ...],
    *,
    strategy: str,
    cluster: ClusterSpec,
    simulate: bool = False,
    specs: dict | None = None,
) -> tuple[TransferSpec, ...]:
    """One TransferSpec per cross-stage edge of the stage graph.

    ``simulate`` also predicts each transfer's time on ``cluster`` (shown in the plan).
    ``specs`` (mesh id -> var id -> spec, from sharding inference) overrides the
    data-parallel rule on each side.
    """
    info = tensor_specs(traced)
    mbs = micro_batch_sizes(traced)
    out = []
    for k, e in enumerate(graph.edges):
        label, shape, dtype = info[e.var]
        src = meshes[e.producer.owner]  # stage s runs on mesh s
        dst = meshes[e.consumer.owner]
        dep = e.var in graph.batch_dependent
        src_spec = data_parallel_spec(shape, dep, mbs, src)
        dst_spec = data_parallel_spec(shape, dep, mbs, dst)
        if specs:
            src_spec = specs.get(src.id, {}).get(e.var, src_spec)
            dst_spec = specs.get(dst.id, {}).get(e.var, dst_spec)
        problem = resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)
        planned = _planned(problem, strategy, cluster, simulate)
        out.append(
            TransferSpec(
                name=TransferRef(k),
                tensor=TensorSpec(e.var, label, shape, dtype, src_spec),
                dst_spec=dst_spec,
                src_mesh=src.id,
                dst_mesh=dst.id,
                producer=e.producer,
                consumer=e.consumer,
                messages=planned.messages,
                strategy=planned.strategy,
                sim_time_s=planned.sim_time_s,
                lower_bound_s=planned.lower_bound_s,
                tight_bound_s=planned.tight_bound_s,
            )
        )
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _planned(problem, strategy: str, cluster: ClusterSpec, simulate: bool):
    return plan_resharding(problem, strategy, cluster, simulate=simulate)
