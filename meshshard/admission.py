"""Topology-aware admission of communication: one rule for the simulator and the runtime.

Planning-free and Ray-free: the simulator's engine (:mod:`meshshard.sim.engine`) and the
runtime's comm thread (:class:`meshshard.runtime.overlap.CommQueue`) both ask
:func:`admit` before they start a communication, with the links it will use
(:func:`comm_links`, named as in :mod:`meshshard.sim.topology`, from the plan's cluster
description) and what is in flight on them (:class:`InFlight` at run time, the engine's
own table in simulation).

    >>> from meshshard.cluster import ClusterSpec
    >>> comm_links(ClusterSpec(num_hosts=2), 0, (1,), both_ways=False)  # a send
    ('h0.d0.out', 'h0.nic0.out', 'h1.d0.in', 'h1.nic0.in')
    >>> table = InFlight()
    >>> token = table.add(30_000, ("h0.nic0.out",))
    >>> table.admits(10, ("h0.nic0.out",)), table.admits(10, ("h1.nic0.out",))
    (False, True)
    >>> table.remove(token); table.admits(10, ("h0.nic0.out",))
    True
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping

from meshshard.cluster import ClusterSpec

__all__ = ["admit", "comm_links", "InFlight", "plan_admits"]


def admit(priority: int, links: Iterable, in_flight: Mapping[object, Iterable[int]]) -> bool:
    """The topology-aware admission rule, shared by the simulator and the runtime.

    A communication of ``priority`` that will use ``links`` is admitted now unless some
    operation of strictly higher priority is in flight on one of them
    (``in_flight[link]`` lists the priorities there); otherwise it is delayed until
    that one finishes.  Bulk traffic is cut into chunks, so a high-priority transfer
    waits at most for the chunks already on the wire.

    >>> admit(10, ["nic0"], {"nic0": [30_000]}), admit(30_000, ["nic0"], {"nic0": [10]})
    (False, True)
    """
    return all(p <= priority for link in links for p in in_flight.get(link, ()))


@functools.lru_cache(maxsize=64)
def _topology(cluster: ClusterSpec):
    from meshshard.sim.topology import Topology  # the link table only; no simulation

    return Topology(cluster)


def comm_links(
    cluster: ClusterSpec, worker: int, peers: Iterable[int], both_ways: bool = True
) -> tuple[str, ...]:
    """The links a communication of ``worker`` with ``peers`` uses (device 0 of each host
    stands for the host), sorted; empty for a worker alone.  ``both_ways``: a collective
    (data flows to and from every peer); a send uses the outgoing direction only."""
    topo = _topology(cluster)
    ids: set[int] = set()
    for p in peers:
        if p != worker and 0 <= p < cluster.num_hosts and 0 <= worker < cluster.num_hosts:
            ids.update(topo.path((worker, 0), (p, 0)))
            if both_ways:
                ids.update(topo.path((p, 0), (worker, 0)))
    return tuple(sorted(topo.links[i].name for i in ids))


class InFlight:
    """The run-time in-flight table: priorities of the communications on each link,
    shared by the comm threads of one process (thread-safe).  A comm thread that is
    refused waits on :attr:`changed` until an operation finishes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._on: dict[str, list[int]] = {}
        self._seq = 0
        self._ops: dict[int, tuple[int, tuple[str, ...]]] = {}
        self.changed = threading.Condition(self._lock)

    def admits(self, priority: int, links: Iterable[str]) -> bool:
        """:func:`admit` against what is in flight now."""
        with self._lock:
            return admit(priority, links, self._on)

    def add(self, priority: int, links: tuple[str, ...]) -> int:
        """Record an operation now in flight; returns its token for :meth:`remove`."""
        with self._lock:
            self._seq += 1
            self._ops[self._seq] = (priority, links)
            for link in links:
                self._on.setdefault(link, []).append(priority)
            return self._seq

    def remove(self, token: int) -> None:
        """The operation ``token`` finished: take it off its links, wake waiters."""
        with self._lock:
            priority, links = self._ops.pop(token)
            for link in links:
                self._on[link].remove(priority)
            self.changed.notify_all()


def plan_admits(plan) -> bool:
    """True when ``plan`` was scheduled with the ``topology`` switch (its notes say so):
    the runtime then admits every communication by :func:`admit`."""
    return any(n.startswith(ADMISSION_NOTE) for n in plan.notes)


#: The plan note the communication-scheduling pass writes for the ``topology`` switch.
ADMISSION_NOTE = "comm admission:"

#: The table of this process (threads backend: all workers; Ray: one host-actor).
PROCESS_TABLE = InFlight()
