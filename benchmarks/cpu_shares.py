"""Core shares for local host-actors, on and off, side by side in one run.

    python benchmarks/cpu_shares.py [--layouts 2x1 4x1 2x2 4x2] [--rounds 3]
                                    [--steps 40] [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` (M=4) on the embedded local Ray cluster,
for each layout ``SxD`` (S stages, one host-actor of D CPU devices each): the
host-actors are restarted with core shares (``runtime/cpu_shares.py``) and without
(``MESHSHARD_CPU_SHARES=0``: XLA's pools span every core), alternating in rounds in one
driver, so a drift of the machine reaches both alike.  Each round recompiles the
schedules and times ``--steps`` steps after a warm-up.  Reported: the median step of
each, and shares / none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_torch_pipe import MODEL, make_batch  # noqa: E402
from benchmarks.step_timing import timed_steps  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "zb_h1")
M = 4
MODES = {"none": "0", "shares": "1"}


def run_layout(stages: int, devices: int, rounds: int, steps: int) -> list[dict]:
    """Median step per schedule with and without core shares, alternating rounds."""
    import meshshard
    from examples import gpt
    from meshshard.runtime import cpu_shares

    cluster = meshshard.init(num_hosts=stages, devices_per_host=devices)
    batch = make_batch(0)
    state0 = gpt.make_state(gpt.GPT(**MODEL), batch["inputs"])
    times = {(m, s): [] for m in MODES for s in SCHEDULES}
    saved = os.environ.get("MESHSHARD_CPU_SHARES")
    try:
        for _ in range(rounds):
            for mode, flag in MODES.items():
                os.environ["MESHSHARD_CPU_SHARES"] = flag
                cluster._restart(list(range(stages)), f"core shares {mode}")
                for schedule in SCHEDULES:
                    method = meshshard.PipeshardParallel(
                        num_micro_batches=M, stages=[(1, devices)] * stages, schedule=schedule
                    )
                    step = meshshard.parallelize(gpt.train_step, method=method)
                    state, _ = timed_steps(step, state0, batch, steps // 4 + 3)  # warm up
                    _, t = timed_steps(step, state, batch, steps)
                    times[(mode, schedule)] += t
                    step.release()
        shares = cpu_shares.core_shares([devices] * stages, os.sched_getaffinity(0))
    finally:
        if saved is None:
            os.environ.pop("MESHSHARD_CPU_SHARES", None)
        else:
            os.environ["MESHSHARD_CPU_SHARES"] = saved
        meshshard.shutdown()
    rows = []
    for schedule in SCHEDULES:
        none = statistics.median(times[("none", schedule)])
        on = statistics.median(times[("shares", schedule)])
        rows.append(
            dict(
                stages=stages,
                devices=devices,
                schedule=schedule,
                shares=[list(s) for s in shares],
                none_s=none,
                shares_s=on,
                ratio=on / none,
            )
        )
        print(
            f"{stages}x{devices:<3} {schedule:<7} {none * 1e3:>9.2f} {on * 1e3:>9.2f} "
            f"{on / none:>7.3f}   {shares}",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "2x2", "4x2"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"cores: {sorted(os.sched_getaffinity(0))}")
    print(f"{'SxD':<5} {'schedule':<7} {'none ms':>9} {'shares ms':>9} {'ratio':>7}   shares")
    rows = []
    for layout in args.layouts:
        s, d = (int(x) for x in layout.split("x"))
        rows += run_layout(s, d, args.rounds, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=MODEL, micro_batches=M, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
