"""Runtime overhead: the driver's per-step dispatch on Ray, and the interpreter's cost
per instruction on an empty pipeline.

    python benchmarks/runtime_overhead.py [--steps 10] [--json OUT.json] [--profile]

1. **GPT example on the local Ray cluster** (one CPU device per host-actor), every
   schedule at 2 and 4 stages: median step time, driver overhead = step time minus
   the slowest worker's own ``run_step`` time (dispatch, argument and result
   transfer, the driver's bookkeeping), and that overhead as a share of the step
   (target: <= 5%); each with the step calls over the direct connections
   (``runtime/step_channel.py``, the default) and over Ray actor calls, alternating
   in rounds.
2. **Empty pipeline** (this process, workers as threads): the GPT plan at 4 stages
   with every program replaced, after one real step, by a no-op that returns the
   outputs that step produced; sends still read their blocks and messages still
   cross the in-memory transport.  Reported: microseconds per instruction (step time
   over the longest stream, and over all instructions, since the worker threads share
   the GIL), with the overlapping and with the sequential runtime.  Next to it, Ray
   Compiled Graphs' published per-step dispatch (< 50 us; see ANCHORS.md) for scale.

3. **The driver's own work per step** (Ray cluster, 1F1B): the same steps with the
   host-actors taken out (the backend answers each step at once with a reply the
   workers sent earlier), so what is timed is only what the driver does per call:
   flattening and looking up the arguments, the workers' requests, the result arrays,
   the by-value results, the frees of the replaced state.  On a quiet core, so it is
   the steadiest of the three figures; inside a real step the same work takes 2-4
   times as long (the workers' programs leave the driver's caches cold).

``--profile`` prints the top of a cProfile of the empty pipeline's steps.
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

RAY_CG_DISPATCH_US = 50  # Ray Compiled Graphs: "< 50 us" per-step dispatch (published)
#: how a step call reaches the host-actors: runtime.step_channel, or Ray actor calls
PATHS = {"connection": True, "ray call": False}
ROUNDS = 3  # alternating rounds per path (the machine's load drifts)


def ray_overheads(stage_counts, micro_batches: int, steps: int, warmup: int) -> list[dict]:
    """Part 1: driver overhead per schedule on the Ray cluster, with step calls over the
    direct connections and over Ray actor calls, alternating in rounds (one run)."""
    import meshshard
    from benchmarks.schedules_real import measure
    from examples import gpt
    from meshshard.methods import SCHEDULES

    cluster = meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    rows = []
    try:
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        for stages in stage_counts:
            for schedule in SCHEDULES:
                try:
                    method = _meshshard_method(schedule, stages, micro_batches)
                    step = meshshard.parallelize(gpt.train_step, method=method)
                    step(state0, make_batch(0))
                except Exception as exc:  # a schedule this stage count cannot run
                    rows.append(dict(stages=stages, schedule=schedule, skipped=str(exc)[:120]))
                    continue
                runs: dict[str, list] = {path: [] for path in PATHS}
                for _ in range(ROUNDS):
                    for path, on in PATHS.items():
                        cluster.use_step_channel = on
                        cluster.close_channels()
                        runs[path].append(measure(step, state0, steps, warmup, 0, overlap=True))
                cluster.use_step_channel = True
                for path, rs in runs.items():
                    step_s = statistics.median(r["step_s"] for r in rs)
                    driver_s = statistics.median(r["driver_s"] for r in rs)
                    rows.append(
                        dict(
                            stages=stages,
                            schedule=schedule,
                            path=path,
                            step_s=step_s,
                            driver_s=driver_s,
                            share=driver_s / step_s,
                        )
                    )
    finally:
        meshshard.shutdown()
    return rows


def _no_op(prog, cache: dict):
    def call(groups):
        out = cache.get(prog.name)
        if out is None:
            out = cache[prog.name] = prog(groups)
        return out

    return call


def empty_pipeline(stages: int, micro_batches: int, steps: int, profile: bool) -> list[dict]:
    """Part 2: interpreter cost per instruction with no-op programs (threads)."""
    import meshshard
    from examples import gpt

    rows = []
    meshshard.init(backend="threads", num_hosts=stages, devices_per_host=1)
    try:
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        method = _meshshard_method("1f1b", stages, micro_batches)
        step = meshshard.parallelize(gpt.train_step, method=method)
        step(state0, make_batch(0))
        backend = step.executable.backend
        caches: dict = {}
        for w, wk in backend.workers.items():
            cache = caches.setdefault(w, {})
            wk.interp.programs = {k: _no_op(p, cache) for k, p in wk.interp.programs.items()}
        lengths = [len(s.instructions) for s in step.plan.streams]
        for overlap in (True, False):
            backend.runtime_options(overlap=overlap)
            state = state0
            times = []
            for i in range(steps + 2):
                t0 = time.perf_counter()
                state, loss = step(state, make_batch(i))
                float(loss)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rows.append(
                dict(
                    stages=stages,
                    micro_batches=micro_batches,
                    overlap=overlap,
                    step_s=med,
                    instructions=sum(lengths),
                    longest_stream=max(lengths),
                    us_per_instruction_longest=med / max(lengths) * 1e6,
                    us_per_instruction_all=med / sum(lengths) * 1e6,
                )
            )
        if profile:
            import cProfile
            import pstats

            backend.runtime_options(overlap=True)
            pr = cProfile.Profile()
            pr.enable()
            for i in range(steps):
                state, loss = step(state, make_batch(i))
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    finally:
        meshshard.shutdown()
    return rows


class _Instant:
    """A submitted step that is already done: the reply the workers sent earlier."""

    def __init__(self, results: dict):
        self.results = results

    def result(self) -> dict:
        return dict(self.results)


def driver_own(stage_counts, micro_batches: int, steps: int) -> list[dict]:
    """Part 3: the driver's per-step work, with the backend answering at once."""
    import jax

    import meshshard
    from examples import gpt

    rows = []
    meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    try:
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        batches = [make_batch(i) for i in range(16)]
        for stages in stage_counts:
            method = _meshshard_method("1f1b", stages, micro_batches)
            step = meshshard.parallelize(gpt.train_step, method=method)
            state, _ = step(state0, batches[0])
            backend = step.executable.backend
            replies = {}
            real_submit, real_free = backend.submit_step, backend.free

            def submit(per_worker, real=real_submit, replies=replies):
                replies["last"] = real(per_worker).result()
                return _Instant(replies["last"])

            backend.submit_step = submit
            state, _ = step(state, batches[1])  # one real step: its reply is replayed
            backend.submit_step = lambda per_worker, r=replies: _Instant(r["last"])
            backend.free = lambda worker, keys: None  # the replayed keys were never stored
            try:
                times = []
                for i in range(steps):
                    t0 = time.perf_counter()
                    state, loss = step(state, batches[i % len(batches)])
                    float(loss)
                    times.append(time.perf_counter() - t0)
            finally:
                backend.submit_step, backend.free = real_submit, real_free
            leaves = len(jax.tree.leaves(state))
            rows.append(
                dict(
                    stages=stages,
                    state_leaves=leaves,
                    us_per_step=statistics.median(times) * 1e6,
                    us_per_step_mean=statistics.fmean(times) * 1e6,
                )
            )
            del state, step
    finally:
        meshshard.shutdown()
    return rows


def print_tables(ray_rows, empty_rows, own_rows=()) -> None:
    print(f"{'S':>2} {'schedule':<18} {'path':<11} {'step ms':>8} {'driver ms':>9} {'share':>6}")
    for r in ray_rows:
        if "skipped" in r:
            print(f"{r['stages']:>2} {r['schedule']:<18} skipped: {r['skipped']}")
            continue
        print(
            f"{r['stages']:>2} {r['schedule']:<18} {r['path']:<11} {r['step_s'] * 1e3:>8.1f} "
            f"{r['driver_s'] * 1e3:>9.2f} {r['share']:>6.1%}"
        )
    print()
    print(
        f"{'empty pipeline':<28} {'instr':>6} {'step ms':>8} {'us/instr (longest)':>19} "
        f"{'us/instr (all)':>15}"
    )
    for r in empty_rows:
        rt = "overlap" if r["overlap"] else "sequential"
        name = f"S={r['stages']} M={r['micro_batches']} {rt}"
        print(
            f"{name:<28} {r['instructions']:>6} {r['step_s'] * 1e3:>8.2f} "
            f"{r['us_per_instruction_longest']:>19.1f} {r['us_per_instruction_all']:>15.1f}"
        )
    print(
        f"{'Ray Compiled Graphs (published)':<28} {'':>6} {'':>8} "
        f"{'< ' + str(RAY_CG_DISPATCH_US) + ' us per step':>19}"
    )
    if own_rows:
        print()
        print(f"{'driver alone, 1f1b':<28} {'leaves':>6} {'us/step (median)':>17} {'(mean)':>8}")
        for r in own_rows:
            print(
                f"{'S=' + str(r['stages']):<28} {r['state_leaves']:>6} "
                f"{r['us_per_step']:>17.1f} {r['us_per_step_mean']:>8.1f}"
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--own-steps", type=int, default=1000, help="part 3's steps (0: skip)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ray_rows = []
    if not args.skip_ray:
        ray_rows = ray_overheads(args.stages, args.micro_batches, args.steps, args.warmup)
    empty_rows = empty_pipeline(max(args.stages), 8, args.steps, args.profile)
    own_rows = []
    if args.own_steps:
        own_rows = driver_own(args.stages, args.micro_batches, args.own_steps)
    print_tables(ray_rows, empty_rows, own_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    model=MODEL,
                    ray=ray_rows,
                    empty=empty_rows,
                    driver_alone=own_rows,
                    ray_compiled_graphs_us=RAY_CG_DISPATCH_US,
                ),
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
