"""Parity sweep: every schedule x stages x micro-batches equals single-device ``jax.jit``.

    python benchmarks/schedules_parity.py [--stages 2,4] [--micro-batches 1,2,4,8]
        [--schedules gpipe,1f1b,...] [--json OUT.json]

The test suite runs a few of these cases (tests/test_schedule_parity.py); this runs the
whole grid on the threads backend with the 8-layer MLP (2 steps; 2BW 5 steps against
its plain-JAX reference, ``tests/two_bw_reference.py``).  Invalid combinations
(interleaved needs ``M % S == 0``, 2BW ``M >= S``) are listed as skipped.  Prints one
row per case: passed or the assertion, and the seconds it took (compile included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("MESHSHARD_CHECKS", "1")

from examples import mlp  # noqa: E402
from meshshard import PipeshardParallel  # noqa: E402
from meshshard.runtime.cluster import ThreadsCluster, use_cluster  # noqa: E402
from tests import parity  # noqa: E402
from tests.two_bw_reference import check_2bw  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1", "2bw")


def valid(schedule: str, S: int, M: int) -> bool:
    """Whether ``schedule`` accepts ``S`` stages and ``M`` micro-batches."""
    if schedule == "interleaved_1f1b":
        return M % S == 0
    return M >= S if schedule == "2bw" else True


def run_case(schedule: str, S: int, M: int) -> str:
    """'passed' or the failure's first line."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    method = PipeshardParallel(
        num_micro_batches=M, stages=[(1, 2)] * S, schedule=schedule, virtual_stages=v
    )
    try:
        if schedule == "2bw":
            check_2bw(method, steps=5)
        else:
            parity.check_parity("mlp", method, steps=2)
    except AssertionError as e:
        return f"FAILED: {str(e).splitlines()[0] if str(e) else 'assertion'}"
    return "passed"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2,4")
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    parity.MODELS["mlp"] = lambda: (mlp, mlp.MLP(num_layers=8), mlp.make_batch(batch_size=16))
    rows = []
    with use_cluster(ThreadsCluster(4, 2)):
        for schedule in args.schedules.split(","):
            for S in map(int, args.stages.split(",")):
                for M in map(int, args.micro_batches.split(",")):
                    t0 = time.perf_counter()
                    result = run_case(schedule, S, M) if valid(schedule, S, M) else "skipped"
                    rows.append(
                        dict(
                            schedule=schedule,
                            stages=S,
                            micro_batches=M,
                            result=result,
                            seconds=round(time.perf_counter() - t0, 1),
                        )
                    )
                    r = rows[-1]
                    print(f"{schedule:>16} S={S} M={M}: {result} ({r['seconds']} s)", flush=True)
    failed = [r for r in rows if r["result"].startswith("FAILED")]
    print(f"{len(rows)} cases, {len(failed)} failed")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
