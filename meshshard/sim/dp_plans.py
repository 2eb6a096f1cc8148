"""Synthetic plans with data-parallel replicas of every pipeline stage (TriRace's setting).

:func:`replicate` takes a :func:`~meshshard.sim.schedule_plans.schedule_plan` of ``S``
one-host meshes and makes ``d`` replicas of it: replica ``j`` of stage ``r`` is mesh and
worker ``r + S j`` (one host each), runs the same column of the grid on ``1/d`` of each
micro-batch (the caller scales the costs), and exchanges activations only with
replica ``j`` of the neighbouring stages.  Every backward accumulates the stage's
weight gradient into per-layer *buckets* (``r`` buffers, the order of the stage's
layers), and an embedding stage also into its embedding gradient; each update
waits for one ``COLL allreduce`` per bucket over the stage's ``d`` replicas::

    ... RUN s{r}.B (last micro-batch of the step) -> (A, r.., e..)
    COLL allreduce r{b} [replicas]  ...  WAIT r{b} ...  RUN m{r}.apply (r.. e.. S) -> (O P~v)

That is the unscheduled order (2BW's reference code all-reduces after the whole
iteration); :func:`meshshard.passes.comm_schedule.schedule_comm` reorders it.
``sparse_grads`` names, per embedding gradient, its (indices, rows) twin for the
``sparse`` switch.

    >>> from meshshard.passes.schedules import make_schedule
    >>> from meshshard.sim.schedule_plans import StageCosts, schedule_plan
    >>> base = schedule_plan(make_schedule("1f1b", 2, 2), StageCosts(1e9, 1e9, 0, 1 << 20))
    >>> plan = replicate(base, 2, bucket_bytes=[1 << 20, 1 << 20])
    >>> [str(x) for x in plan.streams[2].instructions if x.is_comm][-2:]
    ['COLL allreduce r0 #0 [w0,w2]', 'COLL allreduce r1 #0 [w0,w2]']
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
)
from meshshard.passes.comm_schedule import SparseGrad
from meshshard.plan import BufferSpec, Plan, ProgramSpec, TensorSpec, TransferSpec
from meshshard.refs import BufferKind, BufferRef, CollectiveKind, Phase, ProgramRef, TransferRef

__all__ = ["replicate", "sparse_grads"]

_R = BufferKind.REDUCTION


def _ids(S: int, B: int, embed: dict[int, tuple[int, int]]):
    """Reduction-buffer indices: buckets of stage r, then embedding (dense, rows)."""
    bucket = {(r, b): r * B + b for r in range(S) for b in range(B)}
    base = S * B
    emb = {r: (base + 2 * i, base + 2 * i + 1) for i, r in enumerate(sorted(embed))}
    return bucket, emb


class _Remap:
    """Renames a base plan's refs to replica ``j`` (meshes + S j, transfers + T j)."""

    def __init__(self, S: int, T: int, j: int):
        self.S, self.T, self.j = S, T, j

    def buf(self, b: BufferRef) -> BufferRef:
        if b.kind is BufferKind.TRANSFER:
            return replace(b, owner=b.owner + self.T * self.j)
        if b.kind is _R:
            return b
        return replace(b, owner=b.owner + self.S * self.j)

    def prog(self, p: ProgramRef) -> ProgramRef:
        return replace(p, owner=p.owner + self.S * self.j)

    def tr(self, t: TransferRef | None) -> TransferRef | None:
        return None if t is None else TransferRef(t.index + self.T * self.j)

    def ins(self, x: Instruction) -> Instruction:
        if isinstance(x, Run):
            return replace(
                x,
                program=self.prog(x.program),
                inputs=tuple(map(self.buf, x.inputs)),
                outputs=tuple(map(self.buf, x.outputs)),
            )
        if isinstance(x, Send | Recv):
            return replace(
                x,
                buffer=self.buf(x.buffer),
                transfer=self.tr(x.transfer),
                peer=x.peer + self.S * self.j,
            )
        if hasattr(x, "buffer"):
            return replace(x, buffer=self.buf(x.buffer))
        return x


def _grad_refs(r: int, bucket, emb, B: int) -> tuple[BufferRef, ...]:
    out = [BufferRef(_R, bucket[(r, b)]) for b in range(B)]
    if r in emb:
        out.append(BufferRef(_R, emb[r][0]))
    return tuple(out)


def _versioned(grads, version: int | None) -> tuple[BufferRef, ...]:
    return grads if version is None else tuple(replace(g, version=version) for g in grads)


def _stream(base: WorkerStream, rm: _Remap, grads, group, S: int, M: int, versions: bool):
    """Replica ``rm.j`` of stage ``base.worker``: backward runs also write the gradient
    buckets; each update all-reduces them first and writes the new weights.  Over
    several 2BW steps the buckets alternate between two versions (step parity), so
    a step's update may wait while the next step accumulates."""
    out: list[Instruction] = []
    applied = 0
    for x in base.instructions:
        x = rm.ins(x)
        if isinstance(x, Run) and x.program.phase in (Phase.BACKWARD, Phase.WEIGHT_GRAD):
            if x.program.phase is Phase.WEIGHT_GRAD or BufferKind.ACCUMULATORS in {
                o.kind for o in x.outputs
            }:
                mine = _versioned(grads, (x.mb // M) % 2 if versions else None)
                x = replace(x, outputs=x.outputs + mine)
        elif isinstance(x, Run) and x.program.phase is Phase.APPLY:
            mine = _versioned(grads, applied % 2 if versions else None)
            applied += 1
            p = x.inputs[0]
            out += [
                Collective(
                    buffer=g, transfer=None, message=0, kind=CollectiveKind.ALLREDUCE, group=group
                )
                for g in mine
            ]
            out += [Wait(buffer=g) for g in mine]
            x = replace(x, inputs=mine + x.inputs[2:], outputs=x.outputs + (p,))
        if isinstance(x, WaitAll):
            for v in (0, 1) if versions else (None,):
                out += [Free(buffer=g) for g in _versioned(grads, v)]
        out.append(x)
    return WorkerStream(base.worker + S * rm.j, tuple(out))


def _tensor(var: int, name: str, nbytes: int) -> TensorSpec:
    return TensorSpec(var, name, (max(int(nbytes) // 2, 1),), "float16")


def replicate(
    plan: Plan,
    d: int,
    *,
    bucket_bytes: Sequence[int],
    embed: dict[int, tuple[int, int]] | None = None,
    cluster: ClusterSpec | None = None,
) -> Plan:
    """``d`` data-parallel replicas of the synthetic pipeline ``plan`` (module doc).

    ``bucket_bytes``: the per-layer gradient buckets of each stage; ``embed``: stage ->
    (dense embedding-gradient bytes, one replica's touched-rows bytes).
    """
    S, T, B = len(plan.meshes), len(plan.transfers), len(bucket_bytes)
    embed = dict(embed or {})
    bucket, emb = _ids(S, B, embed)
    versions = plan.schedule.steps > 1
    streams, programs, buffers, transfers, meshes = [], [], [], [], []
    for j in range(d):
        rm = _Remap(S, T, j)
        for st in plan.streams:
            r = st.worker
            group = tuple(r + S * k for k in range(d))
            grads = _grad_refs(r, bucket, emb, B)
            streams.append(_stream(st, rm, grads, group, S, plan.num_micro_batches, versions))
        for m in plan.meshes:
            meshes.append(replace(m, id=m.id + S * j, hosts=(m.hosts[0] + S * j,)))
        for p in plan.programs:
            programs.append(_program(p, rm, _grad_refs(p.mesh, bucket, emb, B)))
        buffers += [replace(b, name=rm.buf(b.name), mesh=b.mesh + S * j) for b in plan.buffers]
        transfers += [_transfer(t, rm) for t in plan.transfers]
    var = iter(range(20_000_000, 30_000_000))
    for v in (0, 1) if versions else (None,):
        for (r, b), i in bucket.items():
            t = _tensor(next(var), f"r{i}.g", bucket_bytes[b])
            buffers.append(BufferSpec(BufferRef(_R, i, version=v), r, False, (t,)))
        for r, (dense, rows) in emb.items():
            for i, n, tag in zip((dense, rows), embed[r], ("e", "rows"), strict=True):
                t = _tensor(next(var), f"r{i}.{tag}", n)
                buffers.append(BufferSpec(BufferRef(_R, i, version=v), r, False, (t,)))
    cluster = cluster or replace(plan.cluster, num_hosts=S * d)
    streams.sort(key=lambda s: s.worker)
    key = repr((plan.fingerprint, d, tuple(bucket_bytes), sorted(embed.items())))
    return replace(
        plan,
        method=f"{plan.method}-dp{d}",
        cluster=cluster,
        fingerprint="synthetic-" + hashlib.sha256(key.encode()).hexdigest()[:12],
        meshes=tuple(sorted(meshes, key=lambda m: m.id)),
        programs=tuple(programs),
        buffers=tuple(buffers),
        transfers=tuple(transfers),
        streams=tuple(streams),
        notes=plan.notes + (f"{d} data-parallel replicas per stage (meshshard.sim.dp_plans)",),
    )


def _program(p: ProgramSpec, rm: _Remap, grads) -> ProgramSpec:
    q = replace(
        p,
        name=rm.prog(p.name),
        mesh=p.mesh + rm.S * rm.j,
        inputs=tuple(map(rm.buf, p.inputs)),
        outputs=tuple(map(rm.buf, p.outputs)),
    )
    if p.name.phase is Phase.APPLY:
        return replace(q, inputs=grads + q.inputs[2:], outputs=q.outputs + (q.inputs[0],))
    if BufferKind.ACCUMULATORS in {o.kind for o in p.outputs} or p.name.phase is Phase.WEIGHT_GRAD:
        return replace(q, outputs=q.outputs + grads)
    return q


def _transfer(t: TransferSpec, rm: _Remap) -> TransferSpec:
    k = rm.S * rm.j
    msgs = tuple(replace(m, src=m.src + k, dst=m.dst + k) for m in t.messages)
    return replace(
        t,
        name=rm.tr(t.name),
        src_mesh=t.src_mesh + k,
        dst_mesh=t.dst_mesh + k,
        producer=rm.prog(t.producer) if t.producer else None,
        consumer=rm.prog(t.consumer) if t.consumer else None,
        messages=msgs,
    )


def sparse_grads(plan: Plan) -> list[SparseGrad]:
    """The embedding gradients of a :func:`replicate` plan with their rows twins."""
    specs = {b.name.owner: b for b in plan.buffers if b.name.kind is _R}
    out = []
    for i, spec in sorted(specs.items()):
        if spec.tensors[0].name.endswith(".e") and i + 1 in specs:
            rows = specs[i + 1]
            out.append(SparseGrad(BufferRef(_R, i), BufferRef(_R, i + 1), spec.nbytes, rows.nbytes))
    return out
