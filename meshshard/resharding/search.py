"""The paper's bounded search over sender choice and order (``broadcast_search``).

Alpa's ``loadbalance_order`` with ``search`` (PAPER_NOTES section 1.4).  Each host is
one single-threaded worker (one NIC); a *work* is one broadcast of a slice: candidate
sender hosts, receiver hosts, a duration (its bytes).  Works run in a global order; a
work starts when its sender and all its receivers are free and keeps them all busy
for its duration.  A depth-first search branches over (next work, its sender), prunes
a branch when a greedy estimate of its finish exceeds the best complete schedule, and
stops after a budget of search nodes, keeping the best schedule found.  Alpa caps the
search at 1 s of wall clock; a node budget makes the plan (and every golden file)
the same on every machine, however fast.  :data:`NODE_BUDGET` (250,000 nodes) is
about that second on the machine the benchmarks ran on.  The search also stops early
when the best schedule meets the busiest worker's total load (nothing can beat
that).  Works that start together form one round.

It does not cut slices: a slice goes whole from one sender.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.baselines import Planned, naive_order
from meshshard.resharding.blocks import by_host, make_message
from meshshard.tiles import ReshardingProblem

__all__ = [
    "NODE_BUDGET",
    "Work",
    "SearchResult",
    "search_schedule",
    "searched_messages",
    "broadcast_search",
]

NODE_BUDGET = 250_000
"""Search nodes ``broadcast_search`` may visit (Alpa's 1 s cap, as a machine-independent count)."""


@dataclass(frozen=True)
class Work:
    """One broadcast to schedule: ``senders`` (candidate hosts), ``receivers``, ``duration``."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    duration: int


@dataclass(frozen=True)
class SearchResult:
    """Best schedule found: sender per work, global order, start per work, search stats."""

    senders: tuple[int, ...]
    order: tuple[int, ...]
    starts: tuple[int, ...]
    makespan: int
    nodes: int
    complete: bool  # True: the search space was exhausted or the bound was met

    def __str__(self) -> str:
        how = "complete" if self.complete else "cut off by the node budget"
        return f"search: makespan {self.makespan} B after {self.nodes} nodes ({how})"


def search_schedule(works: list[Work], max_nodes: int = NODE_BUDGET) -> SearchResult:
    """Depth-first branch and bound over (order, sender) of ``works`` (see module docstring).

    Visits at most ``max_nodes`` search nodes and keeps the best complete schedule
    found, so the result depends on the works and the budget only, never on the
    machine's speed.  The first dive to a complete schedule is always finished (it
    takes ``len(works) + 1`` nodes), so a budget below that is raised to it.
    """
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}; pass e.g. 1000")
    n = len(works)
    workers = sorted({w for x in works for w in x.senders + x.receivers})
    slot = {w: i for i, w in enumerate(workers)}
    senders = [tuple(slot[s] for s in x.senders) for x in works]
    receivers = [tuple(slot[r] for r in x.receivers) for x in works]
    dur = [x.duration for x in works]
    target = _floor(senders, receivers, dur, len(workers))
    clock = [0] * len(workers)
    placed = [False] * n
    order: list[int] = []
    chosen = [0] * n
    best: dict = {"time": None, "order": (), "senders": (), "done": False}
    stats = {"nodes": 0, "timeout": False}

    def estimate(remaining: list[int]) -> int:
        extra = [0] * len(workers)
        for i in remaining:
            s = min(senders[i], key=lambda s: extra[s] + clock[s])
            extra[s] += dur[i]
            for r in receivers[i]:
                extra[r] += dur[i]
        return max(e + c for e, c in zip(extra, clock, strict=True))

    def visit(depth: int) -> None:
        stats["nodes"] += 1
        if best["done"]:
            return
        if stats["nodes"] >= max_nodes:
            stats["timeout"] = True
        if stats["timeout"] and best["time"] is not None:
            return
        if depth == n:
            finish = max(clock, default=0)
            if best["time"] is None or finish < best["time"]:
                best.update(time=finish, order=tuple(order), senders=tuple(chosen))
                best["done"] = finish <= target
            return
        remaining = [i for i in range(n) if not placed[i]]
        if best["time"] is not None and estimate(remaining) > best["time"]:
            return
        for i in remaining:
            placed[i] = True
            order.append(i)
            for s in senders[i]:
                members = (s,) + receivers[i]
                saved = [clock[m] for m in members]
                end = max(saved) + dur[i]
                for m in members:
                    clock[m] = end
                chosen[i] = s
                visit(depth + 1)
                for m, c in zip(members, saved, strict=True):
                    clock[m] = c
                if best["done"] or (stats["timeout"] and best["time"] is not None):
                    break
            order.pop()
            placed[i] = False
            if best["done"] or (stats["timeout"] and best["time"] is not None):
                return

    visit(0)
    starts = _starts(best["order"], best["senders"], receivers, dur, len(workers))
    return SearchResult(
        tuple(workers[s] for s in best["senders"]),
        tuple(best["order"]),
        starts,
        int(best["time"] or 0),
        stats["nodes"],
        not stats["timeout"],
    )


def _floor(senders, receivers, dur, workers: int) -> int:
    """No schedule beats the busiest receiver, nor (for single-sender works) the sender."""
    floor = [0] * workers
    for i, d in enumerate(dur):
        for r in receivers[i]:
            floor[r] += d
        if len(senders[i]) == 1:
            floor[senders[i][0]] += d
    return max(floor, default=0)


def _starts(order, chosen, receivers, dur, workers: int) -> tuple[int, ...]:
    """When each work starts when run in ``order`` from its ``chosen`` sender."""
    starts = [0] * len(dur)
    clock = [0] * workers
    for i in order:
        members = (chosen[i],) + receivers[i]
        starts[i] = max(clock[m] for m in members)
        for m in members:
            clock[m] = starts[i] + dur[i]
    return tuple(starts)


def broadcast_search(
    problem: ReshardingProblem, cluster: ClusterSpec, *, max_nodes: int = NODE_BUDGET
) -> Planned:
    """One broadcast per (destination tile, slice); senders and order from :func:`search_schedule`.

    Round ``k`` holds the works that start ``k``-th in the searched schedule; the
    search visits at most ``max_nodes`` nodes (deterministic, unlike Alpa's 1 s cap).
    """
    itemsize = problem.itemsize
    needs = [need for _, tile_needs in naive_order(problem) for need in tile_needs]
    works = [
        Work(
            tuple(by_host(n.holders)),
            tuple(by_host(n.receivers)),
            n.nbytes(itemsize),
        )
        for n in needs
    ]
    result = search_schedule(works, max_nodes)
    return tuple(searched_messages(problem, needs, result)), (str(result),)


def searched_messages(
    problem: ReshardingProblem, needs: list, result: SearchResult
) -> list[Message]:
    """One broadcast per searched work (``needs[i]`` from ``result.senders[i]``), ordered
    by start; works that start together share a round."""
    itemsize = problem.itemsize
    rounds = {t: k for k, t in enumerate(sorted(set(result.starts)))}
    position = {i: p for p, i in enumerate(result.order)}
    msgs = []
    for i in sorted(range(len(needs)), key=lambda i: (result.starts[i], position[i])):
        need, host = needs[i], result.senders[i]
        sender = (host, by_host(need.holders)[host][0])
        receivers = list(by_host(need.receivers).items())
        msgs.append(make_message(need.index, itemsize, sender, receivers, rounds[result.starts[i]]))
    return msgs
