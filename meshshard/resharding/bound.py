"""The lower bound: no plan, however clever, moves the slices faster than this.

Every host reaches the others through its NICs, ``nics_per_host x nic_bandwidth``
bytes/s each way (full duplex).  Two facts bound any plan:

- **ingress**: a destination host must take in, at least once, every byte that any of
  its devices needs (fan-out to its other devices runs on the intra-host fabric);
- **egress**: every needed slice must leave the source mesh at least once, from a host
  that holds it.  For any set ``A`` of source hosts, the slices held *only* inside
  ``A`` must leave through ``A``'s NICs.  ``A = {h}`` is the single-holder rule (a
  slice only ``h`` holds must leave ``h``); the largest ratio over all sets equals the
  best possible spread of the egress over holders (max-flow/min-cut).

Relays do not help either bound: a byte forwarded by a destination host still entered
it once, and still left the source mesh once.

Latency: a message carries one block, and a block lies inside one slice (it is inside
one source tile and one destination tile), so a host that must take in ``n`` slices
takes part in at least ``n`` messages; in the runtime's execution model a worker runs
its communication one operation at a time and each pays the NIC latency before its
bytes move.  So a destination host needs ``n x nic_latency + bytes / bandwidth``, and
a set ``A`` of source hosts needs that for what only it holds, divided over its
``|A|`` hosts.  (Paper notes section 1.9; the latency term matters for small arrays.)

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((1024, 1024, 512), "int32", MeshSpec(0, (2, 4), (0, 1)), ("host",),
    ...                        MeshSpec(1, (2, 4), (2, 3)), ("host",))
    >>> print(lower_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    lower bound 859.023 ms: w2 ingress, 1.0 GiB at 1.25 GB/s + 1 x 30 us latency
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.resharding.result import fmt_bytes, fmt_seconds
from meshshard.tiles import ReshardingProblem

__all__ = ["BoundTerm", "LowerBound", "lower_bound", "lower_bound_terms", "host_bandwidth"]

_MAX_SUBSET_HOSTS = 16  # beyond this, only single hosts and the whole mesh are tried


@dataclass(frozen=True)
class BoundTerm:
    """One resource's time: ``nbytes`` and ``slices`` through ``hosts`` host(s)' NICs."""

    resource: str
    nbytes: int
    slices: int
    hosts: int
    seconds: float

    def __str__(self) -> str:
        per = f" over {self.hosts} hosts" if self.hosts > 1 else ""
        return f"{self.resource}, {fmt_bytes(self.nbytes)}{per}"


@dataclass(frozen=True)
class LowerBound:
    """The bound and the per-resource terms it is the maximum of (``w3 ingress``,
    ``w0 egress``, ``w0+w1 egress`` for the bytes only those hosts hold)."""

    seconds: float
    latency: float
    bandwidth: float
    terms: tuple[BoundTerm, ...]

    @property
    def binding(self) -> BoundTerm | None:
        """The largest term (the first one on ties), None when nothing moves."""
        return max(self.terms, key=lambda t: t.seconds) if self.terms else None

    def __str__(self) -> str:
        t = self.binding
        if t is None:
            return "lower bound 0: nothing to move"
        return (
            f"lower bound {fmt_seconds(self.seconds)}: {t.resource}, {fmt_bytes(t.nbytes)} at "
            f"{self.bandwidth / 1e9:.3g} GB/s + {t.slices} x {self.latency * 1e6:.3g} us latency"
            + (f", over {t.hosts} hosts" if t.hosts > 1 else "")
        )


def host_bandwidth(cluster: ClusterSpec) -> float:
    """Bytes/s one host moves each way over all its NICs."""
    return cluster.nics_per_host * cluster.nic_bandwidth


def lower_bound_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> LowerBound:
    """Every ingress and egress term of the bound, and the bound (see module docstring)."""
    bw, lat = host_bandwidth(cluster), float(cluster.nic_latency)
    itemsize = problem.itemsize
    terms: list[BoundTerm] = []
    ingress = {h: [0, 0] for h in problem.dst.hosts}
    by_holders: dict[frozenset[int], list[int]] = {}
    for need in problem.needs:
        nbytes = need.nbytes(itemsize)
        for h in {r[0] for r in need.receivers}:
            ingress[h][0] += nbytes
            ingress[h][1] += 1
        acc = by_holders.setdefault(frozenset(h for h, _ in need.holders), [0, 0])
        acc[0] += nbytes
        acc[1] += 1
    for h, (nbytes, n) in ingress.items():
        if n:
            terms.append(BoundTerm(f"w{h} ingress", nbytes, n, 1, n * lat + nbytes / bw))
    hosts = list(problem.src.hosts)
    if len(hosts) <= _MAX_SUBSET_HOSTS:
        subsets = range(1, 1 << len(hosts))
    else:
        subsets = [1 << i for i in range(len(hosts))] + [(1 << len(hosts)) - 1]
    bit = {h: 1 << i for i, h in enumerate(hosts)}
    masks = [(sum(bit[h] for h in key), acc) for key, acc in by_holders.items()]
    for a in subsets:
        inside = [acc for m, acc in masks if m & ~a == 0]
        if not inside:
            continue
        nbytes, n = sum(x[0] for x in inside), sum(x[1] for x in inside)
        size = bin(a).count("1")
        name = "+".join(f"w{h}" for h in hosts if bit[h] & a) + " egress"
        terms.append(BoundTerm(name, nbytes, n, size, (n * lat + nbytes / bw) / size))
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, lat, bw, tuple(terms))


def lower_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan of ``problem`` can finish on ``cluster``.

    The largest NIC ingress or egress time, latency per slice included (module docstring).
    """
    return lower_bound_terms(problem, cluster).seconds
