"""Cost of recording measured timelines (``step.record(path)``), on both step-call paths.

    python benchmarks/recording_overhead.py [--rounds 6] [--block 8] [--json OUT.json]
    python benchmarks/recording_overhead.py --paired 60 [--block 2] [--json OUT.json]

The fidelity benchmark's first plan (GPT model A, 2x(1,2) gpipe M=4) on the embedded
local Ray cluster: blocks of ``--block`` steps with and without recording, interleaved
for ``--rounds`` rounds (``fidelity._overhead``), once with step calls over the direct
connections (the default) and once over Ray actor calls.  Target (issue 10): recording
costs at most 2% of the step.

``--paired N``: this machine drifts by more than 2% between blocks of steps, so the
difference of two medians cannot show a 2% effect.  Paired mode runs N rounds of a
short block with and a short block without recording, in alternating order, takes each
round's ratio (mean traced step / mean untraced step: the drift is shared within a
round) and reports the median ratio with a 95% bootstrap interval over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import fidelity  # noqa: E402  (sets XLA_FLAGS before JAX starts)

PLAN = 1  # fidelity.PLANS[1]: "A 2x(1,2) gpipe M=4"


def on_each_path(row) -> list[dict]:
    """``row(name, step, state, batch, trace_path)`` for the plan on each step-call path
    (direct connections, then Ray calls), each row tagged with its plan and path."""
    import meshshard

    cluster = meshshard.init()
    rows = []
    try:
        name, _, model_key, method = fidelity.PLANS[PLAN]
        state, batch = fidelity._setup(model_key)
        step = meshshard.parallelize(fidelity.gpt.train_step, method=method)
        for _ in range(2):  # compile, then place the state on the actors
            state, _ = step(state, batch)
        with tempfile.TemporaryDirectory() as tmp:
            for path, on in (("connection", True), ("ray call", False)):
                cluster.use_step_channel = on
                cluster.close_channels()
                rows.append(dict(plan=name, path=path, **row(step, state, batch, f"{tmp}/t.json")))
        cluster.use_step_channel = True
    finally:
        meshshard.shutdown()
    return rows


def measure(rounds: int, block: int) -> list[dict]:
    """Median traced and untraced step time per step-call path."""

    def row(step, state, batch, trace):
        traced, untraced = fidelity._overhead(step, state, batch, trace, rounds, block)
        return dict(traced_s=traced, untraced_s=untraced, overhead=traced / untraced - 1)

    return on_each_path(row)


def paired_ratios(step, state, batch, path: str, rounds: int, block: int):
    """Per round: mean step with recording over mean step without, adjacent blocks in
    alternating order; and every untraced step's seconds."""
    ratios, untraced = [], []
    for r in range(rounds):
        means = {}
        for on in (True, False) if r % 2 else (False, True):
            step.record(path if on else None)
            state, t = fidelity._timed(step, state, batch, block)
            means[on] = sum(t) / len(t)
            untraced += [] if on else t
        ratios.append(means[True] / means[False])
    step.record(None)
    return ratios, untraced


def bootstrap_median(values: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    v = np.asarray(values)
    medians = np.median(rng.choice(v, size=(n, len(v)), replace=True), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def measure_paired(rounds: int, block: int) -> list[dict]:
    """Median per-round traced/untraced ratio and its 95% interval, per step-call path."""
    import statistics

    def row(step, state, batch, trace):
        ratios, untraced = paired_ratios(step, state, batch, trace, rounds, block)
        lo, hi = bootstrap_median(ratios)
        return dict(
            rounds=rounds,
            block=block,
            untraced_s=statistics.median(untraced),
            overhead=statistics.median(ratios) - 1,
            ci95=(lo - 1, hi - 1),
            ratios=ratios,
        )

    return on_each_path(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--paired", type=int, default=0, metavar="N", help="N paired rounds")
    args = ap.parse_args(argv)
    if args.paired:
        rows = measure_paired(args.paired, args.block)
        print(
            f"{'plan':<22} {'path':<11} {'rounds':>6} {'untraced ms':>11} {'overhead':>8} "
            f"{'95% interval':>18}"
        )
        for r in rows:
            lo, hi = r["ci95"]
            print(
                f"{r['plan']:<22} {r['path']:<11} {r['rounds']:>6} "
                f"{r['untraced_s'] * 1e3:>11.1f} {r['overhead']:>+8.2%} [{lo:+.2%}, {hi:+.2%}]"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(paired=args.paired, block=args.block, rows=rows), f, indent=2)
        return 0
    rows = measure(args.rounds, args.block)
    print(f"{'plan':<22} {'path':<11} {'traced ms':>9} {'untraced ms':>11} {'overhead':>8}")
    for r in rows:
        print(
            f"{r['plan']:<22} {r['path']:<11} {r['traced_s'] * 1e3:>9.1f} "
            f"{r['untraced_s'] * 1e3:>11.1f} {r['overhead']:>+8.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rounds=args.rounds, block=args.block, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
