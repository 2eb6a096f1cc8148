"""One interpreter switch on and off, in one run: what it changes in a real step.

    python benchmarks/runtime_switch.py --option prefetch [--stages 2 4] [--steps 30]
                                        [--rounds 3] [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` on the local Ray cluster (one host-actor
with one CPU device per stage, M=4).  Each schedule is compiled once and run in
alternating rounds with the boolean runtime option ``--option`` on and off
(``runtime_options(<option>=...)`` on the compiled step; ``recv_ahead``: each peer's
next receive posted ahead of its ``RECV``; ``prefetch``: a thread completes received
messages before their readers ask; ``overlap``: communication beside compute).
Reported per schedule: the median step with the option off and on, and on / off.
``MESHSHARD_PEER_GPT_SIZE=D,B,T`` runs a GPT of width D on B sequences of T tokens
instead (what ``peer_torch_pipe.py --d-model D --batch B --seq T`` sets).
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
OPTIONS = ("recv_ahead", "prefetch", "overlap")
MODES = {"off": False, "on": True}


def run_schedules(option: str, stage_counts, steps: int, rounds: int) -> list[dict]:
    """Both settings of ``option`` for every schedule that runs at each stage count,
    alternating rounds."""
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
                    backend.runtime_options(**{option: MODES[mode]})
                    state, _ = timed_steps(step, state, batch, 2)
                    state, t = timed_steps(step, state, batch, steps)
                    times[mode] += t
            off, on = (statistics.median(times[m]) for m in MODES)
            rows.append(dict(stages=stages, schedule=schedule, off_s=off, on_s=on, ratio=on / off))
            print(_row_text(rows[-1]), flush=True)
            step.release()
    finally:
        meshshard.shutdown()
    return rows


def _row_text(r: dict) -> str:
    if "skipped" in r:
        return f"{r['stages']:>2} {r['schedule']:<17} skipped: {r['skipped']}"
    return (
        f"{r['stages']:>2} {r['schedule']:<17} {r['off_s'] * 1e3:>8.2f} "
        f"{r['on_s'] * 1e3:>8.2f} {r['ratio']:>7.3f}"
    )


def main(argv=None, option: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if option is None:
        ap.add_argument("--option", required=True, choices=OPTIONS)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    option = option or args.option
    print(f"option: {option}")
    print(f"{'S':>2} {'schedule':<17} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    rows = run_schedules(option, args.stages, args.steps, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(option=option, model=MODEL, micro_batches=M, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
