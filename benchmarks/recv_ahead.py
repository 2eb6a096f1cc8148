"""Receives posted ahead of their RECV (``runtime/recv_ahead.py``), on and off, in one run.

    python benchmarks/recv_ahead.py [--stages 2 4] [--steps 30] [--rounds 3]
                                    [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` on the local Ray cluster (one host-actor
with one CPU device per stage, M=4).  Each schedule is compiled once and run in
alternating rounds with each peer's next receive posted ahead (the default) and with
every receive posted at its ``RECV``, as the stream is written
(``runtime_options(recv_ahead=False)``).  Reported per schedule: the median step of
each, and ahead / as written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.empty_pipeline_ray import each_schedule  # noqa: E402
from benchmarks.peer_torch_pipe import MODEL, make_batch  # noqa: E402
from benchmarks.step_timing import timed_steps  # noqa: E402

M = 4
MODES = {"as written": False, "ahead": True}


def run_schedules(stage_counts, steps: int, rounds: int) -> list[dict]:
    """Both modes of every schedule that runs at each stage count, alternating rounds."""
    import meshshard
    from examples import gpt

    meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    rows = []
    try:
        batch = make_batch(0)
        state0 = gpt.make_state(gpt.GPT(**MODEL), batch["inputs"])
        for stages, schedule, step, state in each_schedule(stage_counts, state0, batch, rows):
            backend = step.executable.backend
            times = {mode: [] for mode in MODES}
            for r in range(rounds):
                for mode in MODES if r % 2 == 0 else reversed(MODES):
                    backend.runtime_options(recv_ahead=MODES[mode])
                    state, _ = timed_steps(step, state, batch, 2)
                    state, t = timed_steps(step, state, batch, steps)
                    times[mode] += t
            backend.runtime_options(recv_ahead=True)
            off = statistics.median(times["as written"])
            on = statistics.median(times["ahead"])
            rows.append(
                dict(
                    stages=stages,
                    schedule=schedule,
                    as_written_s=off,
                    ahead_s=on,
                    ratio=on / off,
                )
            )
            print(_row_text(rows[-1]), flush=True)
            step.release()
    finally:
        meshshard.shutdown()
    return rows


def _row_text(r: dict) -> str:
    if "skipped" in r:
        return f"{r['stages']:>2} {r['schedule']:<17} skipped: {r['skipped']}"
    return (
        f"{r['stages']:>2} {r['schedule']:<17} {r['as_written_s'] * 1e3:>10.2f} "
        f"{r['ahead_s'] * 1e3:>8.2f} {r['ratio']:>7.3f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"{'S':>2} {'schedule':<17} {'written ms':>10} {'ahead ms':>8} {'ratio':>7}")
    rows = run_schedules(args.stages, args.steps, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=MODEL, micro_batches=M, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
