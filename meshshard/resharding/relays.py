"""The relay bound: a host reached through a relay pays a second hop, or the holders send more.

The tight bound (:mod:`~meshshard.resharding.bound`) lets each destination host take
its data in ``k_h alpha + I_h / B`` (its smallest cover ``k_h`` of source hosts, its
ingress bytes ``I_h``) and lets a chain's second host overlap with its first, so where
more destination hosts need the data than source hosts hold it, the bound stays near
one message while every plan takes nearly two.  Two replicated holders of 62 KB (nine
6.8 KB slices) and three hosts that each need all of it: the tight bound allows 79.8
us, but no schedule the runtime can run takes under 134.7 us, the relay bound (the
example below); a chain of two hosts plus a direct send takes that, and so does each
holder sending one host all of it and the third host half.

**The argument** (the plans' and the runtime's execution model, as for the tight
bound: a worker runs one communication operation at a time and each is a rendezvous
of its members, who stay busy from its start until their own part is done; every
host-to-host edge pays the NIC latency ``alpha`` before its first chunk; an operation
has one *root*, a source host whose blocks it carries, and reaches destination hosts
as a chain: the root's one *depth-1* receiver, then hosts that forward what they got;
a destination host never originates a message; chunks are equal and at least
:data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`, so a message of ``b`` bytes
moves in chunks of at least ``c(b)`` = :func:`~meshshard.resharding.bound.smallest_chunk`).
A destination host only receives what its devices need, each element once per device
(:func:`~meshshard.resharding.coverage.check_messages`), so host ``h`` takes between
``I_h`` and ``V_h`` bytes in all (``V_h`` its devices' tiles added up).

Split the destination hosts ``R`` into ``D``, those that are the depth-1 and last
receiver of every operation they take part in (a point-to-point message, or a chain of
one host), and the rest, each a forwarder or reached at depth 2 or more at least once.
For every plan some split holds, so the plan takes at least the *smallest*, over all
splits, of the largest of these:

0. *Never one relay*: an operation that relays has a forwarder and a host beyond it,
   both outside ``D``, so the rest is empty or has two hosts or more; and both need
   the operation's blocks (a host receives only what its devices need), so each host
   of the rest needs a slice that another host of the rest needs.
1. *A relaying host* ``h`` (not in ``D``) takes part in at least ``k_h`` operations
   (their roots cover its slices), carrying at least ``I_h`` bytes to it.  As the
   last, depth-1 receiver of ``b`` bytes it is busy ``>= alpha + b / B``; as a
   forwarder or at depth ``d >= 2`` the last chunk crosses two edges after the first
   chunk crossed them: ``>= 2 alpha + (b + c(b)) / B``.  So with two or more
   operations it is busy ``>= (max(k_h, 2) + 1) alpha + I_h / B``; with one
   (``k_h = 1``) that operation carries ``I_h <= b <= V_h`` bytes and it is busy
   ``>= 2 alpha + g(I_h, V_h) / B``, ``g(x, y) = inf_{x <= b <= y} (b + c(b))``
   (:func:`relay_bytes`: ``c`` drops where ``b`` crosses a multiple of the chunk, so a
   larger message can relay sooner).  Where ``k_h > 1`` and it takes exactly ``k_h``
   operations, their roots are distinct and make a smallest cover ``C``, so the one
   from ``r`` carries at least the bytes of ``h``'s slices that only ``r`` holds in
   ``C``, and the relaying one adds at least the least chunk such an operation can
   have (:func:`least_chunk`, over every smallest cover and root); with more
   operations it pays one latency more.  The fan-out to its devices is left out.
2. *The holders' work*: each ``h`` in ``D`` is the depth-1 receiver of at least
   ``k_h`` operations carrying at least ``I_h`` bytes; the operations that reach the
   rest have their depth-1 receiver in the rest (a host of ``D`` forwards nothing), at
   least ``k* = max k_h`` of them carrying at least ``I* = max I_h`` over the rest.
   So at least ``K = sum k_h + k*`` operations (an operation has one depth-1
   receiver), carrying ``Y = sum I_h + I*`` bytes; each keeps its root busy ``>= alpha
   + b / B``, and the ``s`` source hosts that hold anything run them one at a time.
   With ``K + 1`` or more the busiest root works ``>= ((K + 1) alpha + Y / B) / s``.
   With exactly ``K`` each ``h`` in ``D`` has exactly ``k_h`` and the rest exactly
   ``k*``; a group with one operation gets it all (``>= I_h``, ``>= I*``).  These are
   jobs of at least ``alpha + I / B`` (or ``alpha`` each where ``k > 1``) on ``s``
   machines: the busiest works at least the average, the largest job, and, with more
   jobs than machines, the ``s``-th plus the ``(s + 1)``-th largest (two of the
   ``s + 1`` largest share a machine).  And where the rest has ``m`` hosts and one
   operation, it is one chain through them all: its last host, at depth ``m``, is
   done ``>= m alpha + (b + (m - 1) c(b)) / B`` with ``b`` at least every ``I_h`` and
   at most every ``V_h`` of the rest.  Where every host is in ``D`` and takes at most
   one chunk, the roots' last messages still land and hop
   (:mod:`~meshshard.resharding.lasthop`).

Cutting slices only adds operations, and host-level messages are operations of one
root, so both are covered; relays that forward several roots' blocks in one message
are not in the runtime (a destination host forwards only inside a chain).

The relay bound also takes, where one source host holds everything and every
destination host needs all of it, the one-holder term
(:mod:`~meshshard.resharding.oneholder`): there the split above only counts the
holder's latencies and bytes once two operations reach the relaying hosts.  And it
takes the shared-root term (:mod:`~meshshard.resharding.sharedroot`): a host's last
message hops unless it is a big one, which one of two hosts that a third source host
alone serves can take only late.  And the two-roots term
(:mod:`~meshshard.resharding.tworoots`): where two source hosts' chains must meet, the
split above lets a relaying host take one relayed and one direct operation, but then
one of the two roots sends every host its bytes apart, or a shared host forwards twice.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((36, 36, 12), "int32", MeshSpec(0, (2, 3), (0, 1)),
    ...                        ("device", None, None), MeshSpec(1, (3, 3), (2, 3, 4)),
    ...                        (None, "device", None))
    >>> print(relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    relay bound 134.650 us: relays, 3 hosts from 2 holders: all direct, 4+ messages

(All three direct: ``(4 alpha + 3 I / B) / 2``; two relaying: ``2 alpha + (I + c) / B``
each, a 62,208-byte message in two chunks, no device of theirs taking more than a third
of it: both 134.7 us.)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    BoundTerm,
    LowerBound,
    least_chunk,
    relay_bytes,
)
from meshshard.resharding.cleanlast import clean_last_terms
from meshshard.resharding.hops import hop_bound_terms
from meshshard.resharding.lasthop import direct_hop, ingress_hop_terms, last_hop_terms
from meshshard.resharding.oneholder import one_holder_terms
from meshshard.resharding.sharedroot import shared_root_terms
from meshshard.resharding.tworoots import two_roots_terms
from meshshard.tiles import ReshardingProblem

__all__ = ["least_chunk", "relay_bound", "relay_bound_terms", "relay_bytes", "relay_terms"]

_MAX_HOSTS = 12  # splits of the destination hosts tried: 2 ** hosts


@dataclass(frozen=True)
class _Host:
    """A destination host: its smallest cover ``k``, ingress ``least``, the most bytes
    it can take, ``most``, and, where ``k > 1``, the least chunk its relaying operation
    can have if it takes exactly ``k`` (module docstring, 1.)."""

    k: int
    least: int
    most: int
    chunk: float = 0.0
    peers: frozenset[int] = frozenset()
    """The other destination hosts that need a slice it needs (0.)."""
    host: int = -1


def _exclusive_chunk(slices, k: int, most: int, hosts: tuple[int, ...]) -> float:
    """Over the smallest covers ``C`` of ``slices`` (``(holder hosts, bytes)``) and their
    roots ``r``, the least chunk of an operation from ``r`` that carries at least the
    bytes only ``r`` holds in ``C``."""
    best = math.inf
    for cover in itertools.combinations(hosts, k):
        if not all(holders & set(cover) for holders, _ in slices):
            continue
        for r in cover:
            mine = sum(n for holders, n in slices if holders & set(cover) == {r})
            best = min(best, least_chunk(mine, most) if mine else 0.0)
    return 0.0 if best == math.inf else best


def _hosts(problem: ReshardingProblem, tight: LowerBound) -> list[_Host]:
    """One :class:`_Host` per destination host that needs data, from ``tight``'s
    ingress terms (``slices`` is the smallest cover, ``nbytes`` the ingress)."""
    most: dict[int, int] = {}
    slices: dict[int, list[tuple[frozenset[int], int]]] = {}
    peers: dict[int, set[int]] = {}
    for need in problem.needs:
        nbytes = need.nbytes(problem.itemsize)
        holders = frozenset(h for h, _ in need.holders)
        receiving = {h for h, _ in need.receivers}
        for h, _ in need.receivers:
            most[h] = most.get(h, 0) + nbytes
        for h in receiving:
            slices.setdefault(h, []).append((holders, nbytes))
            peers.setdefault(h, set()).update(receiving - {h})
    out = []
    for t in tight.terms:
        if t.side != "ingress" or t.detail:
            continue
        h = t.members[0]
        chunk = 0.0
        if 1 < t.slices and len(problem.src.hosts) <= _MAX_HOSTS:
            chunk = _exclusive_chunk(slices[h], t.slices, most[h], problem.src.hosts)
        out.append(_Host(t.slices, t.nbytes, most[h], chunk, frozenset(peers[h]), h))
    return out


def _relays_possible(rest: list[_Host]) -> bool:
    """Whether ``rest`` can be the hosts that relay (0.): none, or each with another
    host of ``rest`` that needs a slice it needs."""
    inside = {h.host for h in rest}
    return all(h.peers & inside for h in rest)


def _relaying(h: _Host, lat: float, bw: float) -> float:
    """Seconds a destination host that forwards or is reached at depth 2 or more at
    least once is busy (1.)."""
    if h.k > 1:
        return h.least / bw + min((h.k + 2) * lat, (h.k + 1) * lat + h.chunk / bw)
    many = 3 * lat + h.least / bw
    return min(many, 2 * lat + relay_bytes(h.least, h.most) / bw)


def _more(groups: list[tuple[int, int]], senders: int, lat: float, bw: float) -> float:
    """The busiest root's work with one operation more than the groups need (2.)."""
    k = sum(kh for kh, _ in groups)
    return ((k + 1) * lat + sum(n for _, n in groups) / bw) / senders


def _exact(groups: list[tuple[int, int]], senders: int, lat: float, bw: float) -> float:
    """The busiest root's work where each group, ``(k, I)``, has exactly ``k``
    operations (2.): the average, the largest job, two of the ``s + 1`` largest."""
    k = sum(kh for kh, _ in groups)
    jobs = sorted((j for kh, n in groups for j in ([lat + n / bw] if kh == 1 else [lat] * kh)))
    jobs.reverse()
    out = max((k * lat + sum(n for _, n in groups) / bw) / senders, jobs[0])
    if len(jobs) > senders:
        out = max(out, jobs[senders - 1] + jobs[senders])
    return out


def _split(
    direct: list[_Host], rest: list[_Host], senders: int, lat: float, bw: float, hop: float
) -> tuple[float, str]:
    """The bound for one split (module docstring) and what binds it; ``hop`` is what
    each root's last message still needs where every host is direct
    (:func:`~meshshard.resharding.lasthop.direct_hop`)."""
    groups = [(h.k, h.least) for h in direct]
    if rest:
        groups.append((max(h.k for h in rest), max(h.least for h in rest)))
    exact = _exact(groups, senders, lat, bw)
    if rest and groups[-1][0] == 1:  # exactly one operation: a chain through the rest
        m = len(rest)
        b = relay_bytes(groups[-1][1], min(h.most for h in rest), m - 1)
        exact = max(exact, m * lat + b / bw)
    more = _more(groups, senders, lat, bw)
    if not rest:
        exact, more = exact + hop, more + (senders - 1) * hop / senders
    seconds = max([min(exact, more)] + [_relaying(h, lat, bw) for h in rest])
    k = sum(kh for kh, _ in groups)
    head = f"{len(rest)} relaying, {len(direct)} direct" if rest else "all direct"
    tail = ", then a hop" if hop and not rest else ""
    return seconds, f"{head}, {k if exact <= more else f'{k + 1}+'} messages{tail}"


def relay_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The relay term (module docstring) from ``tight``'s ingress terms; empty where
    there are too many destination hosts to try every split."""
    hosts = _hosts(problem, tight)
    senders = len({h for n in problem.needs for h, _ in n.holders})
    if not hosts or len(hosts) > _MAX_HOSTS:
        return []
    lat, bw = tight.latency, tight.bandwidth
    hop = direct_hop(problem, cluster, tight)
    best, how = math.inf, ""
    for mask in itertools.product((True, False), repeat=len(hosts)):
        rest = [h for h, d in zip(hosts, mask, strict=True) if not d]
        if not _relays_possible(rest):
            continue  # 0.
        direct = [h for h, d in zip(hosts, mask, strict=True) if d]
        seconds, what = _split(direct, rest, senders, lat, bw, hop)
        if seconds < best:
            best, how = seconds, what
    detail = f"{len(hosts)} hosts from {senders} holders: {how}"
    nbytes = sum(h.least for h in hosts)
    return [BoundTerm("relays", nbytes, 0, len(hosts), best, detail)]


def relay_bound_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> LowerBound:
    """The hop bound's terms (the tight bound's and the hop term), the relay term, for
    one holder the one-holder term (:mod:`~meshshard.resharding.oneholder`), and the
    last-hop terms (:mod:`~meshshard.resharding.lasthop`,
    :mod:`~meshshard.resharding.cleanlast`, :mod:`~meshshard.resharding.sharedroot`)
    and the two-roots term (:mod:`~meshshard.resharding.tworoots`); the bound is their
    maximum."""
    hop = hop_bound_terms(problem, cluster)
    extra = relay_terms(problem, cluster, hop) + one_holder_terms(problem, cluster, hop)
    extra += last_hop_terms(problem, cluster, hop) + ingress_hop_terms(problem, cluster, hop)
    extra += clean_last_terms(problem, cluster, hop) + shared_root_terms(problem, cluster, hop)
    extra += two_roots_terms(problem, cluster, hop)
    terms = hop.terms + tuple(extra)
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, hop.latency, hop.bandwidth, terms, kind="relay")


def relay_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan in the tight bound's execution model can finish: at
    least :func:`~meshshard.resharding.hops.hop_bound` (module docstring)."""
    return relay_bound_terms(problem, cluster).seconds
