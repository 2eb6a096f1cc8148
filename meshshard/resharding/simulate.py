"""Predict a resharding's time with :mod:`meshshard.sim`: build a one-transfer plan, run it.

The plan has one transfer ``t0`` holding the messages and, per worker, the stream the
runtime would run: its messages in ``(round, position)`` order (``SEND``/``RECV`` for
point-to-point, ``COLL broadcast`` on every group member), then ``WAIT`` for what it
received, then, where a :class:`~meshshard.resharding.result.LocalGather` is needed,
a ``RUN`` of the intra-host all-gather, then ``WAITALL``.  It runs with
``serial_comm=True``: a worker does one communication at a time and a transfer
starts when all its parties reach it (NCCL semantics, the paper's execution model),
so order and head-of-line blocking count.  Messages name their devices, so the
simulator routes each flow between them and chains a broadcast through every
destination device (intra-host fan-out).

The all-gather runs on the intra-host fabric, which nothing else uses then, so its
time is closed-form: a device must take in what it lacks at ``intra_bandwidth``
(a ring achieves it), plus ``R - 1`` hops of ``intra_latency``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.instructions import (
    Collective,
    Instruction,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
)
from meshshard.plan import MeshSpec, Message, Plan, ProgramSpec, Schedule, TensorSpec, TransferSpec
from meshshard.resharding.coverage import check_messages
from meshshard.resharding.estimate import execution_order
from meshshard.resharding.result import LocalGather
from meshshard.sim import SimOptions, simulate
from meshshard.tiles import ReshardingProblem

__all__ = ["gather_seconds", "resharding_sim_plan", "simulate_resharding"]

BUFFER = "t0@0"


def gather_seconds(gathers: Sequence[LocalGather], cluster: ClusterSpec) -> float:
    """Seconds the intra-host all-gathers of one host take, run one after another."""
    return sum(
        g.missing / cluster.intra_bandwidth + (len(g.devices) - 1) * cluster.intra_latency
        for g in gathers
    )


def resharding_sim_plan(
    problem: ReshardingProblem,
    messages: Sequence[Message],
    cluster: ClusterSpec,
    gathers: Sequence[LocalGather] = (),
) -> tuple[Plan, dict[str, float]]:
    """The one-transfer plan that runs ``messages`` (module docstring) and its program times."""
    src, dst = problem.src, problem.dst
    meshes = [MeshSpec(0, src.shape, src.hosts), MeshSpec(1, dst.shape, dst.hosts)]
    programs, times = [], {}
    by_host: dict[int, list[LocalGather]] = {}
    for g in gathers:
        by_host.setdefault(g.host, []).append(g)
    for h, gs in sorted(by_host.items()):
        meshes.append(MeshSpec(len(meshes), (1, dst.shape[1]), (h,)))
        name = f"gather.w{h}"
        programs.append(ProgramSpec(name, meshes[-1].id, (), (BUFFER,), (BUFFER,)))
        times[name] = gather_seconds(gs, cluster)
    tensor = TensorSpec(0, "array", tuple(problem.shape), problem.dtype, problem.src_spec)
    transfer = TransferSpec(
        "t0", tensor, problem.dst_spec, 0, 1, "-", "-", tuple(messages), "resharding"
    )
    order = execution_order(messages)
    streams = []
    for w in sorted(set(src.hosts) | set(dst.hosts)):
        ins: list[Instruction] = []
        received = False
        for i in order:
            m = messages[i]
            if m.group:
                if w in m.group:
                    ins.append(
                        Collective(
                            kind="broadcast",
                            buffer=BUFFER,
                            transfer="t0",
                            message=i,
                            group=m.group,
                            root=m.src,
                        )
                    )
                    received |= w != m.src
            elif w == m.src:
                ins.append(Send(buffer=BUFFER, transfer="t0", message=i, peer=m.dst))
            elif w == m.dst:
                ins.append(Recv(buffer=BUFFER, transfer="t0", message=i, peer=m.src))
                received = True
        if received:
            ins.append(Wait(buffer=BUFFER))
        if w in by_host:
            ins.append(Run(program=f"gather.w{w}", mb=None, inputs=(BUFFER,), outputs=(BUFFER,)))
        ins.append(WaitAll())
        streams.append(WorkerStream(w, tuple(ins)))
    key = repr((problem.shape, problem.dtype, tuple(messages), tuple(gathers)))
    plan = Plan(
        method="resharding",
        cluster=cluster,
        num_micro_batches=1,
        fingerprint="resharding-" + hashlib.sha256(key.encode()).hexdigest()[:12],
        meshes=tuple(meshes),
        stages=(),
        programs=tuple(programs),
        buffers=(),
        transfers=(transfer,),
        schedule=Schedule("none", 0, 1, ()),
        streams=tuple(streams),
        inputs=(),
        outputs=(),
        notes=(f"resharding {problem.dtype}{list(problem.shape)} simulated on its own",),
    )
    return plan, times


def simulate_resharding(
    problem: ReshardingProblem,
    messages: Sequence[Message],
    cluster: ClusterSpec,
    *,
    options: SimOptions | None = None,
) -> float:
    """Predicted seconds for ``messages`` to reshard ``problem`` on ``cluster``.

    Runs :func:`meshshard.sim.simulate` on the plan of :func:`resharding_sim_plan`,
    with the local all-gathers the messages rely on; serial communication per worker
    unless ``options`` says otherwise.  Raises ValueError if the messages do not
    reshard exactly or the cluster lacks the hosts.
    """
    gathers = check_messages(problem, messages)
    plan, times = resharding_sim_plan(problem, messages, cluster, gathers)
    opts = options or SimOptions(serial_comm=True, record=False)
    return simulate(plan, cluster, options=opts, program_times=times).iteration_time
