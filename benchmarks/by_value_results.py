"""The driver's own costs on the shortest step: small results as ``jax.Array``s, their
stored copies, and the threads backend's kept step threads.

    python benchmarks/by_value_results.py [--steps 300] [--rounds 5] [--ray] [--json OUT.json]

One compiled step of a two-layer MLP (DataParallel on a one-device mesh of the
in-process threads backend, so the step is as short as a step gets and the driver's
cost shows most) whose state and metrics hold several results small enough to come back
by value (a step counter, biases, a loss and three metrics).  Timed in alternating
rounds with ``runtime.executable.as_results`` as shipped (all of a step's by-value
results made ``jax.Array``s by one call of a compiled identity program), patched to one
``jax.numpy.asarray`` per result (``as_result``, what it did before), and patched to
``numpy.asarray`` (what the driver returned before that); reported: the median step of
each, their ratios and the difference per by-value output.  A fourth variant, "no
stored copies", runs the shipped step with ``TWIN_STEPS = 0``: the workers' copies of
the by-value results are dropped at once, so the next step gets its small state arrays
from the driver again (what every step did before those copies were kept).  A fifth,
"fresh threads" (threads backend only), starts a new thread per worker per step, as the
in-process backend did before ``runtime/step_threads.py`` kept them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


class _FreshThreads:
    """``runtime.step_threads.StepThreads.start`` as before: a new thread per call."""

    def start(self, fn):
        done = threading.Event()

        def run():
            try:
                fn()
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        return done


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

    def one_each(values, weak_types):
        return [executable.as_result(v, w) for v, w in zip(values, weak_types, strict=True)]

    batch = mlp.make_batch(batch_size=8)
    shipped = executable.as_results
    kept = executable.TWIN_STEPS
    variants = (
        ("jax.Array", shipped, kept),
        ("jax.Array, one asarray each", one_each, kept),
        ("NumPy", lambda values, weak_types: [np.asarray(v) for v in values], kept),
        ("no stored copies", shipped, 0),
    )
    if not args.ray:
        variants += (("fresh threads", shipped, kept),)
    times: dict[str, list[float]] = {name: [] for name, *_ in variants}
    kept_threads = executable.STEP_THREADS
    with use_cluster(meshshard.init() if args.ray else ThreadsCluster(4, 2)):
        step = meshshard.parallelize(step_fn, method=meshshard.DataParallel(mesh_shape=(1, 1)))
        state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
        for _ in range(20):  # compile and warm up
            state, _ = step(state, batch)
        by_value = len(step.executable._small_outputs)
        for _ in range(args.rounds):
            for name, convert, twins in variants:
                executable.as_results, executable.TWIN_STEPS = convert, twins
                if name == "fresh threads":
                    executable.STEP_THREADS = _FreshThreads()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    state, _ = step(state, batch)
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                executable.as_results, executable.TWIN_STEPS = shipped, kept
                executable.STEP_THREADS = kept_threads
    med = {name: float(np.median(t)) for name, t in times.items()}
    new, each, old = med["jax.Array"], med["jax.Array, one asarray each"], med["NumPy"]
    uncopied = med["no stored copies"]
    row = {
        "by_value_outputs": by_value,
        "step_ms_jax_array": new,
        "step_ms_one_asarray_each": each,
        "step_ms_numpy": old,
        "ratio": new / old,
        "us_per_output": (new - old) * 1e3 / by_value,
        "one_program_ratio": new / each,
        "step_ms_no_stored_copies": uncopied,
        "stored_copies_ratio": new / uncopied,
    }
    print("| results as | by-value outputs | step ms (median of rounds) |")
    print("|---|---:|---:|")
    for name, ms in med.items():
        print(f"| {name} | {by_value} | {ms:.3f} |")
    print(f"jax.Array / NumPy {row['ratio']:.3f}; {row['us_per_output']:.1f} us per output")
    print(f"one program / one asarray each: {row['one_program_ratio']:.3f}")
    print(f"stored copies / none: {row['stored_copies_ratio']:.3f}")
    if "fresh threads" in med:
        row["step_ms_fresh_threads"] = med["fresh threads"]
        row["kept_threads_ratio"] = new / med["fresh threads"]
        print(f"kept threads / fresh threads: {row['kept_threads_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
