"""Two roots that both relay share a destination host, which then forwards twice.

The relay term (:mod:`~meshshard.resharding.relays`) charges a relaying host ``3 alpha
+ (I + c) / B``: one relayed operation and one direct.  Where two source hosts ``A``,
``B`` each hold their own half of an array that three hosts need whole, that is what a
host pays if one root relays and the other sends it directly, but then that other root
sends every host its half one by one, and if both relay, their chains share a host:
``int32[234, 156] (2, 4) P(None, 'host') -> (3, 3) P('device', None)`` (71.3 KiB
halves) is allowed 226.3 us by the relay term, but every schedule takes the 265.2 us
of each holder sending its half three times.

**The argument** (the relay bound's execution model: a worker runs one operation at a
time, each keeps its root busy ``>= alpha + b / B`` and a receiving host busy ``>=
alpha + b / B``, or ``>= 2 alpha + (b + c(b)) / B`` where the operation reaches two
destination hosts or more (it forwards, or it is reached at depth 2 or more;
``c(b)`` >= :func:`~meshshard.resharding.bound.smallest_chunk`); an operation carries
its root's blocks only, and a host receives only blocks its devices need, so every
host of an operation from ``r`` is in ``N_r``, the hosts that need a slice ``r``
holds).  Source and destination hosts are disjoint.  Take two source hosts ``A != B``
such that no two hosts of ``N_A`` are disjoint from two hosts of ``N_B`` (so an
operation from ``A`` and one from ``B`` that each reach two hosts or more share one).
Every plan does one of:

1. *``A`` relays nothing*: each of its operations reaches one host, so every host
   ``h`` gets the bytes only ``A`` holds, ``x_h``, in operations of ``A`` to ``h``
   alone: ``A`` is busy ``>= sum over x_h > 0 of (alpha + x_h / B)``;
2. the same for ``B``;
3. *both relay*: an operation from each reaches two hosts or more, and they share a
   host ``H`` in ``N_A & N_B``.  ``H`` takes its ``I_H`` bytes in ``n >= max(k_H, 2)``
   operations (``k_H`` its smallest cover), two of them relayed: ``>= (n + 2) alpha +
   I_H / B``.  With ``n >= 3``, ``>= (max(k_H, 3) + 2) alpha + I_H / B``.  With
   ``n = 2`` (``k_H <= 2``) the two are all ``H`` takes, so the one from ``A`` carries
   every slice of ``H`` that ``B`` does not hold (``m_A`` bytes), and its chunk is at
   least :func:`~meshshard.resharding.bound.least_chunk` of that (at most what ``A``
   holds for ``H``'s devices): ``>= 4 alpha + (I_H + c_A + c_B) / B``.

So the plan takes at least the least of the three, with the least over ``H`` in 3.;
the term is the largest of that over ``(A, B)``.  Here: ``min(265.2, 265.2, min(275.8,
266.8))`` us.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> from meshshard.resharding.relays import relay_bound_terms
    >>> p = resharding_problem((234, 156), "int32", MeshSpec(0, (2, 4), (0, 1)),
    ...                        (None, "host"), MeshSpec(1, (3, 3), (2, 3, 4)),
    ...                        ("device", None))
    >>> print(relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    relay bound 265.219 us: roots w0 and w1, w0 sends each host apart
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import BoundTerm, LowerBound, by_receiver_host, least_chunk
from meshshard.tiles import ReshardingProblem

__all__ = ["two_roots_terms"]

_MAX_SOURCE_HOSTS = 16  # pairs of source hosts tried


@dataclass(frozen=True)
class _Holdings:
    """Per destination host: its slices as ``(holder hosts, bytes)``; per ``(source
    host, destination host)``: the bytes only it holds (once per slice) and the bytes
    it holds once per receiving device (the most one operation can carry there)."""

    slices: dict[int, list[tuple[frozenset[int], int]]] = field(default_factory=dict)
    only: dict[tuple[int, int], int] = field(default_factory=dict)
    per_device: dict[tuple[int, int], int] = field(default_factory=dict)

    @classmethod
    def of(cls, problem: ReshardingProblem) -> _Holdings:
        """The holdings of ``problem``'s slices."""
        out = cls()
        for need in problem.needs:
            nbytes = need.nbytes(problem.itemsize)
            holders = frozenset(h for h, _ in need.holders)
            for h, devs in by_receiver_host(need.receivers).items():
                out.slices.setdefault(h, []).append((holders, nbytes))
                for r in holders:
                    out.per_device[(r, h)] = out.per_device.get((r, h), 0) + nbytes * len(devs)
                if len(holders) == 1:
                    key = (next(iter(holders)), h)
                    out.only[key] = out.only.get(key, 0) + nbytes
        return out

    def needing(self, r: int) -> frozenset[int]:
        """``N_r``: the destination hosts that need a slice ``r`` holds."""
        return frozenset(h for h, s in self.slices.items() if any(r in hs for hs, _ in s))


def _must_share(na: frozenset[int], nb: frozenset[int]) -> bool:
    """Whether every two hosts of ``na`` meet every two hosts of ``nb``."""
    for pa in itertools.combinations(sorted(na), 2):
        if any(not set(pa) & set(pb) for pb in itertools.combinations(sorted(nb), 2)):
            return False
    return True


def _direct(hold: _Holdings, r: int, lat: float, bw: float) -> float:
    """1.: ``r``'s least busy time sending every host the bytes only it holds apart."""
    return sum(lat + n / bw for (s, _), n in hold.only.items() if s == r and n)


def _shared(hold: _Holdings, a: int, b: int, h: int, ingress, lat: float, bw: float) -> float:
    """3.: host ``h``'s least busy time in two relayed operations, from ``a`` and ``b``;
    ``ingress`` is its ``(k_h, I_h)`` (``(1, 0)`` where the tight bound has no term:
    the least it could be)."""
    k, least = ingress
    out = (max(k, 3) + 2) * lat + least / bw
    slices = hold.slices[h]
    if k <= 2 and all(hs & {a, b} for hs, _ in slices):
        chunks = 0.0
        for r, other in ((a, b), (b, a)):
            mine = sum(n for hs, n in slices if r in hs and other not in hs)
            chunks += least_chunk(mine, hold.per_device[(r, h)]) if mine else 0.0
        out = min(out, 4 * lat + (least + chunks) / bw)
    return out


def _pair(hold: _Holdings, a: int, b: int, ingress: dict, lat: float, bw: float):
    """The bound for the pair ``(a, b)`` (module docstring) and what binds it."""
    na, nb = hold.needing(a), hold.needing(b)
    shared = min(
        (_shared(hold, a, b, h, ingress.get(h, (1, 0)), lat, bw) for h in na & nb),
        default=math.inf,
    )
    cases = [(_direct(hold, a, lat, bw), f"w{a} sends each host apart")]
    cases += [(_direct(hold, b, lat, bw), f"w{b} sends each host apart")]
    cases += [(shared, "a shared host forwards twice")]
    return min(cases, key=lambda c: c[0])


def two_roots_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The best two-roots term (module docstring) from ``tight``'s ingress terms, as a
    one-item list; empty where no pair of source hosts qualifies."""
    src = problem.src.hosts
    if len(src) > _MAX_SOURCE_HOSTS or set(src) & set(problem.dst.hosts):
        return []
    hold = _Holdings.of(problem)
    ingress = {
        t.members[0]: (t.slices, t.nbytes)
        for t in tight.terms
        if t.side == "ingress" and not t.detail
    }
    lat, bw = tight.latency, tight.bandwidth
    best: tuple[float, str, int, int] | None = None
    for a, b in itertools.combinations(src, 2):
        if not _must_share(hold.needing(a), hold.needing(b)):
            continue
        seconds, how = _pair(hold, a, b, ingress, lat, bw)
        if best is None or seconds > best[0]:
            best = (seconds, how, a, b)
    if best is None or best[0] <= 0.0:
        return []
    seconds, how, a, b = best
    nbytes = sum(n for (s, _), n in hold.only.items() if s in (a, b))
    return [BoundTerm(f"roots w{a} and w{b}", nbytes, 2, len(ingress), seconds, how)]
