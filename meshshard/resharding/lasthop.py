"""The last hop: a message that lands on one device still has to reach the others.

The terms that count a host's or a holder's work (ingress and egress,
:mod:`~meshshard.resharding.bound`; the relay term's holders,
:mod:`~meshshard.resharding.relays`; the one-holder term's "no chain through all",
:mod:`~meshshard.resharding.oneholder`) end when the last message arrives.  Where
messages land whole on one device and several devices need them, one more hop
follows: ``int8[36, 324] (1, 4) P(None, 'host') -> (3, 3) P(None, ('host',
'device'))`` is allowed 99.3 us (three messages of 3.8 KiB from one holder), but every
plan takes one more fabric latency (104.3 us).

**Landing hosts** (:func:`landing`).  A destination host ``h`` is one where (a) no
smallest cover of its slices (``k_h`` source hosts) can send it a message for one
device only (:func:`~meshshard.resharding.bound.single_device_last`), and (b) every
message to it *lands whole*: each source host's share of ``h``'s slices, counted once
per device that needs it, is at most one chunk
(:data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`), or counted once plus ``hop B``
bytes is.  A message carries each element at most once per device, so in the first
case no message to ``h`` is over a chunk; in the second a message over a chunk carries
``>= hop B`` bytes that ``h`` already gets (a second copy for another device), which
its root sends and ``h`` takes on top of everything the terms here count (each element
once per host, or once per operation that carries it): it costs ``>= hop`` anyway.

**The argument** (the tight bound's execution model: a worker runs one operation at a
time, busy ``>= alpha + b / B`` in each; a message of at most one chunk lands whole on
one device before it goes on; a host's local all-gather runs after all its messages
arrived).  Let ``O`` be the last operation of a root ``r`` (or into a host ``h``), at
most one chunk, ending at ``h`` (its depth-1 receiver) no sooner than ``r``'s (or
``h``'s) busy time ``W``.  One of these holds, ``hop = min(alpha, intra_latency)``:

1. ``O`` reaches a second host: that host is at depth 2 and gets its last byte ``>=
   alpha + c / B`` after ``h`` did: the plan ends ``>= W + alpha`` (for a host's
   ingress: ``h`` forwards in ``O`` or is at depth 2 or more, busy ``>= 2 alpha`` in
   it, so ``W`` itself is ``alpha`` more);
2. ``O`` reaches two devices of ``h`` or more: it lands on one of them, then crosses
   the fabric: ``>= W + intra_latency``;
3. ``O`` reaches one device of ``h`` and ``h`` runs a local all-gather: it starts after
   ``O`` arrived: ``>= W + intra_latency``;
4. ``O`` reaches one device of ``h`` and no all-gather runs there (``O`` is *clean*):
   by (a), ``h`` takes ``k_h + 1`` operations or more (with exactly ``k_h``, one from
   each root of a smallest cover, the one from ``O``'s root carries every slice only
   that root holds in the cover, all for one device).

The uses (each a bound that holds whether or not ``O`` is clean):

- *ingress* (:func:`ingress_hop_terms`), ``h`` a landing host: ``h`` is busy ``>= k_h
  alpha + I_h / B``; in case 4 ``>= (k_h + 1) alpha + I_h / B``.  Either way the plan
  ends ``>= k_h alpha + I_h / B + hop``.
- *one holder, egress* (:func:`last_hop_terms`; one source host ``r`` holds every
  slice and every receiving host is a landing host, :func:`last_hop`): ``r`` runs at
  least one operation per group of destination hosts that share no slice
  (:func:`~meshshard.resharding.bound.receiver_groups`, ``k``) and sends ``n`` bytes,
  ``W >= k alpha + n / B``; in case 4 ``h``'s group takes two: ``(k + 1) alpha + n /
  B``.  Either way ``>= k alpha + n / B + hop``.
- *one holder, no chain through all* (the one-holder term's case B: ``r`` runs two
  operations or more and sends every element twice, ``W >= 2 alpha + 2 U / B``).  In
  case 4 ``h`` takes ``O`` and another operation ``O'``; some other host is in neither
  (``O`` reaches only ``h``; were all the others in ``O'``, ``O'`` would reach all
  ``m``), so ``r`` runs a third: ``W >= 3 alpha + 2 U / B``.  Either way ``>= 2 alpha +
  2 U / B + hop`` (:func:`last_hop` passed to
  :func:`~meshshard.resharding.oneholder.one_holder_seconds`).
- *several holders, all direct* (:func:`direct_hop`; the relay term's split where
  every destination host is the depth-1 and last receiver of each operation it takes,
  so each operation goes to one host; :mod:`~meshshard.resharding.relays`, 2.), every
  receiving host a landing host.  If no root's last operation is clean, the plan ends
  ``>= max_r W_r + hop``: the split's bound on the busiest root (``exact`` or
  ``more``) plus ``hop``.  If ``q >= 1`` are, each clean one's host takes one
  operation more than ``k_h``, so there are ``>= K + d`` operations (``d`` such
  hosts); ``c`` clean last operations into one host run one after another there, the
  ``i``-th ending ``>= (i - 1) alpha`` after the first; summing ``end >= W_r +
  offset_r`` over the ``s`` roots: ``s end >= (K + d) alpha + Y / B + alpha sum_h c_h
  (c_h - 1) / 2 + (s - q) hop >= (K + q) alpha + Y / B + (s - q) hop``, least at ``q =
  1`` (``alpha >= hop``).  So the split allows ``min(exact + hop, more + (s - 1) hop /
  s)``.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((36, 324), "int8", MeshSpec(0, (1, 4), (0,)), (None, "host"),
    ...                        MeshSpec(1, (3, 3), (1, 2, 3)), (None, ("host", "device")))
    >>> from meshshard.resharding.relays import relay_bound_terms
    >>> b = relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge"))
    >>> print(b)
    relay bound 104.331 us: relays, 3 hosts from 1 holders: all direct, 3 messages, then a hop
    >>> print(next(t for t in b.terms if t.resource.endswith("last hop")))
    w0 egress + last hop, 11.4 KiB out in 3 messages, then a 5.000 us hop

(Both the egress term and the relay term's all-direct split gain the hop here; the
hosts share no slice, so none can relay.)
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    by_receiver_host,
    single_device_last,
)
from meshshard.resharding.result import fmt_bytes, fmt_seconds
from meshshard.tiles import ReshardingProblem

__all__ = [
    "HostSlices",
    "direct_hop",
    "ingress_hop_terms",
    "landing",
    "last_hop",
    "last_hop_terms",
]

_MAX_SOURCE_HOSTS = 16  # smallest covers tried, as in the tight bound's landing term


def _hop(cluster: ClusterSpec) -> float:
    """``min(nic_latency, intra_latency)``."""
    return float(min(cluster.nic_latency, cluster.intra_latency))


@dataclass(frozen=True)
class HostSlices:
    """Per destination host: its slices as ``(holder hosts, devices, bytes)``."""

    per_host: dict[int, list[tuple[frozenset[int], frozenset[int], int]]]

    @staticmethod
    def of(problem: ReshardingProblem) -> HostSlices:
        """The problem's slices per destination host."""
        out: dict[int, list[tuple[frozenset[int], frozenset[int], int]]] = {}
        for need in problem.needs:
            holders = frozenset(h for h, _ in need.holders)
            for h, devs in by_receiver_host(need.receivers).items():
                out.setdefault(h, []).append((holders, devs, need.nbytes(problem.itemsize)))
        return HostSlices(out)

    def pairs(self, h: int) -> list[tuple[frozenset[int], frozenset[int]]]:
        """Host ``h``'s slices as ``(holder hosts, devices)``
        (:func:`~meshshard.resharding.bound.single_device_last`)."""
        return [(holders, devs) for holders, devs, _ in self.per_host[h]]

    def lands_whole(self, r: int, h: int, extra: float) -> bool:
        """Whether every message from ``r`` to ``h`` lands whole or pays ``extra``
        duplicate bytes (:func:`landing`): ``r``'s share of ``h``'s slices, once per
        device, is at most a chunk, or once plus ``extra`` is."""
        mine = [(devs, n) for holders, devs, n in self.per_host[h] if r in holders]
        once = sum(n for _, n in mine)
        return sum(n * len(d) for d, n in mine) <= MIN_CHUNK_BYTES or (
            once + extra <= MIN_CHUNK_BYTES
        )


def landing(problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound) -> set[int]:
    """The destination hosts whose last message still hops (module docstring): no
    smallest cover of their slices can send them a message for one device only, and
    every message to them lands whole (each source host's share, once per device, at
    most one chunk, or once plus ``hop B`` bytes at most one chunk)."""
    if len(problem.src.hosts) > _MAX_SOURCE_HOSTS:
        return set()
    slices = HostSlices.of(problem)
    extra = _hop(cluster) * tight.bandwidth
    out = set()
    for t in tight.terms:
        if t.side != "ingress" or t.detail:
            continue
        h = t.members[0]
        roots = {r for holders, _, _ in slices.per_host[h] for r in holders}
        whole = all(slices.lands_whole(r, h, extra) for r in roots)
        if whole and not single_device_last(slices.pairs(h), t.slices, problem.src.hosts):
            out.add(h)
    return out


def last_hop(problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound) -> float:
    """``min(nic_latency, intra_latency)`` where the problem is in the family (module
    docstring: one holder; every receiving host in :func:`landing`), else 0: what the
    plan still takes after the holder's last operation left it."""
    roots = {h for n in problem.needs for h, _ in n.holders}
    receiving = {h for n in problem.needs for h, _ in n.receivers}
    if len(roots) != 1 or not receiving <= landing(problem, cluster, tight):
        return 0.0
    return _hop(cluster)


def last_hop_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The holder's egress term of ``tight`` plus :func:`last_hop` (module docstring);
    empty where the problem is not in the family."""
    hop = last_hop(problem, cluster, tight)
    if hop <= 0:
        return []
    out = []
    for t in tight.terms:
        if t.side != "egress" or len(t.members) != 1 or t.detail:
            continue
        detail = f"{fmt_bytes(t.nbytes)} out in {t.slices} messages, then a {fmt_seconds(hop)} hop"
        out.append(
            BoundTerm(f"{t.resource} + last hop", t.nbytes, t.slices, 1, t.seconds + hop, detail)
        )
    return out


def direct_hop(problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound) -> float:
    """The hop every root's last operation still needs in the relay term's all-direct
    split (module docstring, several holders): ``min(nic_latency, intra_latency)``
    where every receiving host is in :func:`landing`, else 0."""
    receiving = {h for n in problem.needs for h, _ in n.receivers}
    if not receiving or not receiving <= landing(problem, cluster, tight):
        return 0.0
    return _hop(cluster)


def ingress_hop_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """Each ingress term of ``tight`` for a host in :func:`landing`, plus the hop
    (module docstring, *ingress*)."""
    hosts = landing(problem, cluster, tight)
    hop = _hop(cluster)
    out = []
    for t in tight.terms:
        if t.side != "ingress" or t.detail or t.members[0] not in hosts:
            continue
        detail = f"{fmt_bytes(t.nbytes)} in {t.slices} message(s), then a {fmt_seconds(hop)} hop"
        out.append(
            BoundTerm(f"{t.resource} + last hop", t.nbytes, t.slices, 1, t.seconds + hop, detail)
        )
    return out
