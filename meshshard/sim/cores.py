"""CPU oversubscription: work that shares a host's cores slows down (processor sharing).

On the emulated local cluster every host-actor is a process of one machine, so all
programs (and the runtime's host work) share ``ClusterSpec.host_cores`` cores.  Each
running op demands some cores (a program: its mesh's devices on the host, since XLA
runs one thread per emulated device; host work: one).  While the total demand ``d``
exceeds the cores ``c``, every running op progresses at ``c / d`` of its full speed;
an op's duration is its work at full speed.  Rates change only when an op starts or
ends, so the pool keeps one pending completion event and re-plans it at each change.

    >>> done = []
    >>> class Clock:
    ...     now = 0.0
    ...     events = []
    ...     def at(self, t, fn, arg): self.events.append((t, fn, arg))
    >>> clock = Clock()
    >>> pool = CorePool(clock, cores=1, complete=done.append)
    >>> pool.add("a", 1.0, 1); pool.add("b", 1.0, 1)  # two 1 s programs on one core
    >>> t, fn, arg = clock.events[-1]; clock.now = t; fn(arg)
    >>> t, sorted(done)
    (2.0, ['a', 'b'])
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CorePool"]

_EPS = 1e-12


class CorePool:
    """Processor sharing of ``cores`` among running ops (see the module docstring).

    ``clock`` has ``now`` and ``at(t, fn, arg)`` (the engine); ``complete(op)`` is
    called when an op's work is done.
    """

    def __init__(self, clock, cores: int, complete: Callable[[object], None]):
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.clock = clock
        self.cores = cores
        self.complete = complete
        self.active: dict[object, list[float]] = {}  # op -> [work left (s), demand]
        self.last = 0.0
        self.version = 0

    def rate(self) -> float:
        """Fraction of full speed every running op progresses at now."""
        demand = sum(d for _, d in self.active.values())
        return min(1.0, self.cores / demand) if demand > 0 else 1.0

    def _advance(self) -> None:
        now = self.clock.now
        step = (now - self.last) * self.rate()
        for entry in self.active.values():
            entry[0] -= step
        self.last = now

    def add(self, op, work: float, demand: float) -> None:
        """Start ``op`` with ``work`` seconds at full speed, needing ``demand`` cores."""
        self._advance()
        self.active[op] = [work, max(float(demand), _EPS)]
        self._plan()

    def _plan(self) -> None:
        self.version += 1
        if self.active:
            left = min(e[0] for e in self.active.values())
            t = self.clock.now + max(left, 0.0) / self.rate()
            self.clock.at(t, self._fire, self.version)

    def _fire(self, version: int) -> None:
        if version != self.version:
            return  # re-planned since
        self._advance()
        left = min(e[0] for e in self.active.values())
        done = [op for op, e in self.active.items() if e[0] <= left + _EPS]
        for op in done:
            del self.active[op]
        self._plan()
        for op in done:
            self.complete(op)
