"""The paper's baselines: send/recv, Alpa's local all-gather, and broadcast without order.

Each is the strategy the cross-mesh resharding paper (MLSys'23) compares against, as
PAPER_NOTES sections 1.3-1.4 describe them.  Work is visited in Alpa's naive order:
destination tile major, then (send/recv) receiver device, then source slice.  No
strategy here orders transfers: every message is in round 0, in that order.

- :func:`send_recv`: one point-to-point message per (receiver device, slice); the
  sender is the least-loaded holder *device* (Alpa's ``normal`` mode).  Every
  destination device gets its own copy over the network.
- :func:`local_allgather`: Alpa's default.  Each of a host's ``R`` replicas of a
  destination tile receives ``1/R`` of it (the tile cut ``R`` ways over its dims, by
  gcd), then the host all-gathers over its fabric.  Where Alpa's conditions fail (the
  tile is replicated over several hosts, or no dims divide ``R`` ways) the tile falls
  back to send/recv, as Alpa does.
- :func:`broadcast_nolb`: one broadcast per (destination tile, slice) to every host
  that needs it, from the slice's first holder ("Naive" in the paper's ablation).
- :func:`broadcast_greedy`: the same, sender host chosen greedily as the least loaded
  by bytes ("Load Balance Only", Alpa's ``loadbalance_size``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.blocks import by_host, make_message, split_block
from meshshard.resharding.coverage import destination_tiles
from meshshard.resharding.result import index_str
from meshshard.tiles import Index, ReshardingProblem, SliceNeed, intersect

__all__ = [
    "naive_order",
    "send_recv",
    "local_allgather",
    "broadcast_nolb",
    "broadcast_greedy",
    "Planned",
]

Planned = tuple[tuple[Message, ...], tuple[str, ...]]
"""What a strategy returns: its messages and notes for the reader."""


def naive_order(problem: ReshardingProblem) -> list[tuple[Index, list[SliceNeed]]]:
    """Destination tiles in order, each with its slices in order (Alpa's naive order)."""
    tiles = destination_tiles(problem)
    by_tile: dict[Index, list[SliceNeed]] = {}
    for need in problem.needs:
        by_tile.setdefault(tiles[need.receivers[0]], []).append(need)
    return [(tile, sorted(by_tile[tile], key=lambda n: n.index)) for tile in sorted(by_tile)]


def _least_loaded(candidates, loads: dict) -> tuple[int, int]:
    return min(candidates, key=lambda c: loads.get(c, 0))


def _send_recv_tile(problem, needs, loads) -> Iterator[Message]:
    itemsize = problem.itemsize
    for rdev in sorted(needs[0].receivers):
        for need in needs:
            sender = _least_loaded(need.holders, loads)
            loads[sender] = loads.get(sender, 0) + need.nbytes(itemsize)
            yield make_message(need.index, itemsize, sender, [(rdev[0], (rdev[1],))])


def send_recv(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """One point-to-point message per (receiver device, slice) from the least-loaded holder device."""
    loads: dict = {}
    msgs = [m for _, needs in naive_order(problem) for m in _send_recv_tile(problem, needs, loads)]
    return tuple(msgs), ()


def _gather_cuts(tile: Index, replicas: int) -> tuple[Index, ...] | None:
    """``tile`` cut into ``replicas`` blocks, chunking its dims in order by gcd (Alpa's
    ``_rewrite_allgather_spec``); None when the dims cannot give that many."""
    blocks = (tile,)
    left = replicas
    for dim, (a, b) in enumerate(tile):
        g = math.gcd(left, b - a)
        if g > 1:
            blocks = tuple(part for blk in blocks for part in split_block(blk, dim, g))
            left //= g
        if left == 1:
            return blocks
    return None if left > 1 else blocks


def local_allgather(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """Each replica device of a host-local destination tile receives 1/R of it; the host
    then all-gathers.  Tiles that break Alpa's conditions fall back to send/recv."""
    itemsize = problem.itemsize
    loads: dict = {}
    msgs: list[Message] = []
    multi_host, indivisible = [], []
    for tile, needs in naive_order(problem):
        receivers = by_host(needs[0].receivers)
        devices = sorted(needs[0].receivers)
        cuts = None
        if len(receivers) > 1:
            multi_host.append(tile)
        elif len(devices) > 1:
            cuts = _gather_cuts(tile, len(devices))
            if cuts is None:
                indivisible.append(tile)
        if cuts is None:
            msgs += _send_recv_tile(problem, needs, loads)
            continue
        for (h, d), part in zip(devices, cuts, strict=True):
            for need in needs:
                piece = intersect(part, need.index)
                if piece is None:
                    continue
                sender = _least_loaded(need.holders, loads)
                loads[sender] = loads.get(sender, 0) + need.nbytes(itemsize)
                msgs.append(make_message(piece, itemsize, sender, [(h, (d,))]))
    notes = []
    if multi_host:
        notes.append(
            f"{len(multi_host)} destination tile(s) are replicated over several hosts "
            f"(e.g. [{index_str(multi_host[0])}]): no local all-gather, plain send/recv"
        )
    if indivisible:
        notes.append(
            f"{len(indivisible)} destination tile(s) cannot be cut into one part per replica "
            f"by gcd (e.g. [{index_str(indivisible[0])}]): plain send/recv, redundant traffic"
        )
    return tuple(msgs), tuple(notes)


def _broadcasts(problem: ReshardingProblem, choose) -> Planned:
    itemsize = problem.itemsize
    msgs = []
    for _, needs in naive_order(problem):
        for need in needs:
            sender = choose(need)
            msgs.append(
                make_message(need.index, itemsize, sender, list(by_host(need.receivers).items()))
            )
    return tuple(msgs), ()


def broadcast_nolb(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """One broadcast per (destination tile, slice) from the slice's first holder, naive order."""
    return _broadcasts(problem, lambda need: need.holders[0])


def broadcast_greedy(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """One broadcast per (destination tile, slice); the sender host is the least loaded
    (bytes) of the slice's holder hosts, visited in naive order (Alpa's ``loadbalance_size``)."""
    loads: dict[int, int] = {}
    itemsize = problem.itemsize

    def choose(need: SliceNeed) -> tuple[int, int]:
        hosts = by_host(need.holders)
        h = min(hosts, key=lambda h: (loads.get(h, 0), list(hosts).index(h)))
        loads[h] = loads.get(h, 0) + need.nbytes(itemsize)
        return (h, hosts[h][0])

    return _broadcasts(problem, choose)
