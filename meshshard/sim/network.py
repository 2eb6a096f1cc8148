"""Flow-level network model: concurrent flows share links max-min fairly.

A *flow* moves ``nbytes`` over a fixed set of links (one direction of a port each).
It first waits out its latency, then joins the active set.  Whenever a flow joins or
leaves, the rates of all active flows are re-solved by progressive filling (the
max-min fair allocation): raise every unfrozen flow's rate together until some link
is full, freeze the flows crossing it at that share, repeat.  Between two such events
every rate is constant, so each flow's finish time is exact.  Only the flows that
share links, directly or through other flows, with the one that joined or left can
change rate, so each event re-solves just that connected component.

This is the contention model PAPER_NOTES section 4.1 asks for: many sends through one
NIC slow each other down, a full-duplex NIC's two directions do not.

    >>> net = FlowNetwork([10.0])  # one link of 10 bytes/s
    >>> a = net.start(0.0, (0,), 10.0, latency=0.0)
    >>> b = net.start(0.0, (0,), 10.0, latency=0.0)
    >>> net.run()
    >>> a.end, b.end   # both share the link: 5 bytes/s each
    (2.0, 2.0)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

__all__ = ["Flow", "FlowNetwork", "max_min_rates"]

_INF = math.inf


def max_min_rates(paths: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates of flows over links (progressive filling).

    ``paths[i]`` lists the links flow ``i`` crosses; ``capacity[l]`` is link ``l``'s
    bytes/s.  A flow with no links (a copy on one device) gets an infinite rate.

        >>> max_min_rates([(0,), (0, 1), (1,)], [2.0, 10.0])
        [1.0, 1.0, 9.0]
    """
    n = len(paths)
    rates = [_INF] * n
    flows_on: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        for link in path:
            flows_on.setdefault(link, []).append(i)
    remaining = {link: float(capacity[link]) for link in flows_on}
    count = {link: len(fs) for link, fs in flows_on.items()}
    fixed = [False] * n
    while count:
        best, share = -1, _INF
        for link, c in count.items():
            s = remaining[link] / c
            if s < share:
                best, share = link, s
        share = max(share, 0.0)
        for i in flows_on[best]:
            if fixed[i]:
                continue
            fixed[i] = True
            rates[i] = share
            for link in paths[i]:
                remaining[link] -= share
                c = count[link] - 1
                if c:
                    count[link] = c
                else:
                    del count[link]
    return rates


class Flow:
    """One flow: ``nbytes`` over ``links``; ``start`` when issued, ``end`` when done."""

    __slots__ = (
        "id",
        "links",
        "nbytes",
        "remaining",
        "rate",
        "updated",
        "start",
        "active_at",
        "finish",
        "end",
        "active",
        "mark",
        "on_done",
        "label",
    )

    def __init__(self, fid, links, nbytes, start, latency, on_done, label):
        self.id = fid
        self.links = links
        self.nbytes = float(nbytes)
        self.remaining = float(nbytes)  # bytes left at time ``updated``
        self.rate = 0.0
        self.updated = start
        self.start = start
        self.active_at = start + latency
        self.finish = _INF
        self.end: float | None = None
        self.active = False
        self.mark = 0
        self.on_done = on_done
        self.label = label

    def __repr__(self) -> str:
        return f"Flow({self.label or self.id}, {self.nbytes:.0f} B, start={self.start}, end={self.end})"


class FlowNetwork:
    """Active flows over links of ``capacity`` bytes/s, advanced event by event.

    Drive it from an event loop: :meth:`start` flows, ask :meth:`next_time` for the
    next moment a flow activates or finishes, and :meth:`advance` to it, which calls
    each finished flow's ``on_done(flow)``.  :meth:`run` does that until idle.

    With ``record=True`` it keeps, per link, the (time, bytes/s) samples of its load
    (for the Chrome trace); busy time and bytes moved per link are always kept.
    """

    def __init__(self, capacity: Sequence[float], *, record: bool = False) -> None:
        self.capacity = [float(c) for c in capacity]
        self.record = record
        self.now = 0.0
        self._pending: list[tuple[float, int, Flow]] = []  # (activation time, id, flow)
        self._finishes: list[tuple[float, int, Flow]] = []  # (finish, id, flow), lazily pruned
        self._on_link: dict[int, set[Flow]] = {}  # active flows per link
        self._touched: list[int] = []  # links whose flow set changed since the last solve
        self._num_active = 0
        self._mark = 0
        self._link_mark = [0] * len(self.capacity)
        self._ids = 0
        n = len(self.capacity)
        self.load = [0.0] * n  # current bytes/s per link
        self.busy = [0.0] * n  # seconds with load > 0
        self.moved = [0.0] * n  # bytes carried
        self._since = [0.0] * n  # time of the last load change per link
        self.samples: list[list[tuple[float, float]]] = [[] for _ in range(n)] if record else []
        self.flows_started = 0

    # --- issuing -----------------------------------------------------------------
    def start(
        self,
        now: float,
        links: Sequence[int],
        nbytes: float,
        *,
        latency: float = 0.0,
        on_done: Callable[[Flow], None] | None = None,
        label: str = "",
    ) -> Flow:
        """Issue a flow at ``now``; it pays ``latency`` first, then moves ``nbytes`` over ``links``."""
        if now < self.now - 1e-12 * max(1.0, self.now):
            raise ValueError(f"cannot start a flow at t={now} before the network's time {self.now}")
        flow = Flow(self._ids, tuple(links), nbytes, now, latency, on_done, label)
        self._ids += 1
        self.flows_started += 1
        if latency > 0 or now > self.now or flow.nbytes <= 0 or not flow.links:
            heapq.heappush(self._pending, (flow.active_at, flow.id, flow))
        else:
            self._activate(flow, now)  # joins now; rates are re-solved before time moves
        return flow

    @property
    def idle(self) -> bool:
        """True when no flow is pending or active."""
        return not self._pending and not self._num_active

    # --- time --------------------------------------------------------------------
    def next_time(self) -> float:
        """When the next flow activates or finishes (``inf`` when idle)."""
        if self._touched:
            self._solve()
        t = self._next_finish()
        if self._pending and self._pending[0][0] < t:
            t = self._pending[0][0]
        return t

    def set_time(self, t: float) -> None:
        """Move the clock to ``t`` <= :meth:`next_time` when nothing happens in the network
        (an outside event), so flows started at ``t`` join at once."""
        if t > self.now:
            self.now = t

    def advance(self, t: float) -> list[Flow]:
        """Move time to ``t``, processing every activation and finish up to it in order;
        returns the flows that finished (their ``on_done`` has been called)."""
        done: list[Flow] = []
        while True:
            nxt = self.next_time()
            if nxt >= t:
                break
            done += self._step(nxt)
        return done + self._step(t)

    def run(self) -> None:
        """Advance until no flow is left (for tests and stand-alone use)."""
        while True:
            t = self.next_time()
            if t == _INF:
                return
            self.advance(t)

    def finish_stats(self, t_end: float) -> None:
        """Close the busy/bytes accounting of every link at ``t_end``."""
        for link, load in enumerate(self.load):
            if load > 0:
                dt = t_end - self._since[link]
                self.busy[link] += dt
                self.moved[link] += load * dt
                self._since[link] = t_end
                self.load[link] = 0.0
                if self.record:
                    self.samples[link].append((t_end, 0.0))

    # --- internals ---------------------------------------------------------------
    def _next_finish(self) -> float:
        heap = self._finishes
        while heap:
            t, _, f = heap[0]
            if f.active and f.finish == t:
                return t
            heapq.heappop(heap)  # stale: the flow finished or changed rate since
        return _INF

    def _step(self, t: float) -> list[Flow]:
        """Move to ``t`` (at most the next event time) and handle what happens at ``t``."""
        if self._touched:
            self._solve()
        if t > self.now:
            self.now = t
        done: list[Flow] = []
        tol = 1e-12 * max(1.0, t) + 1e-15
        heap, on_link, touched = self._finishes, self._on_link, self._touched
        while heap and heap[0][0] <= t + tol:
            ft, _, f = heapq.heappop(heap)
            if not f.active or f.finish != ft:
                continue
            f.active = False
            self._num_active -= 1
            for link in f.links:
                on_link[link].discard(f)
            touched.extend(f.links)
            done.append(f)
        pending = self._pending
        while pending and pending[0][0] <= t + tol:
            _, _, f = heapq.heappop(pending)
            if f.nbytes <= 0 or not f.links:
                done.append(f)  # nothing to move (or a same-device copy): done at activation
                continue
            self._activate(f, t)
        if touched:
            self._solve()
        for f in done:
            f.end = t
            f.remaining = 0.0
            f.rate = 0.0
        for f in done:
            if f.on_done is not None:
                f.on_done(f)
        return done

    def _activate(self, f: Flow, t: float) -> None:
        f.active = True
        f.updated = t
        self._num_active += 1
        on_link, touched = self._on_link, self._touched
        for link in f.links:
            flows = on_link.get(link)
            if flows is None:
                flows = on_link[link] = set()
            flows.add(f)
        touched.extend(f.links)

    def _solve(self) -> None:
        """Re-solve max-min rates of the flows connected to the touched links."""
        now = self.now
        on_link = self._on_link
        self._mark += 1
        mark = self._mark
        link_mark = self._link_mark
        comp_links: list[int] = []
        comp: list[Flow] = []
        stack = self._touched
        self._touched = []
        while stack:
            link = stack.pop()
            if link_mark[link] == mark:
                continue
            link_mark[link] = mark
            comp_links.append(link)
            flows = on_link.get(link)
            if flows:
                for f in flows:
                    if f.mark != mark:
                        f.mark = mark
                        comp.append(f)
                        stack.extend(f.links)
        if len(comp) == 1:  # the common case: a flow alone on its links
            f = comp[0]
            capacity = self.capacity
            rates = [min(capacity[link] for link in f.links)]
        else:
            rates = max_min_rates([f.links for f in comp], self.capacity)
        heap = self._finishes
        for f, r in zip(comp, rates, strict=True):
            rem = f.remaining - f.rate * (now - f.updated)
            f.remaining = rem if rem > 0 else 0.0
            f.updated = now
            if r != f.rate or f.finish == _INF:
                f.rate = r
                f.finish = now + (f.remaining / r if r > 0 else _INF)
                heapq.heappush(heap, (f.finish, f.id, f))
        new_load = dict.fromkeys(comp_links, 0.0)
        for f in comp:
            r = f.rate
            for link in f.links:
                new_load[link] += r
        load, since = self.load, self._since
        for link, new in new_load.items():
            old = load[link]
            if new == old:
                continue
            if old > 0:
                dt = now - since[link]
                self.busy[link] += dt
                self.moved[link] += old * dt
            since[link] = now
            load[link] = new
            if self.record:
                self.samples[link].append((now, new))
