"""How long a program runs: measured times when given, else a roofline of its cost analysis.

Convention: ``ProgramSpec.flops`` and ``bytes_accessed`` count the *whole* program's
work across its mesh (what XLA's cost analysis reports for the unpartitioned
computation).  The mesh's devices split it evenly (ideal intra-operator scaling), so
one device runs ``flops / devices`` at its peak rate for the program's dtype::

    time = max(flops / D / peak_flops[dtype], bytes / D / memory_bandwidth) + launch_overhead

A ``program_times={"s0.F": 0.012}`` entry replaces that with a measured time (already
including launch overhead).  A program with neither costs only the launch overhead,
and the simulator says so in its notes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.plan import Plan, ProgramSpec, TensorSpec

__all__ = ["ProgramCost", "input_tensors", "program_cost", "program_dtype"]


@dataclass(frozen=True)
class ProgramCost:
    """A program's predicted run time and where it came from (``measured``/``roofline``/``none``)."""

    program: str
    seconds: float
    source: str
    bound: str = ""  # "compute" or "memory" for roofline costs

    def __str__(self) -> str:
        bound = f", {self.bound}-bound" if self.bound else ""
        return f"{self.program}: {self.seconds * 1e3:.4g} ms ({self.source}{bound})"


def input_tensors(plan: Plan, program: ProgramSpec) -> list[TensorSpec]:
    """The described arrays ``program`` reads: its input buffer groups' tensors and its
    received transfers' tensors (inputs the plan does not describe are skipped)."""
    out: list[TensorSpec] = []
    for name in program.inputs:
        try:
            out.extend(plan.buffer(name).tensors)
        except KeyError:
            try:
                out.append(plan.transfer(name).tensor)
            except KeyError:
                continue
    return out


def program_dtype(plan: Plan, program: ProgramSpec) -> str:
    """The dtype a program mostly computes in: that of the most bytes among its inputs.

    Parameters dominate a stage's inputs, so this is the parameter dtype in practice.
    Falls back to ``float32`` when no input is described.
    """
    by_dtype: dict[str, int] = {}
    for t in input_tensors(plan, program):
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    if not by_dtype:
        return "float32"
    return max(by_dtype.items(), key=lambda kv: (kv[1], kv[0]))[0]


def program_cost(
    plan: Plan,
    program: ProgramSpec,
    cluster: ClusterSpec,
    program_times: Mapping[str, float] | None = None,
) -> ProgramCost:
    """Predicted seconds for one run of ``program`` on its mesh of ``cluster``.

    ``program_times`` is keyed by program token (``"s0.F"``), as users write it.
    """
    name = str(program.name)
    if program_times and name in program_times:
        seconds = float(program_times[name])
        if seconds < 0:
            raise ValueError(f"program_times[{name!r}] must be >= 0 seconds, got {seconds}")
        return ProgramCost(name, seconds, "measured")
    mesh = next((m for m in plan.meshes if m.id == program.mesh), None)
    devices = mesh.num_devices if mesh is not None else 1
    if program.flops is None and program.bytes_accessed is None:
        return ProgramCost(name, float(cluster.launch_overhead), "none")
    compute = (program.flops or 0.0) / devices / cluster.flops_for(program_dtype(plan, program))
    memory = (program.bytes_accessed or 0.0) / devices / cluster.memory_bandwidth
    bound = "compute" if compute >= memory else "memory"
    return ProgramCost(name, max(compute, memory) + cluster.launch_overhead, "roofline", bound)
