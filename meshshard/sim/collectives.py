"""Collectives as DAGs of point-to-point flows, following the algorithms libraries run.

A :class:`Decomposition` lists :class:`FlowStep` s (device -> device, bytes) with the
steps each must wait for.  The engine starts a step when its dependencies finish and
lets the network model share links among all steps in flight, so contention with
other traffic, pipelining and full-duplex links all come out of the flow model
rather than out of a closed formula.

Members are hosts (one worker each).  A host talks through one device per NIC; like
NCCL's channels, a collective over hosts with ``K`` NICs each is split into ``K``
parallel copies of the algorithm, channel ``c`` on NIC ``c``.

Rules (one entry per kind in :data:`COLLECTIVE_RULES`):

- ``broadcast``: pipelined chain from the root through the other members in group
  order, in chunks of ``chunk_bytes``; each host boundary is crossed once.  Chunks
  stream back to back, so each edge pays its latency once and the time is
  ``(k - 1) * alpha + (chunks + k - 2) * chunk / B``: ``n / B`` plus the pipeline fill.
- ``allreduce``: ring (reduce-scatter then all-gather, ``2(p-1)`` steps of ``n/p``), or
  hierarchical (ring reduce-scatter inside each host over the fabric, one inter-host
  ring per device on its NIC, ring all-gather inside the host).
- ``allgather`` / ``reducescatter``: ring, ``p-1`` steps of ``n/p`` (``n`` is the full,
  gathered size).
- ``alltoall``: every member sends ``n/p`` to every other member at once.

    >>> from meshshard.cluster import ClusterSpec
    >>> d = decompose("allreduce", (0, 1, 2), None, 3e6, ClusterSpec.preset("aws-p3.8xlarge"))
    >>> len(d.steps), d.steps[0].src, d.steps[0].dst, d.steps[0].nbytes
    (12, (0, 0), (1, 0), 1000000.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.sim.topology import Endpoint

__all__ = [
    "FlowStep",
    "Decomposition",
    "COLLECTIVE_RULES",
    "decompose",
    "send_recv",
    "chain_broadcast",
    "ring_allreduce",
    "hierarchical_allreduce",
    "ring_allgather",
    "ring_reducescatter",
    "alltoall",
]


@dataclass(frozen=True)
class FlowStep:
    """Move ``nbytes`` from device ``src`` to device ``dst`` after steps ``deps`` finish.

    ``latency=False`` marks a chunk that streams right behind an earlier one on the
    same edge: the pipeline already paid the edge's latency once.
    """

    src: Endpoint
    dst: Endpoint
    nbytes: float
    deps: tuple[int, ...] = ()
    latency: bool = True


@dataclass(frozen=True)
class Decomposition:
    """A collective (``kind`` by ``algorithm``) over member hosts as a DAG of flow steps."""

    kind: str
    algorithm: str
    members: tuple[int, ...]
    nbytes: float
    steps: tuple[FlowStep, ...]

    def __str__(self) -> str:
        hosts = ",".join(f"w{h}" for h in self.members)
        return (
            f"{self.kind}/{self.algorithm} [{hosts}] {self.nbytes:.0f} B: "
            f"{len(self.steps)} flow steps"
        )


class _Builder:
    def __init__(self) -> None:
        self.steps: list[FlowStep] = []

    def add(self, src: Endpoint, dst: Endpoint, nbytes: float, deps=(), latency=True) -> int:
        self.steps.append(FlowStep(src, dst, float(nbytes), tuple(sorted(set(deps))), latency))
        return len(self.steps) - 1

    def ring(
        self, nodes: list[Endpoint], nbytes: float, nsteps: int, after: list[list[int]]
    ) -> list[list[int]]:
        """``nsteps`` ring steps: node i sends ``nbytes`` to node i+1 once it has what node
        i-1 sent it in the previous step.  ``after[i]`` gates node i's first send.
        Returns, per node, the steps it must see finish to be done (its last send and
        the last send into it)."""
        p = len(nodes)
        if p < 2 or nsteps == 0:
            return after
        prev: list[int | None] = [None] * p
        for s in range(nsteps):
            cur: list[int | None] = [None] * p
            for i in range(p):
                if s == 0:
                    deps = list(after[i])
                else:
                    deps = [prev[i], prev[(i - 1) % p]]
                cur[i] = self.add(
                    nodes[i], nodes[(i + 1) % p], nbytes, [d for d in deps if d is not None]
                )
            prev = cur
        return [[prev[i], prev[(i - 1) % p]] for i in range(p)]


def _channels(cluster: ClusterSpec) -> int:
    return cluster.nics_per_host


def _nic_device(cluster: ClusterSpec, host: int, channel: int) -> Endpoint:
    devices = cluster.devices_of_nic(channel % cluster.nics_per_host) or (0,)
    return (host, devices[0])


def send_recv(
    src: int, dst: int, nbytes: float, cluster: ClusterSpec, *, channel: int = 0
) -> Decomposition:
    """A point-to-point message: one flow from ``src``'s to ``dst``'s device on ``channel``'s NIC."""
    b = _Builder()
    b.add(_nic_device(cluster, src, channel), _nic_device(cluster, dst, channel), nbytes)
    return Decomposition("sendrecv", "direct", (src, dst), float(nbytes), tuple(b.steps))


def _channel_devices(
    cluster: ClusterSpec, host: int, devices: tuple[int, ...], channel: int
) -> list[Endpoint]:
    """Chain nodes of ``host`` on ``channel`` when the devices taking part are known: every
    listed device, entering through one on the channel's NIC when there is one."""
    nic = channel % cluster.nics_per_host
    on_nic = [i for i, d in enumerate(devices) if cluster.nic_of(d) == nic]
    first = on_nic[0] if on_nic else channel % len(devices)
    return [(host, d) for d in devices[first:] + devices[:first]]


def chain_broadcast(
    hosts: tuple[int, ...],
    root: int,
    nbytes: float,
    cluster: ClusterSpec,
    *,
    chunk_bytes: int | None = None,
    max_chunks: int = 1024,
    devices: Mapping[int, tuple[int, ...]] | None = None,
) -> Decomposition:
    """Pipelined chain broadcast (NCCL's ring broadcast): root -> next member -> ... in chunks.

    Each of the ``K`` channels carries ``n/K`` bytes in ``ceil(n/K / chunk_bytes)``
    chunks (at most ``max_chunks``; chunks grow past that).  Chunk ``j`` crosses edge
    ``e`` after it crossed edge ``e-1`` and after chunk ``j-1`` crossed edge ``e``.

    ``devices`` (host -> local devices taking part) makes the chain run device by device,
    as NCCL's ring over the group's GPUs does: it enters each host once, then visits that
    host's other listed devices over the intra-host fabric (the fan-out to every device
    that needs the data).  Without it each host is one node, its NIC's device.
    """
    order = _rooted(hosts, root)
    b = _Builder()
    k = _channels(cluster) if len(order) > 1 else 1
    per_channel = nbytes / k
    chunk = chunk_bytes or cluster.chunk_bytes
    nchunks = max(1, min(max_chunks, math.ceil(per_channel / chunk))) if per_channel > 0 else 1
    size = per_channel / nchunks
    for c in range(k):
        nodes: list[Endpoint] = []
        for h in order:
            devs = tuple(devices.get(h, ())) if devices else ()
            nodes += _channel_devices(cluster, h, devs, c) if devs else [_nic_device(cluster, h, c)]
        prev_edge: list[int] = []
        for e in range(len(nodes) - 1):
            edge: list[int] = []
            for j in range(nchunks):
                deps = []
                if prev_edge:
                    deps.append(prev_edge[j])
                if j:
                    deps.append(edge[j - 1])
                edge.append(b.add(nodes[e], nodes[e + 1], size, deps, latency=j == 0))
            prev_edge = edge
    return Decomposition("broadcast", "chain", order, float(nbytes), tuple(b.steps))


def ring_allreduce(hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec) -> Decomposition:
    """Ring all-reduce over hosts: ``2(p-1)`` steps of ``n/(pK)`` on each of ``K`` channels."""
    b = _Builder()
    p = len(hosts)
    k = _channels(cluster)
    for c in range(k):
        nodes = [_nic_device(cluster, h, c) for h in hosts]
        b.ring(nodes, nbytes / (p * k), 2 * (p - 1), [[] for _ in nodes])
    return Decomposition("allreduce", "ring", tuple(hosts), float(nbytes), tuple(b.steps))


def hierarchical_allreduce(
    hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec
) -> Decomposition:
    """Reduce-scatter inside each host, all-reduce each 1/G slice across hosts, all-gather inside.

    The inter-host phase runs one ring per device over that device's NIC, so hosts
    with one NIC per device use them all and hosts sharing one NIC contend on it.
    """
    b = _Builder()
    p, g = len(hosts), cluster.devices_per_host
    # phase 1: reduce-scatter inside each host (ring over its G devices)
    done1: dict[int, list[list[int]]] = {}
    for h in hosts:
        nodes = [(h, d) for d in range(g)]
        done1[h] = b.ring(nodes, nbytes / g, g - 1, [[] for _ in nodes])
    # phase 2: per device slot d, ring all-reduce of n/G across hosts
    done2: dict[int, list[list[int]]] = {h: [[] for _ in range(g)] for h in hosts}
    for d in range(g):
        nodes = [(h, d) for h in hosts]
        out = b.ring(nodes, nbytes / (g * p), 2 * (p - 1), [done1[h][d] for h in hosts])
        for i, h in enumerate(hosts):
            done2[h][d] = out[i]
    # phase 3: all-gather inside each host
    for h in hosts:
        nodes = [(h, d) for d in range(g)]
        b.ring(nodes, nbytes / g, g - 1, done2[h])
    return Decomposition("allreduce", "hierarchical", tuple(hosts), float(nbytes), tuple(b.steps))


def _ring_half(
    kind: str, hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec
) -> Decomposition:
    b = _Builder()
    p, k = len(hosts), _channels(cluster)
    for c in range(k):
        nodes = [_nic_device(cluster, h, c) for h in hosts]
        b.ring(nodes, nbytes / (p * k), p - 1, [[] for _ in nodes])
    return Decomposition(kind, "ring", tuple(hosts), float(nbytes), tuple(b.steps))


def ring_allgather(hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec) -> Decomposition:
    """Ring all-gather of a gathered size ``n``: ``p-1`` steps of ``n/(pK)`` per channel."""
    return _ring_half("allgather", hosts, nbytes, cluster)


def ring_reducescatter(
    hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec
) -> Decomposition:
    """Ring reduce-scatter of an input of ``n`` bytes per member: ``p-1`` steps of ``n/(pK)``."""
    return _ring_half("reducescatter", hosts, nbytes, cluster)


def alltoall(hosts: tuple[int, ...], nbytes: float, cluster: ClusterSpec) -> Decomposition:
    """All-to-all of ``n`` bytes per member: ``p(p-1)`` concurrent flows of ``n/p`` (split over channels)."""
    b = _Builder()
    p, k = len(hosts), _channels(cluster)
    for c in range(k):
        for i, src in enumerate(hosts):
            for j, dst in enumerate(hosts):
                if i != j:
                    b.add(
                        _nic_device(cluster, src, c), _nic_device(cluster, dst, c), nbytes / (p * k)
                    )
    return Decomposition("alltoall", "direct", tuple(hosts), float(nbytes), tuple(b.steps))


def _rooted(hosts: tuple[int, ...], root: int | None) -> tuple[int, ...]:
    if root is None:
        return tuple(hosts)
    i = hosts.index(root)
    return tuple(hosts[i:]) + tuple(hosts[:i])


Rule = Callable[..., Decomposition]

COLLECTIVE_RULES: dict[str, Rule] = {
    "broadcast": lambda hosts, root, n, cluster, **kw: chain_broadcast(
        hosts, root if root is not None else hosts[0], n, cluster, **kw
    ),
    "allreduce": lambda hosts, root, n, cluster, algorithm="ring", **kw: (
        hierarchical_allreduce(hosts, n, cluster)
        if algorithm == "hierarchical"
        else ring_allreduce(hosts, n, cluster)
    ),
    "allgather": lambda hosts, root, n, cluster, **kw: ring_allgather(hosts, n, cluster),
    "reducescatter": lambda hosts, root, n, cluster, **kw: ring_reducescatter(hosts, n, cluster),
    "alltoall": lambda hosts, root, n, cluster, **kw: alltoall(hosts, n, cluster),
}
"""Per-kind decomposition rules: ``rule(hosts, root, nbytes, cluster, **options)``."""


def decompose(
    kind: str,
    hosts: tuple[int, ...],
    root: int | None,
    nbytes: float,
    cluster: ClusterSpec,
    *,
    allreduce: str = "ring",
    chunk_bytes: int | None = None,
    max_chunks: int = 1024,
    devices: Mapping[int, tuple[int, ...]] | None = None,
) -> Decomposition:
    """The flow DAG of collective ``kind`` over member hosts ``hosts`` moving ``nbytes``.

    ``allreduce`` picks ``"ring"``, ``"hierarchical"`` or ``"auto"`` (hierarchical when
    hosts have several devices and several NICs, as NCCL's tree/ring choice would).
    ``devices`` (broadcast only) names each member's local devices that take part (see
    :func:`chain_broadcast`).
    """
    if kind not in COLLECTIVE_RULES:
        raise ValueError(
            f"no decomposition rule for collective {kind!r}; known: {sorted(COLLECTIVE_RULES)}"
        )
    if allreduce == "auto":
        multi = cluster.devices_per_host > 1 and cluster.nics_per_host > 1
        allreduce = "hierarchical" if multi else "ring"
    if allreduce not in ("ring", "hierarchical"):
        raise ValueError(
            f"allreduce algorithm must be 'ring', 'hierarchical' or 'auto', got {allreduce!r}"
        )
    hosts = tuple(hosts)
    if len(hosts) < 2 and not (kind == "broadcast" and devices):
        return Decomposition(kind, "local", hosts, float(nbytes), ())
    kw: dict = {}
    if kind == "broadcast":
        kw = {"chunk_bytes": chunk_bytes, "max_chunks": max_chunks, "devices": devices}
    elif kind == "allreduce":
        kw = {"algorithm": allreduce}
    return COLLECTIVE_RULES[kind](hosts, root, float(nbytes), cluster, **kw)
