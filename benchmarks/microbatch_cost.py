"""What splitting a step into micro-batches costs on XLA:CPU, before any pipelining.

    python benchmarks/microbatch_cost.py [--steps 30] [--rounds 3] [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` (4 blocks, d_model 64, batch 16, seq 32):
the loss and gradient (``jax.jit``, no optimizer update: a pipeline applies the update
once per step) on the whole batch and on one micro-batch of ``16 / M`` rows, for M in
{1, 2, 4, 8}, measured in interleaved rounds in this process.  Reported per M: the median
time of one micro-batch and ``factor = M x t(16 / M) / t(16)``, the gradient compute a
pipeline of M micro-batches does per step relative to the fused single-process one.  A
pipeline's efficiency against that reference (the peer benchmark's figure) is then at
most about ``S x M / (factor x (M + S - 1))`` on S stages with a core each, whatever its
runtime does (roughly: each stage's programs also keep their own fixed cost), because
the fixed cost of a program run is paid once per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_torch_pipe import BATCH, MODEL, SEQ  # noqa: E402
from benchmarks.step_timing import blocked_times  # noqa: E402

SPLITS = (1, 2, 4, 8)


def measure(steps: int, rounds: int) -> list[dict]:
    """Median time of the loss and gradient per micro-batch size, interleaved rounds."""
    import jax
    import optax

    from examples import gpt

    model = gpt.GPT(**MODEL)

    def grads(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        return jax.value_and_grad(loss_fn)(state.params)

    step = jax.jit(grads)
    cases = {}
    for m in SPLITS:
        batch = gpt.make_batch(BATCH // m, seq_len=SEQ, vocab=MODEL["vocab"])
        state = gpt.make_state(model, batch["inputs"])
        blocked_times(step, state, batch, 3)  # compile and warm up
        cases[m] = (state, batch, [])
    per_round = -(-steps // rounds)
    for _ in range(rounds):
        for state, batch, times in cases.values():
            times.extend(blocked_times(step, state, batch, per_round))
    full = statistics.median(cases[1][2])
    rows = []
    for m, (_, _, times) in cases.items():
        t = statistics.median(times)
        rows.append(dict(micro_batches=m, rows=BATCH // m, step_s=t, compute_factor=m * t / full))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per micro-batch size")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = measure(args.steps, args.rounds)
    print(f"{'M':>3} {'rows':>5} {'grad ms':>9} {'M x t(B/M) / t(B)':>19}")
    for r in rows:
        print(
            f"{r['micro_batches']:>3} {r['rows']:>5} {r['step_s'] * 1e3:>9.2f}"
            f" {r['compute_factor']:>19.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=MODEL, batch=BATCH, seq=SEQ, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
