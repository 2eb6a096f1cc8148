"""Alpa's BatchNorm CNN cases under the sharding ILP, with and without operand reads
priced in a matmul's or convolution's cost.

    python benchmarks/conv_operand_reads.py [--steps 8] [--json OUT.json]

One process, workers as threads, one host of 4 emulated CPU devices, planning with the
fabric's collective costs (as the sharded tests do). The model is the one of Alpa's
``tests/shard_parallel/test_conv.py`` (stride-2 convolutions, BatchNorm, ReLU, a
stride-1 max-pool; ``jax.grad``, momentum SGD). Per case, each row is a median step:
- ``ShardParallel((1, 4))``, the ILP's plan as shipped;
- the same with the operand-read term removed from the ILP's costs, as it was planned
  before the term existed;
- ``ShardParallel((1, 4), sharding="data_parallel")``: the batch split, no ILP.

Each row also gives the kernels' layouts in its plan and its step time over the data
parallel row's. All rows are measured in the same run, alternating over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.step_timing import blocked_times  # noqa: E402

ROUNDS = 3
#: (name, batch, image side, features, layers)
CASES = (
    ("data: batch 128 of 32x32x16, 3 layers", 128, 32, 16, 3),
    ("data: batch 64 of 32x32x32, 3 layers", 64, 32, 32, 3),
    ("model: batch 8 of 16x16x256, 4 layers", 8, 16, 256, 4),
)


def _kernels(step) -> str:
    specs = [
        t.spec
        for b in step.plan.buffers
        for t in b.tensors
        if ".params[" in t.name and "kernel" in t.name
    ]
    return " ".join("whole" if not s else str(s.index(next(a for a in s if a))) for s in specs)


def main(argv=None) -> dict:
    """Measure the rows of every case and print them as a table (JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import meshshard
    from meshshard.passes import shard_ilp
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.conftest import with_fabric_costs
    from tests.test_conv_sharding import batch_norm_case, batch_norm_step

    rows = []
    with use_cluster(ThreadsCluster(1, 4)) as cluster:
        with_fabric_costs(cluster)
        for case, batch, image, features, layers in CASES:
            state, data = batch_norm_case(batch, image, features, layers)
            steps = {}
            reads = shard_ilp._operand_reads
            shard_ilp._operand_reads = lambda *a: 0.0
            try:  # plan and compile the ablation with the term out
                steps["auto, reads not priced"] = meshshard.parallelize(
                    batch_norm_step, method=meshshard.ShardParallel((1, 4))
                )
                blocked_times(steps["auto, reads not priced"], state, data, 1)
            finally:
                shard_ilp._operand_reads = reads
            steps["auto, reads priced"] = meshshard.parallelize(
                batch_norm_step, method=meshshard.ShardParallel((1, 4))
            )
            steps["data_parallel"] = meshshard.parallelize(
                batch_norm_step, method=meshshard.ShardParallel((1, 4), sharding="data_parallel")
            )
            times: dict[str, list[float]] = {name: [] for name in steps}
            for step in steps.values():
                blocked_times(step, state, data, 1)
            for r in range(ROUNDS):
                for name, step in steps.items():
                    times[name] += blocked_times(step, state, data, args.steps)
                print(f"{case}: round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
            ref = statistics.median(times["data_parallel"])
            for name, t in times.items():
                rows.append(
                    {
                        "case": case,
                        "config": name,
                        "median_step_s": statistics.median(t),
                        "vs_data_parallel": statistics.median(t) / ref,
                        "kernels_split_dim": _kernels(steps[name]),
                    }
                )
    print(f"ShardParallel((1, 4)) on threads, {ROUNDS} x {args.steps} steps per row")
    print(f"{'case':40s} {'config':24s} {'median step':>12s} {'/ dp':>6s}  kernels split on dim")
    for row in rows:
        print(
            f"{row['case']:40s} {row['config']:24s} {row['median_step_s'] * 1e3:9.1f} ms "
            f"{row['vs_data_parallel']:6.2f}  {row['kernels_split_dim']}"
        )
    out = {"steps_per_round": args.steps, "rounds": ROUNDS, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
