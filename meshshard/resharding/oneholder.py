"""The one-holder term: one source host broadcasts the same data to every destination host.

The relay bound (:mod:`~meshshard.resharding.relays`) splits the destination hosts into
those reached directly and those that relay; where two or more operations reach the
relaying hosts it only counts the holders' latencies and bytes.  With a single holder
that is loose: one source host that holds a 148 KB array which three hosts need whole
(``float32[21, 21, 84] (1, 1) -> (3, 4)``) is allowed 202.2 us, but every schedule
takes 256.2 us (a chain through the three hosts), and the relay bound's weak branch
cannot see it: it does not know that every host still needs every byte.

**The family**: every slice that any destination host needs is held by one source host
``r`` only, and each of the ``m >= 2`` destination hosts that need data needs every
slice (``U`` bytes; ``V_h`` the bytes its devices need added up, ``V = min V_h``).

**The argument** (the relay bound's execution model: one operation at a time per worker,
each a rendezvous whose members stay busy from its start until their own part is done;
one root per operation, here always ``r``, which is busy ``>= alpha + b / B`` in an
operation of ``b`` bytes; a chain's host at depth ``j`` gets its last byte ``>= j alpha
+ (b + (j - 1) c(b)) / B`` after the operation starts, ``c`` =
:func:`~meshshard.resharding.bound.smallest_chunk`; a host receives only what its
devices need).  Call an operation *full* if its chain reaches all ``m`` hosts.  An
element no full operation carries reaches the ``m`` hosts through two operations or
more, so ``r`` sends it twice or more.  Exactly one of these holds:

A. *One full operation carries every element*: it carries ``U <= b <= V`` bytes, and
   its last host is done ``>= m alpha + g(U, V) / B``, ``g(x, y) = inf_{x <= b <= y} (b
   + (m - 1) c(b))`` (:func:`~meshshard.resharding.bound.relay_bytes`).
B. *No full operation*: ``r`` runs two or more and sends every element twice:
   ``>= 2 alpha + 2 U / B``; where each host takes at most one chunk for two devices
   or more, its last operation still needs one hop after that
   (:mod:`~meshshard.resharding.lasthop`).
C. *One full operation, carrying ``b >= F`` bytes of ``F < U`` elements*: ``r`` runs it
   and two or more others and sends ``>= b + 2 (U - F) >= 2 U - F`` bytes: ``>= 3 alpha
   + (2 U - F) / B``; the full operation's last host is busy ``>= m alpha + (b + (m - 1)
   c(b)) / B`` in it and takes the other ``U - F`` bytes in one operation or more
   (before or after it, one at a time): ``>= (m + 1) alpha + (U + (m - 1) c_F) / B``, ``c_F = inf_{F <= b <= V} c(b)``
   (:func:`~meshshard.resharding.bound.least_chunk`).  The first falls as ``F`` grows
   and the second does not, so for every ``F*`` the smaller of the two at ``F*`` is a
   bound for all ``F``: the term takes the best ``F*`` on a grid.
D. *Two full operations or more*: all ``m`` hosts take part in both, so the second
   starts after the first one's last host is done, and its own last host is done ``>= 2
   m alpha + F / B`` (the two carry the ``F`` elements of full operations); with ``F <
   U`` ``r`` also runs two more and sends ``>= 2 U - F``: ``>= 4 alpha + (2 U - F) /
   B``.  So ``>= max(2 m alpha, (m + 2) alpha + U / B)`` (the larger of the two is at
   least their average).

The term is the smallest of the four.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((21, 21, 84), "float32", MeshSpec(0, (1, 1), (0,)),
    ...                        ("host", None, None), MeshSpec(1, (3, 4), (1, 2, 3)),
    ...                        (None, None, "device"))
    >>> from meshshard.resharding.relays import relay_bound_terms
    >>> print(relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    relay bound 255.957 us: one holder, 3 hosts need all 144.7 KiB: one chain through all

(The relay term allows 202.2 us; the chain through the three hosts takes 256.0 us, and
B, C and D allow no less than 297.1, 273.8 and 268.5 us; the plan takes 256.2 us, the
last 0.2 us its fan-out.)
"""

from __future__ import annotations

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    least_chunk,
    relay_bytes,
)
from meshshard.resharding.lasthop import last_hop
from meshshard.resharding.result import fmt_bytes
from meshshard.tiles import ReshardingProblem

__all__ = ["one_holder_family", "one_holder_seconds", "one_holder_terms"]

_GRID = 256  # points F* tried in case C, besides the multiples of the chunk


def one_holder_family(problem: ReshardingProblem) -> tuple[int, int, int] | None:
    """``(m, U, V)`` where the problem is in the family (module docstring), else None:
    one source host holds every slice and every receiving host needs every slice."""
    roots = {h for n in problem.needs for h, _ in n.holders}
    hosts = {h for n in problem.needs for h, _ in n.receivers}
    if len(roots) != 1 or len(hosts) < 2:
        return None
    most = dict.fromkeys(hosts, 0)
    total = 0
    for need in problem.needs:
        if {h for h, _ in need.receivers} != hosts:
            return None
        nbytes = need.nbytes(problem.itemsize)
        total += nbytes
        for h, _ in need.receivers:
            most[h] += nbytes
    return len(hosts), total, min(most.values())


def _one_full_some_elements(m: int, total: int, most: int, lat: float, bw: float) -> float:
    """Case C: the best ``F*`` of ``min(3 alpha + (2 U - F*) / B, (m + 1) alpha + (U +
    (m - 1) c_F*) / B)`` over a grid (any grid gives a valid bound)."""
    points = {total * i / _GRID for i in range(_GRID + 1)}
    k = 1
    while k * MIN_CHUNK_BYTES < total:
        points |= {k * MIN_CHUNK_BYTES, k * MIN_CHUNK_BYTES + 1}
        k += 1
    best = 0.0
    for f in sorted(points):
        holder = 3 * lat + (2 * total - f) / bw
        last = (m + 1) * lat + (total + (m - 1) * least_chunk(f, most)) / bw
        best = max(best, min(holder, last))
    return best


def one_holder_seconds(
    m: int, total: int, most: int, lat: float, bw: float, hop: float = 0.0
) -> tuple[float, str]:
    """The term's seconds for ``m`` hosts that each need ``total`` bytes, at most
    ``most`` each, from one holder (module docstring), and which case is smallest;
    ``hop`` (:func:`~meshshard.resharding.lasthop.last_hop`) is added to case B."""
    cases = {
        "one chain through all": m * lat + relay_bytes(total, most, m - 1) / bw,
        "no chain through all": 2 * lat + 2 * total / bw + hop,
        "one partial chain through all": _one_full_some_elements(m, total, most, lat, bw),
        "two chains through all": max(2 * m * lat, (m + 2) * lat + total / bw),
    }
    how = min(cases, key=cases.__getitem__)
    return cases[how], how


def one_holder_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The one-holder term (module docstring) with ``tight``'s latency and bandwidth;
    empty where the problem is not in the family."""
    family = one_holder_family(problem)
    if family is None:
        return []
    m, total, most = family
    hop = last_hop(problem, cluster, tight)
    seconds, how = one_holder_seconds(m, total, most, tight.latency, tight.bandwidth, hop)
    detail = f"{m} hosts need all {fmt_bytes(total)}: {how}"
    return [BoundTerm("one holder", total, 0, m, seconds, detail)]
