"""GPT demo on one host's four devices: the physical (1, 4) mesh against its logical
2 x 2 and 4 x 1 views, side by side in one run.

    python benchmarks/logical_views.py [--steps 10] [--micro-batches 1] [--json OUT.json]

Threads backend, one process with 8 emulated CPU devices (a `ThreadsCluster(1, 4)`),
planning with the `local` preset's costs.  Per config: the sharding ILP's size and
predicted objective, the collectives one step runs (parsed from the HLO of every
compiled program, `meshshard.hlo_collectives`, times how often the step runs it), and
the median step time with its ratio to `DataParallel((1, 4))` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.step_timing import progress, time_calls  # noqa: E402

MODEL = dict(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)


def _configs(m: int) -> list[tuple[str, object]]:
    import meshshard

    return [
        ("DataParallel (1,4)", meshshard.DataParallel((1, 4), num_micro_batches=m)),
        ("ShardParallel (1,4)", meshshard.ShardParallel((1, 4), num_micro_batches=m)),
        (
            "ShardParallel (1,4) as 2x2",
            meshshard.ShardParallel((1, 4), num_micro_batches=m, logical_shape=(2, 2)),
        ),
        (
            "ShardParallel (1,4) as 4x1",
            meshshard.ShardParallel((1, 4), num_micro_batches=m, logical_shape=(4, 1)),
        ),
    ]


def _collectives(method, spec, state, batch, m: int) -> dict[str, int]:
    """Collectives one step runs, by kind, from the compiled programs' HLO (the step
    planned again, as ``parallelize`` did, to get its trace)."""
    import jax

    from examples import gpt
    from meshshard.hlo_collectives import count_by_kind, program_collectives
    from meshshard.passes.pipeline import plan_step
    from meshshard.refs import Phase

    plan, traced = plan_step(gpt.train_step, (state, batch), method=method, cluster=spec)
    per_step: dict[str, int] = {}
    for mesh in plan.meshes:
        got = program_collectives(plan, traced, mesh.id, jax.devices()[: mesh.num_devices])
        for p in plan.programs:
            if p.mesh != mesh.id:
                continue
            runs = m if p.name.phase in (Phase.FORWARD, Phase.BACKWARD) else 1
            for kind, n in count_by_kind(got[str(p.name)]).items():
                per_step[kind] = per_step.get(kind, 0) + n * runs
    return per_step


def run(steps: int, m: int) -> list[dict]:
    """Each config's plan figures and step times, measured in one process."""
    from dataclasses import replace

    import meshshard
    from examples import gpt
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    batches = [gpt.make_batch(16, seq_len=32, seed=i) for i in range(steps + 1)]
    state0 = gpt.make_state(gpt.GPT(**MODEL), batches[0]["inputs"])
    records = []
    with use_cluster(ThreadsCluster(1, 4)) as cluster:
        cluster.spec = replace(
            meshshard.ClusterSpec.preset("local"), num_hosts=1, devices_per_host=4
        )
        configs = _configs(m)
        for i, (name, method) in enumerate(configs):
            step = meshshard.parallelize(gpt.train_step, method=method)
            first_s, times = time_calls(step, state0, batches)
            ilp = [n for n in step.plan.notes if "sharding ILP" in n]
            per_step = _collectives(method, cluster.spec, state0, batches[0], m)
            records.append(
                dict(
                    config=name,
                    micro_batches=m,
                    first_call_s=first_s,
                    step_s=statistics.median(times),
                    loadavg=os.getloadavg()[0],
                    collectives_per_step=per_step,
                    total=sum(per_step.values()),
                    ilp=ilp[0] if ilp else "",
                )
            )
            progress(i, len(configs), name, "first call", first_s, records[-1]["step_s"])
    base = records[0]["step_s"]
    for r in records:
        r["ratio"] = r["step_s"] / base
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    records = run(args.steps, args.micro_batches)
    print(f"{'config':<28} {'step ms':>8} {'vs DP':>6} {'load':>5} {'collectives/step':>17}")
    for r in records:
        kinds = ", ".join(f"{k} {n}" for k, n in r["collectives_per_step"].items())
        print(
            f"{r['config']:<28} {r['step_s'] * 1e3:>8.1f} {r['ratio']:>5.2f}x "
            f"{r['loadavg']:>5.1f} {r['total']:>6}  ({kinds})"
        )
    for r in records:
        if r["ilp"]:
            print(f"  {r['config']}: {r['ilp']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
