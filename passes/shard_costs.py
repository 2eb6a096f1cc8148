"""Costs for sharding inference: a logical mesh with an alpha-beta model per axis.

A :class:`LogicalMesh` names each mesh axis with its size and the latency (alpha,
seconds) and inverse bandwidth (beta, seconds per byte) of the links a collective over
that axis crosses: the intra-host fabric for ``device``, the NICs for ``host``
(``ClusterSpec`` fields).  Collective times are the closed forms of the ring
decompositions the simulator runs (:mod:`meshshard.sim.collectives`), with the same
byte convention (``n`` = buffer size for all-reduce and all-to-all, the full gathered
size for all-gather and reduce-scatter)::

    all-reduce        (p-1) alpha + 2 (p-1)/p n beta
    all-gather        (p-1) alpha +   (p-1)/p n beta      (reduce-scatter alike)
    all-to-all        (p-1) alpha +   (p-1)/p n beta      (each member sends n/p to each other)

A collective over several axes at once is priced on the slowest of them with the
product of their sizes (a ring through every device of the group).  An all-reduce pays
its latency like an all-gather, not twice: small ones run as trees (NCCL) or fused into
one (XLA's all-reduce combiner), and twice the latency made the solver gather a whole
activation rather than all-reduce a few bytes, which XLA's partitioner then did not do.

    >>> from meshshard.cluster import ClusterSpec
    >>> m = LogicalMesh.of((2, 4), ClusterSpec.preset("aws-p3.16xlarge"))
    >>> m.axes, m.shape
    (('host', 'device'), (2, 4))
    >>> m.collective_time("all-reduce", ("device",), 0.0)
    0.0
    >>> m.collective_time("all-reduce", ("device",), 1e6) < m.collective_time("all-reduce", ("host",), 1e6)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshshard.cluster import ClusterSpec
from meshshard.plan import MESH_AXES, MeshSpec

__all__ = ["LogicalMesh", "Comm"]


#: Collectives that sum partial values (what local accumulation runs once per step).
REDUCE_KINDS = ("all-reduce", "reduce-scatter")


@dataclass(frozen=True)
class Comm:
    """One predicted collective: ``kind`` (HLO name) over mesh ``axes``, ``nbytes`` moved
    in the simulator's convention, for value ``var`` (-1: none in particular)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    var: int = -1

    def __str__(self) -> str:
        return f"{self.kind}[{','.join(self.axes)}] {self.nbytes:.0f} B"


@dataclass(frozen=True)
class LogicalMesh:
    """Mesh axes (names, sizes) with per-axis alpha (s) and beta (s/byte) for collectives.

    ``peak_flops`` (FLOP/s per device) and ``memory_bandwidth`` (bytes/s) price compute.
    """

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    peak_flops: float = 1e12
    memory_bandwidth: float = 1e11

    def __post_init__(self) -> None:
        n = len(self.axes)
        if not (len(self.shape) == len(self.alpha) == len(self.beta) == n):
            raise ValueError(
                f"LogicalMesh needs one size, alpha and beta per axis {self.axes}, got "
                f"shape={self.shape}, alpha={self.alpha}, beta={self.beta}"
            )
        if any(not isinstance(s, int) or s < 1 for s in self.shape):
            raise ValueError(f"LogicalMesh.shape must be positive ints, got {self.shape!r}")

    @staticmethod
    def of(shape: tuple[int, int], cluster: ClusterSpec, dtype: str = "float32") -> LogicalMesh:
        """The (host, device) mesh of ``shape`` on ``cluster``, its collectives priced as
        ``cluster.mesh_collective()`` says (by default hosts talk through the NICs, all
        of a host's NICs sharing its inter-host traffic, and devices through the fabric)."""
        (host_alpha, host_bw), (dev_alpha, dev_bw) = cluster.mesh_collective()
        return LogicalMesh(
            axes=MESH_AXES,
            shape=(int(shape[0]), int(shape[1])),
            alpha=(host_alpha, dev_alpha),
            beta=(1.0 / host_bw, 1.0 / dev_bw),
            peak_flops=cluster.flops_for(dtype),
            memory_bandwidth=cluster.memory_bandwidth,
        )

    @staticmethod
    def of_mesh(mesh: MeshSpec, cluster: ClusterSpec, dtype: str = "float32") -> LogicalMesh:
        """The axes a plan's ``mesh`` shards over (its logical view, else its shape), each
        priced by the fabric it crosses: the host axis of a mesh inside one host (a view
        such as ``(1, 4)`` seen as 2 x 2) is the intra-host fabric, not the NICs.

        >>> from meshshard.cluster import ClusterSpec
        >>> from meshshard.plan import MeshSpec
        >>> m = LogicalMesh.of_mesh(MeshSpec(0, (1, 4), (0,), view=(2, 2)), ClusterSpec())
        >>> m.shape, m.alpha[0] == m.alpha[1], m.beta[0] == m.beta[1]
        ((2, 2), True, True)
        """
        lm = LogicalMesh.of(mesh.axis_shape, cluster, dtype)
        if len(mesh.hosts) > 1:
            return lm
        return replace(lm, alpha=(lm.alpha[1],) * 2, beta=(lm.beta[1],) * 2)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def size(self, axes: tuple[str, ...]) -> int:
        """Devices along ``axes`` together."""
        return math.prod(self.shape[self.axes.index(a)] for a in axes)

    def collective_time(self, kind: str, axes: tuple[str, ...], nbytes: float) -> float:
        """Seconds for collective ``kind`` of ``nbytes`` over ``axes`` (ring closed forms)."""
        p = self.size(axes)
        if p <= 1 or nbytes <= 0:
            return 0.0
        alpha = max(self.alpha[self.axes.index(a)] for a in axes)
        beta = max(self.beta[self.axes.index(a)] for a in axes)
        frac = (p - 1) / p
        if kind == "all-reduce":
            return (p - 1) * alpha + 2 * frac * nbytes * beta
        if kind in ("all-gather", "reduce-scatter"):
            return (p - 1) * alpha + frac * nbytes * beta
        if kind == "all-to-all":
            return (p - 1) * alpha + frac * nbytes * beta
        if kind == "collective-permute":
            return alpha + nbytes * beta
        raise ValueError(f"unknown collective kind {kind!r}")

    def latency(self, kind: str, axes: tuple[str, ...]) -> float:
        """The latency (alpha) part of :meth:`collective_time` of ``kind`` over ``axes``:
        what merging it into another collective of the same group saves.

        >>> from meshshard.cluster import ClusterSpec
        >>> m = LogicalMesh.of((1, 4), ClusterSpec())
        >>> t = m.collective_time("all-reduce", ("device",), 1e3)
        >>> 0 < m.latency("all-reduce", ("device",)) < t
        True
        """
        p = self.size(axes)
        if p <= 1:
            return 0.0
        alpha = max(self.alpha[self.axes.index(a)] for a in axes)
        return alpha if kind == "collective-permute" else (p - 1) * alpha

    def comm_time(self, comms) -> float:
        """Total seconds of a sequence of :class:`Comm`."""
        return sum(self.collective_time(c.kind, c.axes, c.nbytes) for c in comms)

    def __str__(self) -> str:
        return "x".join(f"{a}={s}" for a, s in zip(self.axes, self.shape, strict=True))
