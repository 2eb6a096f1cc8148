"""A fast estimate of a message list's makespan, for choosing between plans while planning.

Each host does one operation at a time, in ``(round, position)`` order; an operation
starts when its sender and all its receiving hosts are free (a rendezvous, as in
NCCL).  A point-to-point message keeps both sides busy for ``latency + bytes /
bandwidth`` (and, where its receiving host lists several devices, until the device it
lands on has copied each of them its blocks, :mod:`~meshshard.sim.fanout`).  A chain
broadcast moves ``C`` chunks (the message's ``chunk_bytes``, or the cluster's) down a
chain of hosts, entering each on one device, which also copies every chunk's share to
its host's other devices.  Chunks stream and only
the first pays an edge's latency, so the last chunk is done with edge ``e`` at the
longest path through the (chunk, edge) grid (a flow shop: the first chunk's row up
to some edge ``k``, then ``C - 1`` chunk times on the slowest edge from ``k`` on, and
each further edge once); a host is free once its last chunk has moved on (the last
host: once its last device has it).
Local all-gathers (:class:`~meshshard.resharding.result.LocalGather`) run on their
host after its messages.  It is the simulator's serial model without link sharing,
thousands of times cheaper; the simulator stays the judge.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import Message
    >>> c = ClusterSpec.preset("aws-p3.8xlarge")
    >>> msgs = [Message(0, 2, ((0, 1),), 1_250_000_000), Message(1, 3, ((1, 2),), 1_250_000_000)]
    >>> round(estimate_makespan(msgs, c), 6)   # side by side: 1 s + 30 us
    1.00003
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.result import LocalGather
from meshshard.sim.fanout import device_shares

_MAX_CHUNKS = 1024  # the simulator's default cap on chunks per broadcast channel

__all__ = ["execution_order", "estimate_makespan", "busy_seconds", "message_busy"]


def execution_order(messages: Sequence[Message]) -> list[int]:
    """Indices of ``messages`` in the order workers run them: by round, then position."""
    return sorted(range(len(messages)), key=lambda i: (messages[i].round, i))


def _chain_busy(
    nbytes: float, devices: Sequence[int], cluster: ClusterSpec, chunk: int = 0
) -> list[float]:
    """Seconds each host of a chain broadcast stays busy; ``devices[j]`` is how many
    devices host ``j`` (the root first) has in the chain (module docstring)."""
    channels = cluster.nics_per_host
    per = nbytes / channels
    size = chunk or cluster.chunk_bytes
    n = max(1, min(_MAX_CHUNKS, math.ceil(per / size))) if per > 0 else 1
    step = per / n
    edges = []  # (latency, chunk time, host it leaves)
    for j, count in enumerate(devices):
        if j:
            edges.append((cluster.nic_latency, step / cluster.nic_bandwidth, j - 1))
        edges += [(cluster.intra_latency, step / cluster.intra_bandwidth, j)] * (count - 1)
    out = [0.0] * len(devices)
    for e, (_, _, leaves) in enumerate(edges):
        done = _last_chunk_done(edges[: e + 1], n)
        out[leaves] = done
        out[-1] = done
    return out


def _last_chunk_done(edges: Sequence[tuple[float, float, int]], n: int) -> float:
    """When the last of ``n`` chunks has crossed every edge of ``edges`` (a flow shop
    where only the first chunk pays each edge's latency): the longest path through
    the grid, which leaves the first chunk's row at some edge ``k``."""
    best = 0.0
    first = 0.0  # latency + chunk time of the first chunk over edges 0..k
    for k in range(len(edges)):
        first += edges[k][0] + edges[k][1]
        rest = [took for _, took, _ in edges[k:]]
        path = first + sum(rest) + (n - 2) * max(rest) if n > 1 else first
        best = max(best, path)
    return best


def busy_seconds(nbytes: int, hosts: int, cluster: ClusterSpec, chunk: int = 0) -> list[float]:
    """Seconds each of a transfer's ``hosts`` (sender first, then the chain) stays busy,
    one device per host; ``chunk`` is the broadcast's chunk (0: the cluster's)."""
    if hosts <= 2:
        return [cluster.nic_latency + nbytes / cluster.nic_bandwidth] * hosts
    return _chain_busy(nbytes, [1] * hosts, cluster, chunk)


def _scatter_busy(m: Message, cluster: ClusterSpec) -> list[float]:
    """A point-to-point message whose receiving host fans it out: its chunks cross the
    NIC, and the landing device copies each chunk's share on to the other devices in
    parallel through its fabric port (:mod:`~meshshard.sim.fanout`).  Both sides are
    busy for the NIC part; the third entry is when the copies are done (the receiving
    host's data is ready then, but its next message need not wait)."""
    shares = device_shares(m, 0)
    landing = shares[0][0] if shares else 0
    others = sum(b for d, b in shares if d != landing)
    size = m.chunk_bytes or cluster.chunk_bytes
    n = max(1, min(_MAX_CHUNKS, math.ceil(m.nbytes / size))) if m.nbytes > 0 else 1
    nic = cluster.nic_latency + m.nbytes / cluster.nic_bandwidth
    if others <= 0:
        return [nic, nic, nic]
    edges = [
        (cluster.nic_latency, m.nbytes / n / cluster.nic_bandwidth, 0),
        (cluster.intra_latency, others / n / cluster.intra_bandwidth, 1),
    ]
    return [nic, nic, _last_chunk_done(edges, n)]


def message_busy(m: Message, cluster: ClusterSpec) -> list[float]:
    """Seconds each member of message ``m`` (sender first) stays busy, its devices included."""
    if not m.group:
        return [cluster.nic_latency + m.nbytes / cluster.nic_bandwidth] * 2
    if len(m.group) == 2:
        return _scatter_busy(m, cluster)
    if not m.dst_devices:
        return _chain_busy(m.nbytes, [1] * len(m.group), cluster, m.chunk_bytes)
    return _scatter_chain_busy(m, cluster)


def _scatter_chain_busy(m: Message, cluster: ClusterSpec) -> list[float]:
    """A broadcast chains through one device per host, and each receiving host's entry
    device scatters every chunk to its other devices (:mod:`~meshshard.sim.fanout`):
    a host is free once its last chunk has moved on and its own copies are done."""
    per = m.nbytes / cluster.nics_per_host
    size = m.chunk_bytes or cluster.chunk_bytes
    n = max(1, min(_MAX_CHUNKS, math.ceil(per / size))) if per > 0 else 1
    hop = (cluster.nic_latency, per / n / cluster.nic_bandwidth, 0)
    out = [_last_chunk_done([hop], n)]
    for r in range(len(m.receivers)):
        into = [hop] * (r + 1)
        shares = device_shares(m, r)
        entry = shares[0][0] if shares else 0
        others = sum(b for d, b in shares if d != entry) / cluster.nics_per_host
        done = _last_chunk_done(into + [hop], n) if r + 1 < len(m.receivers) else 0.0
        scatter = (cluster.intra_latency, others / n / cluster.intra_bandwidth, 1)
        tail = _last_chunk_done(into + [scatter], n) if others > 0 else 0.0
        out.append(max(done, tail, _last_chunk_done(into, n)))
    return out


def estimate_makespan(
    messages: Sequence[Message], cluster: ClusterSpec, gathers: Sequence[LocalGather] = ()
) -> float:
    """Seconds until the last host finishes, in the serial host model (module docstring)."""
    clock: dict[int, float] = {}
    ready: dict[int, float] = {}  # when a host's in-host copies after its messages are done
    for i in execution_order(messages):
        m = messages[i]
        members = (m.src,) + tuple(m.receivers)
        start = max(clock.get(h, 0.0) for h in members)
        busy = message_busy(m, cluster)
        for h, took in zip(members, busy, strict=False):
            clock[h] = start + took
        if len(busy) > len(members):
            ready[m.dst] = max(ready.get(m.dst, 0.0), start + busy[-1])
    for h, t in ready.items():
        clock[h] = max(clock[h], t)
    for g in gathers:
        clock[g.host] = clock.get(g.host, 0.0) + (
            g.missing / cluster.intra_bandwidth + (len(g.devices) - 1) * cluster.intra_latency
        )
    return max(clock.values(), default=0.0)
