"""Measured timelines: what the runtime really did, per instruction, as a Chrome trace.

Recording is cheap by construction: a :class:`Recorder` holds three preallocated lists
of ``time.perf_counter_ns()`` stamps indexed by instruction position (start, end, and
for communication the moment its completion was observed), so the hot path is two
clock reads and two list stores per instruction, with no allocation or formatting.
Communication completion is observed through :class:`RecordingTransport`, which wraps
the worker's transport and stamps each handle's ``wait()`` return under the index of
the instruction that issued it.

Clocks: every stamp is the worker process's ``perf_counter_ns`` (``CLOCK_MONOTONIC``
on Linux).  The driver estimates each worker's offset from its own clock with a ping
exchange (:func:`estimate_offset`: the sample of least round trip, offset = remote
stamp minus the midpoint), which also holds across machines; on one machine the
monotonic clock is shared by all processes and the estimate comes out within half a
round trip of zero (tested).  Threads of one process share the driver's clock
(offset 0).

:func:`measured_trace` turns recorded steps into the simulator's Chrome-trace shape
(:mod:`meshshard.sim.trace`): one process per worker with a ``host`` thread (one span
per executed instruction; a worker runs one instruction at a time) and ``comm`` lanes
(each communication from issue to observed completion), plus a ``driver`` process
with the dispatch of every step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Load,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
    Zeros,
)
from meshshard.sim.trace import assign_lanes

__all__ = [
    "Recorder",
    "RecordingTransport",
    "WorkerTrace",
    "StepTrace",
    "TraceLog",
    "estimate_offset",
    "measured_trace",
    "span_name",
    "span_category",
]

clock_ns: Callable[[], int] = time.perf_counter_ns


class Recorder:
    """Per-instruction stamps of one step of one worker (``perf_counter_ns``; 0 = none),
    and, when RUNs wait for their outputs (profiling), the process CPU nanoseconds each
    RUN took (``cpu``; 0 = not measured)."""

    __slots__ = ("n", "start", "end", "done", "cpu", "current")

    def __init__(self, n: int):
        self.n = n
        self.reset()

    def reset(self) -> None:
        """Clear the stamps before a step (allocates the lists once per step)."""
        self.start = [0] * self.n
        self.end = [0] * self.n
        self.done = [0] * self.n
        self.cpu = [0] * self.n
        self.current = 0

    def snapshot(self, worker: int, finish: int = 0) -> WorkerTrace:
        """The recorded step as an immutable :class:`WorkerTrace` (``finish``: when the
        worker's step call returned, 0 = unknown)."""
        cpu = tuple(self.cpu) if any(self.cpu) else ()
        return WorkerTrace(
            worker, tuple(self.start), tuple(self.end), tuple(self.done), finish, cpu
        )


class _TimedHandle:
    __slots__ = ("handle", "rec", "index")

    def __init__(self, handle, rec: Recorder, index: int):
        self.handle, self.rec, self.index = handle, rec, index

    def wait(self):
        value = self.handle.wait()
        self.rec.done[self.index] = clock_ns()
        return value


class RecordingTransport:
    """A transport whose handles stamp their completion into a :class:`Recorder`.

    Everything else (``path``, ``rank``, ...) is the wrapped transport's.
    """

    def __init__(self, inner, rec: Recorder):
        self.inner = inner
        self.rec = rec

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, handle):
        return _TimedHandle(handle, self.rec, self.rec.current)

    def isend(self, data, peer, tag):
        """``inner.isend``, completion stamped."""
        return self._timed(self.inner.isend(data, peer, tag))

    def irecv(self, nbytes, peer, tag):
        """``inner.irecv``, completion stamped."""
        return self._timed(self.inner.irecv(nbytes, peer, tag))

    def ibroadcast(self, data, nbytes, group, key, tag):
        """``inner.ibroadcast``, completion stamped."""
        return self._timed(self.inner.ibroadcast(data, nbytes, group, key, tag))

    def iallreduce(self, data, op, group, key):
        """``inner.iallreduce``, completion stamped."""
        return self._timed(self.inner.iallreduce(data, op, group, key))

    def iallgather(self, data, group, key):
        """``inner.iallgather``, completion stamped."""
        return self._timed(self.inner.iallgather(data, group, key))


@dataclass(frozen=True)
class WorkerTrace:
    """One worker's stamps for one step, in its own clock (ns); ``done`` 0 = no comm.

    ``finish`` is when the worker's step call had its small outputs in hand (0 =
    unknown).  JAX dispatches programs asynchronously, so the last instruction's end
    can come long before the programs it dispatched finish: on a mesh spanning two
    host-actors, 100 ms before.
    """

    worker: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    done: tuple[int, ...]
    finish: int = 0
    cpu: tuple[int, ...] = ()  # process CPU ns per RUN when profiled (sync); () = none

    @property
    def busy_ns(self) -> int:
        """First instruction's start to the step's finish (or the last instruction's
        end when the finish was not stamped)."""
        stamps = [t for t in self.start if t]
        if not stamps:
            return 0
        return max(self.finish, max(self.end)) - min(stamps)

    def __str__(self) -> str:
        ran = sum(1 for s in self.start if s)
        return (
            f"w{self.worker}: {ran} instructions, {(max(self.end) - min(self.start)) / 1e6:.3f} ms"
        )


@dataclass(frozen=True)
class StepTrace:
    """One recorded step: the driver's dispatch stamps and every worker's trace.

    ``driver`` holds (name, start_ns, end_ns) in the driver's clock; ``offsets`` each
    worker's clock minus the driver's (ns).
    """

    driver: tuple[tuple[str, int, int], ...]
    workers: tuple[WorkerTrace, ...]
    offsets: tuple[tuple[int, int], ...] = ()

    def offset(self, worker: int) -> int:
        """Worker clock minus driver clock, ns (0 when unknown: same process)."""
        return dict(self.offsets).get(worker, 0)

    @property
    def seconds(self) -> float:
        """The step as the driver saw it (first to last dispatch stamp)."""
        return (self.driver[-1][2] - self.driver[0][1]) / 1e9


def estimate_offset(remote_clock: Callable[[], int], samples: int = 7) -> tuple[int, int]:
    """(offset_ns, rtt_ns) of a remote clock: the least-round-trip ping's remote stamp
    minus the midpoint of its send and reply (NTP's estimate; error <= rtt / 2).

    >>> off, rtt = estimate_offset(lambda: clock_ns() + 5_000_000)
    >>> abs(off - 5_000_000) <= rtt
    True
    """
    best = None
    for _ in range(samples):
        t0 = clock_ns()
        remote = remote_clock()
        t1 = clock_ns()
        if best is None or t1 - t0 < best[1]:
            best = (remote - (t0 + t1) // 2, t1 - t0)
    return best


@dataclass
class TraceLog:
    """The recorded steps of a parallelized function (the last ``keep``) and where to write them."""

    path: str
    keep: int = 20
    steps: list[tuple[Sequence[WorkerStream], StepTrace]] = field(default_factory=list)

    def add(self, streams: Sequence[WorkerStream], step: StepTrace) -> None:
        """Remember one step (dropping the oldest beyond ``keep``)."""
        self.steps.append((streams, step))
        del self.steps[: max(0, len(self.steps) - self.keep)]

    def write(self, path: str | None = None, extra_events: Sequence[dict] = ()) -> str:
        """Write the Chrome trace of the kept steps; returns the path."""
        path = path or self.path
        trace = measured_trace(self.steps)
        trace["traceEvents"].extend(extra_events)
        with open(path, "w") as f:
            json.dump(trace, f)
        return path


_CATEGORY = {
    Run: "run",
    Send: "send",
    Recv: "recv",
    Collective: "collective",
    Wait: "wait",
    WaitAll: "wait",
    Load: "load",
    Zeros: "zeros",
    Free: "free",
}


def span_name(ins: Instruction) -> str:
    """The span name of an instruction, as the simulator's trace names it."""
    if isinstance(ins, Run):
        return f"{ins.program}" + (f" mb{ins.mb}" if ins.mb is not None else "")
    return str(ins)


def span_category(ins: Instruction) -> str:
    """The trace category of an instruction's host span (``run``, ``send``, ``wait``...)."""
    return _CATEGORY.get(type(ins), "other")


DRIVER_PID = 999_000


def measured_trace(steps, pid_base: int = 0, label: str = "measured") -> dict:
    """The Chrome trace of recorded steps: ``[(streams, StepTrace), ...]``.

    Times are microseconds from the first step's first driver stamp, every worker's
    stamps moved onto the driver's clock by its offset.  An instant event "outputs
    ready" marks when each worker's step call had its outputs (programs dispatched
    asynchronously finish there, after the last instruction's span).  Process ids are the worker
    ids plus ``pid_base`` (so a predicted timeline can sit beside it).
    """
    if not steps:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"meshshard": label}}
    t0 = steps[0][1].driver[0][1]
    events: list[dict] = []
    seen: set[int] = set()
    comm: dict[int, list[tuple[float, float, str, str]]] = {}
    for n, (streams, step) in enumerate(steps):
        by_worker = {s.worker: s for s in streams}
        for wt in step.workers:
            pid = pid_base + wt.worker
            if wt.worker not in seen:
                seen.add(wt.worker)
                events += _process_meta(pid, f"w{wt.worker} ({label})", "host")
            shift = step.offset(wt.worker) + t0
            instrs = by_worker[wt.worker].instructions
            for i, ins in enumerate(instrs):
                if not wt.start[i]:
                    continue
                s, e = (wt.start[i] - shift) / 1e3, (wt.end[i] - shift) / 1e3
                name, cat = span_name(ins), span_category(ins)
                events.append(_span(pid, 0, name, cat, s, e, {"step": n, "index": i}))
                if wt.done[i]:
                    done = (wt.done[i] - shift) / 1e3
                    comm.setdefault(pid, []).append((s, done, name, cat))
            if wt.finish:  # the programs dispatched last may run well past the last span
                ts = (wt.finish - shift) / 1e3
                ready = {"ph": "i", "s": "t", "pid": pid, "tid": 0, "name": "outputs ready"}
                events.append({**ready, "ts": ts, "args": {"step": n}})
        for name, a, b in step.driver:
            events.append(
                _span(
                    pid_base + DRIVER_PID,
                    0,
                    name,
                    "dispatch",
                    (a - t0) / 1e3,
                    (b - t0) / 1e3,
                    {"step": n},
                )
            )
    events += _process_meta(pid_base + DRIVER_PID, f"driver ({label})", "dispatch")
    for pid, spans in comm.items():
        lanes = assign_lanes([(s, e) for s, e, _, _ in spans])
        for k in range(max(lanes) + 1):
            events.append(_thread_name(pid, 1 + k, f"comm {k}"))
        for (s, e, name, cat), k in zip(spans, lanes, strict=True):
            events.append(_span(pid, 1 + k, name, cat, s, e, {}))
    seconds = [step.seconds for _, step in steps]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"meshshard": label, "steps": len(steps), "step_seconds": seconds},
    }


def _span(pid, tid, name, cat, start_us, end_us, args) -> dict:
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "cat": cat,
        "ts": start_us,
        "dur": max(0.0, end_us - start_us),
        "args": args,
    }


def _thread_name(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _process_meta(pid: int, name: str, thread: str) -> list[dict]:
    return [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
        _thread_name(pid, 0, thread),
    ]
