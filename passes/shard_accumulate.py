"""Pass: accumulate gradients locally, reduce once per step (issue 11).

For every program that adds a micro-batch's contribution to a gradient accumulator
``A{s}`` on a mesh of several devices, find the contributions that can be held as
per-device partial sums (:func:`meshshard.passes.shard_unreduced.unreduced_values`):
those accumulators are stored with a leading axis of partial sums
(``TensorSpec.unreduced``) and the program's unreduced values are recorded in the plan
(``ProgramSpec.unreduced``), so the runtime runs no collective per micro-batch and the
update sums the partial sums once per step (an all-reduce, or a reduce-scatter where
the update reads the gradient sharded).

With one micro-batch only gradients summed from several contractions are held (a tied
embedding's: reduced once, not once per contraction).  Off with
``MESHSHARD_ACCUMULATE=reduced`` (the previous behaviour: each contribution reduced as
it is made, kept for comparison in ``benchmarks/shard_real.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace

from meshshard.jaxpr_util import is_literal, is_marker, var_ids
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.shard_costs import REDUCE_KINDS, Comm, LogicalMesh
from meshshard.passes.shard_loops import body_layouts
from meshshard.passes.shard_rules import from_spec, to_spec
from meshshard.passes.shard_unreduced import unreduced_values
from meshshard.passes.sharding import micro_batch_sizes
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import MESH_AXES, BufferSpec, MeshSpec, Spec, Unreduced
from meshshard.refs import BufferKind, Phase, ProgramRef

__all__ = ["local_accumulation", "accumulate_mode", "accumulation_comms", "accumulable_eqns"]

ACC = BufferKind.ACCUMULATORS
LINEAR_REDUCTIONS = ("sum", "mean")


def accumulate_mode() -> str:
    """``local`` (default) or ``reduced``, from ``MESHSHARD_ACCUMULATE``."""
    mode = os.environ.get("MESHSHARD_ACCUMULATE", "local")
    return mode if mode in ("local", "reduced") else "local"


def _split_of(spec: Spec, size: Mapping[str, int]) -> dict:
    """{dim: mesh axes} of a spec, less axes of size 1 (they split nothing)."""
    out = {}
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(a for a in names if size[a] > 1)
        if names:
            out[d] = names
    return out


def _batch_rows(traced: TracedStep, graph: StageGraph) -> Callable[[int], tuple]:
    """var id -> its shape when dim 0 is a micro-batch's rows, else ()."""
    shapes = {i: getattr(v.aval, "shape", ()) for v, i in var_ids(traced.jaxpr).items()}
    mbs = micro_batch_sizes(traced)

    def rows(vid: int) -> tuple:
        shape = shapes.get(vid, ())
        return shape if vid in graph.batch_dependent and shape and shape[0] in mbs else ()

    return rows


def _data_parallel_split(traced: TracedStep, graph: StageGraph, mesh: MeshSpec) -> Callable:
    """var id -> {0: every mesh axis} for a value with a micro-batch's rows that divide
    over the mesh, else None: the data-parallel rule."""
    size = dict(zip(MESH_AXES, mesh.axis_shape, strict=True))
    rows = _batch_rows(traced, graph)
    n = mesh.num_devices
    whole = _split_of((MESH_AXES,), size)[0]

    def split(vid):
        shape = rows(vid)
        return {0: whole} if shape and shape[0] % n == 0 else None

    return split


def _data_parallel_loops(traced: TracedStep, graph: StageGraph, mesh: MeshSpec) -> Callable:
    """The data-parallel rule inside a ``lax.scan``'s body (a recurrent layer over
    time): ``scan equation -> (split_of of the body's var ids, mesh axes)``.  A body
    value is split when it has a micro-batch's rows that divide over the mesh and
    depends on a batch-dependent operand of the scan (through the carries too)."""
    size = dict(zip(MESH_AXES, mesh.axis_shape, strict=True))
    whole = _split_of((MESH_AXES,), size)[0]
    mbs = micro_batch_sizes(traced)
    n = mesh.num_devices
    ids = var_ids(traced.jaxpr)

    def loop(eqn):
        body = eqn.params["jaxpr"].jaxpr
        nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
        flags = [not is_literal(v) and ids.get(v) in graph.batch_dependent for v in eqn.invars]
        while True:  # a carry the body makes from the batch depends on it on entry too
            dep = batch_dependent(body, flags, len(body.eqns))
            carried = [
                k for k, o in enumerate(body.outvars[:ncar]) if not is_literal(o) and o in dep
            ]
            if all(flags[nc + k] for k in carried):
                break
            for k in carried:
                flags[nc + k] = True
        body_ids = var_ids(body)
        split = set()
        for v in dep:
            shape = getattr(v.aval, "shape", ())
            if v in body_ids and shape and shape[0] in mbs and shape[0] % n == 0:
                split.add(body_ids[v])
        return (lambda vid: {0: whole} if vid in split else None), whole

    return loop


def _solved_loops(jaxpr, mesh: MeshSpec, specs: Mapping, reads: Mapping) -> Callable:
    """``scan equation -> (split_of of the body's var ids, mesh axes)`` for a scan the
    sharding solver runs in parallel (:mod:`meshshard.passes.shard_loops`): its body
    laid out from its operands' layouts as the solver's strategy reads them."""
    size = dict(zip(MESH_AXES, mesh.axis_shape, strict=True))
    logical = LogicalMesh(MESH_AXES, tuple(mesh.axis_shape), (0.0, 0.0), (0.0, 0.0))
    ids = var_ids(jaxpr)
    index = {id(e): i for i, e in enumerate(jaxpr.eqns)}

    def layout(eqn, pos, v):
        spec = reads.get((index.get(id(eqn)), pos), specs.get(ids.get(v)))
        return None if spec is None else from_spec(spec, v.aval.ndim)

    def loop(eqn):
        lays = [None if is_literal(v) else layout(eqn, k, v) for k, v in enumerate(eqn.invars)]
        body = body_layouts(eqn, logical, lays)
        if body is None:
            return None
        split = {vid: _split_of(to_spec(lay), size) for vid, lay in body.items()}
        axes = {a for got in split.values() for a in got.values()}
        if len(axes) != 1:
            return None
        return (lambda vid: split.get(vid) or None), axes.pop()

    return loop


def _solved_split(mesh: MeshSpec, specs: Mapping) -> Callable:
    """var id -> {dim: mesh axes} of the sharding solver's spec."""
    size = dict(zip(MESH_AXES, mesh.axis_shape, strict=True))
    return lambda vid: _split_of(specs[vid], size) if vid in specs else None


def _data_parallel_found(traced: TracedStep, graph: StageGraph, mesh: MeshSpec, p):
    """(values held, accumulated contributions) of program ``p`` under the
    data-parallel rule."""
    groups = [g for g in p.outputs if g.ref.kind is ACC]
    targets = _targets(traced, groups)
    split = _data_parallel_split(traced, graph, mesh)
    loops = _data_parallel_loops(traced, graph, mesh)
    return unreduced_values(traced.jaxpr, p.eqns, split, targets, loop_split=loops), targets


def _targets(traced: TracedStep, groups) -> dict:
    """Contribution Var -> accumulator var id, for sum/mean accumulators of ``groups``."""
    jaxpr = traced.jaxpr
    g_eqn = next((e for e in jaxpr.eqns if is_marker(e, "grad_end", "out")), None)
    if g_eqn is None:
        return {}
    info = g_eqn.params.get("reduce") or ()
    ids = var_ids(jaxpr)
    wanted = {i for g in groups for i in g.vars}
    out = {}
    for k, (r, op) in enumerate(zip(g_eqn.outvars, g_eqn.invars, strict=True)):
        red = info[k][1] if k < len(info) and info[k][1] else "mean"
        if ids.get(r) in wanted and red in LINEAR_REDUCTIONS and not is_literal(op):
            out[op] = ids[r]
    return out


def local_accumulation(
    traced: TracedStep,
    graph: StageGraph,
    meshes: tuple[MeshSpec, ...],
    buffers: tuple[BufferSpec, ...],
    specs: Mapping[int, Mapping] | None = None,
    keep_gradients_split: bool = False,
    reads: Mapping[int, Mapping] | None = None,
) -> tuple[tuple[BufferSpec, ...], dict[ProgramRef, tuple[Unreduced, ...]]]:
    """(buffers with unreduced accumulators, program -> its unreduced values).

    ``specs``: mesh id -> var id -> spec from sharding inference (None or missing: the
    data-parallel rule).  ``keep_gradients_split`` (ZeRO's modes): a gradient the
    solver splits is reduce-scattered as each micro-batch makes it, so no device ever
    holds it whole; otherwise it too is held as partial sums, and the update
    reduce-scatters it once per step, as the solver priced it.  ``reads``: mesh id ->
    (equation index, operand position) -> the spec the solver reshards that operand to
    before the equation reads it (a loop's operands, as its strategy reads them).
    Returns the inputs unchanged when nothing can stay unreduced.
    """
    if accumulate_mode() == "reduced":
        return buffers, {}
    ids = var_ids(traced.jaxpr)
    programs: dict[ProgramRef, tuple[Unreduced, ...]] = {}
    acc_axes: dict[int, tuple[str, ...]] = {}
    for p in graph.programs:
        groups = [g for g in p.outputs if g.ref.kind is ACC]
        mesh = meshes[p.stage]
        if p.name.phase is Phase.APPLY or not groups or mesh.num_devices == 1:
            continue
        found, targets = _data_parallel_found(traced, graph, mesh, p)
        solved = (specs or {}).get(mesh.id)
        if solved:  # the solver's splits, partial sums made where data parallelism makes
            # them: weight gradients (contracted over the batch and the sequence), never
            # a tensor-parallel contraction over features
            made = {i for _, eqns in _chains(traced.jaxpr, p.eqns, found, targets) for i in eqns}
            split = _solved_split(mesh, solved)
            loops = _solved_loops(traced.jaxpr, mesh, solved, (reads or {}).get(mesh.id, {}))
            found = unreduced_values(
                traced.jaxpr,
                p.eqns,
                split,
                targets,
                keep_gradients_split,
                made_by=made,
                loop_split=loops,
            )
        if traced.num_micro_batches == 1:
            found = _summed_contributions(traced.jaxpr, p.eqns, found, targets)
        if not found:
            continue
        programs[p.name] = tuple(found[k] for k in sorted(found))
        for op, acc in targets.items():
            if ids.get(op) in found:
                acc_axes.setdefault(acc, found[ids[op]].axes)
    if not acc_axes:
        return buffers, {}
    out = []
    for b in buffers:
        if b.name.kind is ACC:
            tensors = tuple(
                replace(t, unreduced=acc_axes[t.var]) if t.var in acc_axes else t for t in b.tensors
            )
            b = replace(b, tensors=tensors)
        out.append(b)
    return tuple(out), programs


def _chains(jaxpr, eqns, found: Mapping, targets: Mapping) -> list[tuple[set, list[int]]]:
    """Per accumulated gradient: the held values it is summed from, and the equations
    among ``eqns`` that make its partial sums (its contractions)."""
    ids = var_ids(jaxpr)
    made_of = {o: i for i in eqns for o in jaxpr.eqns[i].outvars}
    out = []
    for target in targets:
        chain, made, todo = set(), [], [target]
        while todo:
            v = todo.pop()
            if v in chain or ids.get(v) not in found:
                continue
            chain.add(v)
            if (found[ids[v]].split or found[ids[v]].loop_outs) and v in made_of:
                made.append(made_of[v])
            if v in made_of:
                todo.extend(x for x in jaxpr.eqns[made_of[v]].invars if not is_literal(x))
        out.append((chain, made))
    return out


def _summed_contributions(jaxpr, eqns, found: Mapping, targets: Mapping) -> dict:
    """``found`` less the chains of gradients made by one contraction.  With one
    micro-batch, holding partial sums saves only where a gradient adds up several
    contractions (a tied embedding's lookup and output head, a layer applied twice, a
    recurrent layer's scan over time): summed locally, it is reduced once, not once per
    contraction or time step."""
    ids = var_ids(jaxpr)
    out = {k: u for k, u in found.items() if u.loop_outs}  # a loop's: reduced once, not per step
    for chain, made in _chains(jaxpr, eqns, found, targets):
        if len(made) > 1 or any(jaxpr.eqns[i].primitive.name == "scan" for i in made):
            out.update({ids[v]: found[ids[v]] for v in chain})
    return out


def accumulable_eqns(traced: TracedStep, graph: StageGraph, mesh: MeshSpec) -> dict[int, float]:
    """Equation index -> how many times a step runs its reduce, for the contractions of
    ``mesh``'s programs whose result local accumulation holds as partial sums when the
    batch is split: ``1 / (M k)`` for one of the ``k`` contractions a gradient is summed
    from (``k`` is 2 for a tied embedding), since the gradient is reduced once per step,
    not once per micro-batch and contraction; the sharding solver prices it so (without
    this, data parallelism looks ``M k`` times dearer to it than it is)."""
    m = traced.num_micro_batches
    if accumulate_mode() == "reduced" or mesh.num_devices == 1:
        return {}
    jaxpr = traced.jaxpr
    out: dict[int, float] = {}
    for p in graph.programs:
        groups = [g for g in p.outputs if g.ref.kind is ACC]
        if p.stage != mesh.id or p.name.phase is Phase.APPLY or not groups:
            continue
        found, targets = _data_parallel_found(traced, graph, mesh, p)
        for _, made in _chains(jaxpr, p.eqns, found, targets):
            if m * len(made) > 1:
                for i in made:
                    out[i] = min(out.get(i, 1.0), 1.0 / (m * len(made)))
    return out


def _first_reader(jaxpr, eqns, vid: int, ids: Mapping) -> int:
    """The first of ``eqns`` that reads var ``vid`` (else the first of ``eqns``)."""
    for i in eqns:
        if any(not is_literal(v) and ids.get(v) == vid for v in jaxpr.eqns[i].invars):
            return i
    return eqns[0]


def accumulation_comms(
    traced: TracedStep,
    graph: StageGraph,
    meshes: tuple[MeshSpec, ...],
    buffers: tuple[BufferSpec, ...],
    unreduced: Mapping[ProgramRef, tuple[Unreduced, ...]],
    shardings: tuple,
) -> tuple:
    """The meshes' sharding solutions with their predicted collectives as local
    accumulation leaves them: no reduce of a value a program holds as partial sums, and
    one all-reduce per unreduced accumulator in the update, so the plan prints what XLA
    runs.  Where the solver splits the gradient over the summed axes, XLA:CPU compiles
    the sum as an all-reduce and a slice (GPU backends fuse the two into a
    reduce-scatter), as the solver's own rules price a reduce the update reads split."""
    if not unreduced or not shardings:
        return shardings
    jaxpr, ids = traced.jaxpr, var_ids(traced.jaxpr)
    out = []
    for s in shardings:
        progs = [p for p in graph.programs if meshes[p.stage].id == s.mesh]
        held = {u.var for p in progs for u in unreduced.get(p.name, ())}
        apply = next((p for p in progs if p.name.phase is Phase.APPLY and p.eqns), None)
        if not held or apply is None:
            out.append(s)
            continue
        comms = [
            (e, c) for e, c in s.solution.comms if not (c.var in held and c.kind in REDUCE_KINDS)
        ]
        for b in buffers:
            if b.name.kind is not ACC or b.mesh != s.mesh:
                continue
            for t in b.tensors:
                if not t.unreduced:
                    continue
                at = _first_reader(jaxpr, apply.eqns, t.var, ids)
                comms.append((at, Comm("all-reduce", t.unreduced, float(t.nbytes), t.var)))
        solution = replace(s.solution, comms=tuple(comms))
        out.append(replace(s, solution=solution))
    return tuple(out)
