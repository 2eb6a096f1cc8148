"""Predict a resharding's time with :mod:`meshshard.sim`: build a one-transfer plan, run it.

The plan has one transfer ``t0`` holding the messages and, per worker, the stream a
transfer-only plan runs (:func:`~meshshard.passes.lower_transfer.transfer_streams`,
the one lowering of every transfer: its messages in ``(round, position)`` order,
``SEND``/``RECV`` for point-to-point messages and two-member groups, ``COLL
broadcast`` on every member of a larger group, ``WAIT`` for what it received, then
``WAITALL``), with, where a :class:`~meshshard.resharding.result.LocalGather` is
needed, a ``RUN`` of the intra-host all-gather before the ``WAITALL``.  It runs with
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
from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Run, WorkerStream
from meshshard.passes.lower_transfer import transfer_streams
from meshshard.plan import MeshSpec, Message, Plan, ProgramSpec, Schedule, TensorSpec, TransferSpec
from meshshard.resharding.coverage import check_messages
from meshshard.resharding.result import LocalGather
from meshshard.sim import SimOptions
from meshshard.sim.simulator import iteration_time
from meshshard.tiles import ReshardingProblem

__all__ = ["gather_seconds", "resharding_sim_plan", "simulate_resharding"]

BUFFER = "t0@0"


def gather_seconds(gathers: Sequence[LocalGather], cluster: ClusterSpec) -> float:
    """Seconds the intra-host all-gathers of one host take, run one after another."""
    return sum(
        g.missing / cluster.intra_bandwidth + (len(g.devices) - 1) * cluster.intra_latency
        for g in gathers
    )


def _gather(w: int) -> tuple[Run, ...]:
    """The intra-host all-gather worker ``w`` runs once its messages arrived."""
    return (Run(program=f"gather.w{w}", mb=None, inputs=(BUFFER,), outputs=(BUFFER,)),)


def resharding_sim_plan(
    problem: ReshardingProblem,
    messages: Sequence[Message],
    cluster: ClusterSpec,
    gathers: Sequence[LocalGather] = (),
) -> tuple[Plan, dict[str, float]]:
    """The one-transfer plan that runs ``messages`` (module docstring) and its program times."""
    src, dst = problem.src, problem.dst
    meshes = [replace(src, id=0), replace(dst, id=1)]
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
    streams = tuple(
        WorkerStream(s.worker, s.instructions[:-1] + _gather(s.worker) + s.instructions[-1:])
        if s.worker in by_host
        else s
        for s in transfer_streams(transfer, meshes)
    )
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
        streams=streams,
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

    Runs :func:`meshshard.sim.simulator.iteration_time` on the plan of :func:`resharding_sim_plan`,
    with the local all-gathers the messages rely on; serial communication per worker
    unless ``options`` says otherwise.  Raises ValueError if the messages do not
    reshard exactly or the cluster lacks the hosts.
    """
    gathers = check_messages(problem, messages)
    plan, times = resharding_sim_plan(problem, messages, cluster, gathers)
    opts = options or SimOptions(serial_comm=True, record=False)
    return iteration_time(plan, cluster, opts, times)
