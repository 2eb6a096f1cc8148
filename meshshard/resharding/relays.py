"""The relay bound: a host reached through a relay pays a second hop, or the holders send more.

The tight bound (:mod:`~meshshard.resharding.bound`) lets each destination host take
its data in ``k_h alpha + I_h / B`` (its smallest cover ``k_h`` of source hosts, its
ingress bytes ``I_h``) and lets a chain's second host overlap with its first, so where
more destination hosts need the data than source hosts hold it, the bound stays near
one message while every plan takes nearly two.  Two replicated holders of 62 KB (nine
6.8 KB slices) and three hosts that each need all of it: the tight bound allows 79.8
us, no schedule the runtime can run takes under 129.9 us (the term below), and the
best known takes 134.7 us (a chain of two plus a direct send, or each holder sending
one host all of it and the third host half).

**The argument** (the plans' and the runtime's execution model, as for the tight
bound: a worker runs one communication operation at a time and each is a rendezvous
of its members, who stay busy from its start until their own part is done; every
host-to-host edge pays the NIC latency ``alpha`` before its first chunk; an operation
has one *root*, a source host whose blocks it carries, and reaches destination hosts
as a chain: the root's one *depth-1* receiver, then hosts that forward what they got;
a destination host never originates a message; chunks are equal and at least
:data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`, so a message of ``b`` bytes
moves in chunks of at least ``c(b)`` = :func:`~meshshard.resharding.bound.smallest_chunk`).
Split the destination hosts ``R`` into ``D``, those that are the depth-1 receiver of
every operation they take part in, and the rest, each reached at depth 2 or more at
least once.  For every plan some split holds, so the plan takes at least the
*smallest*, over all splits, of the largest of these:

1. *A relayed host* ``h`` (not in ``D``) takes part in at least ``k_h`` operations
   (their roots cover its slices), carrying at least ``I_h`` bytes to it.  As depth-1
   receiver of an operation of ``b`` bytes it is busy ``>= alpha + b / B``; at depth
   ``d >= 2`` its first chunk crossed ``d`` edges and its last chunk one more after
   the first: ``>= 2 alpha + (b + c(b)) / B``.  So with two or more operations it is
   busy ``>= (max(k_h, 2) + 1) alpha + I_h / B``; with one (``k_h = 1``) that
   operation carries ``b >= I_h`` bytes and it is busy ``>= 2 alpha + g(I_h) / B``,
   ``g(x) = inf_{b >= x} (b + c(b))`` (:func:`relay_bytes`: ``c`` drops where ``b``
   crosses a multiple of the chunk, so a larger message can relay sooner).  The
   fan-out to its devices after that is left out.
2. *The direct hosts* ``D``: each ``h`` in ``D`` is the depth-1 receiver of at least
   ``k_h`` operations, at least ``K = sum k_h`` in all, distinct (an operation has one
   depth-1 receiver), carrying at least ``Y = sum I_h`` bytes; each keeps its root
   busy ``>= alpha + b / B``, and the ``s`` source hosts that hold anything run them
   one at a time.  If there are ``K + 1`` or more, the busiest root works
   ``>= ((K + 1) alpha + Y / B) / s``.  If exactly ``K``, each ``h`` in ``D`` has
   exactly ``k_h``; where ``k_h = 1`` that one carries ``>= I_h``.  These are jobs of
   at least ``alpha + I_h / B`` (or ``alpha`` each where ``k_h > 1``) on ``s``
   machines: the busiest works at least the average, the largest job, and, with more
   jobs than machines, the ``s``-th plus the ``(s + 1)``-th largest (two of the
   ``s + 1`` largest share a machine).

Cutting slices only adds operations, and host-level messages are operations of one
root, so both are covered; relays that forward several roots' blocks in one message
are not in the runtime (a destination host forwards only inside a chain).

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((36, 36, 12), "int32", MeshSpec(0, (2, 3), (0, 1)),
    ...                        ("device", None, None), MeshSpec(1, (3, 3), (2, 3, 4)),
    ...                        (None, "device", None))
    >>> print(relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    relay bound 129.905 us: relays, 3 hosts from 2 holders: 1 relayed, 2 direct, 2 messages

(One host relayed: ``2 alpha + g(62208) / B``, ``g`` = 87381 bytes, a message just
over two chunks; all three direct: ``(4 alpha + 3 I / B) / 2`` = 134.7 us.)
"""

from __future__ import annotations

import itertools
import math

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    smallest_chunk,
)
from meshshard.resharding.hops import hop_bound_terms
from meshshard.tiles import ReshardingProblem

__all__ = ["relay_bound", "relay_bound_terms", "relay_bytes", "relay_terms"]

_MAX_HOSTS = 12  # splits of the destination hosts tried: 2 ** hosts


def relay_bytes(nbytes: float) -> float:
    """``inf_{b >= nbytes} (b + c(b))``, ``c`` :func:`~meshshard.resharding.bound.smallest_chunk`:
    ``b + b / m`` rises on each ``((m - 1) C, m C]``, so the infimum is at ``nbytes``
    or just past the next multiple of the chunk ``C``.

    >>> relay_bytes(1000), relay_bytes(32 << 10), relay_bytes(62208)
    (2000.0, 49152.0, 87381.33333333333)
    """
    m = max(1, math.ceil(nbytes / MIN_CHUNK_BYTES))
    return min(nbytes + smallest_chunk(nbytes), m * MIN_CHUNK_BYTES * (m + 2) / (m + 1))


def _relayed(k: int, nbytes: int, lat: float, bw: float) -> float:
    """Seconds a destination host reached at depth 2 or more at least once is busy (1.)."""
    many = (max(k, 2) + 1) * lat + nbytes / bw
    if k > 1:
        return many
    return min(many, 2 * lat + relay_bytes(nbytes) / bw)


def _direct(hosts: list[tuple[int, int]], senders: int, lat: float, bw: float) -> float:
    """Seconds the busiest root works for destination hosts that are depth-1 receivers
    of all their operations, ``(k_h, I_h)`` each (2.)."""
    if not hosts:
        return 0.0
    k = sum(kh for kh, _ in hosts)
    y = sum(n for _, n in hosts) / bw
    more = ((k + 1) * lat + y) / senders
    jobs = sorted((j for kh, n in hosts for j in ([lat + n / bw] if kh == 1 else [lat] * kh)))
    jobs.reverse()
    exact = max((k * lat + y) / senders, jobs[0])
    if len(jobs) > senders:
        exact = max(exact, jobs[senders - 1] + jobs[senders])
    return min(more, exact)


def relay_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The relay term (module docstring), from ``tight``'s ingress terms (``slices`` is
    the host's smallest cover ``k_h``, ``nbytes`` its ingress); empty where there are
    too many destination hosts to try every split."""
    ingress = [t for t in tight.terms if t.side == "ingress" and not t.detail]
    senders = len({h for n in problem.needs for h, _ in n.holders})
    if not ingress or len(ingress) > _MAX_HOSTS:
        return []
    lat, bw = tight.latency, tight.bandwidth
    relayed = [_relayed(t.slices, t.nbytes, lat, bw) for t in ingress]
    best, how = math.inf, ""
    for mask in itertools.product((True, False), repeat=len(ingress)):
        direct = [(t.slices, t.nbytes) for t, d in zip(ingress, mask, strict=True) if d]
        seconds = _direct(direct, senders, lat, bw)
        seconds = max([seconds] + [r for r, d in zip(relayed, mask, strict=True) if not d])
        if seconds < best:
            best, how = seconds, _split_name(mask, direct, senders, lat, bw)
    detail = f"{len(ingress)} hosts from {senders} holders: {how}"
    return [BoundTerm("relays", sum(t.nbytes for t in ingress), 0, len(ingress), best, detail)]


def _split_name(mask, direct, senders: int, lat: float, bw: float) -> str:
    """What the best split is: how many hosts relayed, and the direct hosts' case."""
    relayed = sum(1 for d in mask if not d)
    if not direct:
        return f"{relayed} relayed"
    k = sum(kh for kh, _ in direct)
    more = ((k + 1) * lat + sum(n for _, n in direct) / bw) / senders
    case = f"{k + 1}+ messages" if _direct(direct, senders, lat, bw) == more else f"{k} messages"
    head = "all direct" if not relayed else f"{relayed} relayed, {len(direct)} direct"
    return f"{head}, {case}"


def relay_bound_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> LowerBound:
    """The hop bound's terms (the tight bound's and the hop term) and the relay term;
    the bound is their maximum."""
    hop = hop_bound_terms(problem, cluster)
    terms = hop.terms + tuple(relay_terms(problem, cluster, hop))
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, hop.latency, hop.bandwidth, terms, kind="relay")


def relay_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan in the tight bound's execution model can finish: at
    least :func:`~meshshard.resharding.hops.hop_bound` (module docstring)."""
    return relay_bound_terms(problem, cluster).seconds
