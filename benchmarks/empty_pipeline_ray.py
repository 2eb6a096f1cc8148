"""The runtime's own share of a pipelined step on Ray: every program a no-op.

    python benchmarks/empty_pipeline_ray.py [--stages 2 4] [--steps 20] [--rounds 3]
                                            [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` on the local Ray cluster (one host-actor
with one CPU device per stage, M=4), each schedule compiled once and then run in
alternating rounds two ways, in one run:

- **real**: as compiled;
- **no-op**: inside each host-actor every program is replaced by one that returns the
  outputs its first real run produced.  Every other instruction still runs as it does
  for real: sends read their blocks off the device, messages cross processes over gloo,
  receives rebuild arrays, the driver dispatches the step and collects its outputs.

Reported per schedule: both medians, ``no-op / real`` (the share of the step the
runtime alone would take if nothing overlapped it), microseconds per instruction of the
longest stream, and the median **hop** of the no-op step: from a sender's ``SEND`` start
to the start of the receiver's ``RUN`` that reads the message (aligned recorded
clocks).  Next to it, gloo's own one-way latency for one activation's bytes between two
fresh processes (``torch.distributed`` ping-pong, half the round trip), measured in the
same run.  The threads-backend empty pipeline (``runtime_overhead.py``) shares one GIL
among the workers; this one has the processes, sockets and cores of the real runs.

Also per schedule and mode, the **CPU time per step** of all host-actors together, by
kind of thread (Linux ``/proc``; every thread of every actor, between the first and last
timed step of each round):

- ``python``: the Python threads (the interpreter on the step channel's thread, the comm
  and prefetch threads, Ray's own Python threads): the runtime's host work;
- ``xla``: threads XLA names (its intra-op pool) plus the unnamed native threads, which on
  these actors are XLA's execution threads (they inherit the name of the Python thread
  that made the backend): they fall to about zero in the no-op steps;
- ``gloo``: gloo's socket threads;

and the driver process's CPU per step.  On a machine of few cores the runtime's CPU
competes with the programs' for the same cores, so it costs the step more than its
place on the critical path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_torch_pipe import (  # noqa: E402
    BATCH,
    MODEL,
    SEQ,
    _free_port,
    _meshshard_method,
    make_batch,
)
from benchmarks.step_timing import timed_steps  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "zb_h1", "interleaved_1f1b")
M = 4
#: the CPU columns of the table: (mode, kind of thread), kinds as in the module docstring
CPU_COLUMNS = tuple((m, k) for m in ("real", "no-op") for k in ("python", "xla", "gloo", "driver"))


def _no_op_programs(actor_self, on: bool) -> bool:
    """Runs inside a host-actor: swap every compiled step's programs for no-ops that
    return their first real outputs (``on``; ``runtime_overhead._no_op``, the threads
    benchmark's), or back to the real ones."""
    from benchmarks.runtime_overhead import _no_op

    for worker in actor_self.workers.values():
        interp = worker.interp
        real = interp.__dict__.setdefault("_real_programs", interp.programs)
        cache: dict = {}
        interp.programs = {n: _no_op(p, cache) for n, p in real.items()} if on else real
    return True


def _thread_cpu(actor_self=None) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every thread of this process: ``{thread id: (kind, s)}``
    (kinds in the module docstring; runs inside a host-actor, or in the driver)."""
    import threading

    python = {t.native_id for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        kind = "python" if int(tid) in python else "gloo" if "gloo" in name else "xla"
        if kind == "xla" and not ("XLA" in name or name.startswith("ray::")):
            kind = "other"  # Ray's and gRPC's own native threads
        out[int(tid)] = (kind, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _cpu_by_kind(before: list[dict], after: list[dict]) -> collections.Counter:
    """CPU seconds each kind of thread spent between two snapshots of every actor (a
    thread born in between counts from zero)."""
    spent: collections.Counter = collections.Counter()
    for b, a in zip(before, after, strict=True):
        for tid, (kind, cpu) in a.items():
            spent[kind] += cpu - b.get(tid, (kind, 0.0))[1]
    return spent


def _hops_us(step_trace) -> list[float]:
    """Each message's SEND start to the start of the RUN that reads it on the receiver."""
    from meshshard.instructions import Run, Send
    from meshshard.refs import BufferKind

    streams, st = step_trace
    by_worker = {s.worker: s for s in streams}
    sends, reads = {}, {}
    for wt in st.workers:
        shift = st.offset(wt.worker)
        for i, ins in enumerate(by_worker[wt.worker].instructions):
            if not wt.start[i]:
                continue
            at = wt.start[i] - shift
            if isinstance(ins, Send):
                sends[(ins.transfer, ins.buffer.mb)] = at
            elif isinstance(ins, Run):
                for b in ins.inputs:
                    if b.kind is BufferKind.TRANSFER:
                        reads.setdefault((b.transfer, b.mb), at)
    return [(reads[k] - t) / 1e3 for k, t in sends.items() if k in reads]


def each_schedule(stage_counts, state0, batch, rows: list):
    """Every schedule at each stage count, compiled on the running cluster: yields
    ``(stages, schedule, step, state)`` after three warm-up steps from ``state0``; a
    schedule that a stage count cannot run is added to ``rows`` as skipped instead."""
    import meshshard
    from examples import gpt

    for stages in stage_counts:
        for schedule in SCHEDULES:
            try:
                method = _meshshard_method(schedule, stages, M)
                step = meshshard.parallelize(gpt.train_step, method=method)
                state, _ = timed_steps(step, state0, batch, 3)
            except Exception as exc:  # a schedule this stage count cannot run
                rows.append(dict(stages=stages, schedule=schedule, skipped=str(exc)[:120]))
                continue
            yield stages, schedule, step, state


def run_schedules(stage_counts, steps: int, rounds: int) -> list[dict]:
    """Real and no-op steps of every schedule, alternating rounds (module docstring)."""
    import ray

    import meshshard
    from examples import gpt
    from meshshard.runtime.cluster import current_cluster
    from meshshard.runtime.trace_record import TraceLog

    meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    rows = []
    try:
        batch = make_batch(0)
        state0 = gpt.make_state(gpt.GPT(**MODEL), batch["inputs"])
        actors = [a for a in current_cluster()._actors if a is not None]

        def no_op(on: bool) -> None:
            ray.get([a.__ray_call__.remote(_no_op_programs, on) for a in actors])

        for stages, schedule, step, state in each_schedule(stage_counts, state0, batch, rows):
            times: dict[str, list[float]] = {"real": [], "no-op": []}
            cpu = {mode: collections.Counter() for mode in times}
            for _ in range(rounds):
                for mode in times:
                    no_op(mode == "no-op")
                    state, _ = timed_steps(step, state, batch, 2)
                    before = ray.get([a.__ray_call__.remote(_thread_cpu) for a in actors])
                    driver0 = time.process_time()
                    state, t = timed_steps(step, state, batch, steps)
                    cpu[mode]["driver"] += time.process_time() - driver0
                    after = ray.get([a.__ray_call__.remote(_thread_cpu) for a in actors])
                    cpu[mode].update(_cpu_by_kind(before, after))
                    times[mode] += t
            log = TraceLog(os.devnull, keep=8)
            step.executable.record(log, sync=False)  # still no-op: the last mode
            state, _ = timed_steps(step, state, batch, 5)
            step.executable.record(None)
            no_op(False)
            hops = [h for s in log.steps for h in _hops_us(s)]
            longest = max(len(s.instructions) for s in step.plan.streams)
            real = statistics.median(times["real"])
            empty = statistics.median(times["no-op"])
            rows.append(
                dict(
                    stages=stages,
                    schedule=schedule,
                    real_s=real,
                    no_op_s=empty,
                    share=empty / real,
                    longest_stream=longest,
                    us_per_instruction=empty / longest * 1e6,
                    hop_us=statistics.median(hops),
                    hops=len(hops),
                    cpu_ms_per_step={
                        mode: {k: v / (rounds * steps) * 1e3 for k, v in sorted(c.items())}
                        for mode, c in cpu.items()
                    },
                )
            )
            print(_row_text(rows[-1]), flush=True)
            step.release()
    finally:
        meshshard.shutdown()
    return rows


def _ping_pong(rank: int, port: int, nbytes: int, n: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buf = torch.zeros(nbytes // 4)
    rounds = []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        rounds.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(rounds[n // 10 :]))
    dist.destroy_process_group()


def gloo_one_way_us(nbytes: int, n: int = 400) -> float:
    """Half gloo's median round trip of ``nbytes`` between two fresh processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ping_pong, args=(r, port, nbytes, n, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    rtt = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return rtt / 2 * 1e6


def _row_text(r: dict) -> str:
    if "skipped" in r:
        return f"{r['stages']:>2} {r['schedule']:<17} skipped: {r['skipped']}"
    cpu = r["cpu_ms_per_step"]
    return (
        f"{r['stages']:>2} {r['schedule']:<17} {r['real_s'] * 1e3:>8.2f} {r['no_op_s'] * 1e3:>8.2f} "
        f"{r['share']:>7.2f} {r['longest_stream']:>6} {r['us_per_instruction']:>9.0f} "
        f"{r['hop_us']:>7.0f}" + "".join(f" {cpu[m].get(k, 0.0):>6.1f}" for m, k in CPU_COLUMNS)
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (real, no-op)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # one activation (or its gradient): a micro-batch of the stage boundary, float32
    nbytes = BATCH // M * SEQ * MODEL["d_model"] * 4
    print(
        f"{'S':>2} {'schedule':<17} {'real ms':>8} {'no-op ms':>8} {'no-op/real':>7} "
        f"{'instr':>6} {'us/instr':>9} {'hop us':>7}"
        + "".join(f" {m[:4] + ' ' + k[:3]:>6}" for m, k in CPU_COLUMNS)
    )
    print(
        "(last eight columns: CPU ms per step of all host-actors by thread kind, and the driver's)"
    )
    rows = run_schedules(args.stages, args.steps, args.rounds)
    gloo = gloo_one_way_us(nbytes)
    print(f"gloo one way, {nbytes} B between two processes: {gloo:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(model=MODEL, micro_batches=M, rows=rows, gloo_one_way_us=gloo), f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
