"""What a resharding planner returns: the messages, the local all-gathers, the figures.

>>> from meshshard.plan import MeshSpec, Message
>>> from meshshard.tiles import resharding_problem
>>> p = resharding_problem((8,), "int32", MeshSpec(0, (1, 1), (0,)), (), MeshSpec(1, (1, 2), (1,)), ())
>>> m = Message(0, 1, ((0, 8),), 32, group=(0, 1), dst_devices=((0, 1),))
>>> print(ReshardingPlan(p, "broadcast", (m,), lower_bound_s=1e-3, sim_time_s=None, planning_s=0.0))
reshard i32[8] 32 B: mesh0 (1, 1) P() -> mesh1 (1, 2) P()
  broadcast: 1 messages, 32 B over the network, lower bound 1.000 ms
  #0 r0 p2p   w0.0 -> w1.{0,1} [0:8] 32 B

A group of root and one receiver runs as a send, so it prints ``p2p``; ``bcast`` is
for groups of three or more workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.plan import Message, dtype_str, spec_str
from meshshard.tiles import Index, ReshardingProblem, block_nbytes

__all__ = ["ReshardingPlan", "LocalGather", "index_str", "fmt_bytes", "fmt_seconds"]


def index_str(index: Index) -> str:
    """A block as ``0:512,0:1024`` (start:stop per dim)."""
    return ",".join(f"{a}:{b}" for a, b in index)


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, as plans print them (``32 B``, ``1.5 MiB``, ``2.0 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_seconds(s: float) -> str:
    """Seconds as ``12.345 us`` / ``12.345 ms`` / ``1.234 s``, whichever reads best."""
    if s < 1e-3:
        return f"{s * 1e6:.3f} us"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def message_str(i: int, m: Message) -> str:
    """One message as ``#i r<round> bcast|p2p w<src>.<dev> -> w<h>.{devs} ... [block] size``
    (and ``in <chunk> chunks`` when the planner chose the broadcast's chunk); a
    host-level message lists its blocks as ``.<src dev>[block]->{devs}/...`` joined by ``+``.

    ``bcast`` only for what runs as a broadcast (a group of three or more workers); a
    group of root and one receiver runs as a send, so it prints ``p2p``.
    """
    to = " ".join(
        f"w{h}.{{{','.join(map(str, devs))}}}"
        for h, devs in zip(m.receivers, m.dst_devices or ((),) * len(m.receivers), strict=True)
    )
    kind = "bcast" if m.is_broadcast else "p2p  "
    chunk = f" in {fmt_bytes(m.chunk_bytes)} chunks" if m.chunk_bytes else ""
    if m.blocks:  # a host-level message: each block with its devices
        blocks = " + ".join(map(str, m.blocks))
        return f"#{i} r{m.round} {kind} w{m.src} -> {to} {blocks} {fmt_bytes(m.nbytes)}{chunk}"
    return (
        f"#{i} r{m.round} {kind} w{m.src}.{m.src_device} -> {to} [{index_str(m.index)}] "
        f"{fmt_bytes(m.nbytes)}{chunk}"
    )


@dataclass(frozen=True)
class LocalGather:
    """After the network phase, ``devices`` of worker ``host`` all-gather tile ``index``.

    Each of them received only part of the tile over the network (Alpa's "send/recv +
    local all-gather"); they exchange the parts over the intra-host fabric.  ``missing``
    is the most bytes any one of them lacks, i.e. what it takes in over the fabric.
    """

    host: int
    devices: tuple[int, ...]
    index: Index
    nbytes: int
    missing: int

    def __str__(self) -> str:
        devs = ",".join(map(str, self.devices))
        return (
            f"gather w{self.host}.{{{devs}}} [{index_str(self.index)}] {fmt_bytes(self.nbytes)}, "
            f"{fmt_bytes(self.missing)} per device over the fabric"
        )


@dataclass(frozen=True)
class ReshardingPlan:
    """How one array moves from its source mesh to its destination mesh.

    Attributes:
        problem: the slices, their holders and receivers (what must move).
        strategy: the planner that made it (one of ``STRATEGIES``).
        messages: point-to-point sends and broadcasts; a worker runs its share in
            ``(round, position)`` order.  ``src``/receivers are worker ids,
            ``src_device`` holds the block, ``dst_devices[i]`` are the devices of
            receiver ``i`` that store it.
        lower_bound_s: no plan can finish sooner on the cluster (the NIC bound, ``bound``).
        tight_bound_s: the chunk- and latency-aware bound (``bound.tight_bound``), or
            None when not computed.
        sim_time_s: the simulator's prediction, or None when not simulated.
        planning_s: seconds the planner took (simulation excluded).
        gathers: intra-host all-gathers that run after the messages (``local_allgather``).
        notes: what the planner wants a reader to know (fallbacks, search cut-offs).
    """

    problem: ReshardingProblem
    strategy: str
    messages: tuple[Message, ...]
    lower_bound_s: float
    sim_time_s: float | None
    planning_s: float
    gathers: tuple[LocalGather, ...] = ()
    notes: tuple[str, ...] = ()
    tight_bound_s: float | None = None

    @property
    def wire_bytes(self) -> int:
        """Bytes that cross host NICs (a broadcast counted once per receiving host)."""
        return sum(m.nbytes * len(m.receivers) for m in self.messages)

    @property
    def ratio(self) -> float | None:
        """Simulated time over the lower bound (None when not simulated)."""
        if self.sim_time_s is None or not self.lower_bound_s:
            return None
        return self.sim_time_s / self.lower_bound_s

    def __str__(self) -> str:
        p = self.problem
        total = block_nbytes(tuple((0, n) for n in p.shape), p.itemsize)
        head = (
            f"reshard {dtype_str(p.dtype)}[{','.join(map(str, p.shape))}] {fmt_bytes(total)}: "
            f"mesh{p.src.id} {p.src.shape} {spec_str(p.src_spec)} -> "
            f"mesh{p.dst.id} {p.dst.shape} {spec_str(p.dst_spec)}"
        )
        line = (
            f"  {self.strategy}: {len(self.messages)} messages, {fmt_bytes(self.wire_bytes)} "
            f"over the network, lower bound {fmt_seconds(self.lower_bound_s)}"
        )
        if self.tight_bound_s is not None:
            line += f", tight bound {fmt_seconds(self.tight_bound_s)}"
        if self.sim_time_s is not None:
            line += f", simulated {fmt_seconds(self.sim_time_s)} ({self.ratio:.3f}x"
            if self.tight_bound_s:
                line += f", {self.sim_time_s / self.tight_bound_s:.3f}x tight"
            line += ")"
        out = [head, line]
        out += [f"  {message_str(i, m)}" for i, m in enumerate(self.messages)]
        out += [f"  {g}" for g in self.gathers]
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)
