"""Tile arithmetic: which block of an array each device of a mesh holds.

Pure index math over ``(hosts, devices)`` meshes with axes ``("host", "device")`` and
PartitionSpecs written as tuples; used by planning (never by the runtime's hot path).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from meshshard.errors import MeshshardInputError
from meshshard.plan import MESH_AXES, MeshSpec, Spec, spec_str

Index = tuple[tuple[int, int], ...]


def device_blocks(mesh_shape: tuple[int, int], spec: Spec, shape: tuple[int, ...]) -> list[Index]:
    """The ``(start, stop)`` range per dim held by each device, devices in row-major order.

    >>> device_blocks((2, 2), (("host", "device"),), (8, 3))[1]
    ((2, 4), (0, 3))
    """
    sizes = dict(zip(MESH_AXES, mesh_shape, strict=True))
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if len(spec) > len(shape):
        raise MeshshardInputError(f"spec {spec} has more entries than the array has dims {shape}")
    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        pos = dict(zip(MESH_AXES, coord, strict=True))
        idx = []
        for dim, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            parts, part = 1, 0
            for ax in axes:
                if ax not in sizes:
                    raise MeshshardInputError(f"spec names mesh axis {ax!r}; axes are {MESH_AXES}")
                part = part * sizes[ax] + pos[ax]
                parts *= sizes[ax]
            if shape[dim] % parts:
                raise MeshshardInputError(
                    f"dim {dim} of size {shape[dim]} cannot be split over mesh axes {axes} "
                    f"of total size {parts}; choose a spec whose axes divide it"
                )
            step = shape[dim] // parts
            idx.append((part * step, (part + 1) * step))
        out.append(tuple(idx))
    return out


def block_nbytes(index: Index, itemsize: int) -> int:
    """Bytes of one block."""
    n = 1
    for a, b in index:
        n *= b - a
    return n * itemsize


DeviceRef = tuple[int, int]  # (worker/host id, local device index on that host)


@dataclass(frozen=True)
class SliceNeed:
    """One unit of a cross-mesh resharding: a block of the array, every source device that
    holds it, and every destination device that needs it."""

    index: Index
    holders: tuple[DeviceRef, ...]
    receivers: tuple[DeviceRef, ...]

    def nbytes(self, itemsize: int) -> int:
        return block_nbytes(self.index, itemsize)

    def __str__(self) -> str:
        idx = ",".join(f"{a}:{b}" for a, b in self.index)
        dev = lambda d: f"w{d[0]}.{d[1]}"  # noqa: E731
        return f"[{idx}] from {{{' '.join(map(dev, self.holders))}}} to {{{' '.join(map(dev, self.receivers))}}}"


@dataclass(frozen=True)
class ReshardingProblem:
    """An array sharded ``src_spec`` on ``src`` that is needed sharded ``dst_spec`` on ``dst``.

    ``needs`` is the many-to-many multicast: each slice, its holders and its receivers.
    Every destination device's tile is covered exactly once by the slices naming it.
    """

    shape: tuple[int, ...]
    dtype: str
    src: MeshSpec
    src_spec: Spec
    dst: MeshSpec
    dst_spec: Spec
    needs: tuple[SliceNeed, ...]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def dst_tile(self, device: DeviceRef) -> Index:
        """The block destination device ``device`` must end up holding."""
        blocks = device_blocks(self.dst.axis_shape, self.dst_spec, self.shape)
        return blocks[self.dst.hosts.index(device[0]) * self.dst.shape[1] + device[1]]

    def __str__(self) -> str:
        head = (
            f"reshard {self.dtype}{list(self.shape)}: mesh{self.src.id} {self.src.shape} {spec_str(self.src_spec)} -> "
            f"mesh{self.dst.id} {self.dst.shape} {spec_str(self.dst_spec)}, {len(self.needs)} slices"
        )
        return "\n".join([head] + [f"  {n}" for n in self.needs])


def _devices(mesh: MeshSpec) -> list[DeviceRef]:
    return [(h, d) for h in mesh.hosts for d in range(mesh.shape[1])]


def intersect(a: Index, b: Index) -> Index | None:
    """The overlap of two blocks, or None."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def resharding_problem(
    shape: tuple[int, ...], dtype: str, src: MeshSpec, src_spec: Spec, dst: MeshSpec, dst_spec: Spec
) -> ReshardingProblem:
    """Cut the array into the slices each destination device needs and find their holders."""
    shape = tuple(shape)
    src_tiles: dict[Index, list[DeviceRef]] = {}
    for dev, idx in zip(_devices(src), device_blocks(src.axis_shape, src_spec, shape), strict=True):
        src_tiles.setdefault(idx, []).append(dev)
    dst_tiles: dict[Index, list[DeviceRef]] = {}
    for dev, idx in zip(_devices(dst), device_blocks(dst.axis_shape, dst_spec, shape), strict=True):
        dst_tiles.setdefault(idx, []).append(dev)
    needs = []
    for d_idx, receivers in dst_tiles.items():
        for s_idx, holders in src_tiles.items():
            part = intersect(d_idx, s_idx)
            if part is not None:
                needs.append(SliceNeed(part, tuple(holders), tuple(receivers)))
    needs.sort(key=lambda n: n.index)
    return ReshardingProblem(
        shape, str(np.dtype(dtype)), src, tuple(src_spec), dst, tuple(dst_spec), tuple(needs)
    )
