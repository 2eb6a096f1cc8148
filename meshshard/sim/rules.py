"""Per-instruction rules of the simulator engine, keyed by instruction type.

Each :class:`Rule` says how one instruction kind is built into the engine's graph (its
dependencies and its matching key) and what happens when it reaches the head of its
queue.  :data:`RULES` maps instruction types to rules, so a new instruction kind adds
one entry here and nothing in the event loop::

    >>> from meshshard.instructions import Send, WaitAll
    >>> RULES[Send].comm_span, RULES[WaitAll].comm_span
    ('flow', None)

Matching keys are named tuples, read by field name (never by position), hashed and
compared in C (the engine makes one per instruction): SPMD programs of a multi-host
mesh meet at a :class:`RunKey`, the two sides of a message at a :class:`P2PKey`, and
the members of a collective at a :class:`CollKey`.  Their field counts differ, so keys
of two kinds never compare equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Load,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    Zeros,
)
from meshshard.refs import (
    BufferKind,
    BufferRef,
    CollectiveKind,
    ProgramRef,
    TransferRef,
)

if TYPE_CHECKING:  # the engine passes itself in; no import cycle at run time
    from meshshard.sim.engine import _Engine, _Op

__all__ = ["Rule", "RULES", "RunKey", "P2PKey", "CollKey", "StreamState"]


class RunKey(NamedTuple):
    """The ``n``-th run of ``program`` on micro-batch ``mb`` (an SPMD rendezvous)."""

    program: ProgramRef
    mb: int | None
    n: int


class P2PKey(NamedTuple):
    """The ``n``-th message ``message`` of ``transfer`` in ``buffer`` from ``src`` to ``dst``."""

    transfer: TransferRef
    message: int
    buffer: BufferRef
    src: int
    dst: int
    n: int


class CollKey(NamedTuple):
    """The ``n``-th collective ``kind`` of message ``message`` over ``group``."""

    kind: CollectiveKind
    transfer: TransferRef
    message: int
    buffer: BufferRef
    group: tuple[int, ...]
    root: int | None
    n: int


@dataclass
class StreamState:
    """What building one worker's stream has seen so far."""

    worker: int
    last_writer: dict[BufferRef, int] = field(default_factory=dict)
    unwaited: dict[BufferRef, list[int]] = field(default_factory=dict)
    sends: list[int] = field(default_factory=list)
    seen: dict[object, int] = field(default_factory=dict)

    def nth(self, key: object) -> int:
        """How many times ``key`` was seen before on this worker (0 the first time)."""
        n = self.seen[key] = self.seen.get(key, -1) + 1
        return n

    def writers_of(self, ins: Instruction) -> list[int]:
        """Ops that last wrote the buffers ``ins`` reads."""
        return [self.last_writer[b] for b in ins.reads if b in self.last_writer]


@dataclass(frozen=True)
class Rule:
    """How the engine builds and starts one instruction kind.

    ``build(engine, op, state)`` sets the op's dependencies, key and duration;
    ``arrive(engine, op)`` runs when the op reaches its queue head with its dependencies
    done; ``comm_span`` says which times bound its data movement in the timeline
    (``"flow"``: a point-to-point flow, ``"rendezvous"``: start to end, None: none).
    """

    build: Callable[[_Engine, _Op, StreamState], None]
    arrive: Callable[[_Engine, _Op], None]
    comm_span: str | None = None


def _no_deps(engine: _Engine, op: _Op, state: StreamState) -> None:
    """Local work with no dependency beyond stream order (LOAD, ZEROS, FREE)."""


def _build_run(engine: _Engine, op: _Op, state: StreamState) -> None:
    ins: Run = op.ins
    op.deps = state.writers_of(ins)
    mesh = engine.mesh_of_program.get(ins.program)
    if mesh is None:
        raise ValueError(
            f"w{op.worker}: {ins} runs program {str(ins.program)!r}, which the plan lacks"
        )
    op.dur = engine.costs[ins.program].seconds
    if len(engine.mesh_workers.get(mesh, ())) > 1:
        op.key = RunKey(ins.program, ins.mb, state.nth((Run, ins.program, ins.mb)))


def _p2p_key(ins: Send | Recv, src: int, dst: int, state: StreamState) -> P2PKey:
    base = (type(ins), ins.transfer, ins.message, ins.buffer, src, dst)
    return P2PKey(ins.transfer, ins.message, ins.buffer, src, dst, state.nth(base))


def _build_send(engine: _Engine, op: _Op, state: StreamState) -> None:
    op.deps = state.writers_of(op.ins)
    op.key = _p2p_key(op.ins, op.worker, op.ins.peer, state)
    engine.pair(op.key).send = op
    state.sends.append(op.id)


def _build_recv(engine: _Engine, op: _Op, state: StreamState) -> None:
    op.key = _p2p_key(op.ins, op.ins.peer, op.worker, state)
    engine.pair(op.key).recv = op
    state.unwaited.setdefault(op.ins.buffer, []).append(op.id)


def _build_collective(engine: _Engine, op: _Op, state: StreamState) -> None:
    ins: Collective = op.ins
    op.deps = state.writers_of(ins)
    # data-parallel replicas all-reduce each their own ``A`` buffer: matched by group
    buf = None if ins.buffer.kind is BufferKind.ACCUMULATORS else ins.buffer
    fields = (ins.kind, ins.transfer, ins.message, buf, ins.group, ins.root)
    op.key = CollKey(*fields, state.nth((Collective, *fields)))
    state.unwaited.setdefault(ins.buffer, []).append(op.id)


def _build_wait(engine: _Engine, op: _Op, state: StreamState) -> None:
    op.deps = state.unwaited.pop(op.ins.buffer, [])


def _build_waitall(engine: _Engine, op: _Op, state: StreamState) -> None:
    op.deps, state.sends = state.sends, []


def _arrive_local(engine: _Engine, op: _Op) -> None:
    engine.start(op)


def _arrive_run(engine: _Engine, op: _Op) -> None:
    members = engine.rendezvous(op)
    for member in members or ():
        engine.start(member)


def _arrive_collective(engine: _Engine, op: _Op) -> None:
    members = engine.rendezvous(op)
    if members:
        engine.start_collective(members)


def _arrive_p2p(engine: _Engine, op: _Op) -> None:
    engine.arrive_p2p(op)


#: Instruction type -> its rule.
RULES: dict[type[Instruction], Rule] = {
    Run: Rule(_build_run, _arrive_run),
    Load: Rule(_no_deps, _arrive_local),
    Zeros: Rule(_no_deps, _arrive_local),
    Free: Rule(_no_deps, _arrive_local),
    Send: Rule(_build_send, _arrive_p2p, "flow"),
    Recv: Rule(_build_recv, _arrive_p2p, "flow"),
    Collective: Rule(_build_collective, _arrive_collective, "rendezvous"),
    Wait: Rule(_build_wait, _arrive_local),
    WaitAll: Rule(_build_waitall, _arrive_local),
}
