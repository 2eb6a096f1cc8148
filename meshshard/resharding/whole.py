"""Whole-slice schedules: few, large messages, for arrays where latency or fill rules.

The round LP cuts slices freely, which is exact for bandwidth but adds messages, and
each message costs a NIC latency and (in a chain) a chunk of pipeline fill.  For small
arrays the better plan sends each slice whole.  Two ways to place whole slices:

- :func:`dispatch_slices`: list scheduling in time; whenever a holder of a slice and
  its receiving hosts are idle it starts, busiest receivers first;
- :func:`searched_slices`: the paper's depth-first search over sender and order, with
  durations from the estimate and a node cap (deterministic).
"""

from __future__ import annotations

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.blocks import by_host, make_message
from meshshard.resharding.estimate import busy_seconds
from meshshard.resharding.search import Work, search_schedule, searched_messages
from meshshard.tiles import ReshardingProblem

__all__ = ["GROUPINGS", "dispatch_slices", "searched_slices"]

SEARCH_NODES = 4000  # node cap of searched_slices (deterministic), a few tens of ms


GROUPINGS = {
    "to all receiving hosts": lambda hosts: [hosts],
    "per receiving host": lambda hosts: [[h] for h in hosts],
    "in chains of two hosts": lambda hosts: [hosts[i : i + 2] for i in range(0, len(hosts), 2)],
}


def dispatch_slices(
    problem: ReshardingProblem, cluster: ClusterSpec, grouping: str, *, pooled: bool = False
) -> list[Message]:
    """Whole slices, dispatched as hosts free up: whenever a sender that holds a slice and
    all its receiving hosts are idle, it starts, busiest receivers first (their remaining
    work is the critical path), from the least-loaded idle holder.  ``grouping`` sends
    a slice to all its receiving hosts in one chain, to each on its own, or in chains of
    two (the sender is free again once its own hop is done, so short chains overlap).
    Few messages and no NIC idle while work is ready: the better plan when latency or
    pipeline fill rule (small arrays).  With ``pooled``, the slices with the same holder
    hosts and receiving hosts move as one unit (the same sender host, receivers and
    round, so they merge into one host-level message,
    :mod:`~meshshard.resharding.merge`): one chain of two and one direct send for a
    replicated array that three hosts need, where slice by slice the holders would
    alternate."""
    itemsize = problem.itemsize
    items = []  # (slices, receiving hosts, busy seconds per member)
    for unit in _units(problem, pooled):
        nbytes = sum(n.nbytes(itemsize) for n in unit)
        for group in GROUPINGS[grouping](list(by_host(unit[0].receivers))):
            items.append((unit, group, busy_seconds(nbytes, 1 + len(group), cluster)))
    placed = _dispatch(items)
    rounds = {t: k for k, t in enumerate(sorted({p[0] for p in placed}))}
    loads: dict = {}
    out = []
    for t, unit, s, group in placed:
        for need in unit:
            devs = [d for hh, d in need.holders if hh == s]
            sender = (s, min(devs, key=lambda d: loads.get((s, d), 0)))
            loads[sender] = loads.get(sender, 0) + need.nbytes(itemsize)
            targets = by_host(need.receivers)
            rcv = [(h, targets[h]) for h in group]
            out.append(make_message(need.index, itemsize, sender, rcv, rounds[t]))
    return out


def _units(problem: ReshardingProblem, pooled: bool) -> list[list]:
    """The slices, one per unit, or pooled by (holder hosts, receiving hosts)."""
    if not pooled:
        return [[n] for n in problem.needs]
    pools: dict[tuple, list] = {}
    for n in problem.needs:
        key = (frozenset(h for h, _ in n.holders), frozenset(h for h, _ in n.receivers))
        pools.setdefault(key, []).append(n)
    return list(pools.values())


def _dispatch(items: list) -> list[tuple[float, list, int, list[int]]]:
    """List scheduling of ``items`` (``(slices, receiving hosts, busy seconds per
    member)``): ``(start, slices, sender host, receiving hosts)`` per item
    (:func:`dispatch_slices`)."""
    left: dict[int, float] = {}
    for _, group, busy in items:
        for h, took in zip(group, busy[1:], strict=True):
            left[h] = left.get(h, 0.0) + took
    free: dict[int, float] = {}
    sent: dict[int, float] = {}
    placed = []
    pending = list(range(len(items)))
    now = 0.0
    while pending:
        order = sorted(
            pending,
            key=lambda i: (
                -max(left[h] for h in items[i][1]),
                -items[i][2][0],
                items[i][0][0].index,
            ),
        )
        started = set()
        for i in order:
            unit, group, busy = items[i]
            if any(free.get(h, 0.0) > now for h in group):
                continue
            idle = [h for h in by_host(unit[0].holders) if free.get(h, 0.0) <= now]
            if not idle:
                continue
            s = min(idle, key=lambda h: (sent.get(h, 0.0), h))
            for h, took in zip([s] + group, busy, strict=True):
                free[h] = now + took
            sent[s] = sent.get(s, 0.0) + busy[0]
            for h, took in zip(group, busy[1:], strict=True):
                left[h] -= took
            placed.append((now, unit, s, group))
            started.add(i)
        pending = [i for i in pending if i not in started]
        later = [t for t in free.values() if t > now]
        if pending and later:
            now = min(later)
    return placed


def searched_slices(problem: ReshardingProblem, cluster: ClusterSpec) -> list[Message]:
    """Whole slices, one broadcast each, sender and order from the paper's depth-first
    search with each work's duration the estimate's busy time (latency included) and a
    node cap, so the result does not depend on the machine's speed."""
    itemsize = problem.itemsize
    works = []
    for n in problem.needs:
        hosts = tuple(by_host(n.receivers))
        took = max(busy_seconds(n.nbytes(itemsize), 1 + len(hosts), cluster))
        works.append(Work(tuple(by_host(n.holders)), hosts, round(took * 1e9)))
    result = search_schedule(works, max_nodes=SEARCH_NODES)
    return searched_messages(problem, list(problem.needs), result)
