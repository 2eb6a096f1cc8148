"""Build the jitted programs of one mesh from the traced step and the plan.

The runtime never plans: it takes the plan's equation lists and buffer layouts and
turns each program into one ``jax.jit`` over the mesh's devices with the plan's
``NamedSharding`` for every input and output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from meshshard.passes.trace import TracedStep

from meshshard.jaxpr_util import eval_eqns, is_literal, is_marker, read_var, var_ids
from meshshard.plan import MESH_AXES, Plan, Spec


def make_mesh(devices: Sequence, shape: tuple[int, int]) -> Mesh:
    """A ``(host, device)`` mesh over ``devices`` listed host-major."""
    return Mesh(np.array(devices, dtype=object).reshape(shape), MESH_AXES)


def sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    """The NamedSharding of a plan spec on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec(*spec))


@dataclass
class CompiledProgram:
    """A jitted program and how its flat inputs/outputs split into buffer groups."""

    name: str
    fn: Callable
    input_groups: tuple[str, ...]
    output_groups: tuple[str, ...]
    output_sizes: tuple[int, ...]

    def __call__(self, groups: Sequence[tuple]) -> list[tuple]:
        flat = [a for g in groups for a in g]
        outs = self.fn(*flat)
        result, pos = [], 0
        for n in self.output_sizes:
            result.append(tuple(outs[pos : pos + n]))
            pos += n
        return result


def group_contents(plan: Plan, name: str):
    """(var ids, specs) of buffer group or transfer ``name`` as seen on its mesh."""
    if name.startswith("t"):
        t = plan.transfer(name)
        return (t.tensor.var,), None
    b = plan.buffer(name)
    return tuple(t.var for t in b.tensors), tuple(t.spec for t in b.tensors)


def _specs_for(plan: Plan, group: str, mesh_id: int) -> tuple[Spec, ...]:
    if group.startswith("t"):
        t = plan.transfer(group)
        return (t.tensor.spec if t.src_mesh == mesh_id else t.dst_spec,)
    return tuple(t.spec for t in plan.buffer(group).tensors)


def build_programs(
    traced: TracedStep, plan: Plan, mesh_id: int, mesh: Mesh
) -> dict[str, CompiledProgram]:
    """Compile every program of mesh ``mesh_id`` (its stage's F/B and its update)."""
    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    by_id = {i: v for v, i in ids.items()}
    consts = dict(zip(jaxpr.constvars, traced.closed.consts, strict=True))
    g_eqn = next(e for e in jaxpr.eqns if is_marker(e, "grad_end"))
    result_to_operand = dict(zip(g_eqn.outvars, g_eqn.invars, strict=True))
    literal_results = {r: o.val for r, o in result_to_operand.items() if is_literal(o)}
    m = plan.num_micro_batches
    out = {}
    for spec in plan.programs:
        if spec.mesh != mesh_id:
            continue
        eqns = [jaxpr.eqns[i] for i in spec.eqns]
        defined = {v for e in eqns for v in e.outvars}
        in_vars = [[by_id[i] for i in group_contents(plan, g)[0]] for g in spec.inputs]
        out_vars = [[by_id[i] for i in group_contents(plan, g)[0]] for g in spec.outputs]
        is_apply = spec.name.endswith(".apply")

        def fn(
            *flat,
            _in=in_vars,
            _out=out_vars,
            _eqns=eqns,
            _defined=defined,
            _apply=is_apply,
            _groups=spec.inputs,
            _ogroups=spec.outputs,
        ):
            env = dict(consts)
            env.update(literal_results)
            pos = 0
            acc_in = {}
            for g, vs in zip(_groups, _in, strict=True):
                vals = flat[pos : pos + len(vs)]
                pos += len(vs)
                if g.startswith("A"):
                    for v, x in zip(vs, vals, strict=True):
                        if _apply:  # accumulated sums -> means over micro-batches
                            env[v] = x / m if jnp.issubdtype(x.dtype, jnp.floating) else x
                        else:
                            acc_in[v] = x
                else:
                    env.update(zip(vs, vals, strict=True))
            eval_eqns(_eqns, env)
            outs = []
            for g, vs in zip(_ogroups, _out, strict=True):
                for v in vs:
                    if g.startswith("A") and not _apply:
                        operand = result_to_operand[v]
                        if operand in _defined:
                            outs.append(acc_in[v] + read_var(env, operand))
                        else:
                            outs.append(acc_in[v])
                    else:
                        outs.append(read_var(env, v))
            return tuple(outs)

        in_sh = tuple(sharding(mesh, s) for g in spec.inputs for s in _specs_for(plan, g, mesh_id))
        out_sh = tuple(
            sharding(mesh, s) for g in spec.outputs for s in _specs_for(plan, g, mesh_id)
        )
        donate = tuple(
            i for i, g in enumerate(_flat_groups(plan, spec.inputs, mesh_id)) if g.startswith("A")
        )
        jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
        out[spec.name] = CompiledProgram(
            spec.name,
            jitted,
            spec.inputs,
            spec.outputs,
            tuple(len(_specs_for(plan, g, mesh_id)) for g in spec.outputs),
        )
    return out


def _flat_groups(plan: Plan, groups: Sequence[str], mesh_id: int) -> list[str]:
    return [g for g in groups for _ in _specs_for(plan, g, mesh_id)]
