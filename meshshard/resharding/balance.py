"""Balance a whole-slice schedule's last message over a second holder.

Whole-slice schedules (:mod:`~meshshard.resharding.whole`) give each point-to-point
message to one sender host, so where more destination hosts need private slices than
source hosts hold them, one sender ends a round later than the others: two holders
``A``, ``B`` of three slices for three hosts send ``A: s1, s3`` and ``B: s2``.  The
LP's cut rounds (:mod:`~meshshard.resharding.rounds`) share every slice instead and
pay a latency per piece.  :func:`balanced` cuts only the busiest sender's last
slice: another holder with time to spare sends its first rows *first*, before its own
messages (the receiver is idle then), and the busiest sender sends the rest at the
end, so both finish together: ``A: s1, s3[x:]`` and ``B: s3[:x], s2``, one latency
more on ``B`` but ``x`` bytes less on ``A``.  A message to one host may list several
of its devices (a two-member group, fanned out on arrival); chains and host-level
messages are left alone.  The share equalises the two senders'
busy time (``alpha + bytes / B`` per message); the estimate of
:mod:`~meshshard.resharding.estimate` decides whether the result is kept.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec, Message
    >>> from meshshard.tiles import resharding_problem
    >>> p = resharding_problem((20937,), "int32", MeshSpec(0, (2, 1), (0, 1)), (None,),
    ...                        MeshSpec(1, (3, 1), (2, 3, 4)), ("host",))
    >>> whole = [Message(0, 2, ((0, 6979),), 27916), Message(1, 3, ((6979, 13958),), 27916),
    ...          Message(0, 4, ((13958, 20937),), 27916, round=1)]
    >>> for m in balanced(p, whole, ClusterSpec.preset("aws-p3.8xlarge")):
    ...     print(m)
    w1.0 -> w4 [13958:17447] 13.6 KiB
    w0.0 -> w2 [0:6979] 27.3 KiB r1
    w1.0 -> w3 [6979:13958] 27.3 KiB r1
    w0.0 -> w4 [17447:20937] 13.6 KiB r2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.blocks import cut_block, cut_dim
from meshshard.resharding.bound import host_bandwidth
from meshshard.tiles import ReshardingProblem, block_nbytes

__all__ = ["balanced"]


def _busy(messages: Sequence[Message], cluster: ClusterSpec) -> dict[int, float]:
    """Each sender host's busy time: ``alpha + bytes / B`` per message."""
    bw, lat = host_bandwidth(cluster), float(cluster.nic_latency)
    out: dict[int, float] = {}
    for m in messages:
        out[m.src] = out.get(m.src, 0.0) + lat + m.nbytes / bw
    return out


def _last_of(messages: Sequence[Message], host: int) -> int:
    """Index of the message ``host`` sends last (by round, then position)."""
    mine = [i for i, m in enumerate(messages) if m.src == host]
    return max(mine, key=lambda i: (messages[i].round, i))


def balanced(
    problem: ReshardingProblem, messages: Sequence[Message], cluster: ClusterSpec
) -> list[Message] | None:
    """``messages`` with the busiest sender's last one-host slice shared with the
    least busy other holder of it (module docstring); None where nothing can move."""
    if not messages or any(len(m.group) > 2 or m.blocks for m in messages):
        return None  # chains and host-level messages are left alone
    busy = _busy(messages, cluster)
    top = max(busy, key=lambda h: (busy[h], -h))
    i = _last_of(messages, top)
    m = messages[i]
    need = next((n for n in problem.needs if n.index == m.index), None)
    if need is None:
        return None
    others = {h: d for h, d in need.holders if h != top}
    if not others:
        return None
    helper = min(others, key=lambda h: (busy.get(h, 0.0), h))
    bw, lat = host_bandwidth(cluster), float(cluster.nic_latency)
    share = (busy[top] - busy.get(helper, 0.0) - lat) * bw / 2  # bytes that move to helper
    rows = m.index[cut_dim(m.index)][1] - m.index[cut_dim(m.index)][0]
    cut = int(rows * share / m.nbytes) if m.nbytes else 0
    if not 0 < cut < rows:
        return None
    itemsize = problem.itemsize
    head, rest = cut_block(m.index, 0, cut), cut_block(m.index, cut, rows)
    first = dataclasses.replace(
        m, src=helper, index=head, nbytes=block_nbytes(head, itemsize), src_device=others[helper]
    )
    if m.group:  # a two-member group: one receiving host, several of its devices
        first = dataclasses.replace(first, group=(helper, m.dst))
    first = dataclasses.replace(first, round=0)
    last = dataclasses.replace(
        m, index=rest, nbytes=block_nbytes(rest, itemsize), round=m.round + 1
    )
    shifted = [dataclasses.replace(x, round=x.round + 1) for j, x in enumerate(messages) if j != i]
    return [first] + shifted + [last]
