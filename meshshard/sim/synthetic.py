"""Synthetic pipeline plans: valid :class:`Plan` s built without tracing any JAX code.

The simulator's validation tests and speed benchmark run on these, and they show what
a plan's streams look like.  Stage ``s`` runs on mesh ``s`` (hosts
``s*h .. s*h+h-1`` of shape ``(h, d)``); each stage has a forward ``s{s}.F`` and a
backward ``s{s}.B`` program and each mesh an ``m{s}.apply``.  Boundary ``s`` has a
forward transfer ``t{s}`` (activations, ``s`` -> ``s+1``) and a backward transfer
``t{S-1+s}`` (their gradient, ``s+1`` -> ``s``), one message per host (host ``i`` of
one mesh to host ``i`` of the next), or one broadcast from the sending mesh's first
host with ``transfer="broadcast"``.  Tasks run in the order of the pipeline's own
schedule generators (:mod:`meshshard.passes.schedules`) and every transfer is lowered
by :func:`~meshshard.passes.lower_transfer.lower_transfer`, as in a traced plan (a
broadcast to a single host runs as a send).

Buffer sizes are per device (tensors are replicated in their mesh, transfers sharded
over hosts).  Stream of a stage worker, per task of its schedule order::

    F k:  [LOAD X{s}@k]  [RECV t{s-1}@k, WAIT t{s-1}@k]  RUN s{s}.F  [FREE ...]  [SEND t{s}@k, FREE t{s}@k]
    B k:  [RECV g@k, WAIT g@k]  RUN s{s}.B  FREE R{s}@k [FREE g@k]  [SEND g'@k, FREE g'@k]

framed by ``ZEROS A{s}`` and ``RUN m{s}.apply``, ``WAITALL``.

    >>> plan = synthetic_pipeline(2, 2, schedule="gpipe")
    >>> print(plan.streams[1])
    w1: ZEROS A1
    w1: LOAD X1@0
    w1: RECV t0@0 #0 <- w0
    w1: WAIT t0@0
    w1: RUN s1.F mb0 (P1 X1@0 t0@0) -> (R1@0)
    w1: FREE X1@0
    w1: FREE t0@0
    w1: LOAD X1@1
    w1: RECV t0@1 #0 <- w0
    w1: WAIT t0@1
    w1: RUN s1.F mb1 (P1 X1@1 t0@1) -> (R1@1)
    w1: FREE X1@1
    w1: FREE t0@1
    w1: RUN s1.B mb0 (P1 R1@0 A1) -> (A1 t1@0)
    w1: FREE R1@0
    w1: SEND t1@0 #0 -> w0
    w1: FREE t1@0
    w1: RUN s1.B mb1 (P1 R1@1 A1) -> (A1 t1@1)
    w1: FREE R1@1
    w1: SEND t1@1 #0 -> w0
    w1: FREE t1@1
    w1: RUN m1.apply (P1 A1 S1) -> (O1)
    w1: WAITALL
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Load,
    Run,
    Wait,
    WaitAll,
    WorkerStream,
    Zeros,
)
from meshshard.passes.lower_transfer import lower_transfer
from meshshard.passes.schedules import SCHEDULE_GENERATORS, make_schedule
from meshshard.plan import (
    BufferSpec,
    InputSpec,
    MeshSpec,
    Message,
    OutputSpec,
    Plan,
    ProgramSpec,
    Schedule,
    StageSpec,
    Task,
    TensorSpec,
    TransferSpec,
)

__all__ = [
    "synthetic_pipeline",
    "synthetic_exchange",
    "synthetic_collective",
    "stage_order",
    "schedule_grid",
]

SCHEDULES = tuple(SCHEDULE_GENERATORS)


def stage_order(schedule: str, num_stages: int, num_micro_batches: int, stage: int) -> list[Task]:
    """The order stage ``stage`` runs its tasks in under ``schedule`` (``gpipe`` or ``1f1b``).

    Read off the pipeline's own schedule generator
    (:func:`meshshard.passes.schedules.make_schedule`), so synthetic plans run the
    schedules real plans run.  GPipe: every forward, then every backward.  1F1B
    (PipeDream-Flush): ``S - s - 1`` warm-up forwards, then alternate one forward and
    one backward, then the rest.

        >>> " ".join(map(str, stage_order("1f1b", 3, 4, 0)))
        'F0 F1 F2 B0 F3 B1 B2 B3'
    """
    grid = schedule_grid(schedule, num_stages, num_micro_batches)
    return [row[stage] for row in grid.ticks if row[stage] is not None]


def schedule_grid(schedule: str, num_stages: int, num_micro_batches: int) -> Schedule:
    """The tick grid of ``schedule`` from :mod:`meshshard.passes.schedules`."""
    if schedule not in SCHEDULE_GENERATORS:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return make_schedule(schedule, num_stages, num_micro_batches)


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name} needs one value per stage ({n}), got {len(values)}")
    return values


def _tensor(var: int, name: str, nbytes: int, dtype: str, spec=()) -> TensorSpec:
    itemsize = np.dtype(dtype).itemsize
    return TensorSpec(var, name, (int(nbytes) // itemsize,), dtype, spec)


def synthetic_pipeline(
    num_stages: int,
    num_micro_batches: int,
    *,
    schedule: str = "1f1b",
    mesh_shape: tuple[int, int] = (1, 1),
    forward_flops: float | Sequence[float] = 1e9,
    backward_flops: float | Sequence[float] | None = None,
    apply_flops: float = 0.0,
    activation_bytes: int = 1 << 20,
    residual_bytes: int | None = None,
    param_bytes: int = 16 << 20,
    batch_bytes: int = 1 << 16,
    transfer: str = "send_recv",
    dtype: str = "float32",
    cluster: ClusterSpec | None = None,
) -> Plan:
    """A pipeline plan of ``num_stages`` stages and ``num_micro_batches`` micro-batches.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        mesh_shape: ``(hosts, devices)`` of every stage's mesh.
        forward_flops / backward_flops: per stage (a number or one per stage) for the
            whole mesh; backward defaults to twice the forward.
        apply_flops: work of each mesh's optimizer update.
        activation_bytes: bytes of each boundary's activation (and of its gradient)
            per micro-batch; 0 makes communication free of bandwidth.
        residual_bytes: bytes per device a forward keeps for its backward (default:
            ``activation_bytes``).
        param_bytes: parameter bytes per device of each stage (gradients are the same,
            optimizer state twice that, as Adam's two moments).
        batch_bytes: bytes of each micro-batch's inputs (and labels on the last stage).
        transfer: ``"send_recv"`` (one message per host pair) or ``"broadcast"`` (a
            broadcast collective from the sending mesh's first host to the next mesh).
        dtype: dtype of every tensor.
        cluster: recorded as the plan's cluster (default: just big enough).
    """
    S, M = int(num_stages), int(num_micro_batches)
    if S < 1 or M < 1:
        raise ValueError(f"need at least 1 stage and 1 micro-batch, got {S} and {M}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if transfer not in ("send_recv", "broadcast"):
        raise ValueError(f"transfer must be 'send_recv' or 'broadcast', got {transfer!r}")
    fwd = _per_stage(forward_flops, S, "forward_flops")
    bwd = (
        [2 * f for f in fwd]
        if backward_flops is None
        else _per_stage(backward_flops, S, "backward_flops")
    )
    p = _Pipe(
        S,
        M,
        schedule,
        tuple(mesh_shape),
        tuple(fwd),
        tuple(bwd),
        apply_flops,
        activation_bytes,
        activation_bytes if residual_bytes is None else residual_bytes,
        param_bytes,
        batch_bytes,
        transfer,
        dtype,
    )
    h, d = p.mesh_shape
    meshes = tuple(MeshSpec(s, (h, d), tuple(range(s * h, (s + 1) * h))) for s in range(S))
    var = iter(range(1_000_000))  # tensor ids: the buffers', then the transfers'
    buffers = _pipe_buffers(p, var)
    transfers = _pipe_transfers(p, meshes, var)
    tmap = {str(t.name): t for t in transfers}
    streams = tuple(
        WorkerStream(w, _pipe_stream(p, s, w, tmap)) for s in range(S) for w in meshes[s].hosts
    )
    stages, inputs, outputs = _pipe_header(p)
    return Plan(
        method=f"synthetic-{schedule}",
        cluster=cluster or ClusterSpec(name="synthetic", num_hosts=S * h, devices_per_host=d),
        num_micro_batches=M,
        fingerprint="synthetic-" + hashlib.sha256(repr(p.key).encode()).hexdigest()[:12],
        meshes=meshes,
        stages=stages,
        programs=_pipe_programs(p),
        buffers=buffers,
        transfers=transfers,
        schedule=schedule_grid(schedule, S, M),
        streams=streams,
        inputs=inputs,
        outputs=outputs,
        notes=("synthetic plan built by meshshard.sim.synthetic (no traced program)",),
    )


@dataclass(frozen=True)
class _Pipe:
    """What :func:`synthetic_pipeline`'s arguments resolve to; the parts are built from it."""

    S: int
    M: int
    schedule: str
    mesh_shape: tuple[int, int]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    apply_flops: float
    activation_bytes: int
    res: int
    param_bytes: int
    batch_bytes: int
    transfer: str
    dtype: str

    @property
    def key(self) -> tuple:
        """The values the plan's fingerprint hashes."""
        return (
            self.S,
            self.M,
            self.schedule,
            self.mesh_shape,
            list(self.fwd),
            list(self.bwd),
            self.apply_flops,
            self.activation_bytes,
            self.res,
            self.param_bytes,
            self.batch_bytes,
            self.transfer,
            self.dtype,
        )

    def fwd_t(self, s: int) -> str:
        """The transfer of boundary ``s``'s activations (``s`` -> ``s + 1``)."""
        return f"t{s}"

    def bwd_t(self, s: int) -> str:
        """The transfer of boundary ``s``'s gradient (``s + 1`` -> ``s``)."""
        return f"t{self.S - 1 + s}"

    def reads_batch(self, s: int) -> bool:
        """Whether stage ``s`` loads micro-batch inputs (the first) or labels (the last)."""
        return s in (0, self.S - 1)


def _pipe_buffers(p: _Pipe, var) -> tuple[BufferSpec, ...]:
    """Per stage: parameters, gradient accumulators, optimizer state, the update's
    output, residuals and (first and last stage) the batch."""
    out: list[BufferSpec] = []
    for s in range(p.S):
        per_step = (
            ("P", "params", p.param_bytes),
            ("A", "grads", p.param_bytes),
            ("S", "opt_state", 2 * p.param_bytes),
            ("O", "new_state", 3 * p.param_bytes),
        )
        for kind, what, nbytes in per_step:
            tensor = _tensor(next(var), f"stage{s}.{what}", nbytes, p.dtype)
            out.append(BufferSpec(f"{kind}{s}", s, False, (tensor,)))
        residuals = _tensor(next(var), f"stage{s}.residuals", p.res, p.dtype)
        out.append(BufferSpec(f"R{s}", s, True, (residuals,)))
        if p.reads_batch(s):
            batch = _tensor(next(var), f"stage{s}.batch", p.batch_bytes, p.dtype)
            out.append(BufferSpec(f"X{s}", s, True, (batch,)))
    return tuple(out)


def _pipe_transfers(p: _Pipe, meshes, var) -> tuple[TransferSpec, ...]:
    """Each boundary's activation and gradient transfer: one message per host pair, or
    one broadcast from the sending mesh's first host."""
    h = p.mesh_shape[0]
    out = []
    for s in range(p.S - 1):
        for name, src, dst, prod, cons in (
            (p.fwd_t(s), s, s + 1, f"s{s}.F", f"s{s + 1}.F"),
            (p.bwd_t(s), s + 1, s, f"s{s + 1}.B", f"s{s}.B"),
        ):
            spec = ("host",) if h > 1 and p.transfer == "send_recv" else ()
            tensor = _tensor(next(var), f"{name}.array", p.activation_bytes, p.dtype, spec)
            msgs = _pipe_messages(p, meshes[src], meshes[dst], tensor.shape[0])
            out.append(TransferSpec(name, tensor, spec, src, dst, prod, cons, msgs, p.transfer))
    return tuple(out)


def _pipe_messages(p: _Pipe, src: MeshSpec, dst: MeshSpec, rows: int) -> tuple[Message, ...]:
    """Host ``i`` of ``src`` to host ``i`` of ``dst``, a slice of rows each; or one
    broadcast of every row."""
    nbytes = p.activation_bytes
    if p.transfer != "send_recv":
        group = (src.hosts[0], *dst.hosts)
        return (Message(group[0], group[1], ((0, rows),), nbytes, group=group),)
    h = p.mesh_shape[0]
    per = rows // h
    return tuple(
        Message(
            src.hosts[i],
            dst.hosts[i],
            ((i * per, rows if i == h - 1 else (i + 1) * per),),
            nbytes // h if i < h - 1 else nbytes - (h - 1) * (nbytes // h),
        )
        for i in range(h)
    )


def _pipe_programs(p: _Pipe) -> tuple[ProgramSpec, ...]:
    """Each stage's forward and backward, then each mesh's update."""
    S = p.S
    programs = []
    for s in range(S):
        ins_f = [f"P{s}"] + ([f"X{s}"] if p.reads_batch(s) else [])
        ins_f += [p.fwd_t(s - 1)] if s else []
        out_f = [f"R{s}"] + ([p.fwd_t(s)] if s < S - 1 else [])
        ins_b = [f"P{s}", f"R{s}", f"A{s}"] + ([p.bwd_t(s)] if s < S - 1 else [])
        out_b = [f"A{s}"] + ([p.bwd_t(s - 1)] if s else [])
        programs += [
            ProgramSpec(f"s{s}.F", s, (), tuple(ins_f), tuple(out_f), p.fwd[s], None),
            ProgramSpec(f"s{s}.B", s, (), tuple(ins_b), tuple(out_b), p.bwd[s], None),
        ]
    for s in range(S):
        apply_ins = (f"P{s}", f"A{s}", f"S{s}")
        programs.append(
            ProgramSpec(f"m{s}.apply", s, (), apply_ins, (f"O{s}",), p.apply_flops, None)
        )
    return tuple(programs)


def _pipe_stream(p: _Pipe, s: int, w: int, tmap: dict) -> tuple[Instruction, ...]:
    """Worker ``w`` of stage ``s``: its schedule's tasks (module docstring), framed by
    zeroing the accumulators and the update."""
    ins: list[Instruction] = [Zeros(buffer=f"A{s}")]
    for task in stage_order(p.schedule, p.S, p.M, s):
        task_fn = _forward_task if task.kind == "F" else _backward_task
        ins += task_fn(p, s, task.mb, w, tmap)
    apply_ins = (f"P{s}", f"A{s}", f"S{s}")
    ins.append(Run(program=f"m{s}.apply", mb=None, inputs=apply_ins, outputs=(f"O{s}",)))
    ins.append(WaitAll())
    return tuple(ins)


def _send(tmap: dict, name: str, buf: str, w: int) -> list[Instruction]:
    return [*lower_transfer(tmap[name], buf, w), Free(buffer=buf)]


def _forward_task(p: _Pipe, s: int, k: int, w: int, tmap: dict) -> list[Instruction]:
    """Stage ``s``'s forward of micro-batch ``k``: load, receive, run, free, send."""
    ins: list[Instruction] = []
    inputs = [f"P{s}"]
    if p.reads_batch(s):
        ins.append(Load(buffer=f"X{s}@{k}", mb=k))
        inputs.append(f"X{s}@{k}")
    if s > 0:
        buf = f"{p.fwd_t(s - 1)}@{k}"
        ins += lower_transfer(tmap[p.fwd_t(s - 1)], buf, w)
        inputs.append(buf)
    outputs = [f"R{s}@{k}"] + ([f"{p.fwd_t(s)}@{k}"] if s < p.S - 1 else [])
    ins.append(Run(program=f"s{s}.F", mb=k, inputs=tuple(inputs), outputs=tuple(outputs)))
    if p.reads_batch(s):
        ins.append(Free(buffer=f"X{s}@{k}"))
    if s > 0:
        ins.append(Free(buffer=f"{p.fwd_t(s - 1)}@{k}"))
    if s < p.S - 1:
        ins += _send(tmap, p.fwd_t(s), f"{p.fwd_t(s)}@{k}", w)
    return ins


def _backward_task(p: _Pipe, s: int, k: int, w: int, tmap: dict) -> list[Instruction]:
    """Stage ``s``'s backward of micro-batch ``k``: receive, run, free, send."""
    ins: list[Instruction] = []
    inputs = [f"P{s}", f"R{s}@{k}", f"A{s}"]
    if s < p.S - 1:
        buf = f"{p.bwd_t(s)}@{k}"
        ins += lower_transfer(tmap[p.bwd_t(s)], buf, w)
        inputs.append(buf)
    outputs = [f"A{s}"] + ([f"{p.bwd_t(s - 1)}@{k}"] if s > 0 else [])
    ins.append(Run(program=f"s{s}.B", mb=k, inputs=tuple(inputs), outputs=tuple(outputs)))
    ins.append(Free(buffer=f"R{s}@{k}"))
    if s < p.S - 1:
        ins.append(Free(buffer=f"{p.bwd_t(s)}@{k}"))
    if s > 0:
        ins += _send(tmap, p.bwd_t(s - 1), f"{p.bwd_t(s - 1)}@{k}", w)
    return ins


def _pipe_header(p: _Pipe) -> tuple[tuple, tuple, tuple]:
    """The plan's stages, inputs (the batch, the parameters) and output (the new state)."""
    S, itemsize = p.S, np.dtype(p.dtype).itemsize
    stages = tuple(
        StageSpec(
            s, s, (s,), f"s{s}.F", f"s{s}.B", f"synthetic, {p.fwd[s]:.3g} + {p.bwd[s]:.3g} flop"
        )
        for s in range(S)
    )
    batch_bufs = tuple((f"X{s}", 0) for s in sorted({0, S - 1}))
    inputs = (
        InputSpec(0, "batch", "batch", (p.M, p.batch_bytes // itemsize), p.dtype, batch_bufs),
        InputSpec(
            1,
            "params",
            "state",
            (S, p.param_bytes // itemsize),
            p.dtype,
            tuple((f"P{s}", 0) for s in range(S)),
        ),
    )
    outputs = (
        OutputSpec(
            0,
            "new_state",
            (S, 3 * p.param_bytes // itemsize),
            p.dtype,
            "buffer",
            tuple((f"O{s}", 0) for s in range(S)),
        ),
    )
    return stages, inputs, outputs


def _bare_plan(method, cluster, meshes, buffers, transfers, streams, notes) -> Plan:
    key = repr((method, streams))
    return Plan(
        method=method,
        cluster=cluster,
        num_micro_batches=1,
        fingerprint="synthetic-" + hashlib.sha256(key.encode()).hexdigest()[:12],
        meshes=meshes,
        stages=(),
        programs=(),
        buffers=buffers,
        transfers=transfers,
        schedule=Schedule("none", 0, 1, ()),
        streams=streams,
        inputs=(),
        outputs=(),
        notes=notes,
    )


def synthetic_exchange(
    messages: Sequence[tuple[int, int, int]],
    *,
    num_hosts: int | None = None,
    devices_per_host: int = 1,
    cluster: ClusterSpec | None = None,
) -> Plan:
    """A plan that only moves data: message ``i`` = ``(src, dst, nbytes)`` is transfer ``t{i}``.

    Every host is a one-host mesh.  Each worker first issues its sends (in ``messages``
    order), then its receives and waits, then ``WAITALL``; all data is ready at time 0,
    so concurrent messages contend for links from the start.

        >>> print(synthetic_exchange([(0, 1, 1000)]).streams[1])
        w1: RECV t0@0 #0 <- w0
        w1: WAIT t0@0
        w1: WAITALL
    """
    n = num_hosts or 1 + max((max(s, d) for s, d, _ in messages), default=0)
    cluster = cluster or ClusterSpec(
        name="synthetic", num_hosts=n, devices_per_host=devices_per_host
    )
    meshes = tuple(MeshSpec(h, (1, devices_per_host), (h,)) for h in range(n))
    transfers = tuple(
        TransferSpec(
            f"t{i}",
            _tensor(i, f"t{i}.array", nbytes, "uint8"),
            (),
            src,
            dst,
            "-",
            "-",
            (Message(src, dst, ((0, int(nbytes)),), int(nbytes)),),
        )
        for i, (src, dst, nbytes) in enumerate(messages)
    )
    streams = []
    for w in range(n):
        ins: list[Instruction] = []
        for t in transfers:
            if t.messages[0].src == w:
                ins += [*lower_transfer(t, f"{t.name}@0", w), Free(buffer=f"{t.name}@0")]
        for t in transfers:
            if t.messages[0].dst == w != t.messages[0].src:
                ins += lower_transfer(t, f"{t.name}@0", w)
        ins.append(WaitAll())
        streams.append(WorkerStream(w, tuple(ins)))
    return _bare_plan(
        "synthetic-exchange",
        cluster,
        meshes,
        (),
        transfers,
        tuple(streams),
        ("synthetic exchange of point-to-point messages",),
    )


def synthetic_collective(
    kind: str,
    group: Sequence[int],
    nbytes: int,
    *,
    root: int | None = None,
    num_hosts: int | None = None,
    devices_per_host: int = 1,
    cluster: ClusterSpec | None = None,
) -> Plan:
    """A plan whose only work is one collective ``kind`` of ``nbytes`` over worker ``group``.

    >>> print(synthetic_collective("allreduce", (0, 1), 1 << 20).streams[0])
    w0: COLL allreduce t0@0 #0 [w0,w1]
    w0: WAIT t0@0
    """
    group = tuple(group)
    n = num_hosts or 1 + max(group)
    cluster = cluster or ClusterSpec(
        name="synthetic", num_hosts=n, devices_per_host=devices_per_host
    )
    meshes = tuple(MeshSpec(h, (1, devices_per_host), (h,)) for h in range(n))
    src = group[0] if root is None else root
    transfer = TransferSpec(
        "t0",
        _tensor(0, "t0.array", nbytes, "uint8"),
        (),
        src,
        src,
        "-",
        "-",
        (Message(src, src, ((0, int(nbytes)),), int(nbytes)),),
        kind,
    )
    coll = Collective(kind=kind, buffer="t0@0", transfer="t0", message=0, group=group, root=root)
    streams = tuple(
        WorkerStream(w, (coll, Wait(buffer="t0@0")) if w in group else ()) for w in range(n)
    )
    return _bare_plan(
        f"synthetic-{kind}",
        cluster,
        meshes,
        (),
        (transfer,),
        streams,
        (f"synthetic {kind} over {list(group)}",),
    )
