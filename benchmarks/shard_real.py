"""GPT demo: inferred sharding and local gradient accumulation vs today's data-parallel
plans, side by side.

    python benchmarks/shard_real.py [--steps 10] [--micro-batches 4] [--json OUT.json]

One run on the embedded local Ray cluster (4 host-actors x 2 CPU devices):
``DataParallel`` and ``ShardParallel`` on a (2, 2) mesh spanning two host-actors, and
``PipeshardParallel`` on 2x(2, 2) with ``sharding="data_parallel"`` and ``"auto"``, each
with gradients reduced per micro-batch (``MESHSHARD_ACCUMULATE=reduced``, the plans
before issue 11's local accumulation) and accumulated locally (the default).  Median
step time and its ratio to the data-parallel "reduced" plan of the same shape, and the
collectives one step runs, counted from the HLO of every compiled program of every mesh
(``meshshard.hlo_collectives``) times how often the step runs it (forward/backward once
per micro-batch, the update once).  The HLO counts come from a child process with 8 emulated devices, which
compiles the same plans without running them (Ray's actors keep their own devices).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.step_timing import progress, time_calls  # noqa: E402

MODEL = dict(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)


#: (name, method factory, MESHSHARD_ACCUMULATE, baseline name): "reduced" is the plan
#: before local accumulation (each micro-batch's gradient reduced as it is made).
def _configs(m: int) -> list[tuple]:
    import meshshard

    dp = lambda: meshshard.DataParallel(mesh_shape=(2, 2), num_micro_batches=m)  # noqa: E731
    sp = lambda: meshshard.ShardParallel((2, 2), num_micro_batches=m)  # noqa: E731
    stages = [(2, 2), (2, 2)]

    def pipe(sharding):
        return lambda: meshshard.PipeshardParallel(
            num_micro_batches=m, stages=stages, sharding=sharding
        )

    base1, base2 = "DataParallel (2,2) reduced", "Pipeshard DP 2x(2,2) reduced"
    return [
        (base1, dp, "reduced", base1),
        ("DataParallel (2,2) local", dp, "local", base1),
        ("ShardParallel (2,2) reduced", sp, "reduced", base1),
        ("ShardParallel (2,2) local", sp, "local", base1),
        (base2, pipe("data_parallel"), "reduced", base2),
        ("Pipeshard DP 2x(2,2) local", pipe("data_parallel"), "local", base2),
        ("Pipeshard auto 2x(2,2) local", pipe("auto"), "local", base2),
    ]


def _batches(n: int):
    from examples import gpt

    return [gpt.make_batch(16, seq_len=32, seed=i) for i in range(n)]


def hlo_counts(m: int) -> dict:
    """Per config: collectives per step (parsed from HLO, every mesh) and the ILP notes."""
    import jax

    import meshshard
    from examples import gpt
    from meshshard.hlo_collectives import count_by_kind, program_collectives
    from meshshard.passes.pipeline import plan_step
    from meshshard.refs import Phase

    batch = _batches(1)[0]
    state = gpt.make_state(gpt.GPT(**MODEL), batch["inputs"])
    # what the local Ray cluster plans with (its in-program collective costs included)
    cluster = meshshard.ClusterSpec.preset("local")
    out = {}
    for name, make, mode, _ in _configs(m):
        os.environ["MESHSHARD_ACCUMULATE"] = mode
        plan, traced = plan_step(gpt.train_step, (state, batch), method=make(), cluster=cluster)
        per_step: dict = {}
        for mesh in plan.meshes:
            devs = jax.devices()[4 * mesh.id : 4 * mesh.id + mesh.num_devices]
            got = program_collectives(plan, traced, mesh.id, devs)
            for p in plan.programs:
                if p.mesh != mesh.id:
                    continue
                runs = m if p.name.phase in (Phase.FORWARD, Phase.BACKWARD) else 1
                for kind, n in count_by_kind(got[str(p.name)]).items():
                    per_step[kind] = per_step.get(kind, 0) + n * runs
        notes = [n for n in plan.notes if "sharding ILP" in n]
        out[name] = dict(collectives_per_step=per_step, total=sum(per_step.values()), notes=notes)
    return out


def timings(steps: int, m: int) -> dict:
    """Per config: compile seconds (first step) and median step seconds on Ray, with the
    load average next to them (this machine is shared)."""

    import meshshard
    from examples import gpt

    meshshard.init()
    batches = _batches(steps + 1)
    state0 = gpt.make_state(gpt.GPT(**MODEL), batches[0]["inputs"])
    out = {}
    try:
        configs = _configs(m)
        for i, (name, make, mode, _) in enumerate(configs):
            os.environ["MESHSHARD_ACCUMULATE"] = mode  # read when the step plans
            step = meshshard.parallelize(gpt.train_step, method=make())
            compile_s, times = time_calls(step, state0, batches)
            out[name] = dict(
                compile_s=compile_s,
                step_s=statistics.median(times),
                loadavg=os.getloadavg()[0],
            )
            progress(i, len(configs), name, "compile", compile_s, out[name]["step_s"])
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
    records = []
    for name, _, mode, base in _configs(m):
        records.append(
            dict(
                config=name,
                accumulate=mode,
                baseline=base,
                micro_batches=m,
                **times[name],
                ratio=times[name]["step_s"] / times[base]["step_s"],
                **counts[name],
            )
        )
    print(
        f"{'config':<30} {'compile s':>9} {'step ms':>8} {'vs base':>7} {'load':>5} "
        f"{'collectives/step':>17}"
    )
    for r in records:
        kinds = ", ".join(f"{k} {n}" for k, n in r["collectives_per_step"].items())
        print(
            f"{r['config']:<30} {r['compile_s']:>9.2f} {r['step_s'] * 1e3:>8.1f} "
            f"{r['ratio']:>6.2f}x {r['loadavg']:>5.1f} {r['total']:>6}  ({kinds})"
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
