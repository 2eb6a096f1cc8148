"""What returning small results as ``jax.Array``s costs a step, against NumPy values.

    python benchmarks/by_value_results.py [--steps 300] [--rounds 5] [--ray] [--json OUT.json]

One compiled step of a two-layer MLP (DataParallel on a one-device mesh of the
in-process threads backend, so the step is as short as a step gets and the driver's
cost shows most) whose state and metrics hold several results small enough to come back
by value (a step counter, biases, a loss and three metrics).  Timed in alternating
rounds with ``runtime.executable.as_result`` as shipped (``jax.numpy.asarray``) and
patched to ``numpy.asarray`` (what the driver returned before); reported: the median
step of each, their ratio and the difference per by-value output.  A third variant,
"no stored copies", runs the shipped step with ``TWIN_STEPS = 0``: the workers' copies
of the by-value results are dropped at once, so the next step gets its small state
arrays from the driver again (what every step did before those copies were kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--ray", action="store_true", help="on the local Ray cluster (one host-actor) instead"
    )
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    import meshshard
    import meshshard.runtime.executable as executable
    from examples import mlp
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    def step_fn(state, batch):
        state, loss = mlp.train_step(state, batch)
        metrics = {"loss": loss, "double": loss * 2, "plus": loss + 1}
        return state, {**metrics, "positive": jnp.sum(batch["x"] > 0)}

    batch = mlp.make_batch(batch_size=8)
    shipped = executable.as_result
    times: dict[str, list[float]] = {"jax.Array": [], "NumPy": [], "no stored copies": []}
    variants = (
        ("jax.Array", shipped, executable.TWIN_STEPS),
        ("NumPy", lambda value, weak_type=False: np.asarray(value), executable.TWIN_STEPS),
        ("no stored copies", shipped, 0),
    )
    kept = executable.TWIN_STEPS
    with use_cluster(meshshard.init() if args.ray else ThreadsCluster(4, 2)):
        step = meshshard.parallelize(step_fn, method=meshshard.DataParallel(mesh_shape=(1, 1)))
        state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
        for _ in range(20):  # compile and warm up
            state, _ = step(state, batch)
        by_value = len(step.executable._small_outputs)
        for _ in range(args.rounds):
            for name, convert, twins in variants:
                executable.as_result, executable.TWIN_STEPS = convert, twins
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    state, _ = step(state, batch)
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                executable.as_result, executable.TWIN_STEPS = shipped, kept
    new, old = (float(np.median(times[k])) for k in ("jax.Array", "NumPy"))
    uncopied = float(np.median(times["no stored copies"]))
    row = {
        "by_value_outputs": by_value,
        "step_ms_jax_array": new,
        "step_ms_numpy": old,
        "ratio": new / old,
        "us_per_output": (new - old) * 1e3 / by_value,
        "step_ms_no_stored_copies": uncopied,
        "stored_copies_ratio": new / uncopied,
    }
    print("| results as | by-value outputs | step ms (median of rounds) |")
    print("|---|---:|---:|")
    print(f"| jax.Array | {by_value} | {new:.3f} |")
    print(f"| NumPy | {by_value} | {old:.3f} |")
    print(f"| jax.Array, no stored copies | {by_value} | {uncopied:.3f} |")
    print(f"ratio {row['ratio']:.3f}; {row['us_per_output']:.1f} us per by-value output")
    print(f"stored copies / none: {row['stored_copies_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
