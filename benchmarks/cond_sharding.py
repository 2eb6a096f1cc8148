"""``lax.cond`` on activations under the sharding ILP: collectives per step and step time,
beside single-device ``jax.jit`` and ``jax.jit`` with the batch split (``NamedSharding``).

    python benchmarks/cond_sharding.py [--layers 3] [--width 512] [--batch 512]
        [--steps 10] [--rounds 3] [--json OUT.json] [--repo PATH]

Each of ``--layers`` dense layers is followed by a ``lax.cond`` choosing its activation
(gelu or relu) from a step argument.  Without a rule for ``cond`` the ILP ran it
replicated, gathering its operand first; it now splits the branches as their equations
allow (``passes/shard_loops.py``).  ``ShardParallel((1, 4))`` on the in-process threads
cluster; counts are one step's HLO collectives (``benchmarks/recurrent_grads.py``'s
counter); times are medians of ``--steps`` calls, the three runs alternating in
``--rounds`` rounds in one process.  ``--repo`` plans and runs with the meshshard checked
out there, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(layers: int, width: int, batch: int):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard

    class Gated(nn.Module):
        @nn.compact
        def __call__(self, x, flag):
            for _ in range(layers):
                x = nn.Dense(width)(x)
                x = jax.lax.cond(flag > 0, nn.gelu, nn.relu, x)
            return nn.Dense(1)(x)

    def step(state, x, y, flag):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x, flag) - y) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, 1)).astype(np.float32)
    model = Gated()
    params = model.init(jax.random.PRNGKey(0), x, 1)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return step, state, x, y, jnp.int32(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repo", default=ROOT, help="the meshshard checkout to plan and run with")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import recurrent_grads

    hlo = recurrent_grads._hlo_reader()
    sys.path.insert(0, os.path.abspath(args.repo))
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import meshshard
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    step, state, x, y, flag = _case(args.layers, args.width, args.batch)
    print(f"planned with {meshshard.__file__}")
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    peer = jax.jit(step, in_shardings=(whole, rows, rows, whole), out_shardings=(whole, whole))
    peer_args = [jax.device_put(a, s) for a, s in ((x, rows), (y, rows), (flag, whole))]
    single = jax.jit(step)
    with use_cluster(ThreadsCluster(1, 4)):
        par = meshshard.parallelize(
            step, method=meshshard.ShardParallel((1, 4)), batch_argnums=(1, 2)
        )
        exe = par._executable_for((state, x, y, flag))
        counts = recurrent_grads.meshshard_per_step(exe.plan, exe.traced, hlo)
        notes = [n for n in exe.plan.notes if "replicated" in n]
        calls = {
            "ShardParallel (1,4)": (lambda s: par(s, x, y, flag), state),
            "jax.jit batch split": (lambda s: peer(s, *peer_args), jax.device_put(state, whole)),
            "jax.jit one device": (lambda s: single(s, x, y, flag), state),
        }
        times, _ = recurrent_grads.timed_rounds(calls, args.steps, args.rounds)
    print(f"collectives per step: {counts}; notes: {notes or 'none replicated'}")
    base = statistics.median(times["jax.jit one device"])
    print(f"{'run':22} {'ms / step':>10} {'vs one device':>14}")
    for k, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{k:22} {ms:>10.2f} {ms / base / 1e3:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"repo": os.path.abspath(args.repo), "counts": counts, "notes": notes}
                | {"times": times},
                f,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
