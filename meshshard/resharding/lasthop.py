"""The last hop: one holder's last message still has to cross a fabric or a NIC edge.

The holder terms (a source host's egress, :mod:`~meshshard.resharding.bound`; the
one-holder term's "no chain through all", :mod:`~meshshard.resharding.oneholder`)
end when the holder's last operation leaves it.  Where one source host holds every
slice and each destination host takes at most one chunk, spread over two devices or
more, that last operation still lands on one device and has to go one hop further:
``int8[36, 324] (1, 4) P(None, 'host') -> (3, 3) P(None, ('host', 'device'))`` is
allowed 99.3 us (three messages of 3.8 KiB from one holder), but every plan takes one
more fabric latency (104.3 us).

**The family**: one source host ``r`` holds every slice any destination host needs;
every destination host that needs data has two devices or more that need data, and its
messages *land whole*: its devices' tiles add up to at most one chunk
(:data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`), so no message to it is larger,
or its ingress ``I_h`` plus ``hop B`` bytes does.  (A message carries each element at
most once per device.  In the second case a message to ``h`` over one chunk carries
``>= hop B`` bytes that ``h`` already gets, a second copy for another device, which
the holder sends and ``h`` takes on top of everything the bounds below count, each
element once per host or once per operation: it costs ``>= hop`` anyway.)

**The argument** (the tight bound's execution model: a worker runs one operation at a
time; ``r``, the root of every operation, is busy ``>= alpha + b / B`` in each, so its
last operation ``O`` ends, at its depth-1 receiver ``h``, no sooner than ``r``'s busy
time ``W``; a message of at most one chunk lands whole on one device before it goes
on; a host's local all-gather runs after all its messages arrived).  Take ``O`` at
most one chunk (else, above, it costs a hop in bytes).  One of these
holds:

1. ``O`` reaches a second host: that host is at depth 2 and gets its last byte ``>=
   alpha + c / B`` after ``h`` did, so the plan ends ``>= W + alpha``;
2. ``O`` reaches two devices of ``h`` or more: it lands on one of them, then crosses
   the fabric: ``>= W + intra_latency``;
3. ``O`` reaches one device of ``h`` and ``h`` runs a local all-gather: it starts after
   ``O`` arrived, ``>= W + intra_latency``;
4. ``O`` reaches one device of ``h`` and no all-gather runs there: another device of
   ``h`` needs data, which another operation brings, so ``h`` takes two operations
   or more, both from ``r`` (the only holder).

So the plan ends ``>= W' + hop`` with ``hop = min(alpha, intra_latency)``, where ``W'``
is any lower bound on ``r``'s busy time that holds for every plan in which ``h`` takes
one operation, unless the bound with ``h`` taking two is already that high.  Two uses:

- *egress*: ``r`` runs at least one operation per group of destination hosts that share
  no slice (:func:`~meshshard.resharding.bound.receiver_groups`, ``k`` of them) and
  sends ``n`` bytes: ``W >= k alpha + n / B``.  In case 4, ``h``'s group takes two
  operations: ``W >= (k + 1) alpha + n / B``.  Either way the plan ends ``>= k alpha +
  n / B + hop`` (:func:`last_hop_terms`).
- *one holder, no chain through all* (the one-holder term's case B: ``r`` runs two
  operations or more and sends every element twice, ``W >= 2 alpha + 2 U / B``).  In
  case 4 ``h`` takes ``O`` and another operation ``O'``; some other host is in neither
  (``O`` reaches only ``h``; were the rest of the hosts all in ``O'``, ``O'`` would reach
  all ``m``), so ``r`` runs a third operation: ``W >= 3 alpha + 2 U / B``.  Either way
  ``>= 2 alpha + 2 U / B + hop`` (:func:`last_hop` passed to
  :func:`~meshshard.resharding.oneholder.one_holder_seconds`).

**Several holders** (the relay term's split where every destination host is the
depth-1 and last receiver of each operation it takes, so every operation is a message
to one host; :mod:`~meshshard.resharding.relays`, 2.).  Where every receiving host is a
*landing host* (:func:`~meshshard.resharding.bound.landing_hosts`: at most one chunk,
and no smallest cover of its slices can send it a message for one device only) whose
messages land whole (as above), call
a root *clean* if its last operation goes to one device of a host ``h`` and no local
all-gather runs there.  If no root is clean, every root's last operation is followed
by a hop (2. or 3. above): the plan ends ``>= max_r W_r + hop``, and the split's bound
on the busiest root (``exact`` or ``more``) plus ``hop`` holds.  If ``q >= 1`` roots
are clean, each clean root's host takes one operation more than its smallest cover
``k_h`` (a landing host), so there are ``>= K + d`` operations (``d`` such hosts);
``c`` clean last operations into one host run one after another there, the ``i``-th
ending ``>= (i - 1) alpha`` after the first, so summing ``end >= W_r + offset_r`` over
the ``s`` roots: ``s end >= (K + d) alpha + Y / B + alpha sum_h c_h (c_h - 1) / 2 + (s
- q) hop >= (K + q) alpha + Y / B + (s - q) hop``, least at ``q = 1`` (``alpha >=
hop``).  So the split allows no less than ``min(exact + hop, more + (s - 1) hop / s)``
(:func:`direct_hop`).

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

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    MIN_CHUNK_BYTES,
    BoundTerm,
    LowerBound,
    host_bandwidth,
    landing_hosts,
)
from meshshard.resharding.result import fmt_bytes, fmt_seconds
from meshshard.tiles import ReshardingProblem

__all__ = ["direct_hop", "last_hop", "last_hop_terms"]


def _lands_whole(problem: ReshardingProblem, extra: float) -> bool:
    """Whether every receiving host's messages land whole or pay ``extra`` bytes
    (module docstring): its devices' tiles add up to at most one chunk, or its ingress
    plus ``extra`` does."""
    ingress: dict[int, int] = {}
    most: dict[int, int] = {}
    for need in problem.needs:
        nbytes = need.nbytes(problem.itemsize)
        for h in {h for h, _ in need.receivers}:
            ingress[h] = ingress.get(h, 0) + nbytes
        for h, _ in need.receivers:
            most[h] = most.get(h, 0) + nbytes
    return all(most[h] <= MIN_CHUNK_BYTES or ingress[h] + extra <= MIN_CHUNK_BYTES for h in ingress)


def _hop(cluster: ClusterSpec) -> float:
    """``min(nic_latency, intra_latency)``."""
    return float(min(cluster.nic_latency, cluster.intra_latency))


def last_hop(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """``min(nic_latency, intra_latency)`` where the problem is in the family (module
    docstring: one holder; every receiving host's messages land whole, for two devices
    or more), else 0: what the plan still takes after the holder's last operation left
    it."""
    roots = {h for n in problem.needs for h, _ in n.holders}
    if len(roots) != 1:
        return 0.0
    devices: dict[int, set[int]] = {}
    for need in problem.needs:
        for h, d in need.receivers:
            devices.setdefault(h, set()).add(d)
    hop = _hop(cluster)
    if not devices or any(len(ds) < 2 for ds in devices.values()):
        return 0.0
    if not _lands_whole(problem, hop * host_bandwidth(cluster)):
        return 0.0
    return hop


def last_hop_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The holder's egress term of ``tight`` plus :func:`last_hop` (module docstring);
    empty where the problem is not in the family."""
    hop = last_hop(problem, cluster)
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
    split (module docstring, several holders): ``min(nic_latency, intra_latency)`` where
    every receiving host is a landing host of ``tight``
    (:func:`~meshshard.resharding.bound.landing_hosts`) whose messages land whole, else
    0."""
    receiving = {h for n in problem.needs for h, _ in n.receivers}
    hosts = landing_hosts(problem, cluster, tight)
    if not receiving or not receiving <= hosts.keys():
        return 0.0
    if not _lands_whole(problem, _hop(cluster) * tight.bandwidth):
        return 0.0
    return min(hosts[h] for h in receiving)
