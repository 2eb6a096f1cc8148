"""Check a plan's streams and schedule for the invariants the runtime relies on.

``verify(plan)`` returns the list of problems (empty when the plan is sound): every
buffer is written before it is read; every per-micro-batch buffer is freed exactly
once; every ``SEND`` has its ``RECV`` on the peer and the reverse; every received
buffer is waited on; the schedule runs each task once, after its dependencies.
"""

from __future__ import annotations

from collections import Counter

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Collective, Free, Load, Recv, Run, Send, Wait, WaitAll, Zeros
from meshshard.plan import Plan, Schedule
from meshshard.plan_checks import header_problems
from meshshard.refs import BufferKind, BufferRef


def verify(plan: Plan, cluster: ClusterSpec | None = None) -> list[str]:
    """All invariant violations of ``plan`` (an empty list if none), header first: the
    micro-batch count, mesh shapes against the plan's cluster (and ``cluster``, if
    given) and the fingerprint format (``plan_checks.header_problems``)."""
    problems = header_problems(plan, cluster)
    problems += verify_schedule(plan.schedule)
    persistent = {b.name for b in plan.buffers if b.name.kind.persistent}
    sends, recvs = Counter(), Counter()
    for stream in plan.streams:
        w = stream.worker
        live: set[BufferRef] = set(persistent)
        freed: Counter = Counter()
        received: set[BufferRef] = set()
        for i, ins in enumerate(stream.instructions):
            where = f"w{w}[{i}] {ins}"
            # a broadcast's receiving member issues a receive: it reads nothing yet
            bcast_in = isinstance(ins, Collective) and ins.root is not None and ins.root != w
            for b in () if bcast_in else ins.reads:
                if b not in live:
                    problems.append(f"{where}: reads {b} before it is written")
            if bcast_in or (isinstance(ins, Collective) and ins.kind in ("allreduce", "allgather")):
                received.add(ins.buffer)  # completes (every member's result) at its WAIT
            elif isinstance(ins, Recv):
                received.add(ins.buffer)
                recvs[(ins.peer, w, ins.buffer, ins.message)] += 1
            elif isinstance(ins, Wait):
                if ins.buffer not in received:
                    problems.append(f"{where}: waits on {ins.buffer} with no receive issued")
                received.discard(ins.buffer)
                live.add(ins.buffer)
            elif isinstance(ins, Send):
                sends[(w, ins.peer, ins.buffer, ins.message)] += 1
            elif isinstance(ins, Free):
                freed[ins.buffer] += 1
                live.discard(ins.buffer)
            elif isinstance(ins, Run | Load | Zeros):
                live.update(ins.writes)
            elif isinstance(ins, WaitAll):
                pass
        if received:
            problems.append(f"w{w}: receives never waited on: {sorted(map(str, received))}")
        written = {
            b
            for ins in stream.instructions
            if isinstance(ins, Run | Load | Zeros | Wait)
            for b in ins.writes
        }
        for b in sorted(written - persistent, key=str):
            if b.kind is BufferKind.APPLY_OUTPUTS:
                continue  # step results stay with the worker
            if freed[b] != 1:
                problems.append(f"w{w}: buffer {b} freed {freed[b]} times (want exactly once)")
        if not stream.instructions or not isinstance(stream.instructions[-1], WaitAll):
            problems.append(f"w{w}: stream does not end with WAITALL")
    for key in sorted(set(sends) | set(recvs), key=lambda k: (k[0], k[1], str(k[2]), k[3])):
        if sends[key] != recvs[key]:
            src, dst, buf, msg = key
            problems.append(
                f"{buf} #{msg} w{src} -> w{dst}: {sends[key]} sends but {recvs[key]} receives"
            )
    return problems


def verify_schedule(schedule: Schedule) -> list[str]:
    """Each task once, in dependency order, one task per stage per tick, activations
    within the schedule's bound, weight versions consistent
    (:func:`meshshard.passes.schedule_verify.schedule_problems`)."""
    from meshshard.passes.schedule_verify import schedule_problems

    return [str(p) for p in schedule_problems(schedule)]


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose last backward task
    (W when split, else B) has not (:func:`~meshshard.passes.schedule_verify.activation_peaks`)."""
    from meshshard.passes.schedule_verify import activation_peaks

    return activation_peaks(schedule)
