"""Rematerialized layers under the sharding ILP and data parallelism: step time and
collectives, with ``nn.remat`` and without.

    python benchmarks/remat_sharding.py [--steps 12] [--json OUT.json] [--repo PATH]

A residual MLP of 4 blocks (d 256, hidden 1024, batch 2048) with each block under
``nn.remat`` or not, Adam, on one host of 4 emulated devices (threads): the inferred
sharding ``ShardParallel((1, 4))`` and ``DataParallel((1, 4), num_micro_batches=2)``.
Before ``passes/inline_remat.py`` a rematerialized block's backward was one opaque
equation that the ILP ran replicated (inputs all-gathered, every device recomputing the
whole batch) and whose gradients data parallelism all-reduced once per micro-batch.
Reported per config: the median step and the collectives one step runs (compiled HLO).
``--repo`` runs the meshshard checked out there (a worktree of an older commit); compare
runs made one after the other, alternately, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(remat: bool):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(256)(nn.gelu(nn.Dense(1024)(nn.LayerNorm()(x))))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = nn.remat(Block) if remat else Block
            for _ in range(4):
                x = layer()(x)
            return x

    def step(state, batch):
        def loss(params):
            return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

        value, grads = meshshard.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((2048, 256)).astype(np.float32) for k in "xy"}
    model = Net()
    params = model.init(jax.random.PRNGKey(0), batch["x"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return step, state, batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repo", default=ROOT, help="the meshshard checkout to run")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    sys.path.insert(0, os.path.abspath(args.repo))
    sys.path.insert(1, ROOT)
    import meshshard
    from benchmarks.step_timing import timed_steps
    from meshshard.instructions import Run
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    methods = {
        "auto": lambda: meshshard.ShardParallel((1, 4)),
        "data_parallel_m2": lambda: meshshard.DataParallel((1, 4), num_micro_batches=2),
    }
    rows = []
    print(f"ran {meshshard.__file__}")
    print(f"{'method':18} {'remat':>5} {'step ms':>8}  collectives per step (compiled)")
    with use_cluster(ThreadsCluster(1, 4)):
        for name, make in methods.items():
            for remat in (False, True):
                fn, state, batch = _case(remat)
                step = meshshard.parallelize(fn, method=make())
                state, _ = timed_steps(step, state, batch, 2)  # compile, warm up
                _, times = timed_steps(step, state, batch, args.steps)
                stream = step.plan.streams[0]  # one mesh: every worker runs the same
                found = {}
                for prog, got in step.compiled_collectives().items():
                    runs = sum(
                        isinstance(i, Run) and str(i.program) == str(prog)
                        for i in stream.instructions
                    )
                    for c in got:
                        found[c.kind] = found.get(c.kind, 0) + runs
                ms = 1e3 * statistics.median(times)
                print(f"{name:18} {str(remat):>5} {ms:>8.1f}  {found}", flush=True)
                rows.append({"method": name, "remat": remat, "step_ms": ms, "collectives": found})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repo": os.path.abspath(args.repo), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
