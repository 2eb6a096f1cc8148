"""LP rounds to messages: pool slices into flows, then cut each flow's bytes into rounds.

:mod:`~meshshard.resharding.rounds` schedules *flows* (bytes held by the same source
hosts and needed by the same destination hosts); this module makes the flows from a
problem's slices and turns a round schedule back into :class:`~meshshard.plan.Message` s.
A flow's slices are laid end to end as a byte stream; each route of each round takes
the next part of its stream (the broadcast part first, then each receiver's own part),
cut at row boundaries of the slices (or, with ``whole``, at slice boundaries: fewer,
larger messages whose shares drift from the LP's).  The sender device is the
least-loaded holder on the route's sender host; every device of a receiving host that
needs the block is listed, so no all-gather is needed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.blocks import by_host, cut_block, cut_dim, make_message
from meshshard.resharding.rounds import Flow, Round, Route
from meshshard.tiles import ReshardingProblem, SliceNeed

__all__ = ["pool_flows", "realize_rounds", "overhead"]


def pool_flows(problem: ReshardingProblem) -> list[tuple[Flow, list[SliceNeed]]]:
    """Slices pooled by (holder hosts, receiving hosts), each pool as a :class:`Flow`."""
    pools: dict[tuple, list[SliceNeed]] = {}
    for need in problem.needs:
        key = (tuple(by_host(need.holders)), tuple(by_host(need.receivers)))
        pools.setdefault(key, []).append(need)
    return [
        (Flow(s, r, float(sum(n.nbytes(problem.itemsize) for n in needs))), needs)
        for (s, r), needs in pools.items()
    ]


@dataclass
class _Stream:
    """A flow's slices laid end to end as bytes, cut only at row boundaries."""

    needs: list[SliceNeed]
    itemsize: int

    def __post_init__(self) -> None:
        self.starts = [0]
        for n in self.needs:
            self.starts.append(self.starts[-1] + n.nbytes(self.itemsize))

    @property
    def total(self) -> int:
        return self.starts[-1]

    def _row_bytes(self, k: int) -> int:
        need = self.needs[k]
        a, b = need.index[cut_dim(need.index)] if need.index else (0, 1)
        return need.nbytes(self.itemsize) // (b - a)

    def snap(self, pos: float, whole: bool = False) -> int:
        """The allowed cut nearest to byte ``pos`` (only slice boundaries if ``whole``)."""
        if pos <= 0:
            return 0
        if pos >= self.total:
            return self.total
        k = max(i for i, s in enumerate(self.starts[:-1]) if s <= pos)
        row = self.starts[k + 1] - self.starts[k] if whole else self._row_bytes(k)
        return self.starts[k] + round((pos - self.starts[k]) / row) * row

    def pieces(self, lo: int, hi: int):
        """``(need, block)`` of every part of bytes ``[lo, hi)``."""
        for k, need in enumerate(self.needs):
            a, b = max(lo, self.starts[k]), min(hi, self.starts[k + 1])
            if a >= b:
                continue
            row = self._row_bytes(k)
            r0, r1 = (a - self.starts[k]) // row, (b - self.starts[k]) // row
            yield need, cut_block(need.index, r0, r1) if need.index else need.index


def _portions(order: list[Round], pools) -> dict:
    """Per stream key, the ``(round position, route, bytes)`` it carries, in round order."""
    out: dict = {}
    for k, rnd in enumerate(order):
        for route, amount in zip(rnd.routes, rnd.amounts, strict=True):
            flow = pools[route.flow][0]
            key = (route.flow, None if route.receivers == flow.receivers else route.receivers[0])
            out.setdefault(key, []).append((k, route, amount))
    return out


def realize_rounds(
    order: list[Round], pools, problem: ReshardingProblem, whole: bool = False
) -> list[Message]:
    """Messages that carry each route's share of its flow, round by round; ``whole``
    rounds each share to whole slices (fewer, larger messages; shares drift)."""
    itemsize = problem.itemsize
    portions = _portions(order, pools)
    jobs: list[tuple[int, int, int, Route, int, int, _Stream]] = []  # round, flow, ... , range
    for f, (flow, needs) in enumerate(pools):
        stream = _Stream(needs, itemsize)
        full = portions.get((f, None), [])
        singles = (
            {r: portions.get((f, r), []) for r in flow.receivers} if len(flow.receivers) > 1 else {}
        )
        if singles and all(singles.values()):
            split = stream.snap(min(sum(p[2] for p in full), stream.total), whole)
        else:
            split = stream.total  # some receiver gets nothing alone: the broadcast covers all
        if split and not full:
            raise AssertionError(f"round LP left flow {flow} without a broadcast route")
        ranges = [(full, 0, split)] + [(ps, split, stream.total) for ps in singles.values()]
        for parts, lo, hi in ranges:
            if hi <= lo:
                continue
            done, cut = 0.0, lo
            for i, (k, route, nbytes) in enumerate(parts):
                done += nbytes
                end = (
                    hi if i == len(parts) - 1 else max(cut, min(hi, stream.snap(lo + done, whole)))
                )
                if end > cut:
                    jobs.append((k, f, i, route, cut, end, stream))
                cut = end
    jobs.sort(key=lambda j: j[:3])
    used = {k: i for i, k in enumerate(sorted({j[0] for j in jobs}))}  # rounds left non-empty
    loads: dict = {}
    msgs = []
    for k, _, _, route, lo, hi, stream in jobs:
        for need, block in stream.pieces(lo, hi):
            holders = [d for d in need.holders if d[0] == route.sender]
            sender = min(holders, key=lambda d: loads.get(d, 0))
            loads[sender] = loads.get(sender, 0) + need.nbytes(itemsize)
            targets = by_host(need.receivers)
            receivers = [(h, targets[h]) for h in route.receivers]
            msgs.append(make_message(block, itemsize, sender, receivers, used[k]))
    return msgs


def overhead(route: Route, pool: list[SliceNeed], problem, cluster: ClusterSpec) -> float:
    """Per-byte overhead fraction of ``route`` for the LP: every hop pays the NIC latency
    once and every hop after the first a chunk of pipeline fill, per message (a message
    carries about one slice of the pool)."""
    piece = sum(n.nbytes(problem.itemsize) for n in pool) / len(pool)
    hops = len(route.receivers)
    fill = (hops - 1) * min(cluster.chunk_bytes, piece)
    latency = hops * cluster.nic_latency * cluster.nic_bandwidth * cluster.nics_per_host
    return (fill + latency) / piece
