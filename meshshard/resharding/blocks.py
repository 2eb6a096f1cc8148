"""Block arithmetic and message building shared by every resharding strategy.

A *block* is a ``((start, stop), ...)`` range per dim (a :data:`~meshshard.tiles.Index`).
Strategies cut slices into sub-blocks (to share one slice between senders, or to give
each replica device 1/R of it) and turn them into :class:`~meshshard.plan.Message` s;
the helpers here do both so every strategy obeys the same contract:

- a message's ``index`` lies inside the source tile of ``(src, src_device)``;
- it lies inside the destination tile of every device listed in ``dst_devices``;
- ``dst_devices[i]`` are the devices of receiver ``i`` (``group[1:]``, or ``dst``).

    >>> split_block(((0, 8), (0, 3)), 0, 4)
    (((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 6), (0, 3)), ((6, 8), (0, 3)))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshshard.plan import Message
from meshshard.tiles import DeviceRef, Index, block_nbytes

__all__ = [
    "volume",
    "contains",
    "split_block",
    "cut_dim",
    "cut_block",
    "by_host",
    "make_message",
]


def volume(index: Index) -> int:
    """Number of elements of a block."""
    n = 1
    for a, b in index:
        n *= b - a
    return n


def contains(outer: Index, inner: Index) -> bool:
    """True when block ``inner`` lies inside block ``outer``."""
    return all(a0 <= a1 and b1 <= b0 for (a0, b0), (a1, b1) in zip(outer, inner, strict=True))


def split_block(index: Index, dim: int, parts: int) -> tuple[Index, ...]:
    """``index`` cut into ``parts`` equal blocks along ``dim`` (its extent must divide)."""
    lo, hi = index[dim]
    step, rest = divmod(hi - lo, parts)
    assert rest == 0, (index, dim, parts)
    return tuple(
        index[:dim] + ((lo + i * step, lo + (i + 1) * step),) + index[dim + 1 :]
        for i in range(parts)
    )


def cut_dim(index: Index) -> int:
    """The dim along which a slice is cut into byte ranges: the outermost dim with at
    least 16 rows (so pieces stay contiguous when the slice is), else the longest one."""
    extents = [b - a for a, b in index]
    for d, n in enumerate(extents):
        if n >= 16:
            return d
    return max(range(len(extents)), key=lambda d: (extents[d], -d)) if extents else 0


def cut_block(index: Index, lo_row: int, hi_row: int) -> Index:
    """Rows ``[lo_row, hi_row)`` (relative) of ``index`` along :func:`cut_dim`."""
    if not index:
        return index
    d = cut_dim(index)
    a, _ = index[d]
    return index[:d] + ((a + lo_row, a + hi_row),) + index[d + 1 :]


def by_host(devices: Iterable[DeviceRef]) -> dict[int, tuple[int, ...]]:
    """Group ``(host, device)`` refs as ``{host: (devices...)}``, hosts and devices sorted."""
    out: dict[int, list[int]] = {}
    for h, d in devices:
        out.setdefault(h, []).append(d)
    return {h: tuple(sorted(set(out[h]))) for h in sorted(out)}


def make_message(
    index: Index,
    itemsize: int,
    src: DeviceRef,
    receivers: Sequence[tuple[int, tuple[int, ...]]],
    round: int = 0,
    *,
    group: bool | None = None,
) -> Message:
    """A message of block ``index`` from device ``src`` to ``receivers`` ((host, devices)...).

    Point-to-point when one device of one host receives (or ``group=False``), else a
    broadcast whose group is the sender followed by the receiving hosts in order.
    """
    receivers = tuple((h, tuple(devs)) for h, devs in receivers)
    if group is None:
        group = not (len(receivers) == 1 and len(receivers[0][1]) == 1)
    if not group and len(receivers) != 1:
        raise ValueError(f"a point-to-point message has one receiver, got {receivers}")
    return Message(
        src=src[0],
        dst=receivers[0][0],
        index=tuple(index),
        nbytes=block_nbytes(index, itemsize),
        group=(src[0],) + tuple(h for h, _ in receivers) if group else (),
        src_device=src[1],
        dst_devices=tuple(devs for _, devs in receivers),
        round=round,
    )
