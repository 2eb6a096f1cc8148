"""``simulate(plan, cluster)``: execute the streams, then summarise them into a SimResult."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Collective, Instruction, Recv, Run, Send, Wait, WaitAll
from meshshard.plan import Plan
from meshshard.plan_checks import require_valid_plan
from meshshard.sim.engine import SimOptions, Timeline, execute, finish_time
from meshshard.sim.memory import CATEGORY_ORDER, memory_profile
from meshshard.sim.result import Counter, LinkStats, MemoryStats, SimResult, Span, WorkerStats

__all__ = ["iteration_time", "simulate"]


def simulate(
    plan: Plan,
    cluster: ClusterSpec | None = None,
    *,
    overlap: bool | None = None,
    program_times: Mapping[str, float] | None = None,
    options: SimOptions | None = None,
) -> SimResult:
    """Predict one iteration of ``plan`` on ``cluster`` (default: the cluster it was planned for).

    ``overlap`` picks the asynchronous runtime (compute and communication queues, the
    default) or the blocking one, overriding ``options.overlap`` when given; ``program_times`` maps program names to measured seconds (else
    a roofline of their cost analysis); ``options`` tunes the rest (:class:`SimOptions`).

        >>> from meshshard.sim.synthetic import synthetic_pipeline
        >>> plan = synthetic_pipeline(2, 4, schedule="1f1b")
        >>> r = simulate(plan, program_times={"s0.F": 1.0, "s1.F": 1.0, "s0.B": 2.0, "s1.B": 2.0})
        >>> round(r.iteration_time, 1)  # (M + S - 1) * (F + B), plus 3 ms of transfers
        15.0
    """
    require_valid_plan(plan, what="simulate", streams=False)  # an edited header
    cluster = plan.cluster if cluster is None else cluster
    opts = options or SimOptions()
    if overlap is not None:
        opts = replace(opts, overlap=overlap)
    with _gc_paused():
        tl = execute(plan, cluster, opts, program_times)
        return summarise(plan, cluster, opts, tl)


def iteration_time(
    plan: Plan,
    cluster: ClusterSpec,
    options: SimOptions,
    program_times: Mapping[str, float] | None = None,
) -> float:
    """Predicted seconds of one iteration of ``plan``: :func:`simulate`'s
    ``iteration_time`` without the summary it builds (per-worker stats, memory, spans).

    For searches and enumerations that only compare candidate plans' times: the summary
    was a quarter of the time of simulating one small resharding.  The plan is trusted
    to be valid (the callers build it).
    """
    with _gc_paused():
        return finish_time(plan, cluster, options, program_times) + cluster.dispatch_overhead


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a simulation runs: it allocates tens of
    thousands of long-lived objects (ops, flows, spans), and the collections they set off
    re-scan all of them again and again (a third of the time of a 25k-instruction plan,
    measured with ``benchmarks/sim_speed.py``).  Nothing it builds needs the collector
    to be freed early; it runs again, as before, once the simulation returns."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _worker_stats(
    plan: Plan, cluster: ClusterSpec, tl: Timeline, end: float, record: bool
) -> tuple[list[WorkerStats], list[Span]]:
    """Per worker: compute and communication time, finish (:class:`WorkerStats`); and,
    when ``record``, a span per program run, communication and wait that blocked."""
    spans: list[Span] = []
    workers: list[WorkerStats] = []
    meshes_of: dict[int, list[int]] = {}
    devices_of: dict[int, int] = {}
    for m in plan.meshes:
        for h in m.hosts:
            meshes_of.setdefault(h, []).append(m.id)
            devices_of[h] = max(devices_of.get(h, 0), m.shape[1])
    for recs in tl.records:
        if not recs:
            continue
        w = recs[0].worker
        track = f"w{w}"
        compute = 0.0
        comm: list[tuple[float, float]] = []
        finish = 0.0
        for r in recs:
            ins = r.instruction
            finish = max(finish, r.end)
            if isinstance(ins, Run):
                compute += r.end - r.start
                if record:
                    mb = f" mb{ins.mb}" if ins.mb is not None else ""
                    spans.append(
                        Span(track, "compute", f"{ins.program}{mb}", r.start, r.end, "run")
                    )
            elif ins.is_comm and r.comm_start is not None:
                comm.append((r.comm_start, r.comm_end))
                if record:
                    spans.append(
                        Span(track, "comm", ins.label, r.comm_start, r.comm_end, _category(ins))
                    )
            elif isinstance(ins, Wait | WaitAll) and record and r.end > r.head:
                spans.append(Span(track, "compute", ins.label, r.head, r.end, "wait"))
        workers.append(
            WorkerStats(
                worker=w,
                meshes=tuple(meshes_of.get(w, ())),
                devices=devices_of.get(w, cluster.devices_per_host),
                compute=compute,
                comm=_union(comm),
                finish=finish,
                iteration=end,
            )
        )
    return workers, spans


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


_SPAN_CATEGORY = {Send: "send", Recv: "recv", Collective: "collective"}


def _category(ins: Instruction) -> str:
    """The trace category of a communication span."""
    return _SPAN_CATEGORY.get(type(ins), "comm")


def summarise(plan: Plan, cluster: ClusterSpec, opts: SimOptions, tl: Timeline) -> SimResult:
    """Turn an engine :class:`Timeline` into a :class:`SimResult` (stats, memory, spans, counters)."""
    end = tl.end + cluster.dispatch_overhead  # the driver's share of every step
    workers, spans = _worker_stats(plan, cluster, tl, end, opts.record)
    net, topo = tl.network, tl.topology
    links = tuple(
        LinkStats(link.name, link.kind, link.capacity, net.moved[link.id], net.busy[link.id], end)
        for link in topo.links
    )
    peaks, curves, mem_notes = memory_profile(plan, tl.records, end)
    memory = tuple(
        MemoryStats(
            worker=w,
            peak=peak,
            at=at,
            breakdown=tuple((c, breakdown.get(c, 0.0)) for c in CATEGORY_ORDER),
            capacity=float(cluster.device_memory),
        )
        for w, (peak, at, breakdown) in sorted(peaks.items())
    )
    counters: list[Counter] = []
    if opts.record:
        for link in topo.links:
            samples = net.samples[link.id]
            if samples:
                counters.append(
                    Counter("network", link.name, "util", tuple(samples), 1.0 / link.capacity)
                )
        for w, curve in sorted(curves.items()):
            counters.append(Counter(f"w{w}", "memory per device", "MiB", tuple(curve), 2.0**-20))
    return SimResult(
        method=plan.method,
        cluster=cluster,
        overlap=opts.overlap,
        iteration_time=end,
        workers=tuple(workers),
        links=links,
        memory=memory,
        programs=tl.costs,
        spans=tuple(spans),
        counters=tuple(counters),
        num_instructions=sum(len(r) for r in tl.records),
        num_flows=net.flows_started,
        notes=tl.notes + tuple(mem_notes),
    )
