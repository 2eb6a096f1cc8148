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
    h, d = mesh_shape
    fwd = _per_stage(forward_flops, S, "forward_flops")
    bwd = (
        [2 * f for f in fwd]
        if backward_flops is None
        else _per_stage(backward_flops, S, "backward_flops")
    )
    res = activation_bytes if residual_bytes is None else residual_bytes
    cluster = cluster or ClusterSpec(name="synthetic", num_hosts=S * h, devices_per_host=d)

    meshes = tuple(MeshSpec(s, (h, d), tuple(range(s * h, (s + 1) * h))) for s in range(S))
    var = iter(range(1_000_000))

    def fwd_t(s: int) -> str:  # activations s -> s+1
        return f"t{s}"

    def bwd_t(s: int) -> str:  # gradient s+1 -> s
        return f"t{S - 1 + s}"

    # --- buffers, programs, transfers ------------------------------------------------
    buffers: list[BufferSpec] = []
    programs: list[ProgramSpec] = []
    transfers: list[TransferSpec] = []
    for s in range(S):
        buffers += [
            BufferSpec(
                f"P{s}", s, False, (_tensor(next(var), f"stage{s}.params", param_bytes, dtype),)
            ),
            BufferSpec(
                f"A{s}", s, False, (_tensor(next(var), f"stage{s}.grads", param_bytes, dtype),)
            ),
            BufferSpec(
                f"S{s}",
                s,
                False,
                (_tensor(next(var), f"stage{s}.opt_state", 2 * param_bytes, dtype),),
            ),
            BufferSpec(
                f"O{s}",
                s,
                False,
                (_tensor(next(var), f"stage{s}.new_state", 3 * param_bytes, dtype),),
            ),
            BufferSpec(f"R{s}", s, True, (_tensor(next(var), f"stage{s}.residuals", res, dtype),)),
        ]
        if s in (0, S - 1):
            buffers.append(
                BufferSpec(
                    f"X{s}", s, True, (_tensor(next(var), f"stage{s}.batch", batch_bytes, dtype),)
                )
            )
    for s in range(S - 1):
        for name, src, dst, prod, cons in (
            (fwd_t(s), s, s + 1, f"s{s}.F", f"s{s + 1}.F"),
            (bwd_t(s), s + 1, s, f"s{s + 1}.B", f"s{s}.B"),
        ):
            spec = ("host",) if h > 1 and transfer == "send_recv" else ()
            tensor = _tensor(next(var), f"{name}.array", activation_bytes, dtype, spec)
            rows = tensor.shape[0]
            if transfer == "send_recv":
                per = rows // h
                msgs = tuple(
                    Message(
                        meshes[src].hosts[i],
                        meshes[dst].hosts[i],
                        ((i * per, rows if i == h - 1 else (i + 1) * per),),
                        activation_bytes // h
                        if i < h - 1
                        else activation_bytes - (h - 1) * (activation_bytes // h),
                    )
                    for i in range(h)
                )
            else:
                group = (meshes[src].hosts[0], *meshes[dst].hosts)
                msgs = (Message(group[0], group[1], ((0, rows),), activation_bytes, group=group),)
            transfers.append(TransferSpec(name, tensor, spec, src, dst, prod, cons, msgs, transfer))
    for s in range(S):
        ins_f = [f"P{s}"] + ([f"X{s}"] if s in (0, S - 1) else []) + ([fwd_t(s - 1)] if s else [])
        out_f = [f"R{s}"] + ([fwd_t(s)] if s < S - 1 else [])
        ins_b = [f"P{s}", f"R{s}", f"A{s}"] + ([bwd_t(s)] if s < S - 1 else [])
        out_b = [f"A{s}"] + ([bwd_t(s - 1)] if s else [])
        programs += [
            ProgramSpec(f"s{s}.F", s, (), tuple(ins_f), tuple(out_f), fwd[s], None),
            ProgramSpec(f"s{s}.B", s, (), tuple(ins_b), tuple(out_b), bwd[s], None),
        ]
    for s in range(S):
        programs.append(
            ProgramSpec(
                f"m{s}.apply", s, (), (f"P{s}", f"A{s}", f"S{s}"), (f"O{s}",), apply_flops, None
            )
        )
    tmap = {str(t.name): t for t in transfers}

    # --- streams -----------------------------------------------------------------------
    def send(name: str, buf: str, w: int) -> list[Instruction]:
        return [*lower_transfer(tmap[name], buf, w), Free(buffer=buf)]

    def recv(name: str, buf: str, w: int) -> list[Instruction]:
        return list(lower_transfer(tmap[name], buf, w))

    streams = []
    for s in range(S):
        order = stage_order(schedule, S, M, s)
        for w in meshes[s].hosts:
            ins: list[Instruction] = [Zeros(buffer=f"A{s}")]
            for task in order:
                k = task.mb
                if task.kind == "F":
                    inputs = [f"P{s}"]
                    if s in (0, S - 1):
                        ins.append(Load(buffer=f"X{s}@{k}", mb=k))
                        inputs.append(f"X{s}@{k}")
                    if s > 0:
                        buf = f"{fwd_t(s - 1)}@{k}"
                        ins += recv(fwd_t(s - 1), buf, w)
                        inputs.append(buf)
                    outputs = [f"R{s}@{k}"] + ([f"{fwd_t(s)}@{k}"] if s < S - 1 else [])
                    ins.append(
                        Run(program=f"s{s}.F", mb=k, inputs=tuple(inputs), outputs=tuple(outputs))
                    )
                    if s in (0, S - 1):
                        ins.append(Free(buffer=f"X{s}@{k}"))
                    if s > 0:
                        ins.append(Free(buffer=f"{fwd_t(s - 1)}@{k}"))
                    if s < S - 1:
                        ins += send(fwd_t(s), f"{fwd_t(s)}@{k}", w)
                else:
                    inputs = [f"P{s}", f"R{s}@{k}", f"A{s}"]
                    if s < S - 1:
                        buf = f"{bwd_t(s)}@{k}"
                        ins += recv(bwd_t(s), buf, w)
                        inputs.append(buf)
                    outputs = [f"A{s}"] + ([f"{bwd_t(s - 1)}@{k}"] if s > 0 else [])
                    ins.append(
                        Run(program=f"s{s}.B", mb=k, inputs=tuple(inputs), outputs=tuple(outputs))
                    )
                    ins.append(Free(buffer=f"R{s}@{k}"))
                    if s < S - 1:
                        ins.append(Free(buffer=f"{bwd_t(s)}@{k}"))
                    if s > 0:
                        ins += send(bwd_t(s - 1), f"{bwd_t(s - 1)}@{k}", w)
            ins.append(
                Run(
                    program=f"m{s}.apply",
                    mb=None,
                    inputs=(f"P{s}", f"A{s}", f"S{s}"),
                    outputs=(f"O{s}",),
                )
            )
            ins.append(WaitAll())
            streams.append(WorkerStream(w, tuple(ins)))

    stages = tuple(
        StageSpec(s, s, (s,), f"s{s}.F", f"s{s}.B", f"synthetic, {fwd[s]:.3g} + {bwd[s]:.3g} flop")
        for s in range(S)
    )
    inputs = (
        InputSpec(
            0,
            "batch",
            "batch",
            (M, batch_bytes // np.dtype(dtype).itemsize),
            dtype,
            tuple((f"X{s}", 0) for s in sorted({0, S - 1})),
        ),
        InputSpec(
            1,
            "params",
            "state",
            (S, param_bytes // np.dtype(dtype).itemsize),
            dtype,
            tuple((f"P{s}", 0) for s in range(S)),
        ),
    )
    outputs = (
        OutputSpec(
            0,
            "new_state",
            (S, 3 * param_bytes // np.dtype(dtype).itemsize),
            dtype,
            "buffer",
            tuple((f"O{s}", 0) for s in range(S)),
        ),
    )
    key = repr(
        (
            S,
            M,
            schedule,
            mesh_shape,
            fwd,
            bwd,
            apply_flops,
            activation_bytes,
            res,
            param_bytes,
            batch_bytes,
            transfer,
            dtype,
        )
    )
    return Plan(
        method=f"synthetic-{schedule}",
        cluster=cluster,
        num_micro_batches=M,
        fingerprint="synthetic-" + hashlib.sha256(key.encode()).hexdigest()[:12],
        meshes=meshes,
        stages=stages,
        programs=tuple(programs),
        buffers=tuple(buffers),
        transfers=tuple(transfers),
        schedule=schedule_grid(schedule, S, M),
        streams=tuple(streams),
        inputs=inputs,
        outputs=outputs,
        notes=("synthetic plan built by meshshard.sim.synthetic (no traced program)",),
    )


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
