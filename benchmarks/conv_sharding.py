"""A CNN under the sharding ILP, with and without its convolution and pooling rules.

    python benchmarks/conv_sharding.py [--steps 8] [--json OUT.json]

One process, workers as threads, one host of 2 emulated CPU devices, planning with the
fabric's collective costs (as the sharded tests do). Each row is a median step time:
- ``jax.jit`` on one device, the reference;
- ``ShardParallel((1, 2))`` with the sharding rules as shipped (convolutions, pooling,
  pads and reversals split);
- the same with those rules removed from ``STRATEGY_RULES``. This is how every
  convolution ran before the rules existed: replicated, with every device computing the
  whole batch.
- ``DataParallel((1, 2))``, which splits the batch by its fixed rule without the ILP.

Each row also gives its step time over ``jax.jit``'s. All rows are measured in the same
run, alternating over rounds.
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

from benchmarks.step_timing import timed_steps  # noqa: E402

#: the rules the ablation removes (what ran replicated before they existed)
CONV_RULES = (
    "conv_general_dilated",
    "reduce_window_sum",
    "reduce_window_max",
    "select_and_scatter_add",
    "pad",
    "rev",
)
ROUNDS = 3


def _model_and_batch(batch_size: int):
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from flax.training import train_state

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (32, 32):
                x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    rng = np.random.RandomState(0)
    batch = {
        "x": rng.randn(batch_size, 32, 32, 3).astype(np.float32),
        "y": rng.randint(0, 10, batch_size).astype(np.int32),
    }
    model = CNN()
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.01, momentum=0.9)
    )
    return state, batch


def main(argv=None) -> dict:
    """Measure the four rows and print them as a table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax

    import meshshard
    from meshshard.passes import shard_rules
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.conftest import with_fabric_costs
    from tests.test_conv_sharding import cnn_step as train_step

    state, batch = _model_and_batch(args.batch_size)
    without = {k: shard_rules.STRATEGY_RULES.pop(k) for k in CONV_RULES}
    with use_cluster(ThreadsCluster(1, 2)) as cluster:
        with_fabric_costs(cluster)
        steps = {"jax.jit (1 device)": jax.jit(train_step)}
        steps["ShardParallel (1,2), no conv rules"] = meshshard.parallelize(
            train_step, method=meshshard.ShardParallel((1, 2))
        )
        # compile the ablation while the rules are out, then put them back
        steps["ShardParallel (1,2), no conv rules"].lower(state, batch)
        notes = steps["ShardParallel (1,2), no conv rules"].plan.notes
        replicated_without = sorted({n for n in notes if "runs replicated" in n})
        comm_without = [n for n in notes if "predicted comm" in n]
        shard_rules.STRATEGY_RULES.update(without)
        steps["ShardParallel (1,2), conv rules"] = meshshard.parallelize(
            train_step, method=meshshard.ShardParallel((1, 2))
        )
        steps["DataParallel (1,2)"] = meshshard.parallelize(
            train_step, method=meshshard.DataParallel((1, 2))
        )
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # first call: plan and compile
            timed_steps(step, state, batch, 1)
        for r in range(ROUNDS):
            for name, step in steps.items():
                _, t = timed_steps(step, state, batch, args.steps)
                times[name] += t
            print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
        notes = steps["ShardParallel (1,2), conv rules"].plan.notes
        replicated_with = sorted({n for n in notes if "runs replicated" in n})
        comm_with = [n for n in notes if "predicted comm" in n]
    ref = statistics.median(times["jax.jit (1 device)"])
    rows = [
        {
            "config": name,
            "median_step_s": statistics.median(t),
            "vs_jit": statistics.median(t) / ref,
        }
        for name, t in times.items()
    ]
    print(f"CNN, batch {args.batch_size} of 32x32x3, {ROUNDS} x {args.steps} steps per row")
    print(f"{'config':42s} {'median step':>12s} {'/ jax.jit':>10s}")
    for row in rows:
        print(f"{row['config']:42s} {row['median_step_s'] * 1e3:10.1f} ms {row['vs_jit']:10.2f}")
    print("replicated without the rules:", "; ".join(replicated_without) or "none")
    print("replicated with the rules:", "; ".join(replicated_with) or "none")
    print("the plan's collectives without the rules:", "; ".join(comm_without) or "none")
    print("the plan's collectives with the rules:", "; ".join(comm_with) or "none")
    out = {
        "batch_size": args.batch_size,
        "steps_per_round": args.steps,
        "rounds": ROUNDS,
        "rows": rows,
        "replicated_without_rules": replicated_without,
        "replicated_with_rules": replicated_with,
        "predicted_comm_without_rules": comm_without,
        "predicted_comm_with_rules": comm_with,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
