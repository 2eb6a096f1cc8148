"""What each destination device ends up holding: the contract every plan must meet.

:func:`check_messages` verifies, without data, that a list of messages reshards
exactly: each message reads a block its sender device holds, writes it only into
destination devices whose tile contains it, and every destination device's tile is
covered exactly once, either by what it receives itself or, for Alpa's local
all-gather, by what the devices of its host that hold the same tile received
together (a :class:`LocalGather`: each got 1/R over the network, the host shares).

    >>> from meshshard.plan import MeshSpec, Message
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((4,), "int32", MeshSpec(0, (1, 1), (0,)), (), MeshSpec(1, (1, 2), (1,)), ())
    >>> m = Message(0, 1, ((0, 4),), 16, group=(0, 1), dst_devices=((0, 1),))
    >>> check_messages(p, [m])
    ()
    >>> check_messages(p, [])
    Traceback (most recent call last):
    ...
    ValueError: destination device w1.0 gets 0 of the 4 elements of its tile [0:4]; every destination tile must be covered exactly once
"""

from __future__ import annotations

from collections.abc import Sequence

from meshshard.plan import Message
from meshshard.resharding.blocks import contains, volume
from meshshard.resharding.result import LocalGather, index_str
from meshshard.tiles import DeviceRef, Index, ReshardingProblem, block_nbytes, device_blocks

__all__ = ["check_messages", "source_tiles", "destination_tiles"]


def source_tiles(problem: ReshardingProblem) -> dict[DeviceRef, Index]:
    """The block each source device holds."""
    mesh = problem.src
    blocks = device_blocks(mesh.axis_shape, problem.src_spec, problem.shape)
    return {
        (h, d): blocks[i * mesh.shape[1] + d]
        for i, h in enumerate(mesh.hosts)
        for d in range(mesh.shape[1])
    }


def destination_tiles(problem: ReshardingProblem) -> dict[DeviceRef, Index]:
    """The block each destination device must end up holding."""
    mesh = problem.dst
    blocks = device_blocks(mesh.axis_shape, problem.dst_spec, problem.shape)
    return {
        (h, d): blocks[i * mesh.shape[1] + d]
        for i, h in enumerate(mesh.hosts)
        for d in range(mesh.shape[1])
    }


def _overlap(a: Index, b: Index) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))


def _first_overlap(blocks: Sequence[Index]) -> tuple[Index, Index] | None:
    order = sorted(blocks)
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            if a and b[0][0] >= a[0][1]:
                break  # sorted by the first dim's start: no later block can overlap ``a``
            if _overlap(a, b):
                return a, b
    return None


class _Where:
    """``message #i (m)`` for error messages, printed only when one is raised: printing
    every message checked cost more than checking it."""

    __slots__ = ("i", "m")

    def __init__(self, i: int, m: Message) -> None:
        self.i, self.m = i, m

    def __str__(self) -> str:
        return f"message #{self.i} ({self.m})"


def _check_one(m: Message, i: int, problem, src_tiles, dst_tiles) -> None:
    where = _Where(i, m)
    if m.group and (m.group[0] != m.src or len(m.group) < 2 or m.dst != m.group[1]):
        raise ValueError(f"{where}: group {m.group} must be (src, dst, ...)")
    if len(m.dst_devices) != len(m.receivers) or not all(m.dst_devices):
        raise ValueError(
            f"{where}: dst_devices {m.dst_devices} must list devices for each receiver "
            f"{m.receivers}"
        )
    if m.nbytes != sum(block_nbytes(b.index, problem.itemsize) for b in m.parts):
        raise ValueError(f"{where}: nbytes {m.nbytes} is not the size of its blocks")
    if m.blocks:
        _check_host_level(m, where)
    for b in m.parts:
        _check_block(b, m, where, src_tiles, dst_tiles)


def _check_host_level(m: Message, where: _Where) -> None:
    """A host-level message's header matches its blocks (``Message`` docstring)."""
    first = m.blocks[0]
    if (m.index, m.src_device) != (first.index, first.src_device):
        raise ValueError(f"{where}: index and src_device must be those of its first block")
    union = tuple(
        tuple(sorted({d for b in m.blocks for d in b.dst_devices[r]}))
        if all(len(b.dst_devices) == len(m.receivers) for b in m.blocks)
        else ()
        for r in range(len(m.receivers))
    )
    if union != m.dst_devices or not all(all(b.dst_devices) for b in m.blocks):
        raise ValueError(
            f"{where}: dst_devices {m.dst_devices} must be, per receiver, the devices its "
            f"blocks go to {union}; every block lists devices for each receiver"
        )


def _check_block(b, m: Message, where: _Where, src_tiles, dst_tiles) -> None:
    if (m.src, b.src_device) not in src_tiles:
        raise ValueError(f"{where}: sender w{m.src}.{b.src_device} is not a source device")
    if not contains(src_tiles[(m.src, b.src_device)], b.index):
        raise ValueError(
            f"{where}: block [{index_str(b.index)}] is not inside the tile "
            f"[{index_str(src_tiles[(m.src, b.src_device)])}] of its sender w{m.src}.{b.src_device}"
        )
    for h, devs in zip(m.receivers, b.dst_devices, strict=True):
        for d in devs:
            if (h, d) not in dst_tiles:
                raise ValueError(f"{where}: receiver w{h}.{d} is not a destination device")
            if not contains(dst_tiles[(h, d)], b.index):
                raise ValueError(
                    f"{where}: block [{index_str(b.index)}] is not inside the tile "
                    f"[{index_str(dst_tiles[(h, d)])}] of receiver w{h}.{d}"
                )


def check_messages(
    problem: ReshardingProblem, messages: Sequence[Message], *, allow_gather: bool = True
) -> tuple[LocalGather, ...]:
    """Raise ValueError unless ``messages`` reshard ``problem`` exactly; return the local
    all-gathers they rely on (destination devices that got only part of their tile).

    ``allow_gather=False`` demands that every destination device receive its whole tile
    itself (every strategy but ``local_allgather``).
    """
    src_tiles, dst_tiles = source_tiles(problem), destination_tiles(problem)
    got: dict[DeviceRef, list[Index]] = {dev: [] for dev in dst_tiles}
    for i, m in enumerate(messages):
        _check_one(m, i, problem, src_tiles, dst_tiles)
        for b in m.parts:
            for h, devs in zip(m.receivers, b.dst_devices, strict=True):
                for d in devs:
                    got[(h, d)].append(b.index)
    gathers: list[LocalGather] = []
    done: set[DeviceRef] = set()
    for dev, tile in dst_tiles.items():
        if dev in done:
            continue
        need = volume(tile)
        have = sum(volume(b) for b in got[dev])
        clash = _first_overlap(got[dev])
        if clash:
            raise ValueError(
                f"destination device w{dev[0]}.{dev[1]} receives overlapping blocks "
                f"[{index_str(clash[0])}] and [{index_str(clash[1])}]; each element must arrive once"
            )
        if have == need:
            continue
        replicas = tuple(
            d for (h, d), t in dst_tiles.items() if h == dev[0] and t == tile and d != dev[1]
        )
        pool = [b for d in (dev[1],) + replicas for b in got[(dev[0], d)]]
        if not allow_gather or not replicas or sum(volume(b) for b in pool) != need:
            raise ValueError(
                f"destination device w{dev[0]}.{dev[1]} gets {have} of the {need} elements of "
                f"its tile [{index_str(tile)}]; every destination tile must be covered exactly once"
            )
        clash = _first_overlap(pool)
        if clash:
            raise ValueError(
                f"the devices of w{dev[0]} holding tile [{index_str(tile)}] receive overlapping "
                f"blocks [{index_str(clash[0])}] and [{index_str(clash[1])}]; their all-gather needs "
                "each element once"
            )
        devices = tuple(sorted((dev[1],) + replicas))
        itemsize = problem.itemsize
        missing = max(need - sum(volume(b) for b in got[(dev[0], d)]) for d in devices)
        gathers.append(LocalGather(dev[0], devices, tile, need * itemsize, missing * itemsize))
        done.update((dev[0], d) for d in devices)
    return tuple(gathers)
