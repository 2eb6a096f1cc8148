"""Pass: communication scheduling (TriRace's three dimensions) over emitted streams.

Pure: a :class:`~meshshard.plan.Plan` in, a plan out whose streams hold the same
instructions (only their order, their ``priority`` slot and, for sparse gradients, the
buffer a gradient collective moves change).  Switches, each usable alone for ablation:

``"p2p"``
    every point-to-point transfer (``SEND``/``RECV`` and the broadcasts of cross-mesh
    resharding) gets the highest priority, so it is never queued behind bulk traffic.
``"sparse"``
    an embedding gradient is moved as ``(row indices, rows)`` of the touched rows (an
    all-gather) instead of a dense all-reduce, when that is cheaper by the cost model
    (:func:`sparse_is_cheaper`); it ranks above dense all-reduce, since the next forward
    of stage 0 reads its rows first.  On a compiled plan the compiler finds those
    gradients in the trace and adds their ``COLL allgather A`` before this pass
    (:mod:`meshshard.passes.sparse_rows`); on a synthetic plan ``sparse`` names each
    gradient's rows twin.
``"allreduce"``
    gradient all-reduces are issued as soon as the buffer they reduce is written
    (hoisted past compute), ranked by when the next step's forward needs the weights
    (lower mesh, then lower bucket first: P3/ByteScheduler priority), and the update
    that waits for them (``WAIT`` + ``RUN *.apply``) sinks to just before the first
    instruction that needs what it writes (under 2BW: the first forward that reads the
    new weight version), so the all-reduce overlaps the compute in between.  The
    all-reduce of a data-parallel replicas' accumulator group (``A``,
    :mod:`meshshard.passes.replicas`) is cut into ``ceil(bytes / chunk_bytes)`` chunks
    (``COLL allreduce A1 #0 .. #n-1``), each its own operation, so higher-priority
    traffic passes between them at run time.
``"topology"``
    nothing in the streams: the runtime and the simulator admit each flow by
    :func:`admit` (what is in flight on the links it uses), recorded in the plan notes.

Moves never cross a collective or ``WAITALL`` (every member of a group issues its
collectives in the same order) and never cross an instruction that touches the moved
instruction's buffers, so results are bit-identical to the unscheduled plan.
``print(plan)`` lists each communication's priority, chunking and the instruction that
bounds it (its first reader) under ``notes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from meshshard.admission import ADMISSION_NOTE, admit
from meshshard.instructions import (
    Collective,
    Free,
    Instruction,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
)
from meshshard.methods import COMM_SWITCHES, check_comm_switches
from meshshard.passes.sparse_rows import rows_are_cheaper
from meshshard.plan import Plan, fmt_bytes
from meshshard.refs import BufferKind, BufferRef, CollectiveKind, Phase

__all__ = [
    "COMM_SWITCHES",
    "PRIORITY",
    "SparseGrad",
    "admit",
    "schedule_comm",
    "sparse_is_cheaper",
    "traffic_kind",
]

#: Priority bands (higher issues first); ranks inside a band are added to its base.
PRIORITY = {"p2p": 30_000, "sparse": 20_000, "allreduce": 10_000}


@dataclass(frozen=True)
class SparseGrad:
    """An embedding gradient ``dense`` that can move as its touched rows ``rows``.

    ``dense_bytes`` is the |V| x H gradient, ``rows_bytes`` one replica's
    (indices, rows) pair.
    """

    dense: BufferRef
    rows: BufferRef
    dense_bytes: int
    rows_bytes: int


def sparse_is_cheaper(g: SparseGrad, replicas: int) -> bool:
    """True when an all-gather of every replica's rows moves fewer bytes per member than a
    ring all-reduce of the dense gradient: ``(p-1) rows < 2 (p-1)/p dense``."""
    return rows_are_cheaper(g.dense_bytes, g.rows_bytes, replicas)


def traffic_kind(ins: Instruction, sparse_rows: frozenset[BufferRef] = frozenset()) -> str | None:
    """``"p2p"``, ``"sparse"`` or ``"allreduce"`` for a communication, else None."""
    if isinstance(ins, Send | Recv):
        return "p2p"
    if isinstance(ins, Collective):
        if ins.transfer is not None:
            return "p2p"  # a resharding broadcast between stages
        if ins.kind is CollectiveKind.ALLGATHER and ins.buffer.kind is BufferKind.ACCUMULATORS:
            return "sparse"  # a replicas' group's touched rows, max/min keys (all-gathered)
        return "sparse" if unversioned(ins.buffer) in sparse_rows else "allreduce"
    return None


def unversioned(b: BufferRef) -> BufferRef:
    """``b``'s group without its weight version (both 2BW copies are one gradient)."""
    return replace(b.group, version=None)


# --- reordering ------------------------------------------------------------------------
def _touches(a: Instruction, b: Instruction) -> bool:
    """True when ``a`` and ``b`` conflict on a buffer (one writes what the other uses)."""
    ra, wa = {x.group for x in a.reads}, _writes(a)
    rb, wb = {x.group for x in b.reads}, _writes(b)
    return bool(wa & (rb | wb) or wb & ra)


def _writes(x: Instruction) -> set[BufferRef]:
    """What ``x`` writes; a ``FREE`` ends its buffer, which counts as a write."""
    return {b.group for b in (x.reads if isinstance(x, Free) else x.writes)}


def _barrier(ins: Instruction) -> bool:
    return isinstance(ins, Collective | WaitAll)


def _hoist(ins: list[Instruction], kinds: set[str], sparse_rows) -> list[Instruction]:
    """Each gradient collective moves up to just after the last instruction it depends on:
    past compute and past point-to-point ``SEND``/``RECV`` of other buffers (so a stage's
    last gradient send, issued after it, overtakes its queued chunks at run time), never
    past another collective, a ``WAIT`` or a ``WAITALL``.  Every replica's stream moves
    alike, so the members of a group still issue their collectives in one order, and a
    collective only waits for what its members did before (never for a moved send)."""
    out: list[Instruction] = []
    for x in ins:
        if isinstance(x, Collective) and traffic_kind(x, sparse_rows) in kinds:
            j = len(out)
            while j and _passable(out[j - 1]):
                if _touches(out[j - 1], x):
                    break
                j -= 1
            out.insert(j, x)
        else:
            out.append(x)
    return out


def _passable(x: Instruction) -> bool:
    """Whether a hoisted collective may move above ``x`` (given no buffer conflict)."""
    if isinstance(x, Wait | WaitAll):
        return False
    return not x.is_comm or isinstance(x, Send | Recv)


def _is_apply(x: Instruction) -> bool:
    return isinstance(x, Run) and x.program.phase is Phase.APPLY


def _sink_updates(ins: list[Instruction]) -> list[Instruction]:
    """Each update (its ``WAIT``s on reduced gradients and its ``RUN *.apply``) moves down
    to just before the first instruction that conflicts with it or is a barrier."""
    out = list(ins)
    i = len(out) - 1
    while i >= 0:
        if _is_apply(out[i]):
            lo = i
            while lo and isinstance(out[lo - 1], Wait) and out[lo - 1].buffer in out[i].reads:
                lo -= 1
            group = out[lo : i + 1]
            j = i + 1
            while j < len(out) and not _barrier(out[j]):
                if any(_touches(g, out[j]) for g in group):
                    break
                j += 1
            if j > i + 1:
                out[lo:j] = out[i + 1 : j] + group
            i = lo - 1
        else:
            i -= 1
    return out


def chunk_allreduce(ins: list[Instruction], plan: Plan, chunk_bytes: int) -> list[Instruction]:
    """Each replicas' gradient all-reduce (``COLL allreduce A{s}``) as its chunks
    ``#0 .. #n-1`` of at most ``chunk_bytes`` each (the runtime splits the flat
    accumulator vector into ``n`` equal parts)."""
    out: list[Instruction] = []
    for x in ins:
        if (
            isinstance(x, Collective)
            and x.kind is CollectiveKind.ALLREDUCE
            and x.buffer.kind is BufferKind.ACCUMULATORS
        ):
            dense, _ = plan.grad_nbytes(x.buffer)
            n = max(1, math.ceil(dense / chunk_bytes))
            out += [replace(x, message=c) for c in range(n)]
        else:
            out.append(x)
    return out


# --- priorities ------------------------------------------------------------------------
def _rank_key(x: Collective):
    """What a gradient collective is ranked by: its buffer, or for the replicas'
    accumulators (every replica names its own ``A``) the group they share."""
    if x.buffer.kind is BufferKind.ACCUMULATORS:
        return tuple(sorted(x.group))
    return unversioned(x.buffer)


def _need_rank(plan: Plan, sparse_rows) -> dict:
    """Rank of each gradient collective (:func:`_rank_key`): needed earlier by the next
    forward (lower mesh, then lower index) gets the larger rank."""
    first: dict = {}
    owner = {unversioned(b.name): b.mesh for b in plan.buffers}
    for s in plan.streams:
        for x in s.instructions:
            if isinstance(x, Collective) and traffic_kind(x, sparse_rows) != "p2p":
                b = unversioned(x.buffer)
                key = (owner.get(b, 0), str(b.kind), b.owner)
                first[_rank_key(x)] = min(first.get(_rank_key(x), key), key)
    order = sorted(first, key=first.__getitem__)
    return {k: len(order) - i for i, k in enumerate(order)}


def _prioritise(x: Instruction, switches, rank, sparse_rows) -> Instruction:
    kind = traffic_kind(x, sparse_rows)
    if kind is None or kind not in switches:
        return x
    if kind == "p2p":
        return replace(x, priority=PRIORITY["p2p"])
    return replace(x, priority=PRIORITY[kind] + rank.get(_rank_key(x), 0))


def _substitute(x: Instruction, sub: Mapping[BufferRef, BufferRef]) -> Instruction:
    """``x`` with every buffer in ``sub`` replaced (a dense gradient by its rows; the
    weight version and micro-batch are kept)."""

    def s(b: BufferRef) -> BufferRef:
        t = sub.get(unversioned(b))
        return b if t is None else replace(t, mb=b.mb, version=b.version)

    if isinstance(x, Run):
        return replace(x, inputs=tuple(map(s, x.inputs)), outputs=tuple(map(s, x.outputs)))
    if isinstance(x, Collective) and unversioned(x.buffer) in sub:
        return replace(x, buffer=s(x.buffer), kind=CollectiveKind.ALLGATHER)
    if hasattr(x, "buffer") and unversioned(x.buffer) in sub:
        return replace(x, buffer=s(x.buffer))
    return x


# --- the pass --------------------------------------------------------------------------
def schedule_comm(
    plan: Plan,
    switches: Iterable[str],
    *,
    sparse: Iterable[SparseGrad] = (),
    chunk_bytes: int = 4 << 20,
) -> Plan:
    """``plan`` with its communication scheduled by ``switches`` (see the module doc)."""
    sw = check_comm_switches(switches)
    if not sw:
        return plan
    sub: dict[BufferRef, BufferRef] = {}
    if "sparse" in sw:
        for g in sparse:
            group = _group_size(plan, g.dense)
            if sparse_is_cheaper(g, group):
                sub[unversioned(g.dense)] = unversioned(g.rows)
    sparse_rows = frozenset(sub.values())
    if sub:
        plan = replace(
            plan,
            streams=tuple(
                WorkerStream(st.worker, tuple(_substitute(x, sub) for x in st.instructions))
                for st in plan.streams
            ),
        )
    rank = _need_rank(plan, sparse_rows) if sw & {"allreduce", "sparse"} else {}
    kinds = {k for k in ("allreduce", "sparse") if k in sw}
    streams = []
    for st in plan.streams:
        ins = list(st.instructions)
        if "allreduce" in sw:
            ins = chunk_allreduce(ins, plan, chunk_bytes)
        if kinds:
            ins = _hoist(ins, kinds, sparse_rows)
        if "allreduce" in sw:
            ins = _sink_updates(ins)
        ins = [_prioritise(x, sw, rank, sparse_rows) for x in ins]
        streams.append(WorkerStream(st.worker, tuple(ins)))
    out = replace(plan, streams=tuple(streams))
    notes = comm_table(out, sw, sparse_rows, chunk_bytes)
    return replace(out, notes=plan.notes + tuple(notes))


def _group_size(plan: Plan, dense: BufferRef) -> int:
    for s in plan.streams:
        for x in s.instructions:
            if isinstance(x, Collective) and unversioned(x.buffer) == unversioned(dense):
                return len(x.group)
    return 1


def _nbytes(plan: Plan, ref: BufferRef) -> int:
    try:
        return plan.buffer(ref).nbytes
    except KeyError:
        try:
            return plan.reduction(ref).nbytes
        except (KeyError, AttributeError):
            return 0


def _chunks(plan: Plan, x: Collective, chunk_bytes: int) -> int:
    """How many operations collective ``x`` is cut into (an all-gather of rows: one)."""
    if x.buffer.kind is BufferKind.ACCUMULATORS:
        if x.kind is CollectiveKind.ALLGATHER:
            return 1
        return max(1, math.ceil(plan.grad_nbytes(x.buffer)[0] / chunk_bytes))
    return max(1, math.ceil(_nbytes(plan, x.buffer) / chunk_bytes))


def comm_table(plan: Plan, switches, sparse_rows, chunk_bytes: int) -> list[str]:
    """One line per gradient collective (priority, chunks, bounding reader) and one per
    point-to-point transfer, after the switch line."""
    lines = [f"comm_schedule: {', '.join(sorted(switches))} (chunks of {fmt_bytes(chunk_bytes)})"]
    if "topology" in switches:
        lines.append(f"{ADMISSION_NOTE} a flow waits while a higher-priority one is on its links")
    p2p: dict[tuple, list[int]] = {}
    for st in plan.streams:
        ins = st.instructions
        for i, x in enumerate(ins):
            kind = traffic_kind(x, sparse_rows)
            if kind == "p2p":
                key = (str(x.transfer), x.priority)
                p2p.setdefault(key, []).append(st.worker)
            elif kind is not None and getattr(x, "message", 0) == 0:
                n = _chunks(plan, x, chunk_bytes)
                bound = next(
                    (
                        y
                        for y in ins[i + 1 :]
                        if x.buffer in y.reads and not isinstance(y, Collective)
                    ),
                    None,
                )
                lines.append(
                    f"  w{st.worker}[{i}] {kind} {x} chunks={n} bound by "
                    f"{bound.opcode.value + ' ' + str(getattr(bound, 'program', '')) if bound else 'end of step'}"
                )
    for (t, prio), ws in sorted(p2p.items()):
        lines.append(
            f"  p2p {t} !{prio} x{len(ws)} (workers {','.join(map(str, sorted(set(ws))))})"
        )
    return lines
