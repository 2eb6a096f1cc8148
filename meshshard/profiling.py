"""Profile a parallelized step's programs on their real meshes, and read the collectives
XLA compiled into them (``step.profile(...)``, ``step.lower(..., profile=True)``).

Profiling runs the step on the running cluster with every ``RUN`` waiting for its
outputs (``record(sync=True)``), so each program's span is its run time on its own
mesh, collectives inside it included; the median per program is cached on disk under a
key of the plan's fingerprint, the program, its mesh shape, the micro-batch count and
the jax / meshshard versions, so a later profile of the same program skips the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import jax

from meshshard.errors import MeshshardInputError
from meshshard.plan import Plan
from meshshard.refs import Phase

__all__ = [
    "ProfileCache",
    "describe_profile",
    "profile_key",
    "profile_script",
    "profile_step",
    "profiled_steps",
    "stage_times_of",
    "program_collectives",
]

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "meshshard", "profiles")


def profile_key(plan: Plan, program: str, cores: int = 0) -> str:
    """The cache key of one program of ``plan`` (program + mesh + versions; ``cores``:
    times with the sharing of that many cores removed, see :func:`profile_step`)."""
    import meshshard

    spec = next(p for p in plan.programs if str(p.name) == program)
    mesh = next(m for m in plan.meshes if m.id == spec.mesh)
    parts = (
        plan.fingerprint,
        program,
        str(mesh.shape) + (f" as {mesh.view}" if mesh.view else ""),
        str(plan.num_micro_batches),
        ",".join(map(str, spec.eqns)),
        jax.__version__,
        getattr(meshshard, "__version__", "dev"),
        plan.cluster.name,
    ) + ((f"isolated on {cores} cores",) if cores else ())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


class ProfileCache:
    """Program times on disk, one small JSON file per key."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or os.environ.get("MESHSHARD_PROFILE_CACHE", DEFAULT_CACHE)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.json")

    def get(self, plan: Plan, cores: int = 0) -> dict[str, float] | None:
        """Every run program's cached seconds, or None if any is missing."""
        out = {}
        for p in plan.programs_run():
            path = self._path(profile_key(plan, str(p.name), cores))
            if not os.path.exists(path):
                return None
            with open(path) as f:
                out[str(p.name)] = float(json.load(f)["seconds"])
        return out

    def put(self, plan: Plan, times: dict[str, float], cores: int = 0) -> None:
        """Store measured seconds per program."""
        os.makedirs(self.directory, exist_ok=True)
        for name, seconds in times.items():
            with open(self._path(profile_key(plan, name, cores)), "w") as f:
                json.dump({"program": name, "seconds": seconds}, f)


def profile_step(
    step, args: tuple, steps: int = 5, cache: ProfileCache | None = None, cores: int | None = None
) -> dict[str, float]:
    """Median seconds of every program of parallelized ``step`` over ``steps`` profiled
    calls on ``args`` (compiling first if needed; the step's own recording is restored
    after); read from and written to ``cache`` when given (a hit only plans the step:
    nothing is compiled or run).

    ``cores`` > 0: each program's time as if it had run alone, the slow-down from the
    other programs that shared those CPU cores removed
    (:func:`~meshshard.sim.fidelity.isolated_program_times`), for a simulation with
    ``ClusterSpec.host_cores`` = ``cores``, which puts the sharing back for the plan at
    hand (the model that meets issue 10's target in benchmarks/fidelity.py).  0: the
    times as measured.  None (default): the plan's ``cluster.host_cores``, so that
    ``simulate(plan, program_times=...)`` counts the sharing once (the local cluster's
    workers share this machine's cores; a cluster of real hosts has 0).
    """
    from meshshard.sim.fidelity import isolated_program_times, program_times

    if cores is not None and (not isinstance(cores, int) or cores < 0):
        raise MeshshardInputError(
            f"profile(cores={cores!r}): pass the CPU cores the cluster's workers share "
            "(os.cpu_count() for a cluster on one machine), 0 for times as measured, or "
            "None for the cluster's ClusterSpec.host_cores"
        )
    if cache is not None:  # planning alone gives the keys: a hit compiles nothing
        plan = step.lower(*args, costs=False)
        n = plan.cluster.host_cores if cores is None else cores
        hit = cache.get(plan, n)
        if hit is not None:
            return hit
    exe = step._executable_for(args)
    cores = exe.plan.cluster.host_cores if cores is None else cores
    recorded = profiled_steps(step, args, steps)
    if cores:
        times = isolated_program_times(recorded, exe.plan, cores)
    else:
        times = program_times(recorded)
    if cache is not None:
        cache.put(exe.plan, times, cores)
    return times


def profile_demands(
    step, args: tuple, steps: int = 5, cores: int | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """``(times, demands)`` of every program of parallelized ``step`` over ``steps``
    profiled calls on ``args``: the cores each program keeps busy while it runs
    (:func:`~meshshard.sim.fidelity.program_demands`, from its process CPU time) and its
    seconds alone with the sharing of ``cores`` removed under those demands.  For
    ``simulate(plan, program_times=times, options=SimOptions(core_demands=...))`` on a
    cluster whose workers share ``cores`` (None: the plan's ``ClusterSpec.host_cores``).

    Needs one process per worker (the Ray backend): the in-process threads backend's
    workers share one process's CPU time, which cannot be told apart per program."""
    from meshshard.sim.fidelity import isolated_program_times, program_demands

    fix = "pass the CPU cores the cluster's workers share (os.cpu_count() for a cluster on one machine)"
    if cores is not None and (not isinstance(cores, int) or cores < 1):
        raise MeshshardInputError(f"profile_demands(cores={cores!r}): {fix}")
    exe = step._executable_for(args)
    if cores is None:
        cores = exe.plan.cluster.host_cores
        if not cores:
            raise MeshshardInputError(
                "profile_demands: the plan's cluster has ClusterSpec.host_cores=0 (its "
                f"workers do not share cores, so demands mean nothing); {fix} as cores="
            )
    if getattr(exe.backend, "workers_share_process", False):
        raise MeshshardInputError(
            "profile_demands needs one process per worker, as on the Ray backend "
            "(meshshard.init()); the threads backend's workers share this process's "
            "CPU time.  Use step.profile() there"
        )
    recorded = profiled_steps(step, args, steps)
    demands = program_demands(recorded, exe.plan, cores)
    return isolated_program_times(recorded, exe.plan, cores, demands), demands


def profiled_steps(step, args: tuple, steps: int = 5) -> list:
    """The recorded ``[(streams, StepTrace)]`` of ``steps`` calls of ``step`` on ``args``
    in which every program waits for its outputs (the step's own recording is restored
    after): what :func:`~meshshard.sim.fidelity.program_times` and
    :func:`~meshshard.sim.fidelity.isolated_program_times` read."""
    from meshshard.runtime.trace_record import TraceLog

    exe = step._executable_for(args)
    before, before_sync = exe.trace_log, exe._sync
    log = TraceLog(path=os.devnull, keep=steps)
    exe.record(log, sync=True)
    try:
        for _ in range(steps):
            step(*args)
    finally:
        exe.record(before, before_sync)
    return list(log.steps)


def program_collectives(plan: Plan, traced, devices: Sequence | None = None) -> dict[str, tuple]:
    """The collectives XLA compiled into each program of ``plan`` on its mesh shape,
    compiled on this process's devices (``devices``; a mesh of H x D needs H*D of them,
    which CPU emulation provides with ``--xla_force_host_platform_device_count``).  Every
    mesh's programs that some stream runs, compiled as the runtime compiles them
    (:func:`meshshard.hlo_collectives.program_collectives`)."""
    from meshshard.hlo_collectives import program_collectives as of_mesh

    devices = list(devices if devices is not None else jax.devices())
    out: dict[str, tuple] = {}
    for m in plan.meshes:
        if m.num_devices > len(devices):
            raise ValueError(
                f"mesh{m.id} {m.shape} needs {m.num_devices} devices to compile its programs "
                f"but this process has {len(devices)}; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={m.num_devices}"
            )
        out.update(of_mesh(plan, traced, m.id, devices[: m.num_devices]))
    return out


def profile_script(
    path: str,
    steps: int = 5,
    cache_dir: str | None = None,
    backend: str = "ray",
    num_hosts: int | None = None,
    devices_per_host: int | None = None,
    refresh: bool = False,
):
    """``meshshard profile``: run a step script's step (see :mod:`meshshard.bench`) with
    every program timed on its real mesh, median over ``steps`` calls, and store the
    times in the profile cache (``cache_dir``, default the one ``lower(profile=True)``
    and ``step.profile`` read), so a later ``lower(profile=True)`` of the same step on
    the same cluster reads them instead of running.  Starts the cluster asked for if
    the script did not; ``refresh`` measures again even when cached.  Returns
    ``(plan, {program: seconds}, cache_hit)``."""
    from meshshard.bench import script_on_cluster

    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    with script_on_cluster(path, backend, num_hosts, devices_per_host) as module:
        step, args = module.setup()
        if getattr(step, "_two_bw", None) is not None:
            raise ValueError(
                "meshshard profile: schedule='2bw' runs two compiled variants; profile the "
                "same step with schedule='1f1b' (the same programs)"
            )
        cache = ProfileCache(cache_dir)
        plan = step.lower(*args, costs=False)
        cores = plan.cluster.host_cores  # as step.profile() keys them by default
        hit = not refresh and cache.get(plan, cores) is not None
        times = profile_step(step, args, steps, None if refresh else cache)
        if refresh:
            cache.put(plan, times, cores)
        step.release()
        return plan, times, hit


def describe_profile(plan: Plan, times: dict[str, float], cache_dir: str, hit: bool) -> str:
    """The table ``meshshard profile`` prints: each program's mesh and measured time."""
    shapes = {m.id: m.shape for m in plan.meshes}
    mesh_of = {str(p.name): p.mesh for p in plan.programs}
    head = "cached" if hit else "measured"
    lines = [f"{len(times)} programs, {head}; cache {cache_dir}", f"{'program':<16} mesh   ms"]
    for name, seconds in times.items():
        shape = "x".join(map(str, shapes[mesh_of[name]]))
        lines.append(f"{name:<16} {shape:<6} {seconds * 1e3:.3f}")
    return "\n".join(lines)


def stage_times_of(plan: Plan, program_times: dict[str, float]) -> tuple:
    """``PipeshardParallel.stage_times`` records from a profiled plan: per stage, its
    layers, the submesh it ran on (as the stage DP names it: ``(1, d)`` inside a host or
    whole hosts ``(h, D)``) and its forward + backward (+ weight-gradient) program seconds
    per micro-batch, from the runs the streams make (a fused ``s{i}.FB`` counts once for
    both; a one-micro-batch ``s{i}.step`` counts its update in too).  Stages whose run programs were not all timed are left out."""
    from meshshard.instructions import Run

    runs: dict[int, list] = {}
    for stream in plan.streams:
        for ins in stream.instructions:
            if isinstance(ins, Run) and ins.program.phase not in (Phase.APPLY, Phase.GATHER):
                runs.setdefault(ins.program.owner, []).append(ins)
    out = []
    for st in plan.stages:
        mine = runs.get(st.id, [])
        names = [str(r.program) for r in mine]
        if not names or any(n not in program_times for n in names):
            continue
        per_mb = sum(program_times[n] for n in names) / len({r.mb for r in mine})
        submesh = tuple(plan.meshes[st.mesh].shape)  # as the stage DP named it
        lo, hi = min(st.layers), max(st.layers) + 1
        out.append((lo, hi, submesh, per_mb))
    return tuple(out)
