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
from meshshard.errors import MeshshardInputError
from meshshard.passes.sharding import data_parallel_spec, micro_batch_sizes, tensor_specs
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import LOCAL, MeshSpec, TensorSpec, TransferSpec
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
        tensor = TensorSpec(e.var, label, shape, dtype, src_spec)
        ends = dict(
            name=TransferRef(k),
            tensor=tensor,
            dst_spec=dst_spec,
            src_mesh=src.id,
            dst_mesh=dst.id,
            producer=e.producer,
            consumer=e.consumer,
        )
        if set(src.hosts) & set(dst.hosts):
            _check_local(tensor, src, dst, dst_spec, e)
            zero = 0.0 if simulate else None
            out.append(TransferSpec(**ends, messages=(), strategy=LOCAL, sim_time_s=zero))
            continue
        problem = resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)
        planned = _planned(problem, strategy, cluster, simulate)
        out.append(
            TransferSpec(
                **ends,
                messages=planned.messages,
                strategy=planned.strategy,
                sim_time_s=planned.sim_time_s,
                lower_bound_s=planned.lower_bound_s,
                tight_bound_s=planned.tight_bound_s,
            )
        )
    return tuple(out)


def _check_local(tensor: TensorSpec, src: MeshSpec, dst: MeshSpec, dst_spec, edge) -> None:
    """Refuse, naming the value, a transfer between meshes that share hosts unless both
    are views of the same workers laying the value out alike (interleaved 1F1B's chunks
    on one mesh): only then can the consumer read the producer's buffer in place."""
    same = src.workers == dst.workers and src.axis_shape == dst.axis_shape
    if same and tensor.spec == dst_spec:
        return
    raise MeshshardInputError(
        f"value {tensor.name} ({tensor.dtype}{list(tensor.shape)}) goes from {edge.producer} "
        f"on mesh{src.id} (hosts {list(src.hosts)}) to {edge.consumer} on mesh{dst.id} "
        f"(hosts {list(dst.hosts)}): the two meshes share hosts but are not the same "
        "workers with the same layout, so it can neither move between them nor be read in "
        "place; give the stages disjoint hosts, or lay the meshes out alike"
    )


@functools.lru_cache(maxsize=4096)
def _planned(problem, strategy: str, cluster: ClusterSpec, simulate: bool):
    return plan_resharding(problem, strategy, cluster, simulate=simulate)
