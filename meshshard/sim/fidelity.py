"""What the roofline misses, fitted from measured timelines (issue 10).

Three ingredients turn a measured run into simulator inputs:

- **program times** (:func:`program_times`): the median span of each program's ``RUN``
  in a *profiling* trace (``record(sync=True)``: each RUN waits for its outputs), on the
  program's real mesh, collectives inside it included.  :func:`isolated_program_times`
  removes the slow-down from other programs that shared the CPU cores at the time (from
  the aligned spans), for a simulator that models the cores itself (``host_cores``);
- **host overheads** (:func:`opcode_overheads`, :func:`dispatch_overhead`): the
  runtime's seconds per non-program instruction and the driver's per-step dispatch;
- a **calibrated roofline** (:class:`CalibratedRoofline`) for programs never profiled:
  ``t = c0 + c_ops * ops + c1 * flops/D + c2 * bytes/D + c3 * intra_s + c4 * cross_s``
  (``ops``: the program's traced equations, each a kernel XLA's CPU runtime launches
  with a fixed cost that dominates at small sizes), fitted by
  non-negative least squares on relative error over profiled programs, where
  ``intra_s``/``cross_s`` price the collectives XLA put inside the program (read from
  its compiled HLO, :mod:`meshshard.hlo_collectives`) on the mesh's fabric
  (:func:`collective_seconds`: gloo between host-actors, memcpy within one).

Everything here is arithmetic on recorded stamps and plan data: no Ray, no devices.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Run, Zeros
from meshshard.plan import MESH_AXES, MeshSpec, Plan, ProgramSpec
from meshshard.sim.costs import input_tensors

__all__ = [
    "program_times",
    "isolated_program_times",
    "program_demands",
    "devices_per_host",
    "opcode_overheads",
    "dispatch_overhead",
    "fit_dispatch",
    "zeros_tensors",
    "collective_seconds",
    "CalibratedRoofline",
    "ProgramSample",
]


def _runs(steps, cpu: bool = False) -> Iterable[tuple]:
    """(step, worker, RUN, start, end) in seconds on the driver clock; with ``cpu``, also
    the run's process CPU seconds (0.0 where none was recorded)."""
    for n, (streams, step) in enumerate(steps):
        by_worker = {s.worker: s for s in streams}
        for wt in step.workers:
            shift = step.offset(wt.worker)
            stamps = getattr(wt, "cpu", ())  # traces pickled before CPU times have none
            for i, ins in enumerate(by_worker[wt.worker].instructions):
                if isinstance(ins, Run) and wt.start[i]:
                    row = (
                        n,
                        wt.worker,
                        ins,
                        (wt.start[i] - shift) / 1e9,
                        (wt.end[i] - shift) / 1e9,
                    )
                    yield (*row, stamps[i] / 1e9 if stamps else 0.0) if cpu else row


def program_times(steps) -> dict[str, float]:
    """Median seconds of each program's RUN spans over recorded ``[(streams, StepTrace)]``
    (record with ``sync=True`` so a span is the program's run, not its dispatch)."""
    spans: dict[str, list[float]] = {}
    for _, _, ins, s, e in _runs(steps):
        spans.setdefault(str(ins.program), []).append(e - s)
    return {p: statistics.median(v) for p, v in sorted(spans.items())}


def isolated_program_times(
    steps, plan: Plan, cores: int, demands: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Like :func:`program_times`, with each span's work counted at the speed it would
    have had alone: ``integral of min(1, cores / demand(t)) dt`` over the span, where
    ``demand(t)`` is the cores every program running at ``t`` keeps busy (``demands``,
    e.g. :func:`program_demands`; else its mesh's devices per host), from the aligned
    spans of all workers of the same step."""
    runs = list(_runs(steps))
    by_step = _demand_spans(runs, _demands_or_devices(plan, demands))
    work: dict[str, list[float]] = {}
    for n, _, ins, s, e in runs:
        work.setdefault(str(ins.program), []).append(_work(s, e, by_step[n], cores))
    return {p: statistics.median(v) for p, v in sorted(work.items())}


def devices_per_host(plan: Plan) -> dict[str, int]:
    """Each program's mesh devices on one host: the threads XLA:CPU runs it on there."""
    return {str(p.name): _mesh(plan, p.mesh).shape[1] for p in plan.programs}


def _demands_or_devices(plan: Plan, demands: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = dict(devices_per_host(plan))
    out.update(demands or {})
    return out


def _demand_spans(runs, demand: Mapping[str, float]) -> dict[int, list]:
    by_step: dict[int, list[tuple[float, float, float]]] = {}
    for n, _, ins, s, e, *_ in runs:
        by_step.setdefault(n, []).append((s, e, demand[str(ins.program)]))
    return by_step


def program_demands(steps, plan: Plan, cores: int, rounds: int = 4) -> dict[str, float]:
    """Cores each program keeps busy while it runs, from profiled steps whose RUNs
    recorded their process CPU time (``record(sync=True)``): CPU seconds over the
    seconds the run would have taken alone (:func:`isolated_program_times`'s integral),
    the median over its runs, between 1 and its mesh's devices per host.

    A program's devices each run a thread, but the threads are not always busy: a
    micro-batch replicated over two devices runs about 1.3x as long as on one device
    alone, yet two such programs together take the time of four one-device runs
    (``benchmarks/core_contention.py``), so charging it two full cores over-predicts
    any sharing.  The isolation depends on the demands and the demands on it: a few
    rounds of both from devices per host.  Programs without a CPU time are left out."""
    runs = [r for r in _runs(steps, cpu=True) if r[5] > 0]
    devices = devices_per_host(plan)
    demand: dict[str, float] = dict(devices)
    out: dict[str, float] = {}
    for _ in range(rounds):
        by_step = _demand_spans(runs, demand)
        samples: dict[str, list[float]] = {}
        for n, _, ins, s, e, cpu in runs:
            alone = _work(s, e, by_step[n], cores)
            if alone > 0:
                samples.setdefault(str(ins.program), []).append(cpu / alone)
        out = {
            p: min(float(devices[p]), max(1.0, statistics.median(v)))
            for p, v in sorted(samples.items())
        }
        demand = {**devices, **out}
    return out


def _work(start: float, end: float, spans, cores: int) -> float:
    cuts = sorted({start, end} | {t for s, e, _ in spans for t in (s, e) if start < t < end})
    total = 0.0
    for a, b in zip(cuts, cuts[1:], strict=False):
        mid = (a + b) / 2
        demand = sum(d for s, e, d in spans if s <= mid < e)
        total += (b - a) * (min(1.0, cores / demand) if demand else 1.0)
    return total


def opcode_overheads(steps) -> dict[str, float]:
    """Host seconds per instruction of each opcode but RUN, from recorded ``steps``.

    Record them with ``sync=True``: a RUN then holds its program's whole run, so the
    other spans are the runtime's own work (reading a block off the device for a SEND,
    assembling a received value at its WAIT, allocating ZEROS...).  The median per
    opcode; for WAIT and WAITALL, which also block until peers deliver, the 10th
    percentile (their cost when the data is already there).
    """
    spans: dict[str, list[float]] = {}
    for streams, step in steps:
        by_worker = {s.worker: s for s in streams}
        for wt in step.workers:
            for i, ins in enumerate(by_worker[wt.worker].instructions):
                if not isinstance(ins, Run) and wt.start[i]:
                    op = ins.opcode.value
                    spans.setdefault(op, []).append((wt.end[i] - wt.start[i]) / 1e9)
    out = {}
    for op, v in sorted(spans.items()):
        v.sort()
        out[op] = v[len(v) // 10] if op in ("WAIT", "WAITALL") else statistics.median(v)
    return out


def dispatch_overhead(steps) -> float:
    """The driver's median seconds per step outside the workers' own spans: preparing
    inputs, collecting outputs, and the call's round trip (the driver's ``workers``
    span minus the longest worker's first stamp to its finish, programs still running
    after the last instruction's dispatch included: :attr:`WorkerTrace.busy_ns`)."""
    dispatch: list[float] = []
    for _, step in steps:
        busiest = max((wt.busy_ns / 1e9 for wt in step.workers), default=0.0)
        named = {name: (b - a) / 1e9 for name, a, b in step.driver}
        outside = named.get("prepare", 0.0) + named.get("outputs", 0.0)
        dispatch.append(outside + max(0.0, named.get("workers", 0.0) - busiest))
    return statistics.median(dispatch) if dispatch else 0.0


def zeros_tensors(plan: Plan) -> float:
    """Mean tensors per ``ZEROS`` instruction of ``plan`` (0 without any): the runtime
    places each accumulator tensor on the mesh one by one, so a ``ZEROS`` costs about
    its tensor count times a per-tensor time (fit that from one plan, price another)."""
    counts = [
        len(plan.buffer(ins.buffer).tensors)
        for stream in plan.streams
        for ins in stream.instructions
        if isinstance(ins, Zeros)
    ]
    return sum(counts) / len(counts) if counts else 0.0


def fit_dispatch(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(d0, d1)`` of the driver's dispatch ``d0 + d1 * workers`` seconds per step, from
    ``(workers, measured dispatch seconds)`` of several plans (non-negative least
    squares): the driver hands inputs to and collects outputs from each worker in turn,
    so a plan with more workers pays more per step.  One distinct worker count fits a
    constant.

    >>> [round(c, 6) for c in fit_dispatch([(1, 0.003), (2, 0.005), (4, 0.009)])]
    [0.001, 0.002]
    """
    from scipy.optimize import nnls

    if not samples:
        raise ValueError("fit_dispatch needs at least one (workers, seconds) sample")
    if len({w for w, _ in samples}) < 2:
        return statistics.median(t for _, t in samples), 0.0
    x = np.array([[1.0, float(w)] for w, _ in samples])
    y = np.array([t for _, t in samples], dtype=np.float64)
    coef, _ = nnls(x, y)
    return float(coef[0]), float(coef[1])


def _mesh(plan: Plan, mesh_id: int) -> MeshSpec:
    return next(m for m in plan.meshes if m.id == mesh_id)


def collective_seconds(
    collectives: Sequence, mesh_shape: tuple[int, int], cluster: ClusterSpec
) -> tuple[float, float]:
    """Alpha-beta seconds of a program's collectives on its mesh, as (within a host,
    across hosts): a group spanning hosts moves ``(n-1)/n`` of its bytes per phase over
    the NIC (gloo between host-actors here), one within a host over the intra-host
    fabric; all-reduce is two phases (reduce-scatter + all-gather), a permute one full
    message; a collective in a loop body counts once per iteration.  Kept apart because
    the two fabrics' real costs are fitted separately."""
    per_host = mesh_shape[1]
    intra = cross = 0.0
    for c in collectives:
        if c.kind == "collective-permute":
            members = {d for pair in c.pairs[:1] for d in pair}
        else:
            members = set(c.groups[0] if c.groups else range(mesh_shape[0] * per_host))
        across = len({d // per_host for d in members}) > 1
        lat, bw = cluster.mesh_collective()[0 if across else 1]
        n = max(2, c.group_size)
        if c.kind == "collective-permute":
            t = lat + c.nbytes / bw
        else:
            phases = 2 if c.kind == "all-reduce" else 1
            t = phases * ((n - 1) * lat + (n - 1) / n * c.nbytes / bw)
        t *= c.runs  # a loop body's collective, once per iteration
        if across:
            cross += t
        else:
            intra += t
    return intra, cross


@dataclass(frozen=True)
class ProgramSample:
    """One profiled program: its cost analysis, mesh devices, collective seconds, time."""

    program: str
    flops: float
    bytes_accessed: float
    devices: int
    collective_s: tuple[float, float]  # (within a host, across hosts)
    seconds: float
    ops: int = 0  # the program's traced equations

    def features(self) -> list[float]:
        """The fit's regressors: 1, ops, flops/D, bytes/D, collective seconds in and
        across hosts."""
        d = max(self.devices, 1)
        return [1.0, float(self.ops), self.flops / d, self.bytes_accessed / d, *self.collective_s]


@dataclass(frozen=True)
class CalibratedRoofline:
    """``t = c0 + c_ops ops + c1 flops/D + c2 bytes/D + c3 intra_s + c4 cross_s``, all
    coefficients >= 0.

    ``c1`` is 1 / (effective FLOP/s per device), ``c2`` 1 / (effective bytes/s), ``c0``
    the per-program launch and host cost, ``c_ops`` the cost of each operation,
    ``c3``/``c4`` how much slower the fabric within / across hosts really is than the
    cluster's alpha-beta figures.
    """

    coef: tuple[float, float, float, float, float, float]
    samples: int

    def __str__(self) -> str:
        c0, cop, c1, c2, c3, c4 = self.coef
        rate = f"{1 / c1 / 1e9:.3g} GFLOP/s" if c1 > 0 else "inf FLOP/s"
        bw = f"{1 / c2 / 1e9:.3g} GB/s" if c2 > 0 else "inf B/s"
        return (
            f"calibrated roofline ({self.samples} programs): launch {c0 * 1e6:.4g} us, "
            f"{cop * 1e6:.3g} us per op, "
            f"{rate}, {bw} per device, collectives x{c3:.3g} within / x{c4:.3g} across hosts"
        )

    @staticmethod
    def fit(samples: Sequence[ProgramSample]) -> CalibratedRoofline:
        """Non-negative least squares on relative error over ``samples``."""
        from scipy.optimize import nnls

        if not samples:
            raise ValueError("CalibratedRoofline.fit needs at least one profiled program")
        x = np.array([s.features() for s in samples], dtype=np.float64)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        scale = x.max(axis=0)
        scale[scale == 0] = 1.0
        w = 1.0 / np.maximum(y, 1e-9)
        coef, _ = nnls(x / scale * w[:, None], y * w)
        return CalibratedRoofline(tuple(float(c) for c in coef / scale), len(samples))

    def seconds(self, sample: ProgramSample) -> float:
        """Predicted seconds of a program described like ``sample`` (its time unused)."""
        return float(np.dot(self.coef, sample.features()))

    def program_times(
        self, plan: Plan, collective_s: Mapping[str, tuple[float, float]] | None = None
    ) -> dict[str, float]:
        """Predicted seconds of every program of ``plan`` (for ``simulate(program_times=)``)."""
        return {
            str(p.name): self.seconds(
                sample_of(plan, p, (collective_s or {}).get(str(p.name), (0.0, 0.0)))
            )
            for p in plan.programs
        }


def work_devices(plan: Plan, program: ProgramSpec) -> int:
    """How many ways ``program``'s work is split: the most shards any of its input arrays
    is cut into on its mesh.  A micro-batch too small to split over a (2, 2) mesh runs
    whole, replicated, on each of its 4 devices: its FLOPs are not divided by 4."""
    sizes = dict(zip(MESH_AXES, _mesh(plan, program.mesh).axis_shape, strict=True))
    best = 1
    for t in input_tensors(plan, program):
        n = 1
        for entry in t.spec:
            for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
                n *= sizes.get(axis, 1)
        best = max(best, n)
    return best


def sample_of(
    plan: Plan, program: ProgramSpec, collective_s: tuple[float, float], seconds: float = 0.0
) -> ProgramSample:
    """A :class:`ProgramSample` of one program of ``plan`` (FLOPs and bytes per device
    over the devices its work is split across, :func:`work_devices`)."""
    return ProgramSample(
        str(program.name),
        program.flops or 0.0,
        program.bytes_accessed or 0.0,
        work_devices(plan, program),
        collective_s,
        seconds,
        len(program.eqns),
    )


def run_spans(steps, index: int = -1) -> dict[tuple[int, str], tuple[float, float]]:
    """``{(worker, "s0.F mb1"): (start, end)}`` seconds of every RUN of recorded step
    ``index`` (driver clock), named as the simulator names its spans."""
    n = range(len(steps))[index]
    return {(w, _run_name(ins)): (s, e) for k, w, ins, s, e in _runs(steps) if k == n}


def _run_name(ins: Run) -> str:
    return f"{ins.program}" + (f" mb{ins.mb}" if ins.mb is not None else "")


def order_disagreements(a: Mapping, b: Mapping, margin: float) -> list[tuple]:
    """Pairs of spans (keys common to ``a`` and ``b``, values (start, end)) that one
    timeline runs one after the other (the first ends ``margin`` before the second
    starts) while the other timeline starts the second ``margin`` before the first: the
    interleaving the two disagree on.  Near-ties (within ``margin``) in either timeline
    are not judged: two spans one timeline starts together, the other may run in
    either order (a core taken by another process serialises them).

    >>> order_disagreements({"x": (0, 1), "y": (2, 3)}, {"x": (0, 1), "y": (1.5, 2)}, 0.1)
    []
    >>> order_disagreements({"x": (0, 1), "y": (2, 3)}, {"x": (2, 3), "y": (0, 1)}, 0.1)
    [('x', 'y')]
    >>> order_disagreements({"x": (0, 1), "y": (2, 3)}, {"x": (0.05, 1), "y": (0, 1)}, 0.1)
    []
    """
    keys = sorted(set(a) & set(b), key=str)
    out = []
    for i, x in enumerate(keys):
        for y in keys[i + 1 :]:
            for p, q in ((a, b), (b, a)):
                if p[x][1] + margin <= p[y][0] and q[y][0] + margin <= q[x][0]:
                    out.append((x, y))
                    break
                if p[y][1] + margin <= p[x][0] and q[x][0] + margin <= q[y][0]:
                    out.append((x, y))
                    break
    return out
