"""Pass: cross-mesh transfers of whole arrays by point-to-point send/recv.

Every destination host receives the whole array: each distinct block the source mesh
holds is sent once per destination host, by the first source host that holds it.
Simple and exact for any pair of shardings; the cross-mesh resharding planner replaces
it with tile-level plans (broadcast trees, load balancing).
"""

from __future__ import annotations

import numpy as np

from meshshard.passes.sharding import data_parallel_spec, micro_batch_sizes, tensor_specs
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import MeshSpec, Message, TensorSpec, TransferSpec
from meshshard.tiles import block_nbytes, device_blocks


def whole_array_messages(
    src: MeshSpec, dst: MeshSpec, src_spec, shape: tuple[int, ...], itemsize: int
) -> tuple[Message, ...]:
    """Messages that give every destination host the whole array."""
    blocks = device_blocks(src.shape, src_spec, shape)
    per_host = src.shape[1]
    owner: dict = {}
    for d, idx in enumerate(blocks):
        owner.setdefault(idx, src.hosts[d // per_host])
    msgs = []
    for dst_host in dst.hosts:
        for idx, src_host in owner.items():
            msgs.append(Message(src_host, dst_host, idx, block_nbytes(idx, itemsize)))
    return tuple(msgs)


def plan_transfers(
    traced: TracedStep, graph: StageGraph, meshes: tuple[MeshSpec, ...]
) -> tuple[TransferSpec, ...]:
    """One TransferSpec per cross-stage edge of the stage graph."""
    info = tensor_specs(traced, graph, meshes)
    mbs = micro_batch_sizes(traced)
    out = []
    for k, e in enumerate(graph.edges):
        label, shape, dtype = info[e.var]
        src = meshes[int(e.producer[1:].split(".")[0])]
        dst = meshes[int(e.consumer[1:].split(".")[0])]
        dep = e.var in graph.batch_dependent
        src_spec = data_parallel_spec(shape, dep, mbs, src)
        dst_spec = data_parallel_spec(shape, dep, mbs, dst)
        msgs = whole_array_messages(src, dst, src_spec, shape, np.dtype(dtype).itemsize)
        out.append(
            TransferSpec(
                name=f"t{k}",
                tensor=TensorSpec(e.var, label, shape, dtype, src_spec),
                dst_spec=dst_spec,
                src_mesh=src.id,
                dst_mesh=dst.id,
                producer=e.producer,
                consumer=e.consumer,
                messages=msgs,
            )
        )
    return tuple(out)
