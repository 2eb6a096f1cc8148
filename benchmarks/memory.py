"""Memory over a long run and over re-created steps: driver and actor RSS, stored arrays.

    python benchmarks/memory.py [--steps 2000] [--recreate 5] [--json OUT.json]

On the embedded local Ray cluster (4 host-actors x 2 CPU devices), the MLP pipelined over
two meshes.  Recorded at step 10 and at the last step of one training loop, then after
re-creating the parallelized step ``--recreate`` times (a re-run notebook cell: a new
step and a new state each time, the old ones dropped): this process's RSS and, per
actor, its RSS, the arrays in its store, its live device buffers and its compiled steps.
Flat store/buffer/compiled counts mean nothing leaks; RSS shows what the allocator keeps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

import meshshard  # noqa: E402
from examples import mlp  # noqa: E402
from meshshard.runtime.release import RELEASER  # noqa: E402

METHOD = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def snapshot(cluster, label: str) -> dict:
    gc.collect()
    RELEASER.flush()
    hosts = cluster.host_stats()
    return {
        "at": label,
        "driver_rss_MB": psutil.Process().memory_info().rss / 2**20,
        "actor_rss_MB": [h["rss"] / 2**20 for h in hosts.values()],
        "store": [h["store"] for h in hosts.values()],
        "live_buffers": [h["live_buffers"] for h in hosts.values()],
        "compiled": [h["compiled"] for h in hosts.values()],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--recreate", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cluster = meshshard.init()
    rows = []
    try:
        batch = mlp.make_batch(batch_size=16)
        state0 = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
        step = meshshard.parallelize(mlp.train_step, method=METHOD)
        state = state0
        for i in range(args.steps):
            state, _ = step(state, batch)
            if i + 1 in (10, args.steps):
                rows.append(snapshot(cluster, f"step {i + 1}"))
        for _ in range(args.recreate):
            step = meshshard.parallelize(mlp.train_step, method=METHOD)
            state, _ = step(state0, batch)
        rows.append(snapshot(cluster, f"{args.recreate} re-created steps"))
        del step, state
        rows.append(snapshot(cluster, "all dropped"))
    finally:
        meshshard.shutdown()
    print(
        f"{'':22}{'driver MB':>10}  {'actor RSS MB':>24}  {'store':>12}  {'buffers':>14}  compiled"
    )
    for r in rows:
        rss = " ".join(f"{x:5.0f}" for x in r["actor_rss_MB"])
        print(
            f"{r['at']:22}{r['driver_rss_MB']:10.0f}  {rss:>24}  {str(r['store']):>12}  "
            f"{str(r['live_buffers']):>14}  {r['compiled']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "recreate": args.recreate, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
