"""Build the jitted programs of one mesh from the traced step and the plan.

The runtime never plans: it takes the plan's equation lists and buffer layouts and
turns each program into one ``jax.jit`` over the mesh's devices with the plan's
``NamedSharding`` for every input and output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshshard.passes.apply_programs import program_partials
from meshshard.passes.trace import TracedStep
from meshshard.plan import MESH_AXES, Plan, Spec, TensorSpec
from meshshard.program_fn import Local, program_function
from meshshard.refs import BufferGroup, BufferKind, BufferRef, Phase, ProgramRef


def make_mesh(devices: Sequence, shape: tuple[int, int]) -> Mesh:
    """A ``(host, device)`` mesh over ``devices`` listed host-major."""
    return Mesh(np.array(devices, dtype=object).reshape(shape), MESH_AXES)


@functools.lru_cache(maxsize=4096)
def sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    """The NamedSharding of a plan spec on ``mesh``: one object per mesh and spec, since
    the runtime asks for them per message and per step (building one and comparing it
    with a program's costs more than the lookup)."""
    return NamedSharding(mesh, PartitionSpec(*spec))


@dataclass
class CompiledProgram:
    """A jitted program and how its flat inputs/outputs split into buffer groups."""

    name: ProgramRef
    fn: Callable
    input_groups: tuple[BufferRef, ...]
    output_groups: tuple[BufferRef, ...]
    output_sizes: tuple[int, ...]
    #: (flat output, flat input) pairs the program hands back as they came in, uncopied:
    #: ``fn`` does not return them (see :func:`passed_through`)
    passed: tuple[tuple[int, int], ...] = ()

    def __call__(self, groups: Sequence[tuple]) -> list[tuple]:
        flat = [a for g in groups for a in g]
        outs = self.fn(*flat)
        if self.passed:
            computed = iter(outs)
            given = dict(self.passed)
            total = len(outs) + len(given)
            outs = [flat[given[j]] if j in given else next(computed) for j in range(total)]
        result, pos = [], 0
        for n in self.output_sizes:
            result.append(tuple(outs[pos : pos + n]))
            pos += n
        return result


def _tensors(plan: Plan, ref: BufferRef) -> tuple[TensorSpec, ...]:
    """The arrays of buffer group, transfer or all-reduce ``ref``."""
    if ref.kind is BufferKind.TRANSFER:
        return (plan.transfer(ref).tensor,)
    if ref.kind is BufferKind.REDUCTION:
        return (plan.reduction(ref).tensor,)
    return plan.buffer(ref).tensors


def group_contents(plan: Plan, ref: BufferRef) -> BufferGroup:
    """Buffer group, transfer or all-reduce ``ref`` with the var ids it holds."""
    return BufferGroup(ref, tuple(t.var for t in _tensors(plan, ref)))


def _specs_for(plan: Plan, group: BufferRef, mesh_id: int) -> tuple[Spec, ...]:
    if group.kind is BufferKind.TRANSFER:
        t = plan.transfer(group)
        return (t.tensor.spec if t.src_mesh == mesh_id else t.dst_spec,)
    if group.kind is BufferKind.REDUCTION:
        return ((),)
    axis_size = dict(zip(MESH_AXES, plan.meshes[mesh_id].axis_shape, strict=True))
    return tuple(t.stored(axis_size)[1] for t in plan.buffer(group).tensors)


def stored_shapes(plan: Plan, group: BufferRef, mesh_id: int) -> tuple:
    """Shape of each array of ``group`` as held on the mesh (None: the traced shape)."""
    if group.kind in (BufferKind.TRANSFER, BufferKind.REDUCTION):
        return (None,)
    axis_size = dict(zip(MESH_AXES, plan.meshes[mesh_id].axis_shape, strict=True))
    return tuple(t.stored(axis_size)[0] for t in plan.buffer(group).tensors)


def build_programs(
    traced: TracedStep, plan: Plan, mesh_id: int, mesh: Mesh
) -> dict[ProgramRef, CompiledProgram]:
    """Compile every program of mesh ``mesh_id`` (its stage's F/B and its update)."""
    out = {}
    for spec in plan.programs:
        if spec.mesh != mesh_id:
            continue
        fn = program_function(
            traced,
            spec.eqns,
            [group_contents(plan, g) for g in spec.inputs],
            [group_contents(plan, g) for g in spec.outputs],
            plan.num_micro_batches,
            spec.name.phase is Phase.APPLY,
            partials=program_partials(plan.reductions, spec.outputs, mesh_id),
            constrain=_constrainer(mesh, dict(spec.constraints)),
            constrained=tuple(v for v, _ in spec.constraints),
            unreduced=_local(plan, spec, mesh),
            operand_constraints=_operand_pins(mesh, spec.operand_constraints),
        )
        in_sh = tuple(sharding(mesh, s) for g in spec.inputs for s in _specs_for(plan, g, mesh_id))
        out_sh = tuple(
            sharding(mesh, s) for g in spec.outputs for s in _specs_for(plan, g, mesh_id)
        )
        phased = spec.name.part is not None
        ins = _flat_arrays(plan, spec.inputs, mesh_id, in_sh)
        outs = _flat_arrays(plan, spec.outputs, mesh_id, out_sh)
        donate = _usable_donations(
            [
                i
                for i, g in enumerate(_flat_groups(plan, spec.inputs, mesh_id))
                if g.kind is BufferKind.ACCUMULATORS and not phased  # a later phase reads A
            ],
            ins,
            outs,
        )
        passed = passed_through(plan, spec, ins, outs, donate)
        if passed:
            dropped = {j for j, _ in passed}
            fn = _without_outputs(fn, dropped)
            out_sh = tuple(s for j, s in enumerate(out_sh) if j not in dropped)
        jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
        out[spec.name] = CompiledProgram(
            spec.name,
            jitted,
            spec.inputs,
            spec.outputs,
            tuple(len(_specs_for(plan, g, mesh_id)) for g in spec.outputs),
            passed,
        )
    return out


def passed_through(plan: Plan, spec, ins: Sequence, outs: Sequence, donate) -> tuple:
    """(flat output, flat input) pairs of program ``spec`` whose output is a parameter it
    reads, unchanged and laid out alike (``ins``/``outs``: :func:`_flat_arrays`), not
    donated: a shared parameter's copy for another stage.

    XLA would copy such an output on every run (every micro-batch, though the copy moves
    once per step); the runtime hands back the input array itself instead.
    """
    in_vars = [
        (g.kind, v) for g in spec.inputs for v in group_contents(plan, g).vars
    ]  # one per flat input, as _flat_arrays
    where = {
        v: i for i, (kind, v) in enumerate(in_vars) if kind is BufferKind.PARAMS and i not in donate
    }
    pairs = []
    j = 0
    for g in spec.outputs:
        for v in group_contents(plan, g).vars:
            i = where.get(v)
            if g.kind is BufferKind.TRANSFER and i is not None and ins[i] == outs[j]:
                pairs.append((j, i))
            j += 1
    return tuple(pairs)


def _without_outputs(fn: Callable, dropped: set[int]) -> Callable:
    """``fn`` returning its flat outputs less the positions in ``dropped``."""

    @functools.wraps(fn)
    def run(*args):
        return tuple(o for j, o in enumerate(fn(*args)) if j not in dropped)

    return run


def _constrainer(mesh: Mesh, specs: dict) -> Callable | None:
    """``with_sharding_constraint`` of a value to its inferred spec on ``mesh``."""
    if not specs:
        return None
    return lambda var, x: jax.lax.with_sharding_constraint(x, sharding(mesh, specs[var]))


def _operand_pins(mesh: Mesh, pins) -> dict:
    """equation index -> {operand position: NamedSharding} of the plan's operand reshards."""
    out: dict = {}
    for eqn, pos, spec in pins:
        out.setdefault(eqn, {})[pos] = sharding(mesh, spec)
    return out


def _local(plan: Plan, spec, mesh: Mesh) -> Local | None:
    """What the program holds as per-device partial sums (gradient accumulation)."""
    accs = {
        t.var: t.unreduced
        for g in (*spec.inputs, *spec.outputs)
        if g.kind is BufferKind.ACCUMULATORS
        for t in plan.buffer(g).tensors
        if t.unreduced
    }
    if not spec.unreduced and not accs:
        return None
    specs = dict(spec.constraints)

    def shard(var: int, axes: tuple[str, ...], x):
        t = TensorSpec(var, "", tuple(x.shape[1:]), "float32", specs.get(var, ()), axes)
        return jax.lax.with_sharding_constraint(x, sharding(mesh, t.stored(mesh.shape)[1]))

    return Local({u.var: u for u in spec.unreduced}, accs, dict(mesh.shape), shard)


def _flat_groups(plan: Plan, groups: Sequence[BufferRef], mesh_id: int) -> list[BufferRef]:
    return [g for g in groups for _ in _specs_for(plan, g, mesh_id)]


def _flat_arrays(plan: Plan, groups: Sequence[BufferRef], mesh_id: int, shardings) -> list:
    """(shape, dtype, sharding) of each flat array of ``groups`` as the program holds it."""
    out = []
    for g in groups:
        for t, shape in zip(_tensors(plan, g), stored_shapes(plan, g, mesh_id), strict=True):
            out.append((tuple(t.shape if shape is None else shape), str(t.dtype)))
    return [(*a, s) for a, s in zip(out, shardings, strict=True)]


def _usable_donations(candidates: Sequence[int], ins: Sequence, outs: Sequence) -> tuple:
    """The candidate inputs XLA can reuse: each needs an output of its own with the same
    shape, dtype and sharding (a replicated accumulator of an update whose outputs are
    all sharded has none).  Donating only those keeps the step's memory the same and
    spares the user JAX's "Some donated buffers were not usable" warning per program."""
    free: dict = {}
    for key in outs:
        free[key] = free.get(key, 0) + 1
    usable = []
    for i in candidates:
        if free.get(ins[i], 0):
            free[ins[i]] -= 1
            usable.append(i)
    return tuple(usable)
