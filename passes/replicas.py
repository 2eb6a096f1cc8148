"""Pass: data-parallel replicas of every pipeline stage (``PipeshardParallel(data_parallel=d)``).

Pure: a plan of ``S`` stage meshes whose schedule runs ``M/d`` micro-batches in, a plan
of ``d`` copies of it out.  Replica ``j`` of mesh ``m`` is mesh ``m + L j`` (``L`` meshes
per replica) on the hosts of ``m`` shifted by ``H j`` (``H`` hosts per replica); its
buffers, programs, transfers and cross-mesh reductions are renamed the same way, and it
runs micro-batches ``j M/d .. (j+1) M/d - 1`` of the step's batch (its ``LOAD``s,
``RUN``s and per-micro-batch buffers name them by these global numbers, so a stream
prints and parses back as it runs).  Activations move only
between the meshes of one replica.  Before the first update phase that reads a stage's
gradient accumulators ``A``, every replica all-reduces them over the stage's ``d``
workers, once per step (the traffic TriRace schedules)::

    w0: RUN s0.B mb1 (P0 X0@1 R0@1 t1@1 A0) -> (A0)
    w0: COLL allreduce A0 #0 [w0,w2]
    w0: WAIT A0
    w0: RUN m0.apply (A0 P0 S0) -> (O0)

An update that combines values of several meshes (the squared norm of global-norm
clipping) keeps its cross-mesh all-reduce per replica, over the replica's own meshes:
it reads accumulators the replicas' all-reduce made equal, so every replica computes
the same total (its literal terms added by the replica's first mesh).

The sum over replicas of the per-replica sums is the sum over all micro-batches, so the
update (which divides by ``M`` for a mean) computes what one pipeline over ``M``
micro-batches computes, up to summation order; every replica gets the same bits and so
keeps identical weights.  The plan's schedule stays one replica's grid (``M/d``
micro-batches on ``L`` meshes).  State inputs go to every replica; each step result is listed
on every replica (a state result stays where the next step reads it).

A max- or min-reduced accumulator (``aux_max`` / ``aux_min``) and per-example values
concatenated over micro-batches (logits returned as aux, a forward-only step's
predictions) must not be summed: the plan lists them in ``gathered``
(:class:`~meshshard.plan.GatheredAccumulator`) and issues a ``COLL allgather A`` before
the group's all-reduce; every member takes the maximum of the gathered order keys, or
the members' rows in replica order (:mod:`meshshard.runtime.replica_grads`).  A value
that does not depend on the batch (reduction ``same``) is listed there too: every
replica keeps its own, equal copy instead of adding the others'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from meshshard.errors import MeshshardInputError
from meshshard.instructions import Collective, Instruction, Load, Recv, Run, Send, Wait
from meshshard.plan import (
    GATHERED_REDUCTIONS,
    GatheredAccumulator,
    Plan,
    ReductionSpec,
    TransferSpec,
)
from meshshard.refs import BufferKind, BufferRef, CollectiveKind, Phase, ProgramRef, TransferRef

__all__ = ["replicate_stages"]


class _Rename:
    """Replica ``j``'s names: meshes and stages + ``L j``, transfers + ``T j``,
    reductions + ``R j``, workers + ``H j``, micro-batch loads + ``K j``."""

    def __init__(self, plan: Plan, j: int, d: int):
        self.L, self.T = len(plan.meshes), len(plan.transfers)
        self.R = len(plan.reductions)
        self.H = 1 + max(h for m in plan.meshes for h in m.hosts)
        self.K = plan.schedule.num_micro_batches
        self.j, self.d = j, d

    def w(self, worker: int) -> int:
        return worker + self.H * self.j

    def buf(self, b: BufferRef) -> BufferRef:
        if b.mb is not None:  # a replica's micro-batches by their global numbers
            b = replace(b, mb=b.mb + self.K * self.j)
        if b.kind is BufferKind.TRANSFER:
            return replace(b, owner=b.owner + self.T * self.j)
        if b.kind is BufferKind.REDUCTION:
            return replace(b, owner=b.owner + self.R * self.j)
        return replace(b, owner=b.owner + self.L * self.j)

    def prog(self, p: ProgramRef | None) -> ProgramRef | None:
        return None if p is None else replace(p, owner=p.owner + self.L * self.j)

    def tr(self, t: TransferRef | None) -> TransferRef | None:
        return None if t is None else TransferRef(t.index + self.T * self.j)

    def ins(self, x: Instruction) -> Instruction:
        """Instruction ``x`` of a base stream as replica ``j`` runs it."""
        if isinstance(x, Run):
            return replace(
                x,
                program=self.prog(x.program),
                mb=None if x.mb is None else x.mb + self.K * self.j,
                inputs=tuple(map(self.buf, x.inputs)),
                outputs=tuple(map(self.buf, x.outputs)),
            )
        if isinstance(x, Load):
            return replace(x, buffer=self.buf(x.buffer), mb=x.mb + self.K * self.j)
        if isinstance(x, Send | Recv):
            return replace(
                x, buffer=self.buf(x.buffer), transfer=self.tr(x.transfer), peer=self.w(x.peer)
            )
        if isinstance(x, Collective):
            root = None if x.root is None else self.w(x.root)
            return replace(
                x,
                buffer=self.buf(x.buffer),
                transfer=self.tr(x.transfer),
                group=tuple(map(self.w, x.group)),
                root=root,
            )
        if hasattr(x, "buffer"):
            return replace(x, buffer=self.buf(x.buffer))
        return x

    def reduction(self, r: ReductionSpec) -> ReductionSpec:
        """Replica ``j``'s copy of cross-mesh all-reduce ``r``: over its own meshes."""
        return replace(
            r,
            name=str(self.buf(BufferRef(BufferKind.REDUCTION, int(r.name[1:])))),
            group=tuple(map(self.w, r.group)),
            leaders=tuple(map(self.w, r.leaders)),
            parts=tuple((m + self.L * self.j, vs) for m, vs in r.parts),
        )

    def transfer(self, t: TransferSpec) -> TransferSpec:
        msgs = tuple(
            replace(m, src=self.w(m.src), dst=self.w(m.dst), group=tuple(map(self.w, m.group)))
            for m in t.messages
        )
        return replace(
            t,
            name=self.tr(t.name),
            src_mesh=t.src_mesh + self.L * self.j,
            dst_mesh=t.dst_mesh + self.L * self.j,
            producer=self.prog(t.producer),
            consumer=self.prog(t.consumer),
            messages=msgs,
        )


def _check(plan: Plan, d: int) -> None:
    multi = [m.id for m in plan.meshes if m.shape[0] > 1]
    if multi:
        raise MeshshardInputError(
            f"PipeshardParallel(data_parallel={d}): meshes {multi} span several hosts; "
            "replicas all-reduce whole accumulators from one worker per mesh, so give each "
            "stage a one-host mesh such as (1, 2)"
        )
    H = 1 + max(h for m in plan.meshes for h in m.hosts)
    if H * d > plan.cluster.num_hosts:
        raise MeshshardInputError(
            f"PipeshardParallel(data_parallel={d}) needs {d} x {H} hosts for {d} replicas of "
            f"the stage meshes, but the cluster has {plan.cluster.num_hosts}; use fewer "
            "replicas or smaller stages"
        )


def _with_allreduce(
    ins: list[Instruction], group_of, gathered: frozenset[BufferRef]
) -> list[Instruction]:
    """``ins`` with ``COLL allreduce A`` + ``WAIT A`` before the first update phase
    reading each accumulator group ``A``, and a ``COLL allgather A`` first for a group in
    ``gathered`` (it has accumulators not summed: :class:`~meshshard.plan.GatheredAccumulator`)."""
    out: list[Instruction] = []
    done: set[BufferRef] = set()
    for x in ins:
        if isinstance(x, Run) and x.program.phase is Phase.APPLY:
            for a in x.inputs:
                if a.kind is BufferKind.ACCUMULATORS and a.group not in done:
                    done.add(a.group)
                    coll = Collective(
                        kind=CollectiveKind.ALLREDUCE,
                        buffer=a,
                        transfer=None,
                        message=0,
                        group=group_of,
                    )
                    if a.group in gathered:
                        out.append(replace(coll, kind=CollectiveKind.ALLGATHER))
                    out += [coll, Wait(buffer=a)]
        out.append(x)
    return out


def _not_summed(
    plan: Plan, names, reductions: Mapping[int, str]
) -> tuple[GatheredAccumulator, ...]:
    """Every replica's accumulator tensors combined by max, min or concatenation, or
    kept as they are (``same``) (``reductions``: var id -> reduction over micro-batches):
    the sum the rest of ``A`` takes would be wrong."""
    return tuple(
        GatheredAccumulator(rn.buf(b.name), k, reductions[t.var])
        for rn in names
        for b in plan.buffers
        if b.name.kind is BufferKind.ACCUMULATORS
        for k, t in enumerate(b.tensors)
        if reductions.get(t.var) in GATHERED_REDUCTIONS
    )


def replicate_stages(plan: Plan, d: int, reductions: Mapping[int, str] | None = None) -> Plan:
    """``plan`` run by ``d`` data-parallel replicas of its stages (module doc).
    ``reductions``: var id -> how each accumulator combines over micro-batches
    (:func:`~meshshard.passes.reductions.accumulator_reductions`); a max, min or concat
    one is all-gathered, not summed (:class:`~meshshard.plan.GatheredAccumulator`)."""
    if d == 1:
        return plan
    _check(plan, d)
    names = [_Rename(plan, j, d) for j in range(d)]
    not_summed = _not_summed(plan, names, reductions or {})
    gathered = frozenset(e.group for e in not_summed if e.sent)
    streams, meshes, programs, buffers, transfers, reductions = [], [], [], [], [], []
    for rn in names:
        for st in plan.streams:
            group = tuple(r.w(st.worker) for r in names)
            ins = _with_allreduce([rn.ins(x) for x in st.instructions], group, gathered)
            streams.append(replace(st, worker=rn.w(st.worker), instructions=tuple(ins)))
        meshes += [
            replace(m, id=m.id + rn.L * rn.j, hosts=tuple(map(rn.w, m.hosts))) for m in plan.meshes
        ]
        programs += [
            replace(
                p,
                name=rn.prog(p.name),
                mesh=p.mesh + rn.L * rn.j,
                inputs=tuple(map(rn.buf, p.inputs)),
                outputs=tuple(map(rn.buf, p.outputs)),
            )
            for p in plan.programs
        ]
        buffers += [
            replace(b, name=rn.buf(b.name), mesh=b.mesh + rn.L * rn.j) for b in plan.buffers
        ]
        transfers += [rn.transfer(t) for t in plan.transfers]
        reductions += [rn.reduction(r) for r in plan.reductions]

    def slots(spec):
        return tuple((rn.buf(g), i) for rn in names for g, i in spec.slots)

    notes = [
        f"data_parallel={d}: mesh m of replica j is mesh m+{names[0].L}j on worker w+"
        f"{names[0].H}j; replica j loads micro-batches {names[0].K}j..{names[0].K}j+"
        f"{names[0].K - 1}; accumulators all-reduced over the replicas before each update; "
        "the schedule grid is one replica's"
    ]
    if not_summed:
        notes.append(
            f"data_parallel={d}: {len(not_summed)} max/min/concat/same accumulator(s) "
            "all-gathered and combined by their order keys or rows, or kept, not summed"
        )
    return replace(
        plan,
        meshes=tuple(meshes),
        programs=tuple(programs),
        buffers=tuple(buffers),
        transfers=tuple(transfers),
        reductions=tuple(reductions),
        streams=tuple(sorted(streams, key=lambda s: s.worker)),
        inputs=tuple(replace(i, slots=slots(i)) for i in plan.inputs),
        outputs=tuple(replace(o, slots=slots(o)) for o in plan.outputs),
        notes=plan.notes + tuple(notes),
        gathered=not_summed,
    )
