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

Latency: in the runtime's execution model a worker runs its communication one
operation at a time and each pays the NIC latency before its bytes move.  A message
carries blocks of one source host (a host-level message,
:mod:`~meshshard.resharding.merge`, carries every slice that host sends to the same
hosts; relays forward it whole in a chain), so a destination host takes part in at
least as many messages as it needs source hosts to cover its slices (the smallest
set of holders that hits every slice it needs), and pays that many latencies plus
``bytes / bandwidth``; a set ``A`` of source hosts needs ``nic_latency + bytes /
(|A| x bandwidth)`` for what only it holds (its busiest host sent at least its
share, in at least one message), and at least ``(m x nic_latency + bytes /
bandwidth) / |A|`` where ``m`` counts the groups of receiving hosts that share no
slice (a message only reaches hosts that all need its blocks).  (Paper notes section 1.9; the latency term matters
for small arrays.  Before host-level messages it was one latency per slice.)

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((1024, 1024, 512), "int32", MeshSpec(0, (2, 4), (0, 1)), ("host",),
    ...                        MeshSpec(1, (2, 4), (2, 3)), ("host",))
    >>> print(lower_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    lower bound 859.023 ms: w2 ingress, 1.0 GiB at 1.25 GB/s + 1 x 30 us latency

**The tight bound** (:func:`tight_bound`) adds what the NIC bound leaves out for
small multicasts: chunks, hops and fan-out, in the plans' execution model (a host
runs one operation at a time; only a source device sends a block, so a destination
host relays only inside a chain broadcast; a broadcast moves in chunks of at least
:data:`MIN_CHUNK_BYTES`, NCCL's smallest, 32 KiB, cut into equal chunks, so
:func:`smallest_chunk` of the block).

- *multicast*: a slice of ``n`` bytes held by ``s`` source hosts and needed by ``h``
  hosts reaches them through chains.  A holder's ``k``-th chain starts once its
  earlier ones left it (``alpha + n / B`` each); each host of a chain gets its first
  chunk ``alpha + c / B`` after the one before it (``c`` the chunk) and its last byte
  ``(n - c) / B`` after its first chunk.  The ``h``-th host to be reached, over the
  best such chains, gives the term;
- *relay tail*: a source host whose own slices all need relaying ends with a relay:
  its egress plus the smallest ``alpha + c / B`` of those slices;
- *fan-out tail*: the block a destination host takes last still has to reach its
  ``R`` devices after the host's NIC is done: for a one-chunk block ``R - 1`` fabric
  latencies (a chain through them, or a local all-gather), one fabric latency plus
  ``R - 1`` copies from the device it landed on (:mod:`meshshard.sim.fanout`), or
  another NIC message, whichever is less; for a larger one its last chunk's ``R - 1`` fabric hops (the
  smallest such tail over the host's blocks) after its ingress; likewise after a set
  of source hosts' egress, for the last block to leave them.  A host-level message
  of blocks that together exceed one chunk pipelines its fan-out, so where a host
  takes several slices, more than :data:`MIN_CHUNK_BYTES` in all, a hop costs at
  most half a chunk's time;
- *landing*: a destination host that takes at most one chunk in all gets each message
  whole before it fans out; with the fewest messages its last one still needs a fabric
  hop, unless one source host of a smallest cover can send it blocks for one device
  only; one more message costs a NIC latency instead.

The tight bound is the largest of these and the NIC terms.  The multicast term
assumes a slice travels whole; where several source hosts hold it they may cut it
instead (each sends part of it to a host, as the balance candidate does), and then
some host takes two pieces or more, ``>= 2 alpha + n / B``: the term is the smaller of
the two.

    >>> q = resharding_problem((1 << 18,), "int32", MeshSpec(0, (1, 1), (0,)), (),
    ...                        MeshSpec(1, (4, 2), (1, 2, 3, 4)), ())
    >>> print(tight_bound_terms(q, ClusterSpec.preset("aws-p3.8xlarge")))
    tight bound 1.038 ms: slice [0:262144] to 4 hosts from 1, 1.0 MiB in 32.0 KiB chunks
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.resharding.result import fmt_bytes, fmt_seconds, index_str
from meshshard.tiles import ReshardingProblem

__all__ = [
    "MIN_CHUNK_BYTES",
    "BoundTerm",
    "LowerBound",
    "lower_bound",
    "lower_bound_terms",
    "min_senders",
    "receiver_groups",
    "relay_bytes",
    "host_bandwidth",
    "single_device_last",
    "landing_hosts",
    "least_chunk",
    "multicast_seconds",
    "smallest_chunk",
    "tight_bound",
    "tight_bound_terms",
]

MIN_CHUNK_BYTES = 32 << 10
"""The smallest pipelining chunk of a broadcast: NCCL halves its chunk for small
messages down to 32 KiB (``enqueue.cc``), and so does :mod:`~meshshard.resharding.chunks`."""

_MAX_SUBSET_HOSTS = 16  # beyond this, only single hosts and the whole mesh are tried


@dataclass(frozen=True)
class BoundTerm:
    """One resource's time: ``nbytes`` and ``slices`` through ``hosts`` host(s)' NICs
    (or, for the tight bound's multicast terms, ``detail`` says what it is).  ``side``
    (``"ingress"`` or ``"egress"``) and ``members`` (the hosts) say whose NICs a NIC
    term is about."""

    resource: str
    nbytes: int
    slices: int
    hosts: int
    seconds: float
    detail: str = ""
    side: str = ""
    members: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.detail:
            return f"{self.resource}, {self.detail}"
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
    kind: str = "lower"

    @property
    def binding(self) -> BoundTerm | None:
        """The largest term (the first one on ties), None when nothing moves."""
        return max(self.terms, key=lambda t: t.seconds) if self.terms else None

    def __str__(self) -> str:
        t = self.binding
        if t is None:
            return f"{self.kind} bound 0: nothing to move"
        if t.detail:
            return f"{self.kind} bound {fmt_seconds(self.seconds)}: {t}"
        return (
            f"{self.kind} bound {fmt_seconds(self.seconds)}: {t.resource}, {fmt_bytes(t.nbytes)} at "
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
    origins: dict[int, set[frozenset[int]]] = {h: set() for h in problem.dst.hosts}
    by_holders: dict[frozenset[int], list[int]] = {}
    for need in problem.needs:
        nbytes = need.nbytes(itemsize)
        for h in {r[0] for r in need.receivers}:
            ingress[h][0] += nbytes
            ingress[h][1] += 1
            origins[h].add(frozenset(s for s, _ in need.holders))
        acc = by_holders.setdefault(frozenset(h for h, _ in need.holders), [0, 0, set()])
        acc[0] += nbytes
        acc[1] += 1
        acc[2].add(frozenset(h for h, _ in need.receivers))
    for h, (nbytes, n) in ingress.items():
        if n:
            k = min_senders(origins[h], problem.src.hosts)
            term = BoundTerm(f"w{h} ingress", nbytes, k, 1, k * lat + nbytes / bw)
            terms.append(dataclasses.replace(term, side="ingress", members=(h,)))
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
        nbytes = sum(x[0] for x in inside)
        k = receiver_groups(set().union(*(x[2] for x in inside)))
        size = bin(a).count("1")
        name = "+".join(f"w{h}" for h in hosts if bit[h] & a) + " egress"
        members = tuple(h for h in hosts if bit[h] & a)
        seconds = max(lat + nbytes / bw / size, (k * lat + nbytes / bw) / size)
        term = BoundTerm(name, nbytes, max(1, k // size), size, seconds)
        terms.append(dataclasses.replace(term, side="egress", members=members))
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, lat, bw, tuple(terms))


def receiver_groups(receivers: set[frozenset[int]]) -> int:
    """The fewest messages that reach every host of ``receivers`` (each the receiving
    hosts of a slice): a message goes only to hosts that all need its blocks, so hosts
    that share no slice, even through others, need separate messages.

    >>> receiver_groups({frozenset({3}), frozenset({4, 5}), frozenset({5, 6})})
    2
    """
    parent: dict[int, int] = {}

    def root(h: int) -> int:
        while parent.setdefault(h, h) != h:
            h = parent[h]
        return h

    for group in receivers:
        first, *rest = sorted(group)
        for h in rest:
            parent[root(h)] = root(first)
    return len({root(h) for group in receivers for h in group})


def min_senders(origins: set[frozenset[int]], hosts: tuple[int, ...]) -> int:
    """The fewest source hosts that hold, between them, a copy of every slice whose
    holder hosts are listed in ``origins`` (a smallest hitting set; 1 beyond
    :data:`_MAX_SUBSET_HOSTS` hosts, where the search would be too long).

    >>> min_senders({frozenset({0}), frozenset({1, 2}), frozenset({2})}, (0, 1, 2))
    2
    """
    if not origins:
        return 0
    if len(hosts) > _MAX_SUBSET_HOSTS:
        return 1
    for k in range(1, len(hosts) + 1):
        for chosen in itertools.combinations(hosts, k):
            if all(o & set(chosen) for o in origins):
                return k
    return len(hosts)


def lower_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan of ``problem`` can finish on ``cluster``.

    The largest NIC ingress or egress time, one message latency included (module docstring).
    """
    return lower_bound_terms(problem, cluster).seconds


def smallest_chunk(nbytes: float) -> float:
    """The smallest chunk a block of ``nbytes`` moves in: a broadcast cuts it into equal
    chunks of at most its chunk size, which is at least :data:`MIN_CHUNK_BYTES`, so
    ``n / ceil(n / MIN_CHUNK_BYTES)`` (the whole block if smaller).

    >>> smallest_chunk(1000), smallest_chunk(32 << 10), smallest_chunk((32 << 10) + 2)
    (1000.0, 32768.0, 16385.0)
    """
    return nbytes / max(1, math.ceil(nbytes / MIN_CHUNK_BYTES))


def relay_bytes(least: float, most: float = math.inf, hops: int = 1) -> float:
    """``inf (b + hops c(b))`` over ``least <= b <= most``, ``c``
    :func:`smallest_chunk`: ``b + hops b / m`` rises on each
    ``((m - 1) C, m C]``, so the infimum is at ``least`` or just past the next multiple
    of the chunk ``C`` (where there is room below ``most``).

    >>> relay_bytes(1000), relay_bytes(62208, 62208), relay_bytes(62208), relay_bytes(1000, 2000, 2)
    (2000.0, 93312.0, 87381.33333333333, 3000.0)
    """
    m = max(1, math.ceil(least / MIN_CHUNK_BYTES))
    best = least + hops * smallest_chunk(least)
    if m * MIN_CHUNK_BYTES < most:
        best = min(best, m * MIN_CHUNK_BYTES * (1 + hops / (m + 1)))
    return best


def least_chunk(least: float, most: float) -> float:
    """``inf c(b)`` over ``least <= b <= most``: ``c(b) = b / m`` rises on each
    ``((m - 1) C, m C]``, so at ``least`` or just past the next multiple of ``C``.

    >>> least_chunk(1000, 1000), least_chunk(73008, 73008), least_chunk(32768, 10**6)
    (1000.0, 24336.0, 16384.0)
    """
    m = max(1, math.ceil(least / MIN_CHUNK_BYTES))
    best = smallest_chunk(least)
    if m * MIN_CHUNK_BYTES < most:
        best = min(best, m * MIN_CHUNK_BYTES / (m + 1))
    return best


def multicast_seconds(nbytes: int, senders: int, receivers: int, cluster: ClusterSpec) -> float:
    """Earliest time ``receivers`` hosts can all have a slice of ``nbytes`` that
    ``senders`` hosts hold, in chunked chain broadcasts from the holders (module docstring).

    >>> c = ClusterSpec.preset("aws-p3.8xlarge")
    >>> round(multicast_seconds(1 << 20, 1, 2, c) * 1e6, 3)   # a chain of two: 2 alpha + (n + c) / B
    925.075
    """
    if receivers <= 0 or nbytes <= 0:
        return 0.0
    bw, lat = host_bandwidth(cluster), float(cluster.nic_latency)
    chunk = smallest_chunk(nbytes)
    first, again = lat + chunk / bw, lat + nbytes / bw
    slots = [(first, True)] * max(1, senders)  # (first chunk of the next host, from a holder?)
    heapq.heapify(slots)
    reached = 0.0
    for _ in range(receivers):
        reached, root = heapq.heappop(slots)
        if root:  # the holder's next chain starts once this one has left it
            heapq.heappush(slots, (reached - first + again + first, True))
        heapq.heappush(slots, (reached + first, False))  # the chain goes on from the new host
    return reached + (nbytes - chunk) / bw


def _multicast_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> list[BoundTerm]:
    itemsize = problem.itemsize
    out = []
    for need in problem.needs:
        nbytes = need.nbytes(itemsize)
        s = len({h for h, _ in need.holders})
        r = len({h for h, _ in need.receivers})
        if r <= s:
            continue  # one direct send per receiver: the NIC terms cover it
        chunk = smallest_chunk(nbytes)
        detail = f"{fmt_bytes(nbytes)} in {fmt_bytes(chunk)} chunks"
        name = f"slice [{index_str(need.index)}] to {r} hosts from {s}"
        t = multicast_seconds(nbytes, s, r, cluster)
        if s > 1:  # holders may cut the slice: some host then takes two pieces or more
            cut = 2 * float(cluster.nic_latency) + nbytes / host_bandwidth(cluster)
            if cut < t:
                t, detail = cut, f"{fmt_bytes(nbytes)} cut between holders, in 2+ pieces"
        out.append(BoundTerm(name, nbytes, 1, r, t, detail))
    return out


def _relay_tail_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, nic: LowerBound
) -> list[BoundTerm]:
    """Per source host: its single-host egress term plus the shortest relay tail of the
    slices only it holds that more than one host needs (its last one ends with a relay)."""
    itemsize = problem.itemsize
    tails: dict[int, float] = {}
    for need in problem.needs:
        holders = {h for h, _ in need.holders}
        if len(holders) != 1 or len({h for h, _ in need.receivers}) < 2:
            continue
        nbytes = need.nbytes(itemsize)
        tail = nic.latency + smallest_chunk(nbytes) / nic.bandwidth
        (h,) = holders
        tails[h] = min(tails.get(h, tail), tail)
    out = []
    for t in nic.terms:
        if t.side != "egress" or len(t.members) != 1 or t.members[0] not in tails:
            continue
        every = all(
            len({h for h, _ in n.receivers}) > 1
            for n in problem.needs
            if {h for h, _ in n.holders} == set(t.members)
        )
        if not every:
            continue  # it can end with a direct send
        tail = tails[t.members[0]]
        detail = f"{fmt_bytes(t.nbytes)} out, then a relay hop ({fmt_seconds(tail)})"
        out.append(
            BoundTerm(f"{t.resource} + relay tail", t.nbytes, t.slices, 1, t.seconds + tail, detail)
        )
    return out


def _fan_out_tails(problem: ReshardingProblem, cluster: ClusterSpec) -> list[dict[int, float]]:
    """Per slice: each receiving host's fan-out tail to its ``R`` devices.  A block of one
    chunk (at most :data:`MIN_CHUNK_BYTES`) pays ``R - 1`` fabric latencies after the
    NIC (a chain or a local all-gather) unless another NIC message brings it; a larger
    block pipelines the fan-out, which hides the latencies, and only its last chunk
    (at least ``n / ceil(n / c)`` bytes) still crosses ``R - 1`` fabric hops."""
    out = []
    itemsize = problem.itemsize
    total: dict[int, int] = {}  # bytes each destination host takes, if in several slices
    slices: dict[int, int] = {}
    for need in problem.needs:
        for h in {h for h, _ in need.receivers}:
            total[h] = total.get(h, 0) + need.nbytes(itemsize)
            slices[h] = slices.get(h, 0) + 1
    merged_hop = min(cluster.intra_latency, MIN_CHUNK_BYTES / 2 / cluster.intra_bandwidth)
    for need in problem.needs:
        nbytes = need.nbytes(itemsize)
        count: dict[int, int] = {}
        for h, _ in need.receivers:
            count[h] = count.get(h, 0) + 1
        one_chunk = nbytes <= MIN_CHUNK_BYTES
        if one_chunk:
            per_hop = cluster.intra_latency
        else:
            per_hop = smallest_chunk(nbytes) / cluster.intra_bandwidth
        tails = {}
        for h, r in count.items():
            # a host-level message of several blocks over one chunk pipelines its fan-out
            # in chunks of at least half the smallest chunk: no latency per hop
            several = slices[h] > 1 and total[h] > MIN_CHUNK_BYTES
            hop = min(per_hop, merged_hop) if several else per_hop
            tail = (r - 1) * hop
            if one_chunk and r > 1:  # or the landing device copies it to the rest at once
                tail = min(tail, cluster.intra_latency + (r - 1) * nbytes / cluster.intra_bandwidth)
            tails[h] = min(tail, cluster.nic_latency)
        out.append(tails)
    return out


def _fan_out_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, nic: LowerBound
) -> list[BoundTerm]:
    """Every ingress term plus the smallest fan-out tail of the host's blocks (the one
    it takes last still has to reach its devices); every egress term of a set of source
    hosts plus the smallest tail of the blocks only it holds (the last one to leave
    still has to reach the devices of some receiving host)."""
    tails = _fan_out_tails(problem, cluster)
    ingress: dict[int, float] = {}
    for t in tails:
        for h, tail in t.items():
            ingress[h] = min(ingress.get(h, tail), tail)
    out = []
    for t in nic.terms:
        if t.side == "ingress":
            tail = ingress.get(t.members[0], 0.0)
        else:
            inside = set(t.members)
            tail = min(
                (
                    min(t_.values())
                    for need, t_ in zip(problem.needs, tails, strict=True)
                    if {h for h, _ in need.holders} <= inside
                ),
                default=0.0,
            )
        if tail <= 0:
            continue
        detail = f"{fmt_bytes(t.nbytes)}, then a fan-out to the devices ({fmt_seconds(tail)})"
        out.append(
            BoundTerm(
                f"{t.resource} + fan-out", t.nbytes, t.slices, t.hosts, t.seconds + tail, detail
            )
        )
    return out


def single_device_last(
    slices: list[tuple[frozenset[int], frozenset[int]]], k: int, hosts: tuple[int, ...]
) -> bool:
    """Whether ``k`` source hosts can cover ``slices`` (``(holder hosts, devices)`` of one
    destination host) with one of them left only slices for a single device: then the
    host's last message may need no fan-out."""
    for chosen in itertools.combinations(hosts, k):
        if not all(holders & set(chosen) for holders, _ in slices):
            continue
        for s in chosen:
            rest = set(chosen) - {s}
            mine = {devs for holders, devs in slices if s in holders and not holders & rest}
            if len(mine) == 1 and len(next(iter(mine))) == 1:
                return True
    return False


def landing_hosts(
    problem: ReshardingProblem, cluster: ClusterSpec, nic: LowerBound
) -> dict[int, float]:
    """``{destination host: seconds}`` for each host whose last message, with the fewest
    messages, still needs a fabric hop after it landed (:func:`_landing_terms`): a host
    that takes at most one chunk in all and that no smallest cover can send a last
    message for one device only.  The seconds are one fabric latency, or a NIC latency
    where that is less (one more message)."""
    per_host: dict[int, list[tuple[frozenset[int], frozenset[int]]]] = {}
    for need in problem.needs:
        holders = frozenset(h for h, _ in need.holders)
        for h, devs in by_receiver_host(need.receivers).items():
            per_host.setdefault(h, []).append((holders, devs))
    if len(problem.src.hosts) > _MAX_SUBSET_HOSTS:
        return {}
    extra = min(cluster.intra_latency, cluster.nic_latency)
    out = {}
    for t in nic.terms:
        if t.side != "ingress" or t.nbytes > MIN_CHUNK_BYTES:
            continue
        if not single_device_last(per_host[t.members[0]], t.slices, problem.src.hosts):
            out[t.members[0]] = extra
    return out


def _landing_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, nic: LowerBound
) -> list[BoundTerm]:
    """A destination host that takes at most one chunk in all takes every message whole
    before its fan-out starts.  With the fewest messages (one per source host of the
    smallest cover), unless one of them can carry only blocks for one device, its last
    message lands on one device and still has to reach another (a fabric latency);
    avoiding that costs one more message (a NIC latency)."""
    hosts = landing_hosts(problem, cluster, nic)
    out = []
    for t in nic.terms:
        if t.side != "ingress" or t.members[0] not in hosts:
            continue
        extra = hosts[t.members[0]]
        detail = f"{fmt_bytes(t.nbytes)} in {t.slices} message(s), the last one fanned out"
        out.append(
            BoundTerm(f"{t.resource} + landing", t.nbytes, t.slices, 1, t.seconds + extra, detail)
        )
    return out


def by_receiver_host(receivers) -> dict[int, frozenset[int]]:
    """``{host: devices}`` of a slice's receiving ``(host, device)`` refs."""
    out: dict[int, set[int]] = {}
    for h, d in receivers:
        out.setdefault(h, set()).add(d)
    return {h: frozenset(ds) for h, ds in out.items()}


def tight_bound_terms(problem: ReshardingProblem, cluster: ClusterSpec) -> LowerBound:
    """The NIC terms and the chunk- and latency-aware multicast terms (module docstring)."""
    nic = lower_bound_terms(problem, cluster)
    terms = nic.terms + tuple(_multicast_terms(problem, cluster))
    terms += tuple(_relay_tail_terms(problem, cluster, nic))
    terms += tuple(_fan_out_terms(problem, cluster, nic))
    terms += tuple(_landing_terms(problem, cluster, nic))
    top = max((t.seconds for t in terms), default=0.0)
    return LowerBound(top, nic.latency, nic.bandwidth, terms, kind="tight")


def tight_bound(problem: ReshardingProblem, cluster: ClusterSpec) -> float:
    """Seconds below which no plan that sends slices whole in chunks of at least
    :data:`MIN_CHUNK_BYTES` can finish: at least :func:`lower_bound`."""
    return tight_bound_terms(problem, cluster).seconds
