"""The compiled plan: every decision the compiler made, frozen, printable and JSON.

A :class:`Plan` is what ``parallelize(fn, method=...).lower(*args)`` returns.  The
runtime executes it, the simulator predicts it; neither changes it.  ``print(plan)``
shows stages, meshes, shardings, transfers, the schedule grid and each worker's
instruction stream; ``Plan.from_json(plan.to_json()) == plan``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.instructions import WorkerStream

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


@dataclass(frozen=True)
class MeshSpec:
    """A block of ``shape[0]`` hosts x ``shape[1]`` devices that runs one stage.

    ``hosts`` are cluster host indices; host ``h`` is run by worker ``w{h}``.
    """

    id: int
    shape: tuple[int, int]
    hosts: tuple[int, ...]

    @property
    def workers(self) -> tuple[int, ...]:
        """Worker ids of this mesh (one host-actor per host)."""
        return self.hosts

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def __str__(self) -> str:
        hosts = ",".join(f"w{h}" for h in self.hosts)
        return (
            f"mesh{self.id}  {self.shape[0]}x{self.shape[1]}  workers [{hosts}]  axes {MESH_AXES}"
        )


@dataclass(frozen=True)
class TensorSpec:
    """One array of a buffer group: its traced variable, readable name, type and sharding."""

    var: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec = ()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{_shape_str(self.dtype, self.shape)} {spec_str(self.spec)} {self.name}"


@dataclass(frozen=True)
class BufferSpec:
    """A named group of arrays that instructions read and write as one (``P0``, ``t3``, ``R1``)."""

    name: str
    mesh: int
    per_micro_batch: bool
    tensors: tuple[TensorSpec, ...]

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

    ``inputs``/``outputs`` are buffer-group names; a group in both (``A{s}``) is an
    accumulator: the program returns input + this micro-batch's contribution.
    ``flops``/``bytes_accessed`` come from a cost analysis when one was run.
    """

    name: str
    mesh: int
    eqns: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: float | None = None
    bytes_accessed: float | None = None

    def __str__(self) -> str:
        cost = f"  {self.flops:.3g} flop" if self.flops is not None else ""
        return (
            f"{self.name}  mesh{self.mesh}  {len(self.eqns)} eqns  "
            f"({' '.join(self.inputs)}) -> ({' '.join(self.outputs)}){cost}"
        )


@dataclass(frozen=True)
class Message:
    """One piece of a transfer: block ``index`` of the array, sent by worker ``src``.

    Point-to-point when ``group`` is empty: ``src`` -> ``dst``.  A broadcast when
    ``group`` is set: ``group[0] == src`` is the root and every other member receives
    (``dst`` is then the first receiver).  ``src_device``/``dst_devices`` name the
    local devices that send and, per receiving worker in order, the devices that need the
    block (for the simulator's intra-host hops); ``round`` orders messages for load
    balancing (messages of one round may run at once).
    """

    src: int
    dst: int
    index: tuple[tuple[int, int], ...]
    nbytes: int
    group: tuple[int, ...] = ()
    src_device: int = 0
    dst_devices: tuple[tuple[int, ...], ...] = ()
    round: int = 0

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
        return f"{kind}w{self.src}.{self.src_device} -> {to} [{idx}] {fmt_bytes(self.nbytes)}{rnd}"


@dataclass(frozen=True)
class TransferSpec:
    """A cross-mesh transfer of one array from ``src_mesh`` to ``dst_mesh``, per micro-batch."""

    name: str
    tensor: TensorSpec
    dst_spec: Spec
    src_mesh: int
    dst_mesh: int
    producer: str
    consumer: str
    messages: tuple[Message, ...]
    strategy: str = "send_recv"
    sim_time_s: float | None = None
    lower_bound_s: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes sent per micro-batch (a broadcast's block counted once per receiver)."""
        return sum(m.nbytes * len(m.receivers) for m in self.messages)

    def __str__(self) -> str:
        t = self.tensor
        head = (
            f"{self.name}  {t.name}  {_shape_str(t.dtype, t.shape)}  {fmt_bytes(t.nbytes)}  "
            f"mesh{self.src_mesh} {spec_str(t.spec)} -> mesh{self.dst_mesh} {spec_str(self.dst_spec)}  "
            f"{self.producer} -> {self.consumer}  {self.strategy}, "
            f"{len(self.messages)} msgs, {fmt_bytes(self.nbytes)} on wire"
        )
        if self.sim_time_s is not None:
            bound = (
                f" / lower bound {self.lower_bound_s * 1e3:.3f} ms" if self.lower_bound_s else ""
            )
            head += f"\n    simulated {self.sim_time_s * 1e3:.3f} ms{bound}"
        return "\n".join([head] + [f"    #{i} {m}" for i, m in enumerate(self.messages)])


@dataclass(frozen=True)
class Task:
    """One cell of a schedule: stage ``stage`` runs its forward (F) or backward (B) on ``mb``."""

    stage: int
    mb: int
    kind: str

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a grid: ``ticks[t][s]`` is stage ``s``'s task at tick ``t``."""

    name: str
    num_stages: int
    num_micro_batches: int
    ticks: tuple[tuple[Task | None, ...], ...]

    def __str__(self) -> str:
        lines = [
            f"{self.name}: {self.num_stages} stages x {self.num_micro_batches} micro-batches, "
            f"{len(self.ticks)} ticks"
        ]
        lines.append("  tick " + " ".join(f"{'s' + str(s):>4}" for s in range(self.num_stages)))
        for t, row in enumerate(self.ticks):
            cells = " ".join(f"{(str(c) if c else '.'):>4}" for c in row)
            lines.append(f"  {t:>4} {cells}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: the layers it holds, its mesh, its programs and what they contain."""

    id: int
    mesh: int
    layers: tuple[int, ...]
    forward: str
    backward: str
    summary: str

    def __str__(self) -> str:
        layers = ",".join(map(str, self.layers))
        return f"stage{self.id}  mesh{self.mesh}  layers [{layers}]  {self.forward}/{self.backward}  {self.summary}"


@dataclass(frozen=True)
class InputSpec:
    """Where a flattened step-argument leaf goes.

    ``kind`` is ``batch`` (split into micro-batches), ``state`` (kept on meshes across
    steps) or ``unused``.  ``slots`` lists ``(buffer, index)`` places that hold it.
    """

    leaf: int
    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    slots: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        where = " ".join(f"{b}[{i}]" for b, i in self.slots) or "-"
        return f"in{self.leaf}  {self.kind:<6} {_shape_str(self.dtype, self.shape)} {self.path}  -> {where}"


@dataclass(frozen=True)
class OutputSpec:
    """Where a flattened step-output leaf comes from.

    ``source`` is ``buffer`` (``slots`` hold it, one per mesh that computes it), ``input``
    (returned unchanged from input leaf ``input_leaf``) or ``literal`` (``literal``).
    """

    leaf: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    slots: tuple[tuple[str, int], ...] = ()
    input_leaf: int | None = None
    literal: float | int | bool | None = None

    def __str__(self) -> str:
        if self.source == "buffer":
            where = " ".join(f"{b}[{i}]" for b, i in self.slots)
        elif self.source == "input":
            where = f"in{self.input_leaf}"
        else:
            where = f"literal {self.literal!r}"
        return f"out{self.leaf}  {_shape_str(self.dtype, self.shape)} {self.path}  <- {where}"


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

    # --- lookups -------------------------------------------------------------------
    def program(self, name: str) -> ProgramSpec:
        """The program called ``name``."""
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(f"plan has no program {name!r}")

    def buffer(self, name: str) -> BufferSpec:
        """The buffer group ``name`` (a ``@k`` suffix is ignored)."""
        base = name.split("@", 1)[0]
        for b in self.buffers:
            if b.name == base:
                return b
        raise KeyError(f"plan has no buffer {name!r}")

    def transfer(self, name: str) -> TransferSpec:
        """The transfer called ``name`` (``t3``; a ``@k`` suffix is ignored)."""
        base = name.split("@", 1)[0]
        for t in self.transfers:
            if t.name == base:
                return t
        raise KeyError(f"plan has no transfer {name!r}")

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
        return json.dumps(_encode(self), indent=indent)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Inverse of :meth:`to_json`.  A document that is not a plan raises
        :class:`~meshshard.plan_checks.PlanFormatError` naming the bad field."""
        from meshshard.plan_checks import PlanFormatError, check_plan_document

        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"plan is not valid JSON: {e}") from None
        check_plan_document(doc)
        try:
            return _decode_plan(doc)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise PlanFormatError(
                f"plan JSON is malformed below the top level ({type(e).__name__}: {e}); "
                "write plans with Plan.to_json() and edit only values"
            ) from None


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- JSON encoding -------------------------------------------------------------------


def _encode(obj):
    if isinstance(obj, WorkerStream):
        return {"worker": obj.worker, "tokens": obj.tokens()}
    if isinstance(obj, ClusterSpec):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _encode(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple | list):
        return [_encode(x) for x in obj]
    return obj


def _tuple(x):
    """Lists back to (nested) tuples."""
    if isinstance(x, list):
        return tuple(_tuple(e) for e in x)
    return x


def _spec(x) -> Spec:
    return tuple(tuple(e) if isinstance(e, list) else e for e in x)


def _tensor(d) -> TensorSpec:
    return TensorSpec(d["var"], d["name"], tuple(d["shape"]), d["dtype"], _spec(d["spec"]))


def _decode_plan(d: dict) -> Plan:
    return Plan(
        method=d["method"],
        cluster=ClusterSpec.from_dict(d["cluster"]),
        num_micro_batches=d["num_micro_batches"],
        fingerprint=d["fingerprint"],
        meshes=tuple(MeshSpec(m["id"], tuple(m["shape"]), tuple(m["hosts"])) for m in d["meshes"]),
        stages=tuple(
            StageSpec(
                s["id"], s["mesh"], tuple(s["layers"]), s["forward"], s["backward"], s["summary"]
            )
            for s in d["stages"]
        ),
        programs=tuple(
            ProgramSpec(
                p["name"],
                p["mesh"],
                tuple(p["eqns"]),
                tuple(p["inputs"]),
                tuple(p["outputs"]),
                p["flops"],
                p["bytes_accessed"],
            )
            for p in d["programs"]
        ),
        buffers=tuple(
            BufferSpec(
                b["name"], b["mesh"], b["per_micro_batch"], tuple(_tensor(t) for t in b["tensors"])
            )
            for b in d["buffers"]
        ),
        transfers=tuple(
            TransferSpec(
                name=t["name"],
                tensor=_tensor(t["tensor"]),
                dst_spec=_spec(t["dst_spec"]),
                src_mesh=t["src_mesh"],
                dst_mesh=t["dst_mesh"],
                producer=t["producer"],
                consumer=t["consumer"],
                messages=tuple(
                    Message(
                        m["src"],
                        m["dst"],
                        _tuple(m["index"]),
                        m["nbytes"],
                        tuple(m.get("group", ())),
                        m.get("src_device", 0),
                        _tuple(m.get("dst_devices", [])),
                        m.get("round", 0),
                    )
                    for m in t["messages"]
                ),
                strategy=t["strategy"],
                sim_time_s=t.get("sim_time_s"),
                lower_bound_s=t.get("lower_bound_s"),
            )
            for t in d["transfers"]
        ),
        schedule=Schedule(
            d["schedule"]["name"],
            d["schedule"]["num_stages"],
            d["schedule"]["num_micro_batches"],
            tuple(
                tuple(Task(c["stage"], c["mb"], c["kind"]) if c else None for c in row)
                for row in d["schedule"]["ticks"]
            ),
        ),
        streams=tuple(WorkerStream.parse(s["worker"], s["tokens"]) for s in d["streams"]),
        inputs=tuple(
            InputSpec(
                i["leaf"], i["path"], i["kind"], tuple(i["shape"]), i["dtype"], _tuple(i["slots"])
            )
            for i in d["inputs"]
        ),
        outputs=tuple(
            OutputSpec(
                o["leaf"],
                o["path"],
                tuple(o["shape"]),
                o["dtype"],
                o["source"],
                _tuple(o["slots"]),
                o["input_leaf"],
                o["literal"],
            )
            for o in d["outputs"]
        ),
        notes=tuple(d.get("notes", ())),
    )
