"""The in-host fan-out after a point-to-point message: the landing device scatters.

A point-to-point message whose receiving host lists several devices lands on the first
of them (through the NIC); the runtime then copies to every other listed device the
blocks *it* needs (device path: ``jax.device_put`` of each shard from the landing
device, :class:`~meshshard.runtime.device_blocks.DeviceBlocks`), in parallel.  A
host-level message (:class:`~meshshard.plan.Message` with ``blocks``) of four blocks for
four devices therefore costs one fabric latency after its NIC hop, not three chained
hops carrying every byte.  The copies follow the NIC chunk by chunk (the message moves
in ``chunk_bytes`` chunks; each device takes its share of every chunk), so a large
message's fan-out overlaps its NIC transfer.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import Block, Message
    >>> m = Message(0, 1, ((0, 4),), 32, blocks=(Block(((0, 4),), 0, ((0,),)),
    ...             Block(((4, 8),), 0, ((1, 2),))), dst_devices=((0, 1, 2),))
    >>> device_shares(m, 0)
    ((0, 16.0), (1, 16.0), (2, 16.0))
    >>> d = scatter_fanout((0, 0), (1, 0), 32.0, ((0, 16.0), (1, 16.0), (2, 16.0)),
    ...                    ClusterSpec.preset("aws-p3.8xlarge"))
    >>> [(s.src, s.dst, s.nbytes, s.deps) for s in d.steps]
    [((0, 0), (1, 0), 32.0, ()), ((1, 0), (1, 1), 16.0, (0,)), ((1, 0), (1, 2), 16.0, (0,))]

A broadcast (:func:`scatter_broadcast`) runs the same way between hosts: the runtime
has one transport rank per host, so the chain crosses each host once, on one device,
and that device forwards every chunk to the next host and scatters it to its own
host's other devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.sim.collectives import Decomposition, FlowStep
from meshshard.sim.topology import Endpoint

__all__ = ["device_shares", "scatter_broadcast", "scatter_fanout"]

Shares = Sequence[tuple[int, float]]
"""``(device, bytes)`` per listed device of one receiving host (:func:`device_shares`)."""


def device_shares(msg: Message, receiver: int) -> tuple[tuple[int, float], ...]:
    """``(device, bytes)`` that each listed device of ``msg``'s receiver number
    ``receiver`` needs, in listed order (the blocks naming it, by element count)."""
    parts = msg.parts
    sizes = [math.prod(b - a for a, b in p.index) for p in parts]
    per_elem = msg.nbytes / max(1, sum(sizes))
    need: dict[int, float] = {}
    for part, n in zip(parts, sizes, strict=True):
        for d in part.dst_devices[receiver] if part.dst_devices else ():
            need[d] = need.get(d, 0.0) + n * per_elem
    devs = msg.dst_devices[receiver] if msg.dst_devices else ()
    return tuple((d, need.get(d, 0.0)) for d in devs)


def _scatter(steps: list[FlowStep], landing: Endpoint, arrivals: list[int], shares: Shares) -> None:
    """Append the copies of each chunk's share from ``landing`` to every other device of
    ``shares`` that needs bytes, chunk ``j`` once ``arrivals[j]`` is done."""
    n = len(arrivals)
    host = landing[0]
    for d, share in shares:
        if (host, d) == landing or share <= 0:
            continue
        prev: int | None = None
        for j in range(n):
            deps = (arrivals[j],) if prev is None else (arrivals[j], prev)
            steps.append(FlowStep(landing, (host, d), share / n, deps, j == 0))
            prev = len(steps) - 1


def _chunks(nbytes: float, chunk: int, max_chunks: int) -> int:
    return max(1, min(max_chunks, math.ceil(nbytes / chunk))) if nbytes > 0 else 1


def _entry(cluster: ClusterSpec, host: int, shares: Shares, channel: int) -> Endpoint:
    """The device a chain enters ``host`` through on ``channel``: the first listed device
    on that channel's NIC, else the channel's turn among the listed ones."""
    devs = [d for d, _ in shares] or [0]
    nic = channel % cluster.nics_per_host
    on_nic = [d for d in devs if cluster.nic_of(d) == nic]
    return (host, on_nic[0] if on_nic else devs[channel % len(devs)])


def scatter_broadcast(
    root: Endpoint,
    receivers: Sequence[tuple[int, Shares]],
    nbytes: float,
    cluster: ClusterSpec,
    *,
    chunk_bytes: int | None = None,
    max_chunks: int = 1024,
) -> Decomposition:
    """A chain broadcast of ``nbytes`` from device ``root`` through ``receivers`` (each a
    host and its devices' shares) in chunks on every NIC channel: it enters each host on
    one device, which passes every chunk on to the next host and scatters it to its
    host's other devices (module docstring).  Only each edge's first chunk pays its
    latency."""
    k = cluster.nics_per_host
    n = _chunks(nbytes / k, chunk_bytes or cluster.chunk_bytes, max_chunks)
    steps: list[FlowStep] = []
    for c in range(k):
        at, prev = root, None
        for host, shares in receivers:
            entry = _entry(cluster, host, shares, c)
            edge: list[int] = []
            for j in range(n):
                deps = tuple(
                    x
                    for x in ((prev[j] if prev else None), edge[-1] if edge else None)
                    if x is not None
                )
                steps.append(FlowStep(at, entry, nbytes / k / n, deps, j == 0))
                edge.append(len(steps) - 1)
            _scatter(steps, entry, edge, [(d, b / k) for d, b in shares])
            at, prev = entry, edge
    members = (root[0],) + tuple(h for h, _ in receivers)
    return Decomposition("broadcast", "chain+scatter", members, float(nbytes), tuple(steps))


def scatter_fanout(
    src: Endpoint,
    landing: Endpoint,
    nbytes: float,
    shares: Sequence[tuple[int, float]],
    cluster: ClusterSpec,
    *,
    chunk_bytes: int | None = None,
    max_chunks: int = 1024,
) -> Decomposition:
    """The flow DAG of a point-to-point message of ``nbytes`` from ``src`` to ``landing``
    in chunks, each chunk's share then copied from ``landing`` to every other device of
    ``shares`` that needs bytes (module docstring).  Only each edge's first chunk pays
    its latency."""
    n = _chunks(nbytes, chunk_bytes or cluster.chunk_bytes, max_chunks)
    steps: list[FlowStep] = []
    for j in range(n):
        steps.append(FlowStep(src, landing, nbytes / n, (len(steps) - 1,) if j else (), j == 0))
    _scatter(steps, landing, list(range(n)), shares)
    return Decomposition("sendrecv", "scatter", (src[0], landing[0]), float(nbytes), tuple(steps))
