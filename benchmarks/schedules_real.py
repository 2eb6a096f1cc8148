"""Every pipeline schedule on the GPT example, measured on the local Ray cluster, with
the overlapping runtime and with the sequential one, in one run.

    python benchmarks/schedules_real.py [--steps 8] [--stages 2 4] [--json OUT.json]

Per (stages, schedule, runtime): the median step time, its ratio to ``1f1b`` with the
overlapping runtime at the same stage count, the driver's overhead (step time minus
the slowest worker's own ``run_step`` time), and from recorded timelines
(:class:`~meshshard.runtime.overlap.Timeline`, a few extra steps with recording on):

``comm ms``
    per step, the summed time messages were in flight: from the sender handing the
    bytes to the transport to the receiver having them;
``overlapped``
    the fraction of that time during which the sender's or the receiver's device was
    computing (so not both idle waiting for the message).

With the sequential runtime a receive is stamped when the interpreter reaches its
``WAIT`` (it does nothing in between), so its in-flight time includes compute of the
receiver before the ``WAIT``: its fraction is an upper bound.  The one-process stages
(one CPU device per host-actor) make every transfer cross processes through gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_torch_pipe import BATCH, MODEL, SEQ, _meshshard_method, make_batch  # noqa: E402


def merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping union of intervals.

    >>> merge([(5, 7), (1, 3), (2, 4)])
    [(1, 4), (5, 7)]
    """
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(a: int, b: int, spans: list[tuple[int, int]]) -> int:
    """Length of [a, b) covered by the merged ``spans``.

    >>> covered(0, 10, [(2, 4), (8, 12)])
    4
    """
    return sum(max(0, min(b, e) - max(a, s)) for s, e in spans)


def overlap_stats(timelines: dict) -> tuple[float, float]:
    """(in-flight ns, overlapped ns) summed over every message of one step."""
    compute = {w: tl.compute_spans() for w, tl in timelines.items() if tl is not None}
    flight = hidden = 0
    for a, tl in timelines.items():
        for key, sent in tl.sent.items():
            for b, other in timelines.items():
                if b == a or key not in other.arrived:
                    continue
                end = other.arrived[key]
                if end <= sent:
                    continue
                flight += end - sent
                hidden += covered(sent, end, merge(compute[a] + compute[b]))
    return flight, hidden


def measure(step, state0, steps: int, warmup: int, record: int, overlap: bool) -> dict:
    """Time ``steps`` steps, then record ``record`` more; medians and overlap."""
    backend = step.executable.backend
    backend.runtime_options(overlap=overlap, timeline=False)
    state = {"s": state0}

    def one(i):
        batch = make_batch(i)  # the user's data: not the step's time
        t0 = time.perf_counter()
        state["s"], loss = step(state["s"], batch)
        float(loss)
        wall = time.perf_counter() - t0
        return wall, wall - max(backend.worker_seconds.values())

    for i in range(warmup):
        one(i)
    walls, drivers = zip(*(one(warmup + i) for i in range(steps)), strict=True)
    backend.runtime_options(timeline=record > 0)
    flights, hiddens, busy = [], [], []
    for i in range(record):
        one(warmup + steps + i)
        tls = {w: t for w, t in backend.runtime_options().items() if t is not None}
        if not tls:  # the step ran elsewhere (2bw alternates two compiled variants)
            continue
        f, h = overlap_stats(tls)
        flights.append(f)
        hiddens.append(h)
        busy.append(max(t.busy_ns() for t in tls.values()))
    backend.runtime_options(timeline=False)
    # a pipelined step (2bw) returns before its workers finish: its workers' times are
    # an earlier step's, so "step minus slowest worker" means nothing there
    pipelined = getattr(step.executable, "pipelined", False)
    driver = float("nan") if pipelined else statistics.median(drivers)
    out = dict(step_s=statistics.median(walls), driver_s=driver)
    if busy:
        out.update(
            comm_s=statistics.median(flights) / 1e9,
            overlapped=sum(hiddens) / sum(flights) if sum(flights) else 0.0,
            busy_s=statistics.median(busy) / 1e9,
        )
    return out


def run(
    stage_counts, micro_batches: int, steps: int, warmup: int, record: int, only=None
) -> list[dict]:
    """Every schedule x stage count x runtime; rows in measurement order."""
    import meshshard
    from examples import gpt
    from meshshard.methods import SCHEDULES

    meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    rows = []
    try:
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        for stages in stage_counts:
            for schedule in only or SCHEDULES:
                try:
                    method = _meshshard_method(schedule, stages, micro_batches)
                    step = meshshard.parallelize(gpt.train_step, method=method)
                    step(state0, make_batch(0))
                except Exception as exc:  # a schedule this stage count cannot run
                    rows.append(dict(stages=stages, schedule=schedule, skipped=str(exc)[:120]))
                    continue
                n = sum(len(s.instructions) for s in step.plan.streams)
                for overlap in (True, False):
                    try:
                        r = measure(step, state0, steps, warmup, record, overlap)
                    except Exception as exc:  # keep the other rows
                        rows.append(dict(stages=stages, schedule=schedule, skipped=str(exc)[:120]))
                        break
                    print(f"S={stages} {schedule} overlap={overlap}: {r}", flush=True)
                    rows.append(
                        dict(stages=stages, schedule=schedule, overlap=overlap, instructions=n, **r)
                    )
    finally:
        meshshard.shutdown()
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b.get("stages") == r["stages"]
                and b.get("schedule") == "1f1b"
                and b.get("overlap")
            ),
            None,
        )
        if "step_s" in r and base:
            r["vs_1f1b"] = r["step_s"] / base["step_s"]
    return rows


def print_table(rows) -> None:
    print(
        f"{'S':>2} {'schedule':<18} {'runtime':<10} {'step ms':>8} {'vs 1f1b':>8} "
        f"{'driver ms':>9} {'busy ms':>8} {'comm ms':>8} {'overlapped':>10}"
    )
    for r in rows:
        if "skipped" in r:
            print(f"{r['stages']:>2} {r['schedule']:<18} skipped: {r['skipped']}")
            continue
        rt = "overlap" if r["overlap"] else "sequential"
        print(
            f"{r['stages']:>2} {r['schedule']:<18} {rt:<10} {r['step_s'] * 1e3:>8.1f} "
            f"{r.get('vs_1f1b', float('nan')):>7.2f}x {r['driver_s'] * 1e3:>9.2f} "
            f"{r.get('busy_s', 0) * 1e3:>8.1f} {r.get('comm_s', 0) * 1e3:>8.2f} "
            f"{r.get('overlapped', 0):>10.1%}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--record", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=None, help="default: every schedule")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run(
        args.stages, args.micro_batches, args.steps, args.warmup, args.record, args.schedules
    )
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    model=MODEL,
                    batch=BATCH,
                    seq=SEQ,
                    micro_batches=args.micro_batches,
                    steps=args.steps,
                    rows=rows,
                ),
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
