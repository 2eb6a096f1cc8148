"""Pass: run a one-micro-batch step of a mesh as one program, update included.

With one micro-batch a single-stage step (``DataParallel`` or ``ShardParallel`` with
``num_micro_batches=1``, the common case) runs::

    ZEROS A0; LOAD X0@0; RUN s0.FB mb0 (P0 X0@0 A0) -> (A0); FREE X0@0
    RUN m0.apply (A0 P0 S0) -> (O0); FREE A0

Three dispatches where ``jax.jit`` runs one program, a zeroed accumulator that the
gradient is added to, and an update that XLA cannot fuse with the backward that made
its gradient.  This pass replaces such a run of instructions by ::

    LOAD X0@0; RUN s0.step mb0 (P0 X0@0 S0) -> (O0); FREE X0@0

one program over both equation lists whose update reads the gradients as one
micro-batch leaves them (:func:`meshshard.program_fn.program_function`); the
accumulator is never stored.  What it computes is unchanged: zeros plus a contribution
is the contribution, and a one-micro-batch mean is that micro-batch's value.

Fused only where the stream has exactly that shape: the accumulators zeroed, written by
one run, read by the mesh's one-phase update right after it (frees between), then freed;
buffers lining up with their programs' groups; every worker of the mesh fusing alike.
Anything else (several micro-batches, a pipeline's sends between backward and update,
replicas' all-reduces, 2BW's kept accumulators) is left as it was.  The stage and update
programs stay in the plan, unrun.  Pure: a new Plan.
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.instructions import Free, Instruction, Run, WorkerStream, Zeros
from meshshard.passes.fuse_forward_backward import merged_program
from meshshard.plan import Plan, ProgramSpec
from meshshard.refs import BufferKind, Phase, ProgramRef

__all__ = ["fuse_step", "step_name"]

ACC = BufferKind.ACCUMULATORS


def step_name(stage_program: ProgramRef) -> ProgramRef:
    """``s{i}.step`` (``s{i}v{j}.step``): stage program ``s{i}.FB`` (a first pipeline
    stage's ``s{i}.B``, zero-bubble's ``s{i}.W``) fused with its mesh's update."""
    return ProgramRef(Phase.STEP, stage_program.owner, stage_program.virtual)


def fuse_step(plan: Plan) -> Plan:
    """``plan`` with each mesh's one-micro-batch stage run and update run as one ``step``
    program (module docstring); the plan itself when no mesh qualifies."""
    if plan.num_micro_batches != 1:
        return plan
    specs = {p.name: p for p in plan.programs}
    found: dict[int, tuple] = {}  # worker -> (its fused stream, the fused program's name)
    fused: dict[ProgramRef, ProgramSpec] = {}
    clash: set[ProgramRef] = set()
    for stream in plan.streams:
        got = _fuse_stream(plan, stream.instructions, specs)
        if got is None:
            continue
        instructions, spec = got
        if fused.setdefault(spec.name, spec) != spec:
            clash.add(spec.name)
        found[stream.worker] = (instructions, spec.name)
    # a mesh's workers run one SPMD program: fuse on all of them or on none
    keep = {
        name
        for name, spec in fused.items()
        if name not in clash
        and all(found.get(w, ((), None))[1] == name for w in plan.meshes[spec.mesh].workers)
    }
    if not keep:
        return plan
    streams = tuple(
        WorkerStream(s.worker, found[s.worker][0])
        if found.get(s.worker, ((), None))[1] in keep
        else s
        for s in plan.streams
    )
    added = tuple(fused[name] for name in sorted(keep, key=lambda n: n.sort_key))
    return replace(plan, programs=plan.programs + added, streams=streams)


def _fuse_stream(plan: Plan, instructions: tuple[Instruction, ...], specs: dict) -> tuple | None:
    """(the stream with its stage run and update run fused, the fused program), or None
    when the stream has no such pair."""
    for k, apply in enumerate(instructions):
        if not (
            isinstance(apply, Run)
            and apply.program.phase is Phase.APPLY
            and apply.program.part is None
        ):
            continue
        j = k - 1
        while j >= 0 and isinstance(instructions[j], Free):
            j -= 1
        if j < 0 or not _pair(instructions, j, k, specs):
            continue
        return _fused(plan, instructions, j, k, specs)
    return None


def _pair(instructions, j: int, k: int, specs: dict) -> bool:
    """True when run ``j`` alone writes the accumulators update ``k`` reads, between their
    ``ZEROS`` and one ``FREE`` after ``k``, and both runs line up with their programs."""
    stage, apply = instructions[j], instructions[k]
    if not isinstance(stage, Run) or stage.mb is None or stage.program.phase is Phase.APPLY:
        return False
    accs = [b for b in apply.inputs if b.kind is ACC]
    writes = [b for b in stage.outputs if b.kind is ACC]
    if not accs or sorted(writes, key=str) != sorted(accs, key=str):
        return False
    if {f.buffer for f in instructions[j + 1 : k]} & set(apply.inputs):
        return False
    for a in accs:
        touching = [i for i, x in enumerate(instructions) if a in x.reads or a in x.writes]
        zeros = [i for i in touching if isinstance(instructions[i], Zeros)]
        frees = [i for i in touching if isinstance(instructions[i], Free)]
        if len(zeros) != 1 or len(frees) != 1 or touching != [zeros[0], j, k, frees[0]]:
            return False
    stage_spec, apply_spec = specs.get(stage.program), specs.get(apply.program)
    if stage_spec is None or apply_spec is None or stage_spec.mesh != apply_spec.mesh:
        return False
    return all(
        tuple(x.group for x in run_side) == spec_side
        for run_side, spec_side in (
            (stage.inputs, stage_spec.inputs),
            (stage.outputs, stage_spec.outputs),
            (apply.inputs, apply_spec.inputs),
            (apply.outputs, apply_spec.outputs),
        )
    )


def _fused(plan: Plan, instructions, j: int, k: int, specs: dict) -> tuple:
    stage, apply = instructions[j], instructions[k]
    accs = {b for b in apply.inputs if b.kind is ACC}
    later = instructions[k + 1 :]
    read_later = {r for x in later if not isinstance(x, Free) for r in x.reads}
    # what the stage run hands the update alone stays inside the one program
    inside = accs | {
        o for o in stage.outputs if o in apply.inputs and o not in read_later and o not in accs
    }
    inputs = tuple(x for x in stage.inputs if x not in accs) + tuple(
        x for x in apply.inputs if x not in stage.outputs and x not in stage.inputs
    )
    outputs = tuple(o for o in stage.outputs if o not in inside and o not in apply.outputs)
    outputs += apply.outputs
    name = step_name(stage.program)
    run = Run(program=name, mb=stage.mb, inputs=inputs, outputs=outputs)
    s, a = specs[stage.program], specs[apply.program]
    # an inferred plan's gradient layouts hold inside too: the update reads them as laid out
    laid_out = tuple(
        (t.var, t.spec)
        for g in sorted(accs, key=str)
        for t in plan.buffer(g).tensors
        if s.constraints or a.constraints
    )
    spec = merged_program(name, s, a, inputs, outputs, pins=laid_out)
    out: list[Instruction] = []
    for i, x in enumerate(instructions):
        if i == j:
            out.append(run)
        elif i == k or (isinstance(x, Zeros | Free) and x.buffer in inside):
            continue
        else:
            out.append(x)
    return tuple(out), spec
