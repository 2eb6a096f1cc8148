"""Demo: train the GPT example with a 2-stage pipeline on the embedded local cluster.

    python examples/train_gpt.py [--steps 40] [--micro-batches 4] [--schedule 1f1b]

Starts Ray with 4 host-actors of 2 emulated CPU devices each, runs the step as a
1F1B pipeline over two 2-device meshes (data parallel inside each), shows a progress
bar with the loss, prints the plan summary, and shuts everything down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import meshshard  # noqa: E402
from examples import gpt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)

    # Start Ray before this process uses JAX, so Ray's forks don't copy JAX's threads.
    print("starting the local cluster (Ray, 4 host-actors x 2 CPU devices) ...", flush=True)
    meshshard.init()
    model = gpt.GPT(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)
    first = gpt.make_batch(args.batch_size, seq_len=32, seed=0)
    state = gpt.make_state(model, first["inputs"])
    method = meshshard.PipeshardParallel(
        num_micro_batches=args.micro_batches, stages=[(1, 2), (1, 2)], schedule=args.schedule
    )
    step = meshshard.parallelize(gpt.train_step, method=method, donate_argnums=(0,))
    try:
        losses = []
        bar = tqdm(range(args.steps), desc="training", unit="step", dynamic_ncols=True)
        t_first = time.perf_counter()
        for i in bar:
            batch = gpt.make_batch(args.batch_size, seq_len=32, seed=i)
            state, loss = step(state, batch)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if i == 0:
                bar.write(f"compiled and ran step 1 in {time.perf_counter() - t_first:.1f}s")
        bar.close()
        print()
        print(step.plan.summary())
        print()
        for i in range(0, args.steps, max(1, args.steps // 8)):
            print(f"  step {i + 1:>3}  loss {losses[i]:.4f}")
        print(f"  step {args.steps:>3}  loss {losses[-1]:.4f}")
        head, tail = np.mean(losses[:3]), np.mean(losses[-3:])
        verdict = "down" if tail < head else "NOT down"
        print(f"\nloss went {verdict}: {head:.3f} (first 3 steps) -> {tail:.3f} (last 3 steps)")
        return 0 if tail < head else 1
    finally:
        meshshard.shutdown()


if __name__ == "__main__":
    sys.exit(main())
