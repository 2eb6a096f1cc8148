"""What a simulation returns: the predicted iteration, per worker, per link, per memory.

Everything is frozen and printable; ``print(result)`` gives the summary table the CLI
shows, :meth:`SimResult.write_trace` the Chrome trace (open it in Perfetto).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.plan import fmt_bytes
from meshshard.sim.costs import ProgramCost

__all__ = ["Span", "Counter", "WorkerStats", "LinkStats", "MemoryStats", "SimResult"]


@dataclass(frozen=True)
class Span:
    """One interval on a track: worker ``w3``'s compute (``lane="compute"``) or comm lane."""

    track: str
    lane: str
    name: str
    start: float
    end: float
    category: str = ""

    def __str__(self) -> str:
        return f"{self.track}/{self.lane} {self.name} [{self.start * 1e3:.4f}, {self.end * 1e3:.4f}] ms"


@dataclass(frozen=True)
class Counter:
    """A step function over time on a track: ``samples`` are (seconds, raw value) pairs;
    the value shown is ``raw * scale`` in ``unit``."""

    track: str
    name: str
    unit: str
    samples: tuple[tuple[float, float], ...]
    scale: float = 1.0


@dataclass(frozen=True)
class WorkerStats:
    """How one worker (host-actor and its devices) spent the iteration.

    ``compute`` is the time its devices ran programs, ``comm`` the time at least one
    of its communications was in flight, ``idle`` = iteration - compute (the bubble,
    communication stalls, rendezvous waits).
    """

    worker: int
    meshes: tuple[int, ...]
    devices: int
    compute: float
    comm: float
    finish: float
    iteration: float

    @property
    def idle(self) -> float:
        """Seconds the devices did not compute."""
        return self.iteration - self.compute

    @property
    def idle_fraction(self) -> float:
        """Idle share of the iteration (the pipeline bubble when communication is free)."""
        return self.idle / self.iteration if self.iteration > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"w{self.worker}: compute {self.compute * 1e3:.4g} ms, comm {self.comm * 1e3:.4g} ms, "
            f"idle {100 * self.idle_fraction:.1f}%"
        )


@dataclass(frozen=True)
class LinkStats:
    """Traffic on one link direction: bytes moved, time busy, utilisation of the iteration."""

    name: str
    kind: str
    capacity: float
    moved: float
    busy: float
    iteration: float

    @property
    def utilisation(self) -> float:
        """Bytes moved over what the link could have moved in the iteration."""
        denom = self.capacity * self.iteration
        return self.moved / denom if denom > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.moved / 2**20:.4g} MiB, busy {self.busy * 1e3:.4g} ms, "
            f"util {100 * self.utilisation:.1f}%"
        )


@dataclass(frozen=True)
class MemoryStats:
    """Peak bytes held on one device of a worker, and what they were at that moment."""

    worker: int
    peak: float
    at: float
    breakdown: tuple[tuple[str, float], ...]
    capacity: float

    @property
    def fits(self) -> bool:
        """True when the peak fits in the device's memory."""
        return self.peak <= self.capacity

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.4g} MiB" for k, v in self.breakdown if v)
        return (
            f"w{self.worker}: peak {self.peak / 2**20:.4g} MiB at {self.at * 1e3:.4g} ms ({parts})"
        )


@dataclass(frozen=True)
class SimResult:
    """A predicted iteration of a plan on a cluster (see module docstring)."""

    method: str
    cluster: ClusterSpec
    overlap: bool
    iteration_time: float
    workers: tuple[WorkerStats, ...]
    links: tuple[LinkStats, ...]
    memory: tuple[MemoryStats, ...]
    programs: tuple[ProgramCost, ...]
    spans: tuple[Span, ...]
    counters: tuple[Counter, ...]
    num_instructions: int
    num_flows: int
    notes: tuple[str, ...] = ()

    def worker(self, w: int) -> WorkerStats:
        """Stats of worker ``w``."""
        for s in self.workers:
            if s.worker == w:
                return s
        raise KeyError(f"no worker w{w} in this result")

    def link(self, name: str) -> LinkStats:
        """Stats of the link called ``name`` (``h0.nic0.out``)."""
        for s in self.links:
            if s.name == name:
                return s
        raise KeyError(f"no link {name!r} in this result")

    @property
    def bubble_fraction(self) -> float:
        """Mean idle fraction over workers."""
        if not self.workers:
            return 0.0
        return sum(w.idle_fraction for w in self.workers) / len(self.workers)

    def summary(self, max_links: int = 8) -> str:
        """The table the CLI prints: iteration time, workers, busiest links, notes."""
        mode = "overlap on" if self.overlap else "overlap off (blocking)"
        lines = [
            f"simulated plan {self.method!r} on {self.cluster}, {mode}",
            f"iteration time {self.iteration_time * 1e3:.4f} ms  "
            f"({len(self.workers)} workers, {self.num_instructions} instructions, "
            f"{self.num_flows} flows)",
            "",
            f"{'worker':<7}{'meshes':<8}{'compute ms':>11}{'comm ms':>10}{'idle %':>8}"
            f"{'peak mem/dev':>14}{'of cap':>8}",
        ]
        mem = {m.worker: m for m in self.memory}
        for w in self.workers:
            m = mem.get(w.worker)
            peak = fmt_bytes(m.peak) if m else "-"
            cap = f"{100 * m.peak / m.capacity:.1f}%" if m else "-"
            if m and not m.fits:
                cap += "!"
            meshes = ",".join(map(str, w.meshes)) or "-"
            lines.append(
                f"w{w.worker:<6}{meshes:<8}{w.compute * 1e3:>11.4f}{w.comm * 1e3:>10.4f}"
                f"{100 * w.idle_fraction:>8.1f}{peak:>14}{cap:>8}"
            )
        busy = sorted((s for s in self.links if s.moved > 0), key=lambda s: -s.utilisation)
        if busy:
            shown = busy[:max_links]
            lines += [
                "",
                f"links (busiest {len(shown)} of {len(busy)} used):",
                f"{'link':<16}{'GB/s':>9}{'moved':>12}{'busy %':>8}{'util %':>8}",
            ]
            for s in shown:
                busy_pct = 100 * s.busy / self.iteration_time if self.iteration_time else 0.0
                lines.append(
                    f"{s.name:<16}{s.capacity / 1e9:>9.4g}{fmt_bytes(s.moved):>12}"
                    f"{busy_pct:>8.1f}{100 * s.utilisation:>8.1f}"
                )
        over = [m for m in self.memory if not m.fits]
        if over:
            lines += [
                "",
                f"memory: {len(over)} worker(s) exceed device memory ("
                f"{fmt_bytes(self.cluster.device_memory)}): "
                + ", ".join(f"w{m.worker}" for m in over),
            ]
        if self.notes:
            lines += ["", "notes:"] + [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_chrome_trace(self) -> dict:
        """The timeline as a Chrome-trace object (one track per worker and per link)."""
        from meshshard.sim.trace import chrome_trace

        return chrome_trace(self)

    def write_trace(self, path: str) -> None:
        """Write :meth:`to_chrome_trace` as JSON to ``path`` (open it in ui.perfetto.dev)."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)

    def to_dict(self) -> dict:
        """Headline figures as a JSON-ready dict (no spans), for benchmarks and tools."""
        return {
            "method": self.method,
            "cluster": self.cluster.to_dict(),
            "overlap": self.overlap,
            "iteration_time": self.iteration_time,
            "num_instructions": self.num_instructions,
            "num_flows": self.num_flows,
            "workers": [
                {
                    "worker": w.worker,
                    "meshes": list(w.meshes),
                    "compute": w.compute,
                    "comm": w.comm,
                    "idle_fraction": w.idle_fraction,
                }
                for w in self.workers
            ],
            "links": [
                {"name": s.name, "moved": s.moved, "busy": s.busy, "utilisation": s.utilisation}
                for s in self.links
                if s.moved > 0
            ],
            "memory": [
                {"worker": m.worker, "peak": m.peak, "at": m.at, "breakdown": dict(m.breakdown)}
                for m in self.memory
            ],
            "notes": list(self.notes),
        }
