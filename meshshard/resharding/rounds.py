"""Host-level schedule of a resharding as rounds of NIC-disjoint transfers (an LP).

The model is the one the runtime has: each host runs its communication one operation
at a time (one NIC, NCCL-stream semantics), and an operation keeps its sender and all
its receiving hosts busy until it ends.  A schedule that never leaves a NIC idle is a
sequence of *rounds*, each a set of host-disjoint transfers that run side by side.

Slices that have the same holder hosts and the same receiving hosts are
interchangeable at this level, so they are pooled into a :class:`Flow` (bytes from any
of ``senders`` to every one of ``receivers``).  A :class:`Route` moves part of a flow
from one sender either to all its receivers at once (one chain broadcast, each host
boundary crossed once) or to a single receiver (which lets a flow's receivers be
served by different senders at different times).

Choosing how long each round lasts is a linear program over *columns* (sets of
host-disjoint routes): minimise the total length such that every receiver of every
flow gets all its bytes.  A route may carry a per-byte overhead ``cost[route]`` (a
fraction: 0.5 means its bytes take 1.5x as long), which is how the planner charges a
chain broadcast's pipeline fill and every message's latency: in a round of length
``t`` a route moves ``t / (1 + cost)`` bytes.  Columns are generated on demand (column generation): the
pricing step finds the host-disjoint set of routes with the largest dual value, a
small set-packing MILP.  Slices may be cut, so the LP's optimum is a schedule: it
equals the best makespan of any plan in this model (fractional round lengths are just
slices cut into sub-blocks).  On every case of the paper's suite it meets the NIC
lower bound.

    >>> flows = [Flow((0,), (2,), 4), Flow((0,), (3,), 2), Flow((1,), (3,), 2), Flow((1,), (4,), 4)]
    >>> sched = schedule_rounds(flows)   # the paper's case 6 shape: 2 senders, 3 receivers
    >>> sched.length                      # each sender's 6 bytes, back to back
    6.0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

__all__ = ["Flow", "Route", "Round", "RoundSchedule", "routes_of", "schedule_rounds"]

_TOL = 1e-9


@dataclass(frozen=True)
class Flow:
    """Bytes held by every host in ``senders`` that every host in ``receivers`` needs."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: float


@dataclass(frozen=True)
class Route:
    """Part of flow ``flow`` sent by host ``sender`` to hosts ``receivers`` (all of the
    flow's receivers: one broadcast; or one of them)."""

    flow: int
    sender: int
    receivers: tuple[int, ...]

    @property
    def hosts(self) -> frozenset[int]:
        return frozenset((self.sender,) + self.receivers)


@dataclass(frozen=True)
class Round:
    """Host-disjoint routes that run side by side for ``length`` (unit-bandwidth seconds,
    i.e. bytes); route ``i`` moves up to ``amounts[i]`` bytes in that time."""

    routes: tuple[Route, ...]
    amounts: tuple[float, ...]
    length: float


@dataclass(frozen=True)
class RoundSchedule:
    """Rounds whose lengths (bytes per route) add up to ``length``; ``iterations`` of
    column generation; ``optimal`` unless the iteration cap stopped it."""

    rounds: tuple[Round, ...]
    length: float
    iterations: int
    optimal: bool


def routes_of(flows: list[Flow]) -> list[Route]:
    """Every route: per flow and sender, the broadcast to all receivers, and (for flows
    with several receivers) the send to each receiver alone."""
    out = []
    for i, f in enumerate(flows):
        for s in f.senders:
            out.append(Route(i, s, f.receivers))
            if len(f.receivers) > 1:
                out += [Route(i, s, (r,)) for r in f.receivers]
    return out


def _demands(flows: list[Flow]) -> list[tuple[int, int]]:
    return [(i, r) for i, f in enumerate(flows) for r in f.receivers]


def _column_vector(col: frozenset[int], routes: list[Route], rows: dict, rate) -> np.ndarray:
    v = np.zeros(len(rows))
    for k in col:
        route = routes[k]
        for r in route.receivers:
            v[rows[(route.flow, r)]] = rate[k]
    return v


def _greedy_columns(routes: list[Route], flows: list[Flow]) -> list[frozenset[int]]:
    """Starting columns: each route with as many later host-disjoint routes as fit."""
    cols = []
    for k in range(len(routes)):
        used = set(routes[k].hosts)
        col = [k]
        for j in range(len(routes)):
            if j != k and not (routes[j].hosts & used):
                col.append(j)
                used |= routes[j].hosts
        cols.append(frozenset(col))
    return list(dict.fromkeys(cols))


def _price(routes: list[Route], weights: np.ndarray, hosts: list[int]) -> frozenset[int]:
    """The host-disjoint set of routes with the largest total weight (set packing MILP)."""
    useful = [k for k in range(len(routes)) if weights[k] > _TOL]
    if not useful:
        return frozenset()
    slot = {h: i for i, h in enumerate(hosts)}
    a = np.zeros((len(hosts), len(useful)))
    for j, k in enumerate(useful):
        for h in routes[k].hosts:
            a[slot[h], j] = 1.0
    res = milp(
        -weights[useful],
        constraints=LinearConstraint(a, 0, 1),
        integrality=np.ones(len(useful)),
        bounds=Bounds(0, 1),
    )
    if res.x is None:  # pragma: no cover - a set packing is always feasible
        return frozenset()
    return frozenset(useful[j] for j in range(len(useful)) if res.x[j] > 0.5)


def schedule_rounds(
    flows: list[Flow], cost: Callable[[Route], float] | None = None, max_iterations: int = 200
) -> RoundSchedule:
    """The shortest sequence of rounds that delivers every flow (see module docstring).

    Lengths are in bytes (one host's NIC time at unit bandwidth); ``cost`` gives each
    route's per-byte overhead fraction (default none).
    """
    if any(f.nbytes <= 0 for f in flows):
        raise ValueError("every flow must carry bytes")
    if not flows:
        return RoundSchedule((), 0.0, 0, True)
    routes = routes_of(flows)
    rate = [1.0 / (1.0 + (cost(r) if cost else 0.0)) for r in routes]
    rows = {d: i for i, d in enumerate(_demands(flows))}
    demand = np.array([flows[i].nbytes for i, _ in rows])
    scale = float(demand.max())
    hosts = sorted({h for f in flows for h in f.senders + f.receivers})
    columns = _greedy_columns(routes, flows)
    seen = set(columns)
    optimal = False
    iterations = 0
    while True:
        iterations += 1
        a = np.stack([_column_vector(c, routes, rows, rate) for c in columns], axis=1)
        res = linprog(
            np.ones(len(columns)), A_ub=-a, b_ub=-demand / scale, bounds=(0, None), method="highs"
        )
        if res.status != 0:  # pragma: no cover - the starting columns cover every demand
            raise RuntimeError(f"round LP failed: {res.message}")
        if iterations >= max_iterations:
            break
        duals = -np.asarray(res.ineqlin.marginals)
        weights = np.zeros(len(routes))
        for k, route in enumerate(routes):
            weights[k] = rate[k] * sum(duals[rows[(route.flow, r)]] for r in route.receivers)
        best = _price(routes, weights, hosts)
        if sum(weights[k] for k in best) <= 1 + 1e-7 or best in seen:
            optimal = True
            break
        columns.append(best)
        seen.add(best)
    rounds = [
        Round(
            tuple(routes[k] for k in sorted(col)),
            tuple(float(t) * scale * rate[k] for k in sorted(col)),
            float(t) * scale,
        )
        for col, t in zip(columns, res.x, strict=True)
        if t > _TOL
    ]
    rounds.sort(key=lambda r: (-r.length, [(x.flow, x.sender, x.receivers) for x in r.routes]))
    return RoundSchedule(tuple(rounds), float(sum(r.length for r in rounds)), iterations, optimal)
