"""A shared root: a source host that alone holds slices two destination hosts need.

The ingress last hop (:func:`~meshshard.resharding.lasthop.ingress_hop_terms`) holds
only where every message into a host lands whole; a host with a source host whose
share is over a chunk could end with that message, whose fan-out pipelines, and take
no hop.  But it can end with it only after every other message into it, and where a
third source host ``r`` alone holds slices that two hosts need, one of the two gets
``r``'s last byte late: ``float32[228, 114] (3, 1) P('host', 'device') -> (2, 3)
P('host', 'device')`` is allowed 101.6 us by the ingress term, but the host that
``r`` serves second ends its big message no sooner than 144 us, so it ends with
``r``'s message and a hop (106.6 us).

**The argument** (:mod:`~meshshard.resharding.lasthop`'s execution model: a worker
runs one operation at a time, busy ``>= alpha + b / B`` in each; one root per
operation, a source host; a message of at most one chunk, :data:`MIN_CHUNK_BYTES`,
lands whole on one device before it goes on).  Take a source host ``r`` and two
destination hosts ``X != Y`` that each need slices only ``r`` holds (``U`` bytes in
all, counted once), where each message from ``r`` straight to ``X`` or ``Y`` is at
most a chunk (``r``'s share of each, once per device, is).  Only ``r``'s operations
carry those slices.  If one operation reaches both hosts, one is at depth 2 and gets
its last byte of it ``>= 2 alpha + U / B``; otherwise ``r`` runs two or more and the
last ends ``>= 2 alpha + U / B``.  So some ``h`` in ``{X, Y}`` ends an operation from
``r`` at ``t >= T = 2 alpha + U / B``.  Let ``O`` be ``h``'s last operation and
``E_h = k_h alpha + I_h / B`` its ingress term; ``hop = min(alpha, intra_latency)``:

1. ``O`` reaches a second host, or ``h`` at depth 2: ``h`` is busy ``2 alpha`` in it,
   so ``>= E_h + alpha``;
2. ``O`` goes to ``h`` only and is over a chunk: it is not from ``r``, so it starts
   after ``t`` and the plan ends ``>= T + alpha + MIN_CHUNK_BYTES / B``;
3. ``O`` goes to ``h`` only, at most a chunk, for two devices or more, or a local
   all-gather follows: it lands on one device and crosses the fabric: ``>= E_h +
   intra_latency``;
4. ``O`` is for one device of ``h`` and no all-gather follows: where no smallest
   cover can send ``h`` such a message last
   (:func:`~meshshard.resharding.bound.single_device_last`), ``h`` takes ``k_h + 1``
   operations: ``>= E_h + alpha``.

So the plan ends ``>= min over h in {X, Y} of min(E_h + hop, T + alpha +
MIN_CHUNK_BYTES / B)`` (only hosts where 4. applies; else no term), and the term is the
largest of that over ``(r, X, Y)``.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> from meshshard.resharding.relays import relay_bound_terms
    >>> p = resharding_problem((228, 114), "float32", MeshSpec(0, (3, 1), (0, 1, 2)),
    ...                        ("host", "device"), MeshSpec(1, (2, 3), (3, 4)),
    ...                        ("host", "device"))
    >>> b = relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge"))
    >>> print(b)
    relay bound 106.587 us: w1 shared by w3 and w4, 33.8 KiB only it holds
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    by_receiver_host,
    single_device_last,
)
from meshshard.resharding.result import fmt_bytes
from meshshard.tiles import ReshardingProblem

__all__ = ["shared_root_terms"]

_MAX_SOURCE_HOSTS = 16  # smallest covers tried, as in the last-hop terms


@dataclass(frozen=True)
class _Shares:
    """Per destination host: its ``(holder hosts, devices)`` per slice; per ``(source
    host, destination host)``: bytes held, once per device, and the slices only it holds."""

    slices: dict[int, list[tuple[frozenset[int], frozenset[int]]]] = field(default_factory=dict)
    per_device: dict[tuple[int, int], int] = field(default_factory=dict)
    only: dict[tuple[int, int], set[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, problem: ReshardingProblem) -> _Shares:
        """The shares of ``problem``'s slices (numbered in ``problem.needs``)."""
        out = cls()
        for i, need in enumerate(problem.needs):
            nbytes = need.nbytes(problem.itemsize)
            holders = frozenset(h for h, _ in need.holders)
            for h, devs in by_receiver_host(need.receivers).items():
                out.slices.setdefault(h, []).append((holders, devs))
                for r in holders:
                    out.per_device[(r, h)] = out.per_device.get((r, h), 0) + nbytes * len(devs)
                if len(holders) == 1:
                    out.only.setdefault((next(iter(holders)), h), set()).add(i)
        return out


def _ends(shares: _Shares, hosts: tuple[int, ...], tight: LowerBound) -> dict[int, float]:
    """``{host: E_h}`` for each destination host where case 4. of the module docstring
    applies (no smallest cover can send it a message for one device last)."""
    out = {}
    for t in tight.terms:
        if t.side != "ingress" or t.detail:
            continue
        h = t.members[0]
        if h in shares.slices and not single_device_last(shares.slices[h], t.slices, hosts):
            out[h] = t.seconds
    return out


def shared_root_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The best shared-root term (module docstring) from ``tight``'s ingress terms, as a
    one-item list; empty where no source host qualifies or it adds nothing to them."""
    if len(problem.src.hosts) > _MAX_SOURCE_HOSTS:
        return []
    shares = _Shares.of(problem)
    ends = _ends(shares, problem.src.hosts, tight)
    lat, bw = tight.latency, tight.bandwidth
    hop = float(min(cluster.nic_latency, cluster.intra_latency))
    best: tuple[float, str, int] | None = None
    for r in problem.src.hosts:
        served = [
            h
            for h in sorted(ends)
            if shares.only.get((r, h)) and shares.per_device[(r, h)] <= MIN_CHUNK_BYTES
        ]
        for x, y in itertools.combinations(served, 2):
            only = shares.only[(r, x)] | shares.only[(r, y)]
            u = sum(problem.needs[i].nbytes(problem.itemsize) for i in only)
            late = 2 * lat + u / bw + lat + MIN_CHUNK_BYTES / bw
            seconds = min(min(ends[h] + hop, late) for h in (x, y))
            if best is None or seconds > best[0]:
                best = (seconds, f"w{r} shared by w{x} and w{y}", u)
    if best is None or best[0] <= max(ends.values(), default=0.0):
        return []
    seconds, name, u = best
    detail = f"{fmt_bytes(u)} only it holds"
    return [BoundTerm(name, u, 2, 2, seconds, detail)]
