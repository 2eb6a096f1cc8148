"""Steady-state step time of one pipelined GPT on the local Ray cluster, and each
worker's own ``run_step`` time: the figure the runtime's fixed-cost changes move.

    python benchmarks/steady_steps.py [--schedule gpipe] [--stages 2] [--seconds 40]
                                      [--json OUT.json]

The GPT and batch of ``peer_torch_pipe.py`` (one CPU device per host-actor, M=4); the
step runs back to back for ``--seconds`` after one compiling call. Attach
``py-spy record --gil --pid <host-actor pid>`` meanwhile to see where a stage's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.peer_torch_pipe import MODEL, _meshshard_method, make_batch  # noqa: E402


def measure(schedule: str, stages: int, seconds: float) -> dict:
    """Median step time and per-worker ``run_step`` time over ``seconds`` of steps."""
    import meshshard
    from examples import gpt

    meshshard.init(num_hosts=stages, devices_per_host=1)
    try:
        state = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        method = _meshshard_method(schedule, stages, 4)
        step = meshshard.parallelize(gpt.train_step, method=method)
        state, loss = step(state, make_batch(0))
        float(loss)
        backend = step.executable.backend
        walls, workers = [], []
        end, i = time.time() + seconds, 0
        while time.time() < end:
            batch = make_batch(i)  # the user's data: not the step's time
            t0 = time.perf_counter()
            state, loss = step(state, batch)
            float(loss)
            walls.append(time.perf_counter() - t0)
            workers.append(dict(backend.worker_seconds))
            i += 1
        return dict(
            schedule=schedule,
            stages=stages,
            steps=i,
            step_ms=statistics.median(walls) * 1e3,
            worker_ms={w: statistics.median(x[w] for x in workers) * 1e3 for w in workers[0]},
            load=os.getloadavg()[0],
        )
    finally:
        meshshard.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="gpipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    row = measure(args.schedule, args.stages, args.seconds)
    print(f"{'schedule':<18} {'S':>2} {'steps':>6} {'step ms':>8}  worker run_step ms")
    workers = "  ".join(f"w{w} {ms:.1f}" for w, ms in sorted(row["worker_ms"].items()))
    print(
        f"{row['schedule']:<18} {row['stages']:>2} {row['steps']:>6} {row['step_ms']:>8.1f}  "
        f"{workers}  (load {row['load']:.1f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
