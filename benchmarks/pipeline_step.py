"""Per-step time of the pipelined GPT demo vs single-process jax.jit of the same step.

    python benchmarks/pipeline_step.py [--steps 20] [--json OUT.json]

Measured in one run on the embedded local Ray cluster (4 host-actors x 2 CPU devices):
compile time (plan + trace + jit on the workers + first step), median step time,
its ratio to plain ``jax.jit`` in this process, and the driver's per-step overhead
(the driver's wall time for a step minus the slowest worker's own time for it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meshshard  # noqa: E402
from examples import gpt  # noqa: E402

CONFIGS = {
    "pipeline 2x(1,2) 1f1b M=4": meshshard.PipeshardParallel(
        num_micro_batches=4, stages=[(1, 2), (1, 2)]
    ),
    "pipeline 2x(2,2) 1f1b M=4": meshshard.PipeshardParallel(
        num_micro_batches=4, stages=[(2, 2), (2, 2)]
    ),
    "pipeline 4x(1,2) gpipe M=4": meshshard.PipeshardParallel(
        num_micro_batches=4, stages=[(1, 2)] * 4, schedule="gpipe"
    ),
    "data parallel (2,2)": meshshard.DataParallel(mesh_shape=(2, 2)),
}


def timed_steps(step, state, batches, sync):
    times = []
    for b in batches:
        t0 = time.perf_counter()
        state, loss = step(state, b)
        sync(loss)
        times.append(time.perf_counter() - t0)
    return state, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    meshshard.init()
    import jax
    import numpy as np

    model = gpt.GPT(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)
    batches = [gpt.make_batch(16, seq_len=32, seed=i) for i in range(args.steps + 2)]
    state0 = gpt.make_state(model, batches[0]["inputs"])
    records = []
    try:
        ref = jax.jit(gpt.train_step)
        t0 = time.perf_counter()
        s, loss = ref(state0, batches[0])
        loss.block_until_ready()
        ref_compile = time.perf_counter() - t0
        s, ref_times = timed_steps(ref, s, batches[1:], lambda x: x.block_until_ready())
        ref_med = statistics.median(ref_times)
        records.append(
            dict(
                config="jax.jit, one process",
                compile_s=ref_compile,
                step_s=ref_med,
                ratio=1.0,
                overhead_s=0.0,
            )
        )
        for name, method in CONFIGS.items():
            step = meshshard.parallelize(gpt.train_step, method=method, donate_argnums=(0,))
            t0 = time.perf_counter()
            s, loss = step(state0, batches[0])
            float(loss)
            compile_s = time.perf_counter() - t0
            overheads, times = [], []
            for b in batches[1:]:
                t0 = time.perf_counter()
                s, loss = step(s, b)
                float(loss)
                wall = time.perf_counter() - t0
                times.append(wall)
                workers = step.executable.backend.worker_seconds
                overheads.append(wall - max(workers.values()))
            med = statistics.median(times)
            records.append(
                dict(
                    config=name,
                    compile_s=compile_s,
                    step_s=med,
                    ratio=med / ref_med,
                    overhead_s=statistics.median(overheads),
                    instructions=sum(len(x.instructions) for x in step.plan.streams),
                )
            )
            assert np.isfinite(float(loss))
    finally:
        meshshard.shutdown()

    print(f"{'config':<30} {'compile s':>10} {'step ms':>9} {'vs jit':>8} {'driver ms':>10}")
    for r in records:
        print(
            f"{r['config']:<30} {r['compile_s']:>10.2f} {r['step_s'] * 1e3:>9.1f} "
            f"{r['ratio']:>7.2f}x {r['overhead_s'] * 1e3:>10.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
