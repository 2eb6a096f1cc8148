"""What stacking the layers under ``nn.scan`` costs a pipeline, against a Python loop.

    python benchmarks/scan_layers.py [--depth 8] [--width 256] [--batch 64]
        [--micro-batches 4] [--sharding auto|zero2|zero3] [--steps 10] [--rounds 3]
        [--json OUT.json]

The same residual MLP blocks, written two ways: a Python loop of separate modules (each
stage owns its layers' weights) and ``nn.scan`` over one stacked block (one weight array
for all layers, which meshshard unrolls or splits into pieces: ``passes/unroll_scans.py``).
Each is cut into 2 stages of ``(1, 2)`` meshes on the local Ray cluster, by
``mark_pipeline_boundary()`` after every block and by ``layers=2``; 1F1B, 4 micro-batches
by default, Adam.  With ``--sharding MODE`` the two models run on one ``(1, 2)`` mesh
under ``ShardParallel(sharding=MODE)`` instead, without markers.  Steps are timed in
alternating rounds after a warm-up; reported: the median step of each variant and its
ratio to the first (the loop), measured in one run, the bytes each stage keeps per
micro-batch from its forward to its backward (its residuals, read from the plan), and
the bytes of the stacked weights that stage 1 receives once per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def build(kind: str, depth: int, width: int, mark: bool):
    """A Flax module of ``depth`` residual blocks: ``kind`` 'loop' or 'scan'."""
    import flax.linen as nn
    import jax.numpy as jnp

    import meshshard

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _=None):
            x = x + nn.Dense(width)(jnp.tanh(nn.Dense(width)(x)))
            if mark:
                meshshard.mark_pipeline_boundary()
            return x, None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(width)(x)
            if kind == "scan":
                stack = nn.scan(
                    Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=depth
                )
                x, _ = stack()(x, None)
            else:
                for _ in range(depth):
                    x, _ = Block()(x)
            return nn.Dense(1)(x)

    return Net()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument(
        "--sharding",
        default=None,
        help="run ShardParallel((1, 2), sharding=...) on one mesh instead of the pipeline",
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    import optax
    from flax.training import train_state

    import meshshard
    from examples import mlp  # its train step: mean squared error, meshshard.grad

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((args.batch, args.width), dtype=np.float32),
        "y": rng.standard_normal((args.batch, 1), dtype=np.float32),
    }
    variants = {
        "loop, markers": ("loop", True, None),
        "scan, markers": ("scan", True, None),
        "loop, layers=2": ("loop", False, 2),
        "scan, layers=2": ("scan", False, 2),
    }
    if args.sharding:
        variants = {"loop": ("loop", False, None), "scan": ("scan", False, None)}
    meshshard.init()
    steps, states, times = {}, {}, {name: [] for name in variants}
    stack_bytes = 0
    try:
        for name, (kind, mark, layers) in variants.items():
            model = build(kind, args.depth, args.width, mark)
            params = model.init(jax.random.key(0), batch["x"])["params"]
            if kind == "scan":
                stack_bytes = sum(a.nbytes for a in jax.tree.leaves(params["ScanBlock_0"]))
            state = train_state.TrainState.create(
                apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
            )
            if args.sharding:
                method = meshshard.ShardParallel(
                    (1, 2), sharding=args.sharding, num_micro_batches=args.micro_batches
                )
            else:
                method = meshshard.PipeshardParallel(
                    num_micro_batches=args.micro_batches, stages=[(1, 2), (1, 2)], layers=layers
                )
            steps[name] = meshshard.parallelize(mlp.train_step, method=method)
            for _ in range(3):  # compile and warm up
                state, loss = steps[name](state, batch)
            jax.block_until_ready(meshshard.fetch(loss))
            states[name] = state
        for _ in range(args.rounds):
            for name, step in steps.items():
                state = states[name]
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    state, loss = step(state, batch)
                    meshshard.fetch(loss)
                    times[name].append(time.perf_counter() - t0)
                states[name] = state
    finally:
        meshshard.shutdown()

    first = next(iter(times))
    base = statistics.median(times[first])
    rows = []
    print(f"{'variant':<16} {'median ms':>10} {'/ ' + first:>16} {'kept per micro-batch':>22}")
    for name, ts in times.items():
        med = statistics.median(ts)
        kept = residual_bytes(steps[name].plan)
        rows.append(
            {
                "variant": name,
                "median_s": med,
                "ratio": med / base,
                "steps": len(ts),
                "residual_bytes_per_stage": kept,
            }
        )
        per_stage = " + ".join(f"{b / 2**10:.0f}" for b in kept)
        print(f"{name:<16} {med * 1e3:>10.1f} {med / base:>16.2f} {per_stage + ' KiB':>22}")
    if not args.sharding:
        print(f"stacked weights: {stack_bytes / 2**20:.2f} MiB, sent to stage 1 once per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "stack_bytes": stack_bytes}, f, indent=1)
    return 0


def residual_bytes(plan) -> list[int]:
    """Bytes each stage keeps per micro-batch from its forward until its backward (its
    ``R`` buffer: residuals), in stage order."""
    from meshshard.refs import BufferKind

    kept = {b.mesh: b.nbytes for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS}
    return [kept.get(m.id, 0) for m in plan.meshes]


if __name__ == "__main__":
    sys.exit(main())
