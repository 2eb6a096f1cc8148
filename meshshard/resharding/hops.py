"""The hop bound: small multicasts to more hosts than hold the data need more rounds.

The tight bound (:mod:`~meshshard.resharding.bound`) charges each host its own
messages and each slice its own chain, as if they could all overlap.  Where fewer
source hosts hold the data than destination hosts need it, they cannot: with ``N``
hosts taking part, at most ``N // 2`` host pairs talk at once.  Two source hosts
``A``, ``B`` and three destination hosts that each need data of both take 6
deliveries; 5 hosts make at most 2 disjoint pairs, so 3 message latencies, where the
tight bound allows 2.

**The argument** (the plans' and the runtime's execution model, as for the tight
bound: a worker runs one communication at a time and each pays the NIC latency
``alpha`` before its bytes move; a message carries blocks of one source host, its
*root*; a destination host forwards bytes only inside a chain broadcast; chunks are
at least :data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`).  Call a *hop* the
transfer of one chunk between two hosts (over all their NICs).

1. *Deliveries.*  Destination host ``h`` must take in hops whose roots together hold
   every slice it needs, so at least ``k_h`` hops (the smallest cover,
   :func:`~meshshard.resharding.bound.min_senders`), which carry at least its
   ingress bytes ``I_h``.  A hop of ``b`` bytes lasts at least ``alpha + b / B``.  So
   the hops into destination hosts last ``W >= sum_h (k_h alpha + I_h / B)`` in all.
2. *One hop per host at a time.*  If every message that more than one host receives
   fits in one chunk (each source host holds at most one chunk of the slices that
   several hosts need), a chain is store-and-forward: a host's hop out starts after
   its hop in ended.  With one operation at a time, each host is then an end of at
   most one hop at any moment, so the hops running at once form a matching: at most
   ``M = min(|R|, N // 2)`` of them, ``R`` the destination hosts that need data
   (each counted hop has its receiver there), ``N`` the hosts of both meshes.
3. *Nobody relays before it received.*  Before ``alpha`` no destination host has
   finished a hop in, so only source hosts send: at most ``M0 = min(|S|, M)`` hops.

So ``W <= M0 min(T, alpha) + M max(0, T - alpha)``, which gives ``T``.  Plans that
cut slices only add hops, so they are bound too.  Where the condition of 2 fails
(a chain of several chunks overlaps a host's hop in with its hop out) or ``M`` is not
below ``|R|`` the term is left out: the tight bound's per-host terms then say as much.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((136, 68), "int8", MeshSpec(0, (2, 1), (0, 1)), (None, "host"),
    ...                        MeshSpec(1, (3, 4), (2, 3, 4)), ("device", None))
    >>> print(hop_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    hop bound 106.098 us: hops, 6 into 3 hosts, at most 2 at once, then a fan-out (5.000 us)
"""

from __future__ import annotations

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    landing_hosts,
    tight_bound_terms,
)
from meshshard.resharding.result import fmt_seconds
from meshshard.tiles import ReshardingProblem

__all__ = ["hop_bound", "hop_bound_terms", "hop_terms", "one_chunk_relays"]


def one_chunk_relays(problem: ReshardingProblem) -> bool:
    """Whether every message that several hosts receive fits in one chunk: each source
    host holds at most :data:`MIN_CHUNK_BYTES` of the slices that several destination
    hosts need (such a message carries only blocks its root holds and all its
    receivers need)."""
    shared: dict[int, int] = {}
    for need in problem.needs:
        if len({h for h, _ in need.receivers}) < 2:
            continue
        for s in {h for h, _ in need.holders}:
            shared[s] = shared.get(s, 0) + need.nbytes(problem.itemsize)
    return all(n <= MIN_CHUNK_BYTES for n in shared.values())


def makespan(work: float, first: float, at_first: int, at_once: int) -> float:
    """Smallest ``T`` with ``work <= at_first min(T, first) + at_once max(0, T - first)``.

    >>> makespan(6.0, 1.0, 2, 2), makespan(3.0, 1.0, 1, 2), makespan(0.5, 1.0, 1, 2)
    (3.0, 2.0, 0.5)
    """
    if work <= at_first * first:
        return work / at_first
    return first + (work - at_first * first) / at_once


def hop_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The hop term (module docstring), from ``tight``'s ingress terms (``slices`` is
    the host's smallest cover ``k_h``, ``nbytes`` its ingress); empty where it does not
    apply."""
    ingress = [t for t in tight.terms if t.side == "ingress" and not t.detail]
    senders = {h for n in problem.needs for h, _ in n.holders}
    hosts = len(problem.src.hosts) + len(problem.dst.hosts)
    at_once = min(len(ingress), hosts // 2)
    if not ingress or at_once >= len(ingress) or not one_chunk_relays(problem):
        return []
    hops = sum(t.slices for t in ingress)
    nbytes = sum(t.nbytes for t in ingress)
    work = hops * tight.latency + nbytes / tight.bandwidth
    seconds = makespan(work, tight.latency, min(len(senders), at_once), at_once)
    landing = landing_hosts(problem, cluster, tight)
    tail = min([tight.latency / at_once] + [landing.get(t.members[0], 0.0) for t in ingress])
    detail = f"{hops} into {len(ingress)} hosts, at most {at_once} at once"
    if tail > 0:
        detail += f", then a fan-out ({fmt_seconds(tail)})"
    term = BoundTerm("hops", nbytes, hops, len(ingress), seconds + tail, detail)
    return [term]


def hop_bound_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> LowerBound:
    """The tight bound's terms and the hop term; the bound is their maximum."""
    tight = tight_bound_terms(problem, cluster)
    terms = tight.terms + tuple(hop_terms(problem, cluster, tight))
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, tight.latency, tight.bandwidth, terms, kind="hop")


def hop_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan in the tight bound's execution model can finish: at
    least :func:`~meshshard.resharding.bound.tight_bound`, higher where the hop term
    applies (module docstring)."""
    return hop_bound_terms(problem, cluster).seconds
