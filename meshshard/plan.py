"""The compiled plan: every decision the compiler made, frozen, printable and JSON.

A :class:`Plan` is what ``parallelize(fn, method=...).lower(*args)`` returns.  The
runtime executes it, the simulator predicts it; neither changes it.  ``print(plan)``
shows stages, meshes, shardings, transfers, the schedule grid and each worker's
instruction stream; ``Plan.from_json(plan.to_json()) == plan``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.instructions import Run, WorkerStream
from meshshard.plan_json import PlanFormatError, decode, encode
from meshshard.refs import (
    BufferKind,
    BufferRef,
    LeafKind,
    OutputSource,
    ProgramRef,
    TaskKind,
    TransferRef,
)

__all__ = ["GatheredAccumulator", "Plan", "PlanFormatError", "SparseRows"]


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


MESH_AXES = ("host", "device")

# A PartitionSpec as plain data: one entry per tensor dim, each None (replicated),
# an axis name, or a tuple of axis names.  Trailing dims may be omitted.
SpecEntry = None | str | tuple[str, ...]
Spec = tuple[SpecEntry, ...]


def spec_str(spec: Spec) -> str:
    """Print a spec the way ``PartitionSpec`` does: ``P('host', None)``, ``P(('host', 'device'))``."""
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def dtype_str(dtype: str) -> str:
    """Short dtype names as jaxprs print them (``float32`` -> ``f32``)."""
    short = {
        "float32": "f32",
        "float16": "f16",
        "bfloat16": "bf16",
        "float64": "f64",
        "int32": "i32",
        "int64": "i64",
        "int8": "i8",
        "uint8": "u8",
        "uint32": "u32",
        "bool": "bool",
    }
    return short.get(dtype, dtype)


def _shape_str(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype_str(dtype)}[{','.join(map(str, shape))}]"


def is_view(view, shape: tuple[int, int]) -> bool:
    """Whether ``view`` is a logical ``(a, b)`` layout of a ``shape = (hosts, devices)``
    mesh's devices: the same count, the device axis inside a host (``b`` divides them)."""
    return len(view) == 2 and view[0] * view[1] == shape[0] * shape[1] and shape[1] % view[1] == 0


@dataclass(frozen=True)
class MeshSpec:
    """A block of ``shape[0]`` hosts x ``shape[1]`` devices that runs one stage.

    ``hosts`` are cluster host indices; host ``h`` is run by worker ``w{h}``.  ``view``
    (None: the physical shape) is the logical ``(host, device)`` axis sizes the mesh's
    shardings name: the same devices, listed host-major, laid out as ``view`` (Alpa's
    logical mesh), e.g. one host's ``(1, 4)`` devices seen as 2 x 2.  The ``device`` axis
    never crosses a host (``view[1]`` divides ``shape[1]``).
    """

    id: int
    shape: tuple[int, int]
    hosts: tuple[int, ...]
    view: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        v = self.view
        if v is None:
            return
        if not is_view(v, self.shape):
            raise MeshshardInputError(
                f"mesh{self.id}: logical shape {tuple(v)} is not a view of its "
                f"{self.shape[0]}x{self.shape[1]} devices; pass (a, b) with a * b = "
                f"{self.shape[0] * self.shape[1]} and b dividing {self.shape[1]} (the device "
                "axis stays inside a host)"
            )

    @property
    def axis_shape(self) -> tuple[int, int]:
        """Sizes of the mesh axes ``("host", "device")`` that shardings name (the view's,
        else the physical shape)."""
        return self.view or self.shape

    @property
    def workers(self) -> tuple[int, ...]:
        """Worker ids of this mesh (one host-actor per host)."""
        return self.hosts

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def __str__(self) -> str:
        hosts = ",".join(f"w{h}" for h in self.hosts)
        view = f"  viewed as {self.view[0]}x{self.view[1]}" if self.view else ""
        return (
            f"mesh{self.id}  {self.shape[0]}x{self.shape[1]}{view}  workers [{hosts}]  "
            f"axes {MESH_AXES}"
        )


@dataclass(frozen=True)
class TensorSpec:
    """One array of a buffer group: its traced variable, readable name, type and sharding."""

    var: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec = ()
    #: mesh axes over which an accumulator holds per-device partial sums (stored with a
    #: leading axis of their size, summed once per step by the update); () = whole
    unreduced: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def stored(self, axis_size) -> tuple[tuple[int, ...], Spec]:
        """(shape, spec) of the array as held on the mesh (``axis_size``: axis -> size)."""
        if not self.unreduced:
            return self.shape, self.spec
        n = int(np.prod([axis_size[a] for a in self.unreduced]))
        axes = self.unreduced

        def drop(entry):
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            kept = tuple(a for a in names if a not in axes)
            return None if not kept else kept[0] if len(kept) == 1 else kept

        lead = axes if len(axes) > 1 else axes[0]
        return (n, *self.shape), (lead, *(drop(e) for e in self.spec))

    def __str__(self) -> str:
        local = f" unreduced[{','.join(self.unreduced)}]" if self.unreduced else ""
        return f"{_shape_str(self.dtype, self.shape)} {spec_str(self.spec)}{local} {self.name}"


@dataclass(frozen=True)
class Unreduced:
    """A value a program holds as ``n`` partial sums over mesh ``axes`` (leading axis).

    ``split`` is set on the equation that makes it (a contraction over a split dim):
    the dim of each operand split over ``axes`` (``dot_general``: lhs and rhs;
    ``reduce_sum``: its one operand).  Empty for values mapped from unreduced inputs.

    A ``lax.scan`` output sets ``loop_outs``, the positions of the loop's outputs held
    as partial sums (a recurrent layer's weight gradient summed over time in a carry; a
    stacked layer's, one per iteration, in a scanned output), and ``inner``, the values
    of the loop body held so (ids of the body's own
    :func:`~meshshard.jaxpr_util.var_ids`): the loop runs no collective for them, and
    their sum runs once, where they are read whole or by the update.
    """

    var: int
    axes: tuple[str, ...]
    split: tuple[int, ...] = ()
    loop_outs: tuple[int, ...] = ()
    inner: tuple[Unreduced, ...] = ()

    def __str__(self) -> str:
        made = f" split({','.join(map(str, self.split))})" if self.split else ""
        if self.loop_outs:
            slots = ",".join(map(str, self.loop_outs))
            made += f" scan(outs {slots}; {len(self.inner)} inside)"
        return f"%{self.var} unreduced[{','.join(self.axes)}]{made}"


@dataclass(frozen=True)
class BufferSpec:
    """A group of arrays that instructions read and write as one (``P0``, ``R1``).

    ``name`` is the group's reference (no micro-batch); a token string is accepted.
    """

    name: BufferRef
    mesh: int
    per_micro_batch: bool
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        _set(self, "name", BufferRef.of(self.name))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __str__(self) -> str:
        mb = "@k" if self.per_micro_batch else ""
        head = f"{self.name}{mb}  mesh{self.mesh}  {len(self.tensors)} arrays  {fmt_bytes(self.nbytes)}"
        return "\n".join([head] + [f"    {t}" for t in self.tensors])


@dataclass(frozen=True)
class ProgramSpec:
    """A compiled unit: equations ``eqns`` of the traced step, run on ``mesh``.

    ``inputs``/``outputs`` are buffer groups; a group in both (``A{s}``) is an
    accumulator: the program returns input + this micro-batch's contribution.
    ``flops``/``bytes_accessed`` come from a cost analysis when one was run.
    ``constraints``: (var id, spec) of values inside the program that inferred sharding
    fixes (``with_sharding_constraint``); empty under plain data parallelism.
    ``operand_constraints``: (equation index, operand position, spec) of operands the
    inferred plan reshards just before an equation reads them (pinned there too).
    References may be given as their tokens (``"s0.F"``, ``"P0"``).
    """

    name: ProgramRef
    mesh: int
    eqns: tuple[int, ...]
    inputs: tuple[BufferRef, ...]
    outputs: tuple[BufferRef, ...]
    flops: float | None = None
    bytes_accessed: float | None = None
    constraints: tuple[tuple[int, Spec], ...] = ()
    #: values the program holds as per-device partial sums (gradient accumulation)
    unreduced: tuple[Unreduced, ...] = ()
    operand_constraints: tuple[tuple[int, int, Spec], ...] = ()

    def __post_init__(self) -> None:
        _set(self, "name", ProgramRef.of(self.name))
        _set(self, "inputs", tuple(BufferRef.of(b) for b in self.inputs))
        _set(self, "outputs", tuple(BufferRef.of(b) for b in self.outputs))

    def __str__(self) -> str:
        cost = f"  {self.flops:.3g} flop" if self.flops is not None else ""
        if self.constraints:
            cost += f"  {len(self.constraints)} sharding constraints"
        if self.operand_constraints:
            cost += f"  {len(self.operand_constraints)} operand reshards"
        if self.unreduced:
            cost += f"  {len(self.unreduced)} unreduced"
        return (
            f"{self.name}  mesh{self.mesh}  {len(self.eqns)} eqns  "
            f"({' '.join(map(str, self.inputs))}) -> ({' '.join(map(str, self.outputs))}){cost}"
        )


@dataclass(frozen=True)
class Block:
    """One block a host-level :class:`Message` carries: ``index`` of the array, read from
    local device ``src_device`` of the sender and written into ``dst_devices[i]`` of the
    message's receiver ``i``."""

    index: tuple[tuple[int, int], ...]
    src_device: int = 0
    dst_devices: tuple[tuple[int, ...], ...] = ()

    def __str__(self) -> str:
        idx = ",".join(f"{a}:{b}" for a, b in self.index)
        to = "/".join("{" + ",".join(map(str, d)) + "}" for d in self.dst_devices)
        return f".{self.src_device}[{idx}]->{to}"


@dataclass(frozen=True)
class Message:
    """One piece of a transfer: block ``index`` of the array, sent by worker ``src``.

    Point-to-point when ``group`` is empty: ``src`` -> ``dst``.  A broadcast when
    ``group`` is set: ``group[0] == src`` is the root and every other member receives
    (``dst`` is then the first receiver).  ``src_device``/``dst_devices`` name the
    local devices that send and, per receiving worker in order, the devices that need the
    block (for the simulator's intra-host hops); ``round`` orders messages for load
    balancing (messages of one round may run at once).  ``chunk_bytes`` is a
    broadcast's pipelining chunk when the planner chose one (0: the cluster's).

    A *host-level* message carries several blocks (``blocks``, sent back to back in one
    payload, so the per-message latency is paid once): then ``index``/``src_device``
    are those of ``blocks[0]``, ``dst_devices`` lists per receiver every device any
    block goes to (the simulator's fan-out) and ``nbytes`` is the blocks' total.
    """

    src: int
    dst: int
    index: tuple[tuple[int, int], ...]
    nbytes: int
    group: tuple[int, ...] = ()
    src_device: int = 0
    dst_devices: tuple[tuple[int, ...], ...] = ()
    round: int = 0
    chunk_bytes: int = 0
    blocks: tuple[Block, ...] = ()

    @property
    def parts(self) -> tuple[Block, ...]:
        """The blocks this message carries, in payload order (one unless host-level)."""
        return self.blocks or (Block(self.index, self.src_device, self.dst_devices),)

    @property
    def receivers(self) -> tuple[int, ...]:
        """Workers that receive this message."""
        return self.group[1:] if self.group else (self.dst,)

    @property
    def is_broadcast(self) -> bool:
        return len(self.group) > 2

    def __str__(self) -> str:
        idx = ",".join(f"{a}:{b}" for a, b in self.index)
        devs = self.dst_devices or ((),) * len(self.receivers)
        to = ",".join(
            f"w{w}" + (".{" + ",".join(map(str, d)) + "}" if d else "")
            for w, d in zip(self.receivers, devs, strict=False)
        )
        kind = "bcast " if self.is_broadcast else ""
        rnd = f" r{self.round}" if self.round else ""
        chunk = f" chunk {fmt_bytes(self.chunk_bytes)}" if self.chunk_bytes else ""
        merged = f" in {len(self.blocks)} blocks" if self.blocks else ""
        return (
            f"{kind}w{self.src}.{self.src_device} -> {to} [{idx}] {fmt_bytes(self.nbytes)}{rnd}"
            f"{chunk}{merged}"
        )


#: The strategy of a transfer between two views of the same workers: nothing moves.
LOCAL = "local"


@dataclass(frozen=True)
class TransferSpec:
    """A cross-mesh transfer of one array from ``src_mesh`` to ``dst_mesh``, per micro-batch.

    ``producer``/``consumer`` are the programs at its ends (None, printed ``-``, for a
    transfer planned on its own); references may be given as their tokens.  A
    ``local`` transfer (strategy :data:`LOCAL`) joins two views of the same workers
    (interleaved 1F1B's chunks on one mesh) with the same layout: it has no messages,
    and the consumer reads the buffer its producer wrote on the same worker.
    """

    name: TransferRef
    tensor: TensorSpec
    dst_spec: Spec
    src_mesh: int
    dst_mesh: int
    producer: ProgramRef | None
    consumer: ProgramRef | None
    messages: tuple[Message, ...]
    strategy: str = "send_recv"
    sim_time_s: float | None = None
    lower_bound_s: float | None = None
    tight_bound_s: float | None = None

    def __post_init__(self) -> None:
        _set(self, "name", TransferRef.of(self.name))
        for end in ("producer", "consumer"):
            value = getattr(self, end)
            _set(self, end, None if value in (None, "-") else ProgramRef.of(value))

    @property
    def nbytes(self) -> int:
        """Bytes sent per micro-batch (a broadcast's block counted once per receiver)."""
        return sum(m.nbytes * len(m.receivers) for m in self.messages)

    @property
    def is_local(self) -> bool:
        """Whether the consumer reads the producer's buffer on the same workers."""
        return self.strategy == LOCAL

    def __str__(self) -> str:
        t = self.tensor
        head = (
            f"{self.name}  {t.name}  {_shape_str(t.dtype, t.shape)}  {fmt_bytes(t.nbytes)}  "
            f"mesh{self.src_mesh} {spec_str(t.spec)} -> mesh{self.dst_mesh} {spec_str(self.dst_spec)}  "
            f"{self.producer or '-'} -> {self.consumer or '-'}  {self.strategy}, "
            f"{len(self.messages)} msgs, {fmt_bytes(self.nbytes)} on wire"
        )
        if self.sim_time_s is not None:
            bound = (
                f" / lower bound {self.lower_bound_s * 1e3:.3f} ms" if self.lower_bound_s else ""
            )
            if self.tight_bound_s and self.tight_bound_s > (self.lower_bound_s or 0) * (1 + 1e-9):
                bound += f" / tight bound {self.tight_bound_s * 1e3:.3f} ms"
            head += f"\n    simulated {self.sim_time_s * 1e3:.3f} ms{bound}"
        return "\n".join([head] + [f"    #{i} {m}" for i, m in enumerate(self.messages)])


#: Element-wise reductions a cross-mesh all-reduce can apply.
REDUCE_OPS = ("sum", "max", "min", "and", "or")


@dataclass(frozen=True)
class ReductionSpec:
    """A cross-mesh all-reduce of one small value of the update step.

    Each mesh computes its partial (``op`` over the ``parts`` it holds; ``literals`` are
    added on the first mesh), its ``leaders`` worker contributes it (the mesh's other
    workers contribute the identity), and every worker of ``group`` gets the result.
    ``producer``/``consumer`` name the update phases that make and read it.
    """

    name: str
    tensor: TensorSpec
    op: str
    group: tuple[int, ...]
    leaders: tuple[int, ...]
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    producer: str
    consumer: str
    literals: tuple[float, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def var(self) -> int:
        """The traced value being reduced."""
        return self.tensor.var

    def __str__(self) -> str:
        t = self.tensor
        parts = " + ".join(
            f"mesh{m}({','.join(f'%{v}' for v in vs) or '-'})" for m, vs in self.parts
        )
        lits = f" + {list(self.literals)}" if self.literals else ""
        group = ",".join(f"w{w}" for w in self.group)
        return (
            f"{self.name}  {t.name}  {_shape_str(t.dtype, t.shape)}  {fmt_bytes(t.nbytes)}  "
            f"all-reduce {self.op} of {parts}{lits} over [{group}]  "
            f"{self.producer} -> {self.consumer}"
        )


@dataclass(frozen=True)
class Task:
    """One cell of a schedule: mesh ``stage`` runs a forward (F), backward (B) or
    weight-gradient (W) task on micro-batch ``mb``.

    ``virtual`` is the model chunk of interleaved schedules (logical stage
    ``virtual * S + stage``); ``version`` is the weight version a 2BW task reads.
    """

    stage: int
    mb: int
    kind: TaskKind
    virtual: int | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        _set(self, "kind", TaskKind(self.kind))

    @property
    def program(self) -> ProgramRef:
        """The program this task runs."""
        return ProgramRef(self.kind.phase, self.stage, self.virtual)

    def logical(self, num_stages: int) -> int:
        """The logical pipeline stage of this task among ``num_stages`` meshes."""
        return self.stage + num_stages * (self.virtual or 0)

    def __str__(self) -> str:
        v = f"v{self.virtual}" if self.virtual is not None else ""
        ver = f"~{self.version}" if self.version is not None else ""
        return f"{self.kind.value}{self.mb}{v}{ver}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a grid: ``ticks[t][s]`` is mesh ``s``'s task at tick ``t``.

    ``virtual_stages`` model chunks run on each mesh (interleaved schedules);
    ``activation_bound[s]`` is the most micro-batch activations (per chunk) mesh ``s``
    may hold at once, as the generator states it (empty: not stated).  A schedule over
    several ``steps`` without flushes (2BW) numbers micro-batches across steps: task
    ``mb`` is micro-batch ``mb % num_micro_batches`` of step ``mb // num_micro_batches``.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    ticks: tuple[tuple[Task | None, ...], ...]
    virtual_stages: int = 1
    activation_bound: tuple[int, ...] = ()
    steps: int = 1

    def __str__(self) -> str:
        lines = [
            f"{self.name}: {self.num_stages} stages x {self.num_micro_batches} micro-batches, "
            f"{len(self.ticks)} ticks"
        ]
        width = max([4] + [len(str(c)) for row in self.ticks for c in row if c])
        lines.append(
            "  tick " + " ".join(f"{'s' + str(s):>{width}}" for s in range(self.num_stages))
        )
        for t, row in enumerate(self.ticks):
            cells = " ".join(f"{(str(c) if c else '.'):>{width}}" for c in row)
            lines.append(f"  {t:>4} {cells}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: the layers it holds, its mesh, its programs and what they contain."""

    id: int
    mesh: int
    layers: tuple[int, ...]
    forward: ProgramRef
    backward: ProgramRef | None  #: None in a forward-only step
    summary: str

    def __post_init__(self) -> None:
        _set(self, "forward", ProgramRef.of(self.forward))
        if self.backward is not None:
            _set(self, "backward", ProgramRef.of(self.backward))

    def __str__(self) -> str:
        layers = ",".join(map(str, self.layers))
        progs = f"{self.forward}/{self.backward}" if self.backward else str(self.forward)
        return f"stage{self.id}  mesh{self.mesh}  layers [{layers}]  {progs}  {self.summary}"


@dataclass(frozen=True)
class InputSpec:
    """Where a flattened step-argument leaf goes.

    ``kind`` is ``batch`` (split into micro-batches), ``state`` (kept on meshes across
    steps) or ``unused``.  ``slots`` lists ``(buffer, index)`` places that hold it.
    """

    leaf: int
    path: str
    kind: LeafKind
    shape: tuple[int, ...]
    dtype: str
    slots: tuple[tuple[BufferRef, int], ...] = ()

    def __post_init__(self) -> None:
        _set(self, "kind", LeafKind(self.kind))
        _set(self, "slots", tuple((BufferRef.of(b), i) for b, i in self.slots))

    def __str__(self) -> str:
        where = " ".join(f"{b}[{i}]" for b, i in self.slots) or "-"
        return f"in{self.leaf}  {self.kind.value:<6} {_shape_str(self.dtype, self.shape)} {self.path}  -> {where}"


@dataclass(frozen=True)
class OutputSpec:
    """Where a flattened step-output leaf comes from.

    ``source`` is ``buffer`` (``slots`` hold it, one per mesh that computes it), ``input``
    (returned unchanged from input leaf ``input_leaf``) or ``literal`` (``literal``).
    ``weak_type`` marks a result ``jax.jit`` returns weakly typed (a Python ``0.0``).
    """

    leaf: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    source: OutputSource
    slots: tuple[tuple[BufferRef, int], ...] = ()
    input_leaf: int | None = None
    literal: float | int | bool | None = None
    weak_type: bool = False

    def __post_init__(self) -> None:
        _set(self, "source", OutputSource(self.source))
        _set(self, "slots", tuple((BufferRef.of(b), i) for b, i in self.slots))

    def __str__(self) -> str:
        if self.source is OutputSource.BUFFER:
            where = " ".join(f"{b}[{i}]" for b, i in self.slots)
        elif self.source is OutputSource.INPUT:
            where = f"in{self.input_leaf}"
        else:
            where = f"literal {self.literal!r}"
        weak = " (weak)" if self.weak_type else ""
        return f"out{self.leaf}  {_shape_str(self.dtype, self.shape)}{weak} {self.path}  <- {where}"


@dataclass(frozen=True)
class SparseRows:
    """A tensor of a replicas' gradient accumulator group that moves as the rows its step
    touched, ``(row indices, rows)`` in one all-gather, instead of inside the dense
    all-reduce (TriRace's sparse traffic: an embedding table's gradient).

    ``tensor`` is its position in group ``group``'s tensors.  ``max_rows`` bounds the rows
    one replica's step can touch (the rows its lookups read, summed over the
    micro-batches it accumulates, at most the table's): every member sends exactly that
    many rows, padded, so the all-gather has one size.
    """

    group: BufferRef
    tensor: int
    max_rows: int

    def __post_init__(self) -> None:
        _set(self, "group", BufferRef.of(self.group))

    def payload_nbytes(self, t: TensorSpec) -> int:
        """Bytes one member sends for tensor ``t``: ``max_rows`` rows and int32 indices."""
        row = t.nbytes // max(t.shape[0], 1)
        return self.max_rows * (row + 4)

    def __str__(self) -> str:
        return f"{self.group}[{self.tensor}] as touched rows (at most {self.max_rows})"


@dataclass(frozen=True)
class GatheredAccumulator:
    """A tensor of a replicas' accumulator group that the replicas must not add up:
    every member sends it whole (``nbytes``) in the group's all-gather and combines the
    members' copies in member order by ``reduce``.

    - ``max`` / ``min`` (``meshshard.aux_max`` / ``aux_min``): the accumulator holds
      order keys (:mod:`meshshard.accumulate`: the maximum of the keys is the maximum, or
      the minimum, of the values), so the members take the maximum of their keys.
    - ``concat`` (per-example values, e.g. logits returned as aux): each member's
      accumulator holds the rows of its own micro-batches at its end, and replica ``j``
      runs the ``j``-th run of micro-batches, so the members' rows in member order are
      the batch's rows in order.
    - ``same`` (a value that does not depend on the batch): every member already holds
      it, so it is kept as it is and sends nothing.

    ``tensor`` is its position in group ``group``'s tensors.
    """

    group: BufferRef
    tensor: int
    reduce: str

    def __post_init__(self) -> None:
        _set(self, "group", BufferRef.of(self.group))
        if self.reduce not in GATHERED_REDUCTIONS:
            raise ValueError(
                f"GatheredAccumulator reduce {self.reduce!r} is not one of {GATHERED_REDUCTIONS}"
            )

    def __str__(self) -> str:
        if self.reduce == "same":
            return f"{self.group}[{self.tensor}] kept (the same on every replica, not sent)"
        how = "rows in member order" if self.reduce == "concat" else "order keys"
        return f"{self.group}[{self.tensor}] by {self.reduce} ({how}, all-gathered)"

    @property
    def sent(self) -> bool:
        """Whether the members send it (all but ``same``)."""
        return self.reduce != "same"


#: How a :class:`GatheredAccumulator` combines the replicas' copies.
GATHERED_REDUCTIONS = ("max", "min", "concat", "same")


@dataclass(frozen=True)
class Plan:
    """Everything the compiler decided for one parallelized step (see module docstring)."""

    method: str
    cluster: ClusterSpec
    num_micro_batches: int
    fingerprint: str
    meshes: tuple[MeshSpec, ...]
    stages: tuple[StageSpec, ...]
    programs: tuple[ProgramSpec, ...]
    buffers: tuple[BufferSpec, ...]
    transfers: tuple[TransferSpec, ...]
    schedule: Schedule
    streams: tuple[WorkerStream, ...]
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    notes: tuple[str, ...] = field(default=())
    reductions: tuple[ReductionSpec, ...] = field(default=())
    sparse_rows: tuple[SparseRows, ...] = field(default=())
    #: replicas' accumulators combined by max, min or concatenation (all-gathered,
    #: never summed)
    gathered: tuple[GatheredAccumulator, ...] = field(default=())

    # --- lookups -------------------------------------------------------------------
    def program(self, ref: ProgramRef | str) -> ProgramSpec:
        """The program ``ref`` (a token such as ``"s0.F"`` is accepted)."""
        ref = ProgramRef.of(ref)
        for p in self.programs:
            if p.name == ref:
                return p
        raise KeyError(f"plan has no program {str(ref)!r}")

    def programs_run(self) -> tuple[ProgramSpec, ...]:
        """The programs some stream runs, in plan order: where a stage's forward and
        backward run as one fused ``s{i}.FB``, the two stay listed but never run."""
        ran = {i.program for s in self.streams for i in s.instructions if isinstance(i, Run)}
        return tuple(p for p in self.programs if p.name in ran)

    def buffer(self, ref: BufferRef | str) -> BufferSpec:
        """The buffer group of ``ref`` (its micro-batch, if any, is ignored)."""
        found = self._buffer_index.get(BufferRef.of(ref).group)
        if found is None:
            raise KeyError(f"plan has no buffer {str(ref)!r}")
        return found

    @functools.cached_property
    def _buffer_index(self) -> dict[BufferRef, BufferSpec]:
        # the driver looks buffers up for every output of every step: a dict, not a scan
        return {b.name: b for b in self.buffers}

    def transfer(self, ref: TransferRef | BufferRef | str) -> TransferSpec:
        """The transfer ``ref`` (``t3``, or a buffer ``t3@k`` of it)."""
        if isinstance(ref, str):
            ref = BufferRef.parse(ref)
        if isinstance(ref, BufferRef):
            if ref.kind is not BufferKind.TRANSFER:
                raise KeyError(f"plan has no transfer {str(ref)!r}")
            ref = ref.transfer
        for t in self.transfers:
            if t.name == ref:
                return t
        raise KeyError(f"plan has no transfer {str(ref)!r}")

    def reduction(self, ref: BufferRef | str) -> ReductionSpec:
        """The cross-mesh all-reduce ``ref`` (``r0``, as a token or a buffer reference)."""
        base = str(ref).split("@", 1)[0]
        for r in self.reductions:
            if r.name == base:
                return r
        raise KeyError(f"plan has no reduction {base!r}")

    def sparse_tensors(self, ref: BufferRef) -> dict[int, SparseRows]:
        """The tensors of accumulator group ``ref`` that move as rows, by position."""
        group = ref.group
        return {r.tensor: r for r in self.sparse_rows if r.group == group}

    def gathered_tensors(self, ref: BufferRef) -> dict[int, GatheredAccumulator]:
        """The tensors of accumulator group ``ref`` all-gathered, not summed (max, min or
        concat: :class:`GatheredAccumulator`), by position."""
        group = ref.group
        return {e.tensor: e for e in self.gathered if e.group == group}

    def grad_nbytes(self, ref: BufferRef) -> tuple[int, int]:
        """(dense bytes all-reduced, bytes each member all-gathers: touched rows and
        max/min/concat accumulators) of the replicas' accumulator group ``ref``."""
        tensors = self.buffer(ref).tensors
        rows, keys = self.sparse_tensors(ref), self.gathered_tensors(ref)
        dense = sum(t.nbytes for i, t in enumerate(tensors) if i not in rows and i not in keys)
        gathered = sum(r.payload_nbytes(tensors[i]) for i, r in rows.items())
        return dense, gathered + sum(tensors[i].nbytes for i, e in keys.items() if e.sent)

    @property
    def workers(self) -> tuple[int, ...]:
        """Every worker id that has a stream."""
        return tuple(s.worker for s in self.streams)

    # --- text --------------------------------------------------------------------
    def summary(self) -> str:
        """A few lines for logs: method, meshes, stages, transfer volume, schedule length."""
        wire = sum(t.nbytes for t in self.transfers) * self.num_micro_batches
        lines = [
            f"meshshard plan: {self.method}",
            f"  cluster {self.cluster}; {len(self.meshes)} meshes, {len(self.stages)} stages, "
            f"{self.num_micro_batches} micro-batches",
        ]
        lines += [f"  {s}" for s in self.stages]
        lines.append(
            f"  {len(self.transfers)} cross-mesh transfers, {fmt_bytes(wire)} per step; "
            f"schedule {self.schedule.name} in {len(self.schedule.ticks)} ticks; "
            f"{sum(len(s.instructions) for s in self.streams)} instructions"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        out = [f"plan {self.method}", f"cluster {self.cluster}", f"fingerprint {self.fingerprint}"]
        out += ["", "meshes:"] + [f"  {m}" for m in self.meshes]
        out += ["", "stages:"] + [f"  {s}" for s in self.stages]
        out += ["", "programs:"] + [f"  {p}" for p in self.programs]
        out += ["", "buffers:"] + [_indent(str(b)) for b in self.buffers]
        out += ["", "transfers:"] + ([_indent(str(t)) for t in self.transfers] or ["  (none)"])
        if self.reductions:
            out += ["", "all-reduces:"] + [f"  {r}" for r in self.reductions]
        if self.sparse_rows:
            out += ["", "sparse gradients:"] + [f"  {r}" for r in self.sparse_rows]
        if self.gathered:
            out += ["", "gathered accumulators:"] + [f"  {e}" for e in self.gathered]
        out += ["", "inputs:"] + [f"  {i}" for i in self.inputs]
        out += ["", "outputs:"] + [f"  {o}" for o in self.outputs]
        out += ["", "schedule " + _indent(str(self.schedule)).lstrip()]
        out += ["", "streams:"]
        for s in self.streams:
            out.append(_indent(str(s)))
        if self.notes:
            out += ["", "notes:"] + [f"  {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    # --- JSON --------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        """Serialize to JSON; :meth:`from_json` reads it back to an equal plan."""
        return json.dumps(encode(self), indent=indent)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Inverse of :meth:`to_json`; a malformed document raises :class:`PlanFormatError`
        naming the bad field (e.g. ``transfers[2].messages[0].nbytes``)."""
        from meshshard.plan_checks import check_plan_document

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"plan JSON does not parse: {exc}") from None
        check_plan_document(data)  # not an object, or top-level fields missing
        return decode(Plan, data)


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
