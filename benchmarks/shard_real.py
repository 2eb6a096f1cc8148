"""GPT demo: inferred sharding (ShardParallel) vs today's data parallelism, side by side.

    python benchmarks/shard_real.py [--steps 10] [--micro-batches 4] [--json OUT.json]

One run on the embedded local Ray cluster (4 host-actors x 2 CPU devices), both methods
on a (2, 2) mesh spanning two host-actors: median step time (and its ratio to
DataParallel), and the collectives one step runs, counted from the HLO of every
compiled program (``meshshard.hlo_collectives``) times how often the step runs it
(forward/backward once per micro-batch, the update once), next to the ILP's
prediction.  The HLO counts come from a child process with 8 emulated devices, which
compiles the same plans without running them (Ray's actors keep their own devices).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)


def _methods(m: int) -> dict:
    import meshshard

    return {
        "DataParallel (2,2)": meshshard.DataParallel(mesh_shape=(2, 2), num_micro_batches=m),
        "ShardParallel (2,2)": meshshard.ShardParallel((2, 2), num_micro_batches=m),
    }


def hlo_counts(m: int) -> dict:
    """Per method: collectives per step (parsed from HLO) and predicted, by kind."""
    import jax

    import meshshard
    from examples import gpt
    from meshshard.hlo_collectives import count_by_kind, program_collectives
    from meshshard.passes.pipeline import plan_step
    from meshshard.refs import Phase

    batch = gpt.make_batch(16, seq_len=32, seed=0)
    state = gpt.make_state(gpt.GPT(**MODEL), batch["inputs"])
    cluster = meshshard.ClusterSpec(num_hosts=4, devices_per_host=2)
    out = {}
    for name, method in _methods(m).items():
        plan, traced = plan_step(gpt.train_step, (state, batch), method=method, cluster=cluster)
        got = program_collectives(plan, traced, 0, jax.devices()[:4])
        per_step: dict = {}
        for p in plan.programs:
            runs = m if p.name.phase in (Phase.FORWARD, Phase.BACKWARD) else 1
            for kind, n in count_by_kind(got[str(p.name)]).items():
                per_step[kind] = per_step.get(kind, 0) + n * runs
        notes = [n for n in plan.notes if "sharding ILP" in n or "predicted comm" in n]
        out[name] = dict(collectives_per_step=per_step, total=sum(per_step.values()), notes=notes)
    return out


def timings(steps: int, m: int) -> dict:
    """Per method: compile seconds (first step) and median step seconds on Ray."""
    import meshshard

    meshshard.init()
    import numpy as np

    from examples import gpt

    batches = [gpt.make_batch(16, seq_len=32, seed=i) for i in range(steps + 1)]
    state0 = gpt.make_state(gpt.GPT(**MODEL), batches[0]["inputs"])
    out = {}
    try:
        for name, method in _methods(m).items():
            step = meshshard.parallelize(gpt.train_step, method=method)
            t0 = time.perf_counter()
            s, loss = step(state0, batches[0])
            float(loss)
            compile_s = time.perf_counter() - t0
            times = []
            for b in batches[1:]:
                t0 = time.perf_counter()
                s, loss = step(s, b)
                float(loss)
                times.append(time.perf_counter() - t0)
            assert np.isfinite(float(loss))
            out[name] = dict(compile_s=compile_s, step_s=statistics.median(times))
    finally:
        meshshard.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--hlo-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    m = args.micro_batches
    if args.hlo_only:
        print(json.dumps(hlo_counts(m)))
        return 0
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    child = subprocess.run(
        [sys.executable, __file__, "--hlo-only", "--micro-batches", str(m)],
        env=env,
        capture_output=True,
        text=True,
    )
    if child.returncode:
        sys.stderr.write(child.stderr)
        return child.returncode
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    times = timings(args.steps, m)
    base = times["DataParallel (2,2)"]["step_s"]
    records = []
    for name in times:
        records.append(
            dict(
                config=name,
                micro_batches=m,
                **times[name],
                ratio=times[name]["step_s"] / base,
                **counts[name],
            )
        )
    print(f"{'config':<22} {'compile s':>10} {'step ms':>9} {'vs DP':>7} {'collectives/step':>17}")
    for r in records:
        kinds = ", ".join(f"{k} {n}" for k, n in r["collectives_per_step"].items())
        print(
            f"{r['config']:<22} {r['compile_s']:>10.2f} {r['step_s'] * 1e3:>9.1f} "
            f"{r['ratio']:>6.2f}x {r['total']:>6}  ({kinds})"
        )
    for r in records:
        for n in r["notes"]:
            print(f"  {r['config']}: {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
