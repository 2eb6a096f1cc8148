"""Chrome-trace JSON of a simulated iteration (open it in ui.perfetto.dev or chrome://tracing).

One process per worker, with a ``compute`` thread (programs, waits) and as many
``comm`` threads as its communications overlap (spans on one thread never overlap),
plus a ``memory`` counter; one ``network`` process with a utilisation counter per
link that carried traffic.  Times are microseconds, as the format wants.  The
runtime can write its measured timeline in the same shape so both lie side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshshard.sim.result import SimResult

__all__ = ["chrome_trace", "assign_lanes"]

_NETWORK_PID = 1_000_000


def assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Give each (start, end) interval the lowest lane free at its start (greedy colouring).

    >>> assign_lanes([(0, 2), (1, 3), (2, 4)])
    [0, 1, 0]
    """
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    lane_end: list[float] = []
    lanes = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for k, free_at in enumerate(lane_end):
            if free_at <= start:
                lanes[i] = k
                lane_end[k] = end
                break
        else:
            lanes[i] = len(lane_end)
            lane_end.append(end)
    return lanes


#: Perfetto/Chrome colour names for TriRace's three kinds of traffic.
TRAFFIC_COLOURS = {"p2p": "good", "sparse": "yellow", "allreduce": "terrible"}


def _colour(token: str) -> dict:
    """``{"cname": ...}`` for a communication span by its traffic kind (its token)."""
    if token.startswith(("SEND", "RECV")) or (token.startswith("COLL broadcast")):
        kind = "p2p"
    elif token.startswith("COLL allgather"):
        kind = "sparse"
    elif token.startswith("COLL"):
        kind = "allreduce"
    else:
        return {}
    return {"cname": TRAFFIC_COLOURS[kind], "args": {"traffic": kind}}


def chrome_trace(result: SimResult) -> dict:
    """The trace object: ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``."""
    events, pids = _worker_processes(result)
    events += _span_events(result.spans, pids)
    events += _counter_events(result.counters, pids)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "meshshard": "simulated",
            "method": result.method,
            "cluster": str(result.cluster),
            "overlap": result.overlap,
            "iteration_time_s": result.iteration_time,
        },
    }


def _worker_processes(result: SimResult) -> tuple[list[dict], dict[str, int]]:
    """One trace process per worker (named by its meshes and devices, its compute
    lane named), and the process id of each worker's track."""
    events: list[dict] = []
    pids: dict[str, int] = {}
    for w in result.workers:
        pid = w.worker
        pids[f"w{w.worker}"] = pid
        meshes = ",".join(f"mesh{m}" for m in w.meshes) or "no mesh"
        name = f"w{w.worker} ({meshes}, {w.devices} devices)"
        events += [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
        ]
    return events, pids


def _span_events(spans, pids: dict[str, int]) -> list[dict]:
    """Compute spans on lane 0; each track's communication spans on as many lanes as
    overlap (``comm 0``, ``comm 1``, ...).  New tracks get the next process ids."""
    us = 1e6
    events: list[dict] = []
    comm: dict[str, list] = {}
    for s in spans:
        pid = pids.setdefault(s.track, len(pids))
        if s.lane != "compute":
            comm.setdefault(s.track, []).append(s)
            continue
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": 0,
                "name": s.name,
                "cat": s.category or "compute",
                "ts": s.start * us,
                "dur": (s.end - s.start) * us,
            }
        )
    for track, track_spans in comm.items():
        pid = pids[track]
        lanes = assign_lanes([(s.start, s.end) for s in track_spans])
        for k in range(max(lanes) + 1 if lanes else 0):
            name = {"name": f"comm {k}"}
            events.append(
                {"ph": "M", "pid": pid, "tid": 1 + k, "name": "thread_name", "args": name}
            )
        for s, k in zip(track_spans, lanes, strict=True):
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": 1 + k,
                    "name": s.name,
                    "cat": s.category or "comm",
                    **_colour(s.name),
                    "ts": s.start * us,
                    "dur": (s.end - s.start) * us,
                }
            )
    return events


def _counter_events(counters, pids: dict[str, int]) -> list[dict]:
    """The network links' process, and every counter sample (link use, memory held)."""
    name = {"name": "network links"}
    events = [{"ph": "M", "pid": _NETWORK_PID, "name": "process_name", "args": name}]
    for c in counters:
        pid = _NETWORK_PID if c.track == "network" else pids.get(c.track, _NETWORK_PID)
        for t, v in c.samples:
            events.append(
                {
                    "ph": "C",
                    "pid": pid,
                    "name": c.name,
                    "ts": t * 1e6,
                    "args": {c.unit: v * c.scale},
                }
            )
    return events
