"""Train, save, shut the Ray cluster down, start a new one, restore on another layout, train.

Run in its own process by ``tests/test_checkpoint.py`` (it starts and stops its own Ray
cluster, leaving the test session's alone): ``python -m tests.checkpoint_scenario DIR``
prints one JSON line with the worst relative error of each leaf against six uninterrupted
``jax.jit`` steps, and whether the restored state equals the saved one bit for bit.
"""

import json
import sys

import jax
import numpy as np

import meshshard
from examples import mlp
from meshshard import PipeshardParallel

BEFORE = PipeshardParallel(num_micro_batches=2, stages=[(2, 1), (1, 2)], schedule="gpipe")
AFTER = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 1), (2, 2)])


def batches(start, n):
    return [mlp.make_batch(batch_size=16, seed=i) for i in range(start, start + n)]


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def main(directory: str) -> dict:
    state0 = mlp.make_state(mlp.MLP(num_layers=4), batches(0, 1)[0]["x"])
    ref = state0
    for b in batches(0, 6):
        ref, _ = jax.jit(mlp.train_step)(ref, b)
    meshshard.init()
    step = meshshard.parallelize(mlp.train_step, method=BEFORE)
    state = state0
    for b in batches(0, 3):
        state, _ = step(state, b)
    saved = jax.tree.map(np.asarray, state)
    meshshard.save(directory, state)
    meshshard.shutdown()
    meshshard.init()
    step = meshshard.parallelize(mlp.train_step, method=AFTER)
    state = meshshard.restore(directory, like=step.placement(state0, batches(0, 1)[0]))
    exact = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(state), strict=True)
    )
    for b in batches(3, 3):
        state, _ = step(state, b)
    got = jax.tree.map(np.asarray, state)
    meshshard.shutdown()
    errors = [
        rel_error(a, b) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True)
    ]
    return {"bit_exact": exact, "max_rel_error": max(errors), "step": int(got.step)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
