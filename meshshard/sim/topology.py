"""The links of a described cluster and the path a message takes over them.

Every link is one *direction* of a physical port, so a full-duplex NIC is two links
(``out`` and ``in``) that never contend with each other.  Per host there are:

- ``h{h}.d{d}.out`` / ``h{h}.d{d}.in``: device ``d``'s port into the intra-host fabric
  (NVLink/NVSwitch, or memcpy between emulated CPU devices), ``intra_bandwidth``;
- ``h{h}.nic{k}.out`` / ``h{h}.nic{k}.in``: NIC ``k``, ``nic_bandwidth`` each way;
- ``switch``: only when ``oversubscription > 1``, the switch core shared by all
  inter-host traffic, ``num_hosts * nics_per_host * nic_bandwidth / oversubscription``.

A message between hosts runs device -> fabric -> NIC out -> (switch) -> NIC in ->
device; inside a host it runs device out -> device in.  It pays ``nic_latency`` or
``intra_latency`` once.

On a cluster split into workers (``ClusterSpec.split``: several meshes per host) the
links are the physical hosts': endpoints are ``(worker, device)`` and map to device
``first + d`` of the worker's block ``(host, first, devices)``, so two workers of one
host talk over the fabric and share that host's NICs.  Not where the fabric is
``memcpy`` (emulated CPU devices of one process): there every worker is a process that
talks over the transport, priced as a host of its own.

    >>> topo = Topology(ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2))
    >>> [topo.links[i].name for i in topo.path((0, 0), (1, 0))]
    ['h0.d0.out', 'h0.nic0.out', 'h1.nic0.in', 'h1.d0.in']
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec

__all__ = ["Link", "Topology", "Endpoint"]

Endpoint = tuple[int, int]
"""A (host, device) pair."""


@dataclass(frozen=True)
class Link:
    """One direction of one port: ``capacity`` bytes/s shared max-min fairly by its flows."""

    id: int
    name: str
    capacity: float
    kind: str  # "device", "nic" or "switch"

    def __str__(self) -> str:
        return f"{self.name} ({self.capacity / 1e9:.4g} GB/s)"


class Topology:
    """The link table of ``cluster`` and path/latency lookups (cached: paths repeat a lot)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        links: list[Link] = []
        self._dev: dict[tuple[int, int, str], int] = {}
        self._nic: dict[tuple[int, int, str], int] = {}
        # a memcpy fabric (emulated CPU devices) does not reach across processes: the
        # workers of a split local cluster talk over the transport, as separate hosts
        blocks = cluster.worker_blocks if cluster.intra_fabric != "memcpy" else ()
        self._blocks = blocks
        hosts = cluster.physical_hosts if blocks else cluster.num_hosts
        g = max(f + n for _, f, n in blocks) if blocks else cluster.devices_per_host
        self._host_devices = g
        k = cluster.nics_per_host
        for h in range(hosts):
            for d in range(g):
                for io in ("out", "in"):
                    self._dev[h, d, io] = len(links)
                    links.append(
                        Link(
                            len(links), f"h{h}.d{d}.{io}", float(cluster.intra_bandwidth), "device"
                        )
                    )
            for n in range(k):
                for io in ("out", "in"):
                    self._nic[h, n, io] = len(links)
                    links.append(
                        Link(len(links), f"h{h}.nic{n}.{io}", float(cluster.nic_bandwidth), "nic")
                    )
        self.switch: int | None = None
        if cluster.oversubscription > 1:
            self.switch = len(links)
            cap = hosts * k * cluster.nic_bandwidth / cluster.oversubscription
            links.append(Link(len(links), "switch", cap, "switch"))
        self.links: tuple[Link, ...] = tuple(links)
        self.capacity: list[float] = [link.capacity for link in links]
        self._paths: dict[tuple[Endpoint, Endpoint], tuple[int, ...]] = {}

    def path(self, src: Endpoint, dst: Endpoint) -> tuple[int, ...]:
        """Link ids a message from device ``src`` to device ``dst`` crosses (empty: same device)."""
        key = (src, dst)
        cached = self._paths.get(key)
        if cached is not None:
            return cached
        (sh, sd), (dh, dd) = self._physical(src), self._physical(dst)
        if src == dst:
            links: tuple[int, ...] = ()
        elif sh == dh:
            links = (self._dev[sh, sd, "out"], self._dev[dh, dd, "in"])
        else:
            mid = () if self.switch is None else (self.switch,)
            links = (
                self._dev[sh, sd, "out"],
                self._nic[sh, self._nic_of(sd), "out"],
                *mid,
                self._nic[dh, self._nic_of(dd), "in"],
                self._dev[dh, dd, "in"],
            )
        self._paths[key] = links
        return links

    def _physical(self, end: Endpoint) -> Endpoint:
        """The physical (host, device) of a (worker, device) endpoint."""
        if not self._blocks:
            return end
        w, d = end
        host, first, _ = self._blocks[w]
        return host, first + d

    def _nic_of(self, device: int) -> int:
        """The NIC of a physical host's device (spread evenly on a split cluster)."""
        if not self._blocks:
            return self.cluster.nic_of(device)
        return device * self.cluster.nics_per_host // self._host_devices

    def latency(self, src: Endpoint, dst: Endpoint) -> float:
        """Seconds a message from ``src`` to ``dst`` pays once, before its bytes move."""
        if src == dst:
            return 0.0
        same_host = (
            self._physical(src)[0] == self._physical(dst)[0] if self._blocks else src[0] == dst[0]
        )
        if same_host:
            return float(self.cluster.intra_latency)
        return float(self.cluster.nic_latency)

    def nic_device(self, host: int, channel: int) -> Endpoint:
        """The device a host uses for traffic on channel ``channel`` (one channel per NIC)."""
        nic = channel % self.cluster.nics_per_host
        devices = self.cluster.devices_of_nic(nic) or (0,)
        return (host, devices[0])


@functools.lru_cache(maxsize=16)
def topology_of(cluster: ClusterSpec) -> Topology:
    """The :class:`Topology` of ``cluster``, shared by the simulations of one cluster.

    A topology is read-only once built (its path cache only fills), and searches
    simulate thousands of candidate plans on one cluster: building the link table for
    each took a tenth of a small resharding's simulation.
    """
    return Topology(cluster)
