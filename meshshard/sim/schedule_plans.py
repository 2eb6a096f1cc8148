"""Synthetic plans for any schedule grid: the simulator runs every schedule generator.

:func:`meshshard.sim.synthetic.synthetic_pipeline` builds GPipe/1F1B plans; this module
builds a plan from any :class:`~meshshard.plan.Schedule` (eager 1F1B, interleaved
1F1B with ``v`` chunks per mesh, ZB-H1 with split B/W programs, 2BW over several steps)
with the same stream shapes as emitted plans.  Mesh ``r`` is one host (worker ``r``)
of ``devices`` devices; logical stage ``L`` runs on mesh ``L % S`` as chunk ``L // S``.
Per task of a mesh's column, in tick order::

    F:  [LOAD X@k] [RECV/WAIT a@k] RUN F [FREE X@k] [FREE a@k] [SEND a'@k, FREE a'@k]
    B:  [RECV/WAIT g@k] RUN B [FREE R@k unless W follows] [FREE g@k] [SEND g'@k, FREE g'@k]
    W:  RUN W  FREE R@k
    2BW: after a mesh's last backward of a step, RUN m{r}.apply and ZEROS A{r}

F/B/W tasks read the weight version the task names (``P{r}~0``/``P{r}~1`` in 2BW,
two resident copies), so the memory profile holds two versions there.

    >>> from meshshard.passes.schedules import zb_h1
    >>> plan = schedule_plan(zb_h1(2, 2), StageCosts(1e9, 1e9, 1e9, 1 << 20))
    >>> [str(i) for i in plan.streams[1].instructions[4:7]]
    ['RUN s1.F mb0 (P1 X1@0 t0@0) -> (R1@0)', 'FREE X1@0', 'FREE t0@0']
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Free, Instruction, Load, Run, WaitAll, WorkerStream, Zeros
from meshshard.passes.lower_transfer import lower_transfer
from meshshard.plan import (
    BufferSpec,
    MeshSpec,
    Message,
    Plan,
    ProgramSpec,
    Schedule,
    Task,
    TensorSpec,
    TransferSpec,
)
from meshshard.refs import BufferKind, BufferRef, Phase, ProgramRef, TaskKind, TransferRef

__all__ = ["StageCosts", "schedule_plan"]


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline stage (all ``v`` chunks of a mesh together) costs per micro-batch.

    ``backward_flops`` is the input-gradient half (B) and ``weight_flops`` the
    weight-gradient half (W); a schedule without W runs both in its B task.  Bytes are
    per device; ``residual_bytes`` defaults to ``activation_bytes``.
    """

    forward_flops: float
    backward_flops: float
    weight_flops: float
    activation_bytes: int
    residual_bytes: int | None = None
    param_bytes: int = 16 << 20
    batch_bytes: int = 1 << 16
    dtype: str = "float16"


def _tensor(var: int, name: str, nbytes: float, dtype: str) -> TensorSpec:
    return TensorSpec(var, name, (max(int(nbytes) // np.dtype(dtype).itemsize, 1),), dtype)


@dataclass(frozen=True)
class _Layout:
    S: int
    v: int
    split: bool

    @property
    def logical(self) -> int:
        return self.S * self.v

    def chunk(self, L: int) -> int | None:
        return L // self.S if self.v > 1 else None

    def prog(self, phase: Phase, L: int) -> ProgramRef:
        return ProgramRef(phase, L % self.S, self.chunk(L))

    def res(self, L: int) -> BufferRef:
        return BufferRef(BufferKind.RESIDUALS, L % self.S, None, self.chunk(L))

    def batch(self, L: int) -> BufferRef | None:
        if L in (0, self.logical - 1):
            return BufferRef(BufferKind.BATCH, L % self.S, None, self.chunk(L))
        return None

    def fwd(self, L: int) -> TransferRef:  # activation L -> L+1
        return TransferRef(L)

    def bwd(self, L: int) -> TransferRef:  # gradient L+1 -> L
        return TransferRef(self.logical - 1 + L)


def _params(lay: _Layout, r: int, version: int | None) -> BufferRef:
    return BufferRef(BufferKind.PARAMS, r, None, None, None if version is None else version % 2)


def _buffers(lay: _Layout, c: StageCosts, versions: bool) -> list[BufferSpec]:
    var = iter(range(1_000_000))
    res = c.activation_bytes if c.residual_bytes is None else c.residual_bytes
    out = []
    for r in range(lay.S):
        params = [_params(lay, r, 0), _params(lay, r, 1)] if versions else [_params(lay, r, None)]
        for p in params:
            out.append(
                BufferSpec(p, r, False, (_tensor(next(var), f"{p}.w", c.param_bytes, c.dtype),))
            )
        for kind, scale in (("A", 1), ("S", 2), ("O", 3)):
            ref = BufferRef(BufferKind(kind), r)
            t = _tensor(next(var), f"{ref}.x", scale * c.param_bytes, c.dtype)
            out.append(BufferSpec(ref, r, False, (t,)))
    for L in range(lay.logical):
        t = _tensor(next(var), f"{lay.res(L)}.r", res / lay.v, c.dtype)
        out.append(BufferSpec(lay.res(L), L % lay.S, True, (t,)))
        if lay.batch(L) is not None:
            t = _tensor(next(var), f"{lay.batch(L)}.x", c.batch_bytes, c.dtype)
            out.append(BufferSpec(lay.batch(L), L % lay.S, True, (t,)))
    return out


def _transfers(lay: _Layout, c: StageCosts) -> list[TransferSpec]:
    out = []
    for L in range(lay.logical - 1):
        for ref, src, dst, prod, cons in (
            (lay.fwd(L), L, L + 1, lay.prog(Phase.FORWARD, L), lay.prog(Phase.FORWARD, L + 1)),
            (lay.bwd(L), L + 1, L, lay.prog(Phase.BACKWARD, L + 1), lay.prog(Phase.BACKWARD, L)),
        ):
            t = _tensor(10_000_000 + ref.index, f"{ref}.a", c.activation_bytes, c.dtype)
            a, b = src % lay.S, dst % lay.S
            msg = Message(a, b, ((0, t.shape[0]),), int(c.activation_bytes))
            out.append(TransferSpec(ref, t, (), a, b, prod, cons, (msg,)))
    return out


def _programs(lay: _Layout, c: StageCosts, versions: bool) -> list[ProgramSpec]:
    out = []
    v = lay.v
    b_flops = c.backward_flops + (0.0 if lay.split else c.weight_flops)
    for L in range(lay.logical):
        r = L % lay.S
        P, A, R = (
            _params(lay, r, 0 if versions else None),
            BufferRef(BufferKind.ACCUMULATORS, r),
            lay.res(L),
        )
        x = [lay.batch(L)] if lay.batch(L) is not None else []
        fin = [P, *x] + ([lay.fwd(L - 1).buffer()] if L else [])
        fout = [R] + ([lay.fwd(L).buffer()] if L < lay.logical - 1 else [])
        bin_ = (
            [P, R]
            + ([lay.bwd(L).buffer()] if L < lay.logical - 1 else [])
            + ([] if lay.split else [A])
        )
        bout = ([] if lay.split else [A]) + ([lay.bwd(L - 1).buffer()] if L else [])
        out.append(
            ProgramSpec(
                lay.prog(Phase.FORWARD, L), r, (), tuple(fin), tuple(fout), c.forward_flops / v
            )
        )
        out.append(
            ProgramSpec(lay.prog(Phase.BACKWARD, L), r, (), tuple(bin_), tuple(bout), b_flops / v)
        )
        if lay.split:
            out.append(
                ProgramSpec(
                    lay.prog(Phase.WEIGHT_GRAD, L), r, (), (P, R, A), (A,), c.weight_flops / v
                )
            )
    for r in range(lay.S):
        ins = (
            _params(lay, r, 0 if versions else None),
            BufferRef(BufferKind.ACCUMULATORS, r),
            BufferRef(BufferKind.APPLY_STATE, r),
        )
        out.append(
            ProgramSpec(
                ProgramRef(Phase.APPLY, r),
                r,
                (),
                ins,
                (BufferRef(BufferKind.APPLY_OUTPUTS, r),),
                0.0,
            )
        )
    return out


def _forward(lay: _Layout, task: Task, tmap: dict, r: int, P: BufferRef) -> list[Instruction]:
    L, k = task.logical(lay.S), task.mb
    ins: list[Instruction] = []
    inputs = [P]
    X = lay.batch(L)
    if X is not None:
        ins.append(Load(buffer=X.at(k), mb=k))
        inputs.append(X.at(k))
    if L:
        a = lay.fwd(L - 1).buffer(k)
        ins += lower_transfer(tmap[lay.fwd(L - 1)], a, r)
        inputs.append(a)
    out = lay.fwd(L).buffer(k) if L < lay.logical - 1 else None
    outputs = [lay.res(L).at(k)] + ([out] if out is not None else [])
    ins.append(
        Run(program=lay.prog(Phase.FORWARD, L), mb=k, inputs=tuple(inputs), outputs=tuple(outputs))
    )
    ins += [Free(buffer=b) for b in inputs[1:]]
    if out is not None:
        ins += [*lower_transfer(tmap[lay.fwd(L)], out, r), Free(buffer=out)]
    return ins


def _backward(lay: _Layout, task: Task, tmap: dict, r: int, P: BufferRef) -> list[Instruction]:
    L, k = task.logical(lay.S), task.mb
    A, R = BufferRef(BufferKind.ACCUMULATORS, r), lay.res(L).at(k)
    if task.kind is TaskKind.W:
        run = Run(program=lay.prog(Phase.WEIGHT_GRAD, L), mb=k, inputs=(P, R, A), outputs=(A,))
        return [run, Free(buffer=R)]
    ins: list[Instruction] = []
    inputs, outputs = [P, R] + ([] if lay.split else [A]), [] if lay.split else [A]
    g_in = lay.bwd(L).buffer(k) if L < lay.logical - 1 else None
    if g_in is not None:
        ins += lower_transfer(tmap[lay.bwd(L)], g_in, r)
        inputs.append(g_in)
    g_out = lay.bwd(L - 1).buffer(k) if L else None
    outputs += [g_out] if g_out is not None else []
    ins.append(
        Run(program=lay.prog(Phase.BACKWARD, L), mb=k, inputs=tuple(inputs), outputs=tuple(outputs))
    )
    ins += [] if lay.split else [Free(buffer=R)]
    ins += [Free(buffer=g_in)] if g_in is not None else []
    if g_out is not None:
        ins += [*lower_transfer(tmap[lay.bwd(L - 1)], g_out, r), Free(buffer=g_out)]
    return ins


def _apply(r: int, version: int | None) -> Run:
    ins = (
        BufferRef(BufferKind.PARAMS, r, None, None, version),
        BufferRef(BufferKind.ACCUMULATORS, r),
        BufferRef(BufferKind.APPLY_STATE, r),
    )
    return Run(
        program=ProgramRef(Phase.APPLY, r),
        mb=None,
        inputs=ins,
        outputs=(BufferRef(BufferKind.APPLY_OUTPUTS, r),),
    )


def _mesh_stream(
    lay: _Layout, schedule: Schedule, tmap: dict, r: int, versions: bool
) -> WorkerStream:
    """Worker ``r``'s stream: its column of the grid, one update per step."""
    A = BufferRef(BufferKind.ACCUMULATORS, r)
    last = TaskKind.W if lay.split else TaskKind.B
    per_step = schedule.num_micro_batches * lay.v
    finished: dict[int, int] = {}
    ins: list[Instruction] = [Zeros(buffer=A)]
    for row in schedule.ticks:
        task = row[r]
        if task is None:
            continue
        P = _params(lay, r, task.version if versions else None)
        build = _forward if task.kind is TaskKind.F else _backward
        ins += build(lay, task, tmap, r, P)
        step = task.mb // schedule.num_micro_batches
        if task.kind is last:
            finished[step] = finished.get(step, 0) + 1
            if finished[step] == per_step and step < schedule.steps - 1:
                ins += [_apply(r, (step + 1) % 2 if versions else None), Zeros(buffer=A)]
    ins += [_apply(r, schedule.steps % 2 if versions else None), Free(buffer=A), WaitAll()]
    return WorkerStream(r, tuple(ins))


def schedule_plan(
    schedule: Schedule,
    costs: StageCosts,
    *,
    devices: int = 1,
    cluster: ClusterSpec | None = None,
) -> Plan:
    """A plan that runs ``schedule`` on ``S`` one-host meshes of ``devices`` devices,
    each stage costing ``costs`` per micro-batch (see the module docstring)."""
    S, v = schedule.num_stages, schedule.virtual_stages
    split = any(c is not None and c.kind is TaskKind.W for row in schedule.ticks for c in row)
    lay = _Layout(S, v, split)
    versions = schedule.steps > 1
    cluster = cluster or ClusterSpec(name="synthetic", num_hosts=S, devices_per_host=devices)
    transfers = _transfers(lay, costs)
    tmap = {t.name: t for t in transfers}
    streams = tuple(_mesh_stream(lay, schedule, tmap, r, versions) for r in range(S))
    key = repr((schedule, costs, devices))
    return Plan(
        method=f"synthetic-{schedule.name}",
        cluster=cluster,
        num_micro_batches=schedule.num_micro_batches,
        fingerprint="synthetic-" + hashlib.sha256(key.encode()).hexdigest()[:12],
        meshes=tuple(MeshSpec(r, (1, devices), (r,)) for r in range(S)),
        stages=(),
        programs=tuple(_programs(lay, costs, versions)),
        buffers=tuple(_buffers(lay, costs, versions)),
        transfers=tuple(transfers),
        schedule=schedule,
        streams=streams,
        inputs=(),
        outputs=(),
        notes=(f"synthetic {schedule.name} plan built by meshshard.sim.schedule_plans",),
    )
