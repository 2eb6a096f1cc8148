"""How fast the simulator predicts one iteration of a large plan (issue 3: target < 1 s).

Builds synthetic 1F1B pipelines of 8 stages on 4-host meshes (32 hosts of
aws-p3.16xlarge) with 64 micro-batches, so one iteration has tens of thousands of
instructions and flows, and times ``simulate`` (best of ``--repeat`` runs; plan
construction excluded): wall clock ("sim s") and this process's CPU time ("cpu s"), which
other work on a shared machine disturbs less.  Prints a table and writes JSON with
``--json OUT.json``.

    .venv/bin/python benchmarks/sim_speed.py --json sim_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.sim import SimOptions, simulate  # noqa: E402
from meshshard.sim.synthetic import synthetic_pipeline  # noqa: E402

CASES = [
    # name, transfer strategy, activation bytes per micro-batch, record spans/trace samples.
    # Broadcasts are chain-pipelined in 1 MiB chunks, one flow per chunk per edge.
    ("send_recv 16 MiB", "send_recv", 16 << 20, True),
    ("broadcast 4 MiB", "broadcast", 4 << 20, True),
    ("broadcast 16 MiB", "broadcast", 16 << 20, True),
    ("broadcast 16 MiB, no trace", "broadcast", 16 << 20, False),
]


def run(repeat: int) -> list[dict]:
    """Time every case; returns one dict of figures per case."""
    cluster = ClusterSpec.preset("aws-p3.16xlarge", num_hosts=32)
    rows = []
    for name, transfer, nbytes, record in CASES:
        plan = synthetic_pipeline(
            8,
            64,
            schedule="1f1b",
            mesh_shape=(4, 8),
            forward_flops=4e13,
            activation_bytes=nbytes,
            transfer=transfer,
            cluster=cluster,
        )
        best, cpu, result = float("inf"), float("inf"), None
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            result = simulate(plan, cluster, options=SimOptions(record=record))
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        rows.append(
            {
                "case": name,
                "instructions": result.num_instructions,
                "flows": result.num_flows,
                "events": result.num_instructions + result.num_flows,
                "seconds": best,
                "cpu_seconds": cpu,
                "events_per_second": (result.num_instructions + result.num_flows) / best,
                "predicted_iteration_s": result.iteration_time,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    p.add_argument("--json", dest="json_out", help="write results here")
    args = p.parse_args(argv)
    rows = run(args.repeat)
    print(
        f"{'case':<30}{'instructions':>13}{'flows':>8}{'sim s':>8}{'cpu s':>8}{'events/s':>11}"
        f"{'iter s':>9}"
    )
    for r in rows:
        print(
            f"{r['case']:<30}{r['instructions']:>13}{r['flows']:>8}{r['seconds']:>8.3f}"
            f"{r['cpu_seconds']:>8.3f}{r['events_per_second']:>11.0f}"
            f"{r['predicted_iteration_s']:>9.3f}"
        )
    if args.json_out:
        meta = {
            "benchmark": "sim_speed",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
        }
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
