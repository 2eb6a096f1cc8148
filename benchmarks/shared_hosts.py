"""Meshes sharing hosts on the local Ray cluster: step time and the cost of re-laying
the actors, side by side in one run.

    python benchmarks/shared_hosts.py [--steps 10] [--json OUT.json]

One embedded Ray cluster of 2 hosts x 4 emulated CPU devices runs the GPT demo under
1F1B (4 micro-batches) with whole-host meshes ``2 x (1, 4)`` (one host-actor per host),
then with four ``(1, 2)`` meshes sharing the two hosts (four host-actors of 2 devices),
then with mixed widths ``(1, 4), (1, 2), (1, 1), (1, 1)`` (one host-actor per mesh, of
4, 2, 1 and 1 devices), then whole hosts again.  Per config: the first
call (actor restart into the plan's layout + compile), the median step and its ratio
to the first whole-host block; the last block shows the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.step_timing import progress, time_calls  # noqa: E402

MODEL = dict(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)
CONFIGS = [
    ("whole 2x(1,4)", [(1, 4)] * 2),
    ("shared 4x(1,2)", [(1, 2)] * 4),
    ("mixed (1,4),(1,2),(1,1),(1,1)", [(1, 4), (1, 2), (1, 1), (1, 1)]),
    ("whole 2x(1,4) again", [(1, 4)] * 2),
]


def run(steps: int) -> list[dict]:
    """Per config: first-call seconds, median step seconds, workers and load average."""

    import meshshard
    from examples import gpt

    cluster = meshshard.init(num_hosts=2, devices_per_host=4)
    batches = [gpt.make_batch(16, seq_len=32, seed=i) for i in range(steps + 1)]
    state = gpt.make_state(gpt.GPT(**MODEL), batches[0]["inputs"])
    out = []
    try:
        for i, (name, stages) in enumerate(CONFIGS):
            method = meshshard.PipeshardParallel(num_micro_batches=4, stages=stages)
            step = meshshard.parallelize(gpt.train_step, method=method)
            first_s, times = time_calls(step, state, batches)
            plan = step.plan
            out.append(
                dict(
                    config=name,
                    stages=stages,
                    workers=len(plan.workers),
                    actors=len(cluster._actors),
                    mesh_shapes=[m.shape for m in plan.meshes],
                    first_call_s=first_s,
                    step_s=statistics.median(times),
                    loadavg=os.getloadavg()[0],
                )
            )
            progress(i, len(CONFIGS), name, "first call", first_s, out[-1]["step_s"])
            step.release()
    finally:
        meshshard.shutdown()
    base = out[0]["step_s"]
    for r in out:
        r["ratio"] = r["step_s"] / base
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    records = run(args.steps)
    print(
        f"{'config':<32} {'actors':>6} {'meshes (as run)':<28} {'first call s':>12} "
        f"{'step ms':>8} {'vs whole':>8} {'load':>5}"
    )
    for r in records:
        shapes = " ".join(f"{h}x{d}" for h, d in r["mesh_shapes"])
        print(
            f"{r['config']:<32} {r['actors']:>6} {shapes:<28} {r['first_call_s']:>12.1f} "
            f"{r['step_s'] * 1e3:>8.1f} {r['ratio']:>7.2f}x {r['loadavg']:>5.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
