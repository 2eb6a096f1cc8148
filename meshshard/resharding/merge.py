"""Host-level messages: merge the slices one host sends to the same hosts into one message.

Every slice of a plan is its own message, and a message pays the NIC latency on every
hop (and, as a chain broadcast, holds all its hosts until its last hop is done), so a
plan of many small slices between the same hosts runs them one after another, each
paying its latencies.  :func:`host_messages` merges the messages with the same sender
host and the same receiving hosts in the same order (the same ``group``, or the same
point-to-point pair) into one :class:`~meshshard.plan.Message` carrying a list of
:class:`~meshshard.plan.Block` s: the bytes are the same, the latency is paid once.
The planner tries it on every candidate and keeps it where the estimate says it is
faster (:func:`~meshshard.resharding.broadcast.broadcast`).

    >>> from meshshard.plan import Message
    >>> msgs = [Message(0, 1, ((0, 4),), 16, (0, 1), 0, ((0,),)),
    ...         Message(0, 1, ((4, 8),), 16, (0, 1), 1, ((1,),), round=1)]
    >>> [str(m) for m in host_messages(msgs, per_round=False)]
    ['w0.0 -> w1.{0,1} [0:4] 32 B in 2 blocks']
    >>> host_messages(msgs, per_round=True) is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshshard.plan import Message

__all__ = ["host_messages", "merged"]


def merged(messages: Sequence[Message]) -> Message:
    """One message carrying the blocks of ``messages`` (same sender host and receivers),
    in order; its round is the first one's."""
    first = messages[0]
    if len(messages) == 1:
        return first
    blocks = tuple(b for m in messages for b in m.parts)
    devices = tuple(
        tuple(sorted({d for b in blocks for d in b.dst_devices[r]}))
        for r in range(len(first.receivers))
    )
    group = first.group
    if not group and (len(devices[0]) > 1):
        group = (first.src, first.dst)  # several receiving devices: a two-member group
    return dataclasses.replace(
        first,
        group=group,
        index=blocks[0].index,
        src_device=blocks[0].src_device,
        dst_devices=devices,
        nbytes=sum(m.nbytes for m in messages),
        chunk_bytes=0,
        blocks=blocks,
    )


def _key(m: Message, per_round: bool) -> tuple:
    hosts = m.group or (m.src, m.dst)
    return (m.round if per_round else 0, hosts)


def host_messages(messages: Sequence[Message], *, per_round: bool) -> list[Message] | None:
    """``messages`` with those of the same sender host and receiving hosts (and, with
    ``per_round``, the same round) merged into one host-level message at the place of
    the first; None when nothing merges."""
    groups: dict[tuple, list[Message]] = {}
    for m in messages:
        groups.setdefault(_key(m, per_round), []).append(m)
    if all(len(g) == 1 for g in groups.values()):
        return None
    out, seen = [], set()
    for m in messages:
        key = _key(m, per_round)
        if key not in seen:
            seen.add(key)
            out.append(merged(groups[key]))
    return out
