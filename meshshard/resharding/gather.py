"""Broadcast + local gather: one device per receiving host, then the host all-gathers.

A broadcast that lists every device of a host needing a block chains through them
over the fabric, one hop (a fabric latency and, for a small block, the whole block)
per device, and it does so for every block.  When a host's devices hold the same
(replicated) tile, the host can instead take each block on *one* of them and
all-gather the tile once at the end (a
:class:`~meshshard.resharding.result.LocalGather`): the NIC carries the same bytes,
and the fan-out costs ``R - 1`` fabric latencies once, not once per block.  This is
what Alpa's ``local_allgather`` does with point-to-point sends; here it is applied to
any of our plans, blocks spread over the replicas by bytes received.

    >>> from meshshard.plan import MeshSpec, Message
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((8,), "int32", MeshSpec(0, (1, 2), (0,)), ("device",),
    ...                        MeshSpec(1, (1, 2), (1,)), ())
    >>> msgs = [Message(0, 1, ((0, 4),), 16, (0, 1), 0, ((0, 1),)),
    ...         Message(0, 1, ((4, 8),), 16, (0, 1), 1, ((0, 1),))]
    >>> [str(m) for m in gathered(msgs)]
    ['w0.0 -> w1.{0} [0:4] 16 B', 'w0.1 -> w1.{1} [4:8] 16 B']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshshard.plan import Message

__all__ = ["gathered"]


def gathered(messages: Sequence[Message]) -> list[Message] | None:
    """``messages`` with every receiving host taking each block on one of the devices
    listed for it (the least loaded so far), or None when no host lists several.

    A message left with one receiving device becomes point-to-point.  The devices a
    message listed for a host hold the same tile (a block lies inside one destination
    tile), so the host's all-gather completes every one of them.
    """
    if not any(len(devs) > 1 for m in messages for devs in m.dst_devices):
        return None
    load: dict[tuple[int, int], int] = {}
    out = []
    for m in messages:
        devices = []
        for h, devs in zip(m.receivers, m.dst_devices, strict=True):
            d = min(devs, key=lambda d: (load.get((h, d), 0), d))
            load[(h, d)] = load.get((h, d), 0) + m.nbytes
            devices.append((d,))
        group = m.group if len(devices) > 1 else ()
        out.append(dataclasses.replace(m, dst_devices=tuple(devices), group=group, chunk_bytes=0))
    return out
