"""The ``meshshard`` command line.

    meshshard simulate PLAN.json --cluster dgx-a100 --hosts 2 --trace out.json
    meshshard calibrate --out local.json
    meshshard clusters
    meshshard bench STEP_SCRIPT --steps 15 --trace out.json
    meshshard profile STEP_SCRIPT --steps 5

``simulate`` prints the predicted iteration (summary table) and writes the Chrome
trace; ``--cluster`` takes a preset name or a ClusterSpec JSON file (default: the
cluster the plan was made for).  ``calibrate`` measures this machine into a
ClusterSpec JSON.  ``clusters`` lists the presets with their figures.  ``bench`` times
a step script's step (see :mod:`meshshard.bench`) and writes its measured timeline.
``profile`` times each program of a step script's step on its real mesh and writes the
profile cache that ``step.lower(..., profile=True)`` and ``step.profile`` read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from meshshard.cluster import ClusterSpec

__all__ = ["main", "load_cluster"]


def load_cluster(name_or_path: str, num_hosts: int | None = None) -> ClusterSpec:
    """A preset by name, or a ClusterSpec JSON file by path; ``num_hosts`` overrides its hosts."""
    if name_or_path in ClusterSpec.presets():
        return ClusterSpec.preset(name_or_path, num_hosts=num_hosts)
    if os.path.isfile(name_or_path):
        spec = ClusterSpec.load(name_or_path)
        return spec if num_hosts is None else replace(spec, num_hosts=num_hosts)
    raise ValueError(
        f"--cluster {name_or_path!r} is neither a preset ({', '.join(ClusterSpec.presets())}) "
        "nor a ClusterSpec JSON file (write one with `meshshard calibrate --out local.json`)"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshshard", description="meshshard command line tools")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="predict a plan's iteration on a described cluster")
    s.add_argument("plan", help="plan JSON file (Plan.to_json())")
    s.add_argument(
        "--cluster", help="preset name or ClusterSpec JSON (default: the plan's cluster)"
    )
    s.add_argument(
        "--hosts", type=int, help="number of hosts of the cluster (overrides the preset's)"
    )
    s.add_argument("--trace", help="write the Chrome trace (Perfetto) here")
    s.add_argument("--json", dest="json_out", help="write the headline results as JSON here")
    s.add_argument(
        "--no-overlap", action="store_true", help="blocking runtime: one thing at a time per worker"
    )
    s.add_argument(
        "--serial-comm",
        action="store_true",
        help="one communication at a time per worker (NCCL-stream)",
    )
    s.add_argument("--allreduce", choices=("auto", "ring", "hierarchical"), default="auto")
    s.add_argument(
        "--program-times", help='JSON file {"s0.F": seconds, ...} of measured program times'
    )
    s.add_argument("--links", type=int, default=8, help="how many of the busiest links to list")

    c = sub.add_parser("calibrate", help="measure this machine into a ClusterSpec JSON")
    c.add_argument("--out", required=True, help="where to write the ClusterSpec JSON")
    c.add_argument("--hosts", type=int, default=4, help="emulated hosts (default 4)")
    c.add_argument(
        "--devices-per-host", type=int, default=2, help="emulated devices per host (default 2)"
    )
    c.add_argument("--name", default="local")
    c.add_argument("--quick", action="store_true", help="small, fast measurements (less accurate)")

    sub.add_parser("clusters", help="list the cluster presets")

    b = sub.add_parser("bench", help="time a step script's step, record its measured timeline")
    b.add_argument("script", help="Python file defining setup() -> (parallelized step, args)")
    b.add_argument("--steps", type=int, default=15, help="timed steps (default 15)")
    b.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    b.add_argument("--trace", help="write the measured Chrome trace (Perfetto) here")
    b.add_argument("--json", dest="json_out", help="write the step times as JSON here")
    b.add_argument("--backend", choices=("ray", "threads"), default="ray")
    b.add_argument("--hosts", type=int, help="host-actors (default 4)")
    b.add_argument("--devices-per-host", type=int, help="devices per host (default 2)")
    _profile_parser(sub)
    return p


def _profile_parser(sub) -> None:
    f = sub.add_parser(
        "profile", help="time each program of a step script's step on its real mesh (cached)"
    )
    f.add_argument("script", help="Python file defining setup() -> (parallelized step, args)")
    f.add_argument("--steps", type=int, default=5, help="profiled calls (default 5)")
    f.add_argument(
        "--cache-dir",
        help="profile cache (default $MESHSHARD_PROFILE_CACHE or ~/.cache/meshshard/profiles)",
    )
    f.add_argument("--refresh", action="store_true", help="measure again even when cached")
    f.add_argument("--json", dest="json_out", help='write {"s0.F": seconds, ...} here')
    f.add_argument("--backend", choices=("ray", "threads"), default="ray")
    f.add_argument("--hosts", type=int, help="host-actors (default 4)")
    f.add_argument("--devices-per-host", type=int, help="devices per host (default 2)")


def _profile(args) -> int:
    from meshshard.profiling import ProfileCache, describe_profile, profile_script

    plan, times, hit = profile_script(
        args.script,
        steps=args.steps,
        cache_dir=args.cache_dir,
        backend=args.backend,
        num_hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        refresh=args.refresh,
    )
    print(describe_profile(plan, times, ProfileCache(args.cache_dir).directory, hit))
    if args.json_out:  # the format `meshshard simulate --program-times` reads
        with open(args.json_out, "w") as f:
            json.dump(times, f, indent=2)
    return 0


def _bench(args) -> int:
    from meshshard.bench import run_script

    result, _ = run_script(
        args.script,
        steps=args.steps,
        warmup=args.warmup,
        trace=args.trace,
        backend=args.backend,
        num_hosts=args.hosts,
        devices_per_host=args.devices_per_host,
    )
    print(result)
    if args.trace:
        print(f"measured trace written to {args.trace} (open in https://ui.perfetto.dev)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"times_s": list(result.times), "median_s": result.median}, f, indent=2)
    return 0


def _simulate(args) -> int:
    from meshshard.plan import Plan
    from meshshard.sim import SimOptions, SimulationDeadlock, simulate

    with open(args.plan) as f:
        plan = Plan.from_json(f.read())
    if args.cluster:
        cluster = load_cluster(args.cluster, args.hosts)
    else:
        cluster = (
            plan.cluster if args.hosts is None else replace(plan.cluster, num_hosts=args.hosts)
        )
    times = None
    if args.program_times:
        with open(args.program_times) as f:
            times = {str(k): float(v) for k, v in json.load(f).items()}
    options = SimOptions(
        serial_comm=args.serial_comm, allreduce=args.allreduce, record=bool(args.trace)
    )
    try:
        result = simulate(
            plan, cluster, overlap=not args.no_overlap, program_times=times, options=options
        )
    except SimulationDeadlock as e:
        print(f"meshshard simulate: {e}", file=sys.stderr)
        return 1
    print(result.summary(max_links=args.links))
    if args.trace:
        result.write_trace(args.trace)
        print(f"\ntrace written to {args.trace} (open in https://ui.perfetto.dev)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    return 0


def _calibrate(args) -> int:
    from meshshard.sim.calibrate import calibrate

    spec = calibrate(args.hosts, args.devices_per_host, quick=args.quick, name=args.name)
    with open(args.out, "w") as f:
        f.write(spec.to_json())
    print(spec.describe())
    print(
        f"\nwritten to {args.out}; use it with `meshshard simulate PLAN.json --cluster {args.out}`"
    )
    return 0


def _clusters(args) -> int:
    for name in ClusterSpec.presets():
        print(ClusterSpec.preset(name).describe())
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshshard`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    handlers = {
        "simulate": _simulate,
        "calibrate": _calibrate,
        "clusters": _clusters,
        "bench": _bench,
        "profile": _profile,
    }
    try:
        return handlers[args.command](args)
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stdout = open(os.devnull, "w")  # keeps interpreter shutdown quiet
        return 0
    except (ValueError, OSError) as e:
        print(f"meshshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
