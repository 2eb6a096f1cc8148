"""The collectives XLA actually put into a compiled program, parsed from its HLO text.

The sharding planner predicts which collectives each program needs (kind, group, bytes);
the simulator prices them.  This module reads what JAX's partitioner really emitted, so
the two can be compared (issue 11 item 5) and the runtime's measured timeline can be
annotated (issue 10).  It parses ``compiled.as_text()`` — the post-optimisation,
post-SPMD-partitioning HLO module — and lists every

- ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute`` (and their ``-start`` async forms; ``-done`` halves are skipped),

with its result dtype and shape, its replica groups (device ids as XLA numbers them:
positions in the program's device assignment) and ``nbytes`` in the simulator's
convention (:mod:`meshshard.sim.collectives`): the buffer size for all-reduce, all-to-all
and collective-permute, the *full, gathered* size for all-gather and reduce-scatter.

Replica groups come in three printed forms; all are read:

- explicit lists ``{{0,1},{2,3}}`` (``{}`` = one group of every partition),
- iota lists ``[2,2]<=[2,2]T(1,0)`` (``arange`` reshaped, transposed, regrouped),
- mesh-axis lists ``mesh['axis_0'=2,'axis_1'=2] {'axis_1'}`` (groups along named axes).

    >>> text = '''HloModule m, num_partitions=4
    ... ENTRY %main (p: f32[8,16]) -> f32[16,16] {
    ...   %p = f32[8,16]{1,0} parameter(0)
    ...   ROOT %all-gather = f32[16,16]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, use_global_device_ids=true
    ... }'''
    >>> (c,) = parse_collectives(text)
    >>> print(c)
    all-gather f32[16,16] groups=[[0,2],[1,3]] dims=(0,) 1024 B
    >>> count_by_kind([c])
    {'all-gather': 1}
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "KINDS",
    "DTYPE_BYTES",
    "Collective",
    "parse_collectives",
    "parse_replica_groups",
    "collectives_of",
    "count_by_kind",
    "bytes_by_kind",
    "computation_runs",
]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_OPS = "|".join(re.escape(k) for k in KINDS)
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    rf"(?P<op>{_OPS})(?P<start>-start)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module.

    ``shape`` is the per-device result (of the first array for tuple results);
    ``nbytes`` follows :mod:`meshshard.sim.collectives`: buffer size for all-reduce,
    all-to-all and collective-permute, full gathered size for all-gather and
    reduce-scatter.  ``groups`` are the replica groups (``pairs`` for
    collective-permute, as (source, target)).  ``computation`` names the HLO
    computation holding it; ``in_entry`` is False inside loop bodies or called
    computations, where it may run more than once per call: ``runs`` is how many times
    one call of the program runs it (a loop body's collective, the loop's trip count).
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...] = ()
    dimensions: tuple[int, ...] = ()
    computation: str = ""
    in_entry: bool = True
    is_async: bool = False
    runs: int = 1

    @property
    def group_size(self) -> int:
        """Devices per replica group (2 for a collective-permute pair)."""
        if self.kind == "collective-permute":
            return 2
        return len(self.groups[0]) if self.groups else 1

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        if self.kind == "collective-permute":
            where = "pairs=" + ",".join(f"{a}->{b}" for a, b in self.pairs)
        else:
            where = "groups=[" + ",".join("[" + ",".join(map(str, g)) + "]" for g in self.groups)
            where += "]"
        extra = f" dims={self.dimensions}" if self.dimensions else ""
        times = f" x{self.runs}" if self.runs != 1 else ""
        return f"{self.kind} {self.dtype}[{dims}] {where}{extra} {self.nbytes} B{times}"


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for m in _ARRAY.finditer(shape_text):
        if m.group("dtype") not in DTYPE_BYTES:
            continue
        dims = tuple(int(d) for d in m.group("dims").split(",") if d)
        out.append((m.group("dtype"), dims))
    return out


def _array_bytes(dtype: str, dims: Sequence[int]) -> int:
    return int(math.ceil(DTYPE_BYTES[dtype] * math.prod(dims)))


def _braced(text: str, start: int) -> str:
    """The balanced ``{...}`` group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    raise ValueError(f"unbalanced braces in HLO attribute {text[start : start + 80]!r}")


def _attr(attrs: str, key: str) -> str | None:
    """The raw value of ``key=`` in an instruction's attribute text (braces balanced)."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attrs)
    if m is None:
        return None
    i = m.end()
    if attrs[i] == "{":
        return _braced(attrs, i)
    if attrs.startswith("mesh[", i):
        close = attrs.index("]", i)
        j = attrs.index("{", close)
        return attrs[i:j] + _braced(attrs, j)
    m2 = re.match(r"\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?|[^\s,]+", attrs[i:])
    return m2.group(0) if m2 else ""


def parse_replica_groups(text: str | None, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups from their printed form (explicit, iota or mesh-axis), as device ids.

    ``None`` or ``{}`` means one group of all ``num_devices``.

        >>> parse_replica_groups("[2,2]<=[4]", 4)
        ((0, 1), (2, 3))
        >>> parse_replica_groups("{{0,2},{1,3}}", 4)
        ((0, 2), (1, 3))
        >>> parse_replica_groups("mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", 4)
        ((0, 2), (1, 3))
        >>> parse_replica_groups("mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'a'}", 4)
        ((0, 1), (2, 3))
    """
    if text is None or text.strip() in ("", "{}"):
        return (tuple(range(num_devices)),)
    text = text.strip()
    if text.startswith("{"):
        groups = re.findall(r"\{([0-9,\s]*)\}", text[1:-1])
        return tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in groups)
    if text.startswith("["):
        m = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
        if m is None:
            raise ValueError(f"unknown iota replica-group form {text!r}")
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(shape[0], -1)
        return tuple(tuple(int(x) for x in row) for row in ids)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    raise ValueError(f"unknown replica-group form {text!r}")


def _device_ids(text: str | None, n: int) -> np.ndarray:
    """Device id at each mesh position: ``[2,2]T(1,0)`` (iota, transposed) or a list."""
    if not text:
        return np.arange(n)
    m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
    if m is not None:
        ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in re.findall(r"\d+", text)])


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    m = re.fullmatch(r"mesh\[(.*?)\](?:\s*,\s*device_ids=\((.*?)\))?\s*\{(.*)\}", text)
    if m is None:
        raise ValueError(f"unknown mesh replica-group form {text!r}")
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = re.findall(r"'([^']+)'", m.group(3))
    if any(c not in names for c in chosen):
        raise ValueError(f"mesh replica groups name an axis the mesh lacks: {text!r}")
    ids = _device_ids(m.group(2), math.prod(sizes)).reshape(sizes)
    keep = [i for i, n in enumerate(names) if n not in chosen]
    along = [names.index(c) for c in chosen]
    ids = ids.transpose(keep + along).reshape(-1, math.prod(sizes[i] for i in along))
    return tuple(tuple(int(x) for x in row) for row in ids)


def _pairs(text: str | None) -> tuple[tuple[int, int], ...]:
    if not text:
        return ()
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text))


def _result_array(op: str, is_async: bool, shape_text: str) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape of the first result array, bytes of all result arrays)."""
    arrays = _arrays(shape_text)
    if not arrays:
        raise ValueError(f"no array type in HLO result {shape_text!r}")
    if is_async and op in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        # ``(operand, result[, contexts])``: the result is the second entry
        arrays = arrays[1:2] if len(arrays) > 1 else arrays
    total = sum(_array_bytes(d, s) for d, s in arrays)
    return arrays[0][0], arrays[0][1], total


def _collective(m: re.Match, computation: str, in_entry: bool, ndev: int) -> Collective:
    op, attrs, is_async = m.group("op"), m.group("attrs"), bool(m.group("start"))
    dtype, shape, nbytes = _result_array(op, is_async, m.group("shape"))
    groups, pairs = (), ()
    if op == "collective-permute":
        pairs = _pairs(_attr(attrs, "source_target_pairs"))
    else:
        groups = parse_replica_groups(_attr(attrs, "replica_groups"), ndev)
    if op == "reduce-scatter":
        nbytes *= len(groups[0]) if groups else 1
    dims_text = _attr(attrs, "dimensions")
    dims = tuple(int(x) for x in re.findall(r"\d+", dims_text)) if dims_text else ()
    return Collective(
        kind=op,
        name=m.group("name"),
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        groups=groups,
        pairs=pairs,
        dimensions=dims,
        computation=computation,
        in_entry=in_entry,
        is_async=is_async,
    )


def parse_collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Every collective in an HLO module's text, in program order.

    ``hlo_text`` is ``compiled.as_text()`` of a ``jax.jit(...).lower(...).compile()``
    (one module).  Replica groups printed as ``{}`` are expanded with the module's
    ``num_partitions`` (or ``replica_count``).
    """
    head = hlo_text[:4000]
    parts = _PARTITIONS.search(head)
    reps = _REPLICAS.search(head)
    ndev = max(int(parts.group(1)) if parts else 1, int(reps.group(1)) if reps else 1)
    out: list[Collective] = []
    computation, in_entry = "", False
    for line in hlo_text.splitlines():
        cm = _COMPUTATION.match(line)
        if cm is not None:
            computation, in_entry = cm.group("name"), bool(cm.group("entry"))
            continue
        m = _INSTR.match(line)
        if m is not None:
            out.append(_collective(m, computation, in_entry, ndev))
    if any(not c.in_entry for c in out):
        runs = computation_runs(hlo_text)
        out = [c if c.in_entry else replace(c, runs=runs.get(c.computation, 1)) for c in out]
    return tuple(out)


_CALLEE = re.compile(
    r"\b(?P<key>condition|body|to_apply|calls|branch_computations|true_computation|"
    r"false_computation)=(?P<names>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def computation_runs(hlo_text: str) -> dict[str, int]:
    """HLO computation name -> how many times one call of the module runs it: a while
    loop's body and condition run its ``known_trip_count`` times per run of the
    computation holding the loop (once when XLA does not know the count), a called
    computation once per call, a conditional's branch at most once.

        >>> text = '''HloModule m
        ... %body (p: f32[]) -> f32[] {
        ... }
        ... %cond (p: f32[]) -> pred[] {
        ... }
        ... ENTRY %main (p: f32[]) -> f32[] {
        ...   %w = f32[] while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"20"}}
        ... }'''
        >>> computation_runs(text)["body"]
        20
    """
    calls: list[tuple[str, str, int]] = []  # (caller, callee, times per caller run)
    entry, computation = "", ""
    for line in hlo_text.splitlines():
        cm = _COMPUTATION.match(line)
        if cm is not None:
            computation = cm.group("name")
            entry = computation if cm.group("entry") else entry
            continue
        if "=" not in line:
            continue
        trip = _TRIP.search(line)
        for m in _CALLEE.finditer(line):
            times = int(trip.group(1)) if trip and m.group("key") in ("body", "condition") else 1
            for name in re.findall(r"%?([\w.\-]+)", m.group("names")):
                calls.append((computation, name, times))
    runs = {entry: 1}
    for _ in range(len(calls) + 1):  # callers before callees need no order: iterate to a fixpoint
        new = {entry: 1}
        for caller, callee, times in calls:
            if caller in runs:
                new[callee] = new.get(callee, 0) + runs[caller] * times
        if new == runs:
            break
        runs = new
    return runs


def collectives_of(compiled) -> tuple[Collective, ...]:
    """The collectives of a compiled JAX program (``jax.jit(f).lower(...).compile()``)."""
    return parse_collectives(compiled.as_text())


def count_by_kind(collectives: Iterable[Collective]) -> dict[str, int]:
    """How many collectives of each kind one call of the program runs (a collective in a
    loop body once per iteration), in :data:`KINDS` order (kinds absent are left out)."""
    c: Counter = Counter()
    for x in collectives:
        c[x.kind] += x.runs
    return {k: c[k] for k in KINDS if c[k]}


def bytes_by_kind(collectives: Iterable[Collective]) -> dict[str, int]:
    """Total ``nbytes`` of each kind one call of the program moves (a loop body's
    collective once per iteration), in :data:`KINDS` order (kinds absent are left out)."""
    total: Counter = Counter()
    for x in collectives:
        total[x.kind] += x.nbytes * x.runs
    return {k: total[k] for k in KINDS if k in total}


def program_collectives(plan, traced, mesh_id: int, devices) -> dict:
    """Compile each program of mesh ``mesh_id`` that some stream runs, the way the
    runtime does, and parse its collectives: program token -> tuple of
    :class:`Collective`.  A fused pair's forward and backward (``Plan.programs_run``) are
    never run, so they are not compiled here either; a plan without streams yet (the
    sharding passes' own) has every program compiled.

    ``devices`` are the mesh's devices, host-major (any ``len == mesh size`` list of
    local devices works: the programs are only compiled, never run).
    """
    import jax

    from meshshard.jaxpr_util import var_ids
    from meshshard.runtime.programs import (
        _specs_for,
        build_programs,
        group_contents,
        make_mesh,
        sharding,
        stored_shapes,
    )

    shape = next(m.axis_shape for m in plan.meshes if m.id == mesh_id)
    mesh = make_mesh(devices, shape)
    by_id = {i: v for v, i in var_ids(traced.jaxpr).items()}
    run = {p.name for p in (plan.programs_run() if plan.streams else plan.programs)}
    out = {}
    for name, prog in build_programs(traced, plan, mesh_id, mesh).items():
        if name not in run:
            continue
        args = []
        for g in prog.input_groups:
            vids = group_contents(plan, g).vars
            specs, shapes = _specs_for(plan, g, mesh_id), stored_shapes(plan, g, mesh_id)
            for vid, spec, shape in zip(vids, specs, shapes, strict=True):
                aval = by_id[vid].aval
                shape = aval.shape if shape is None else shape  # unreduced: (n, *shape)
                args.append(jax.ShapeDtypeStruct(shape, aval.dtype, sharding=sharding(mesh, spec)))
        out[str(name)] = collectives_of(prog.fn.lower(*args).compile())
    return out
