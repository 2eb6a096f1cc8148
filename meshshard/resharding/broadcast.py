"""``broadcast``: our planner.  Every holder, cut slices, NIC-disjoint rounds.

Compared with the paper's broadcast planners (``broadcast_nolb/greedy/search``):

- **every replica counts**: a slice held by several source hosts can be sent by any of
  them, and one slice can be cut into sub-blocks sent by different holders, so the
  egress spreads over all holders exactly as the lower bound allows;
- **pooled flows**: slices with the same holder hosts and receiving hosts are pooled
  into one flow (:mod:`~meshshard.resharding.rounds`); the messages of one flow in one
  round run back to back between the same hosts.  (Two slices never merge into one
  message: a slice is the whole overlap of one source tile and one destination tile,
  so a larger block is never held by one device and needed whole by every receiver.)
- **rounds**: the flows are scheduled as rounds of host-disjoint transfers whose
  lengths come from a linear program (column generation), so no NIC waits on
  another's queue; a flow may reach its receivers in one chain broadcast (each host
  boundary crossed once, intra-host fan-out over the fabric) or receiver by receiver
  from different senders when that packs better.  The rounds are ordered by the
  estimate of :mod:`~meshshard.resharding.estimate`.

Messages go to every device that needs the block (``dst_devices``), so no local
all-gather is needed; a single receiving device gets a point-to-point message.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.baselines import Planned
from meshshard.resharding.blocks import by_host, cut_block, cut_dim, make_message
from meshshard.resharding.estimate import estimate_makespan
from meshshard.resharding.rounds import Flow, Round, Route, schedule_rounds
from meshshard.tiles import ReshardingProblem, SliceNeed

__all__ = ["broadcast", "pool_flows", "overhead"]

_DISPATCH_MAX_SLICES = 256  # the dispatcher is quadratic; beyond this the LP plans alone


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


def _realize(
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


def _message_seconds(nbytes: int, hops: int, cluster: ClusterSpec) -> float:
    """The estimate's time of one message (see :mod:`~meshshard.resharding.estimate`)."""
    bw = cluster.nic_bandwidth
    return (
        hops * cluster.nic_latency + (nbytes + (hops - 1) * min(cluster.chunk_bytes, nbytes)) / bw
    )


def _dispatch(problem: ReshardingProblem, cluster: ClusterSpec, split: bool) -> list[Message]:
    """Whole slices, dispatched as hosts free up: whenever a sender that holds a slice and
    all its receiving hosts are idle, it starts, busiest receivers first (their remaining
    work is the critical path), from the least-loaded idle holder.  Each slice goes to
    all its receiving hosts at once, or with ``split`` to each on its own.  Few
    messages and no idle NIC while work is ready: the better plan when latency rules."""
    itemsize = problem.itemsize
    items = []  # (need, receiving hosts, targets, seconds)
    for need in problem.needs:
        targets = by_host(need.receivers)
        for group in [[h] for h in targets] if split else [list(targets)]:
            took = _message_seconds(need.nbytes(itemsize), len(group), cluster)
            items.append((need, group, targets, took))
    left: dict[int, float] = {}
    for _, group, _, took in items:
        for h in group:
            left[h] = left.get(h, 0.0) + took
    free: dict[int, float] = {}
    sent: dict[int, float] = {}
    loads: dict = {}
    placed = []
    pending = list(range(len(items)))
    now = 0.0
    while pending:
        order = sorted(
            pending,
            key=lambda i: (-max(left[h] for h in items[i][1]), -items[i][3], items[i][0].index),
        )
        started = []
        for i in order:
            need, group, targets, took = items[i]
            if any(free.get(h, 0.0) > now for h in group):
                continue
            idle = [h for h in by_host(need.holders) if free.get(h, 0.0) <= now]
            if not idle:
                continue
            s = min(idle, key=lambda h: (sent.get(h, 0.0), h))
            for h in [s] + group:
                free[h] = now + took
            sent[s] = sent.get(s, 0.0) + took
            for h in group:
                left[h] -= took
            devs = [d for hh, d in need.holders if hh == s]
            sender = (s, min(devs, key=lambda d: loads.get((s, d), 0)))
            loads[sender] = loads.get(sender, 0) + need.nbytes(itemsize)
            placed.append((now, need, sender, [(h, targets[h]) for h in group]))
            started.append(i)
        done = set(started)
        pending = [i for i in pending if i not in done]
        later = [t for t in free.values() if t > now]
        if pending and later:
            now = min(later)
    rounds = {t: k for k, t in enumerate(sorted({p[0] for p in placed}))}
    return [make_message(n.index, itemsize, snd, rcv, rounds[t]) for t, n, snd, rcv in placed]


def broadcast(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """Our plan: pooled flows, every holder, cut slices, LP rounds (module docstring).

    Candidates: the round LP with and without the per-message overheads of
    :func:`overhead` (they matter for small slices and long chains), each realised in
    both round orders with slices cut to the LP's shares or rounded to whole slices,
    and whole slices dispatched as hosts free up (for latency-bound arrays).  The
    estimate of :mod:`~meshshard.resharding.estimate` picks one.
    """
    pools = pool_flows(problem)
    if not pools:
        return (), ()
    flows = [flow for flow, _ in pools]
    charged = schedule_rounds(flows, lambda r: overhead(r, pools[r.flow][1], problem, cluster))
    candidates: list[tuple[str, list[Message]]] = []
    for name, sched in (("LP", charged), ("LP without overheads", schedule_rounds(flows))):
        rounds = list(sched.rounds)
        for order, rev in ((rounds, ""), (rounds[::-1], ", reversed")):
            for whole in (False, True):
                desc = f"{name} rounds{rev}" + (", whole slices" if whole else "")
                candidates.append((desc, _realize(order, pools, problem, whole)))
    for split in (False, True) if len(problem.needs) <= _DISPATCH_MAX_SLICES else ():
        how = "per receiving host" if split else "to all receiving hosts"
        candidates.append((f"whole slices dispatched {how}", _dispatch(problem, cluster, split)))
    best = min(
        range(len(candidates)),
        key=lambda i: (round(estimate_makespan(candidates[i][1], cluster), 12), i),
    )
    desc, msgs = candidates[best]
    rounds_used = 1 + max((m.round for m in msgs), default=-1)
    return tuple(msgs), (f"{len(pools)} flows in {rounds_used} rounds: {desc}",)
