"""Pass: data-parallel shardings inside each mesh, as buffer groups with specs.

Inside a mesh every value computed from the batch whose leading dim is the micro-batch
is split along that dim over all the mesh's devices; everything else (parameters,
gradients, optimizer state) is replicated.  Later sharding inference replaces this rule
without changing the buffer format.
"""

from __future__ import annotations

import numpy as np

from meshshard.jaxpr_util import var_ids
from meshshard.passes.physical_keys import is_key_aval
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import MESH_AXES, BufferSpec, MeshSpec, Spec, TensorSpec


def data_parallel_spec(
    shape: tuple[int, ...], batch_dependent: bool, micro_batch_sizes: set[int], mesh: MeshSpec
) -> Spec:
    """``P(('host', 'device'))`` for batch-shaped values that divide over the mesh, else ``P()``."""
    n = mesh.num_devices
    if n > 1 and batch_dependent and shape and shape[0] in micro_batch_sizes and shape[0] % n == 0:
        return (MESH_AXES,)
    return ()


def micro_batch_sizes(traced: TracedStep) -> set[int]:
    """Leading dims of the batch leaves at micro-batch shape (not the micro-batch index
    the compiler adds for random draws: its one row per micro-batch is no batch)."""
    from meshshard.passes.random_draws import INDEX_PATH

    m = traced.num_micro_batches
    return {
        leaf.shape[0] // m for leaf in traced.inputs if leaf.is_batch and leaf.path != INDEX_PATH
    }


#: Plan notes that start so are also logged as a warning at compile time.
UNSPLIT_BATCH = "batch not split"


def unsplit_batch_notes(traced: TracedStep, meshes: tuple[MeshSpec, ...]) -> list[str]:
    """A note per mesh whose devices the micro-batch rows do not divide.

    There the data-parallel rule keeps every batch-shaped value whole on every device
    (correct, but with no data parallelism on that mesh), which a user asking for
    ``DataParallel((1, 2))`` does not expect from a batch of 9: say so in the plan.
    """
    notes = []
    for size in sorted(micro_batch_sizes(traced)):
        for mesh in meshes:
            n = mesh.num_devices
            if n > 1 and size % n:
                notes.append(
                    f"{UNSPLIT_BATCH}: micro-batches of {size} rows do not divide over the "
                    f"{n} devices of mesh{mesh.id}, so its batch values are replicated there "
                    f"(every device computes the whole micro-batch); use a batch size whose "
                    f"micro-batches are a multiple of {n}"
                )
    return notes


def tensor_specs(traced: TracedStep) -> dict:
    """Var id -> (readable name, shape, dtype) for every value a buffer may hold."""
    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    info = {}
    for v, i in ids.items():
        if not is_key_aval(v.aval):  # keys never sit in buffers (see physical_keys)
            info[i] = (f"%{i}", tuple(v.aval.shape), str(np.dtype(v.aval.dtype)))
    for leaf, li in enumerate(traced.inputs):
        info[leaf] = (li.path, tuple(jaxpr.invars[leaf].aval.shape), li.dtype)
    return info


def build_buffers(
    traced: TracedStep,
    graph: StageGraph,
    meshes: tuple[MeshSpec, ...],
    specs: dict | None = None,
) -> tuple[BufferSpec, ...]:
    """One BufferSpec per non-empty group of the stage graph, with a spec per array.

    ``specs`` (mesh id -> var id -> spec, from sharding inference) overrides the
    data-parallel rule for the values it names.
    """
    info = tensor_specs(traced)
    mbs = micro_batch_sizes(traced)
    out = []
    for group in graph.groups:
        if not group.vars:
            continue
        per_mb = group.ref.kind.per_micro_batch
        mesh = meshes[group.ref.owner]  # stage s runs on mesh s; S/O groups name their mesh
        tensors = []
        for var in group.vars:
            label, shape, dtype = info[var]
            dep = var in graph.batch_dependent and per_mb
            spec = data_parallel_spec(shape, dep, mbs, mesh)
            if specs and var in specs.get(mesh.id, {}):
                spec = specs[mesh.id][var]
            tensors.append(TensorSpec(var, label, shape, dtype, spec))
        out.append(BufferSpec(group.ref, mesh.id, per_mb, tuple(tensors)))
    return tuple(out)
