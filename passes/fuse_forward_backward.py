"""Pass: run a stage's forward and backward of one micro-batch as one program where a
worker's stream runs them back to back.

The last stage of 1F1B-like schedules (and the only stage of a data-parallel step with
micro-batches) runs ``RUN s{i}.F mb k`` and, with nothing but frees between,
``RUN s{i}.B mb k``.  Two programs there cost more than one on XLA:CPU: the forward
writes every residual out and the backward reads it back, and each program pays its own
dispatch and fixed cost (benchmarks/RESULTS.md, "Fusing a stage's forward and
backward").  This pass replaces each such pair by ``RUN s{i}.FB mb k``: one program
over both equation lists, whose residuals the backward alone reads stay inside it (no
``R`` buffer, no free).  What it computes is unchanged: the same equations, once each.

A pair is fused only when the forward's and the backward's inputs and outputs line up
with their programs' groups, and every fused occurrence of a stage has the same
signature (one ``FB`` program per stage); anything else is left as it was.  A split
backward (zero-bubble B) that computes some weight-gradient contributions only to carry
them to its W (under ``remat``) is not fused with a forward that writes the
accumulators: one program would count those contributions where the forward adds its
own, and W would count them again.

The ``F`` and ``B`` programs stay in the plan: the stage list names them, and a pair
that is not fused still runs them.  The runtime compiles a program only when a stream
first runs it, so the unrun ones cost nothing; :meth:`Plan.programs_run` lists the
others.  Pure: a new Plan.
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.instructions import Free, Instruction, Run, WorkerStream
from meshshard.jaxpr_util import is_marker, var_ids
from meshshard.passes.trace import TracedStep
from meshshard.plan import Plan, ProgramSpec
from meshshard.refs import BufferKind, BufferRef, Phase, ProgramRef

__all__ = ["fuse_forward_backward", "fused_name", "merged_program"]


def fused_name(forward: ProgramRef) -> ProgramRef:
    """``s{i}.FB`` (``s{i}v{j}.FB``) of forward program ``s{i}.F``."""
    return ProgramRef(Phase.FORWARD_BACKWARD, forward.owner, forward.virtual)


def fuse_forward_backward(plan: Plan, traced: TracedStep) -> Plan:
    """``plan`` with each back-to-back forward/backward pair of a micro-batch run as one
    ``FB`` program (module docstring); the plan itself when no pair qualifies."""
    specs = {p.name: p for p in plan.programs}
    owns = _contributions(plan, traced)
    fused: dict[ProgramRef, ProgramSpec] = {}
    streams = []
    for stream in plan.streams:
        instructions = _fuse_stream(stream.instructions, specs, owns, fused)
        streams.append(
            stream if instructions is None else WorkerStream(stream.worker, instructions)
        )
    if not fused:
        return plan
    return replace(plan, programs=plan.programs + tuple(fused.values()), streams=tuple(streams))


def _contributions(plan: Plan, traced: TracedStep):
    """``owns(accumulator group, program)``: does the program compute the contribution of
    any accumulator of the group (the operand its ``grad_end`` result sums)?"""
    jaxpr = traced.jaxpr
    marker = next((e for e in jaxpr.eqns if is_marker(e, "grad_end")), None)
    ids = var_ids(jaxpr)
    operand = (
        {ids[r]: o for r, o in zip(marker.outvars, marker.invars, strict=True)} if marker else {}
    )

    made: dict[ProgramRef, set] = {}  # program -> the values its equations define

    def owns(group: BufferRef, program: ProgramSpec) -> bool:
        if program.name not in made:
            made[program.name] = {v for i in program.eqns for v in jaxpr.eqns[i].outvars}
        return any(operand.get(t.var) in made[program.name] for t in plan.buffer(group).tensors)

    return owns


def _fuse_stream(
    instructions: tuple[Instruction, ...],
    specs: dict[ProgramRef, ProgramSpec],
    owns,
    fused: dict[ProgramRef, ProgramSpec],
) -> tuple[Instruction, ...] | None:
    """The stream with its qualifying pairs fused (``fused`` gains their programs), or
    None when nothing changed."""
    out: list[Instruction] = []
    dropped: set[BufferRef] = set()  # residual instances kept inside a fused program
    skip: set[int] = set()
    for i, ins in enumerate(instructions):
        if i in skip:
            continue
        if isinstance(ins, Free) and ins.buffer in dropped:
            continue
        j = _partner(instructions, i)
        if j is None:
            out.append(ins)
            continue
        run, spec = _fused_run(instructions, i, j, specs, owns)
        if run is None or fused.setdefault(run.program, spec) != spec:
            out.append(ins)
            continue
        out.append(run)
        out.extend(instructions[i + 1 : j])  # the frees between, now after the one run
        skip.update(range(i + 1, j + 1))
        dropped.update(set(ins.outputs) - set(run.outputs))
    return tuple(out) if skip else None


def _partner(instructions, i: int) -> int | None:
    """The position of the backward that follows forward run ``i`` with only frees
    between, on the same stage and micro-batch; None if there is none."""
    ins = instructions[i]
    if not isinstance(ins, Run) or ins.program.phase is not Phase.FORWARD or ins.mb is None:
        return None
    for j in range(i + 1, len(instructions)):
        nxt = instructions[j]
        if isinstance(nxt, Free):
            continue
        p = nxt.program if isinstance(nxt, Run) else None
        if (
            p is not None
            and p.phase is Phase.BACKWARD
            and (p.owner, p.virtual, nxt.mb) == (ins.program.owner, ins.program.virtual, ins.mb)
            and not {f.buffer for f in instructions[i + 1 : j]} & set(nxt.inputs)
        ):
            return j
        return None
    return None


def _fused_run(instructions, i: int, j: int, specs, owns) -> tuple[Run | None, ProgramSpec | None]:
    """The one run (and its program) replacing forward ``i`` and backward ``j``; (None,
    None) when their buffers do not line up with their programs' groups, or the backward
    computes contributions to accumulators only the forward writes (module docstring)."""
    f, b = instructions[i], instructions[j]
    fs, bs = specs.get(f.program), specs.get(b.program)
    if fs is None or bs is None or fs.mesh != bs.mesh:
        return None, None
    forward_only_accs = [
        g for g in fs.outputs if g.kind is BufferKind.ACCUMULATORS and g not in bs.outputs
    ]
    if any(owns(g, bs) for g in forward_only_accs):
        return None, None
    if any(
        tuple(x.group for x in run_side) != spec_side
        for run_side, spec_side in (
            (f.inputs, fs.inputs),
            (f.outputs, fs.outputs),
            (b.inputs, bs.inputs),
            (b.outputs, bs.outputs),
        )
    ):
        return None, None
    later = instructions[j + 1 :]
    read_later = {r for x in later if not isinstance(x, Free) for r in x.reads}
    inside = {
        o
        for o in f.outputs
        if o.kind is BufferKind.RESIDUALS and o in b.inputs and o not in read_later
    }
    inputs = f.inputs + tuple(x for x in b.inputs if x not in f.outputs and x not in f.inputs)
    outputs = tuple(o for o in f.outputs if o not in inside and o not in b.outputs) + b.outputs
    name = fused_name(f.program)
    spec = merged_program(name, fs, bs, inputs, outputs)
    return Run(program=name, mb=f.mb, inputs=inputs, outputs=outputs), spec


def merged_program(
    name: ProgramRef, first: ProgramSpec, second: ProgramSpec, inputs, outputs, pins=()
) -> ProgramSpec:
    """One program ``name`` over the equations of two programs of a mesh run back to back,
    reading ``inputs`` and writing ``outputs`` (buffer instances; their groups are
    taken), with both programs' sharding pins and ``pins`` (more ``(var, spec)``)."""

    def union(a: tuple, b: tuple) -> tuple:
        return tuple(dict.fromkeys(a + b))

    return ProgramSpec(
        name=name,
        mesh=first.mesh,
        eqns=tuple(sorted(set(first.eqns) | set(second.eqns))),
        inputs=tuple(x.group for x in inputs),
        outputs=tuple(x.group for x in outputs),
        constraints=union(first.constraints, union(tuple(pins), second.constraints)),
        unreduced=union(first.unreduced, second.unreduced),
        operand_constraints=union(first.operand_constraints, second.operand_constraints),
    )
