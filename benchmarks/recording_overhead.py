"""Cost of recording measured timelines (``step.record(path)``), on both step-call paths.

    python benchmarks/recording_overhead.py [--rounds 6] [--block 8] [--json OUT.json]

The fidelity benchmark's first plan (GPT model A, 2x(1,2) gpipe M=4) on the embedded
local Ray cluster: blocks of ``--block`` steps with and without recording, interleaved
for ``--rounds`` rounds (``fidelity._overhead``), once with step calls over the direct
connections (the default) and once over Ray actor calls.  Target (issue 10): recording
costs at most 2% of the step.
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


def measure(rounds: int, block: int) -> list[dict]:
    """Median traced and untraced step time per step-call path."""
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
                traced, untraced = fidelity._overhead(
                    step, state, batch, f"{tmp}/trace.json", rounds=rounds, block=block
                )
                rows.append(
                    dict(
                        plan=name,
                        path=path,
                        traced_s=traced,
                        untraced_s=untraced,
                        overhead=traced / untraced - 1,
                    )
                )
        cluster.use_step_channel = True
    finally:
        meshshard.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
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
