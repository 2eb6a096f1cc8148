"""Tile arithmetic: which block of an array each device of a mesh holds.

Pure index math over ``(hosts, devices)`` meshes with axes ``("host", "device")`` and
PartitionSpecs written as tuples; used by planning (never by the runtime's hot path).
"""

from __future__ import annotations

import itertools

from meshshard.errors import MeshshardInputError
from meshshard.plan import MESH_AXES, Spec

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
