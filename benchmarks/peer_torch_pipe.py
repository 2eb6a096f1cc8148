"""Pipeline efficiency of meshshard vs ``torch.distributed.pipelining`` on the same GPT.

    python benchmarks/peer_torch_pipe.py [--steps 10] [--stages 2 4] [--remat none dots]
                                         [--d-model 64] [--batch 16] [--seq 32]
                                         [--json OUT.json]

The GPT of ``examples/gpt.py`` (same layers, widths, batch, micro-batches, stage count;
by default d_model 64, 16 sequences of 32 tokens, 4 blocks; ``--d-model``, ``--batch``
and ``--seq`` pick another size for both frameworks) runs, in one run of this script:

- in torch (``benchmarks/torch_gpt.py``): one process for the reference, then one
  process per pipeline rank over gloo on this machine for ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble
  (the last three hold two stages per rank, so they run where the blocks divide
  into ``2 x stages`` pieces);
- in meshshard: ``jax.jit`` of the whole step in this process for the reference, then
  every schedule ``PipeshardParallel`` offers on the local Ray cluster (one host-actor
  per stage, one CPU device each), once per ``--remat`` setting
  (``PipeshardParallel.remat``; rows ``<schedule> remat=dots``).

Pipeline efficiency = reference step time / pipelined step time, each framework against
its own single-process run (medians over ``--steps`` timed steps after warm-up).  Each
framework has two references, and efficiency is printed against both:

- **every core** (the headline figure): ``jax.jit`` as it runs by default (XLA:CPU runs
  its ops on a pool of one thread per core) and torch with ``os.cpu_count()`` intra-op
  threads: the same core budget the pipelines get;
- **one core** (in brackets): ``jax.jit`` in a process pinned to one core, torch with one
  intra-op thread (what runs before 2026-12-04 used for torch alone).

For each meshshard schedule also: ``stage ms``, the busiest worker's program compute per
step (each RUN at its program's profiled time, sharing of the cores removed; or every
worker's over the cores, if more), and ``bound`` = the all-core reference over it: the
efficiency a runtime with no host cost and no bubble could reach with these programs.
It separates what the compiled micro-batch programs cost from what the runtime adds.

Every torch pipeline rank uses one intra-op thread; a stage's XLA program runs on its
actor's one device.  The machine has few cores, so efficiencies are far below the ideal
M / (M + S - 1): the point is the side-by-side ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MODEL = dict(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)
BATCH, SEQ = 16, 32
#: Environment variable carrying ``--d-model``/``--batch``/``--seq`` to spawned processes
#: (the torch ranks and references import this module afresh).
SIZE_ENV = "MESHSHARD_PEER_GPT_SIZE"


def set_size(d_model: int, batch: int, seq: int) -> None:
    """Run every framework on a GPT of width ``d_model``, ``batch`` sequences of ``seq``
    tokens (default: the sizes above); spawned processes inherit it."""
    global BATCH, SEQ
    MODEL.update(d_model=d_model, max_len=seq)
    BATCH, SEQ = batch, seq
    os.environ[SIZE_ENV] = f"{d_model},{batch},{seq}"


if os.environ.get(SIZE_ENV):
    set_size(*(int(v) for v in os.environ[SIZE_ENV].split(",")))
# torch schedule class name -> (stages per rank, meshshard schedule it is compared with)
TORCH_SCHEDULES = {
    "ScheduleGPipe": (1, "gpipe"),
    "Schedule1F1B": (1, "1f1b"),
    "ScheduleInterleaved1F1B": (2, "interleaved_1f1b"),
    "ScheduleInterleavedZeroBubble": (2, "zb_h1"),
    "ScheduleZBVZeroBubble": (2, None),
}


def make_batch(seed: int) -> dict[str, np.ndarray]:
    """``examples.gpt.make_batch(BATCH, SEQ, vocab, seed)`` without importing JAX
    (checked equal in :func:`main`)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, MODEL["vocab"], size=(BATCH, 1))
    seq = (start + np.arange(SEQ + 1)[None, :]) % MODEL["vocab"]
    return {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_stages(name: str, rank: int, world: int) -> list[int]:
    """The stage indices rank ``rank`` holds under schedule ``name``."""
    per = TORCH_SCHEDULES[name][0]
    if per == 1:
        return [rank]
    if name == "ScheduleZBVZeroBubble":
        return [rank, 2 * world - 1 - rank]  # the V: down then back up
    return [rank, rank + world]  # looped


def _timed(step, steps: int, warmup: int, barrier=lambda: None) -> tuple[list[float], float]:
    times, first = [], None
    for i in range(warmup + steps):
        barrier()
        t0 = time.perf_counter()
        loss = step(i)
        barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if i == 0:
            first = loss
    return times, first


def _jax_single(steps: int, warmup: int) -> tuple[list[float], float]:
    """``jax.jit`` of the whole step in this process: meshshard's reference (step times,
    first loss)."""
    import jax

    from examples import gpt

    holder = {"s": gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])}
    ref_step = jax.jit(gpt.train_step)

    def jit_step(i):
        holder["s"], loss = ref_step(holder["s"], make_batch(i))
        return float(loss)

    return _timed(jit_step, steps, warmup)


def _jax_single_pinned(steps: int, warmup: int, out) -> None:
    """:func:`_jax_single` in a fresh process pinned to one core (XLA:CPU sizes its
    thread pool from the affinity mask): the one-core reference."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    out.put(_jax_single(steps, warmup))


def _torch_single(steps: int, warmup: int, micro_batches: int, threads: int, out) -> None:
    """One process: the whole batch forward, backward and Adam step, on ``threads``
    intra-op threads."""
    import torch

    from benchmarks.torch_gpt import build_gpt, loss_fn

    torch.set_num_threads(threads)
    model = build_gpt(**MODEL)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(i):
        b = make_batch(i)
        loss = loss_fn(
            model(torch.from_numpy(b["inputs"]).long()), torch.from_numpy(b["targets"]).long()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    out.put(_timed(step, steps, warmup))


def _torch_rank(rank, world, name, steps, warmup, micro_batches, port, out) -> None:
    """One pipeline rank of schedule ``name`` over gloo."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from benchmarks.torch_gpt import build_gpt, loss_fn, stage_modules

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        per = TORCH_SCHEDULES[name][0]
        pieces = stage_modules(build_gpt(**MODEL), world * per)
        mine = _rank_stages(name, rank, world)
        stages = [
            pipelining.PipelineStage(pieces[i], i, world * per, torch.device("cpu")) for i in mine
        ]
        params = [p for i in mine for p in pieces[i].parameters()]
        opt = torch.optim.Adam(params, lr=3e-3)
        cls = getattr(pipelining, name)
        sched = cls(stages if per > 1 else stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
        first, last = 0 in mine, world * per - 1 in mine

        def step(i):
            b = make_batch(i)
            args = (torch.from_numpy(b["inputs"]).long(),) if first else ()
            kw = {}
            losses: list = []
            if last:
                kw = dict(target=torch.from_numpy(b["targets"]).long(), losses=losses)
            sched.step(*args, **kw)
            opt.step()
            opt.zero_grad()
            return float(torch.stack(losses).detach().mean()) if losses else None

        times, loss = _timed(step, steps, warmup, barrier=dist.barrier)
        if last:
            out.put((times, loss))
    finally:
        dist.destroy_process_group()


def run_torch(steps: int, warmup: int, micro_batches: int, stage_counts) -> list[dict]:
    """The torch references and every torch schedule at every stage count.

    Two references: one intra-op thread (what each pipeline rank gets) and every core
    of the machine (what ``jax.jit``'s reference uses: XLA:CPU runs its ops on a pool
    of one thread per core).  Efficiency is against the second, the same core budget
    as meshshard's reference; ``efficiency_1core`` against the first."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    refs, rows = {}, []
    for threads in sorted({1, os.cpu_count() or 1}):
        ref_times, ref_loss = _spawned(_torch_single, steps, warmup, micro_batches, threads)
        refs[threads] = statistics.median(ref_times)
        rows.append(
            dict(
                framework="torch",
                schedule=f"single process, {threads} thread{'s' * (threads > 1)}",
                stages=1,
                step_s=refs[threads],
                loss0=ref_loss,
                load=round(os.getloadavg()[0], 1),
            )
        )
    ref, ref1 = refs[max(refs)], refs[1]
    for world in stage_counts:
        for name, (per, _) in TORCH_SCHEDULES.items():
            if MODEL["num_layers"] % (world * per):
                rows.append(
                    dict(
                        framework="torch",
                        schedule=name,
                        stages=world,
                        skipped=(
                            f"{MODEL['num_layers']} blocks do not divide into {world * per} stages"
                        ),
                    )
                )
                continue
            port = _free_port()
            procs = [
                ctx.Process(
                    target=_torch_rank,
                    args=(r, world, name, steps, warmup, micro_batches, port, out),
                )
                for r in range(world)
            ]
            for q in procs:
                q.start()
            times, loss = out.get()
            for q in procs:
                q.join()
            med = statistics.median(times)
            rows.append(
                dict(
                    framework="torch",
                    schedule=name,
                    stages=world,
                    step_s=med,
                    efficiency=ref / med,
                    efficiency_1core=ref1 / med,
                    loss0=loss,
                    load=round(os.getloadavg()[0], 1),
                )
            )
    return rows


def _meshshard_method(schedule: str, stages: int, micro_batches: int, remat: str | None = None):
    import meshshard

    kw = dict(
        num_micro_batches=micro_batches, stages=[(1, 1)] * stages, schedule=schedule, remat=remat
    )
    if schedule == "interleaved_1f1b":
        kw["virtual_stages"] = 2
    return meshshard.PipeshardParallel(**kw)


def _stage_work(step, state, batch) -> float:
    """The least seconds per step these programs allow: the busiest worker's program
    compute (each RUN of its stream at its program's profiled time, every program
    waiting for its outputs, sharing of the cores removed), or all workers' compute
    over this machine's cores if that is more.  The efficiency a runtime without host
    costs or bubbles could reach with these programs is the reference over this."""
    import tempfile

    import meshshard
    from meshshard.instructions import Run

    times = step.profile(meshshard.fetch(state), batch, cache_dir=tempfile.mkdtemp())
    per_worker = [
        sum(times[str(i.program)] for i in s.instructions if isinstance(i, Run))
        for s in step.plan.streams
    ]
    return max(max(per_worker), sum(per_worker) / (os.cpu_count() or 1))


def _spawned(target, *args):
    """What ``target(*args, out)`` puts on ``out``, run in a fresh spawned process (a
    reference alone in its process: its own threads, or pinned to a core)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=target, args=(*args, out))
    p.start()
    result = out.get()
    p.join()
    return result


def run_meshshard(
    steps: int, warmup: int, micro_batches: int, stage_counts, schedules=None, remats=(None,)
) -> list[dict]:
    """``jax.jit`` in this process, then each meshshard schedule (default: every one) on
    the Ray cluster, under each ``PipeshardParallel.remat`` setting of ``remats``."""
    import meshshard
    from meshshard.methods import SCHEDULES

    schedules = SCHEDULES if schedules is None else schedules

    meshshard.init(num_hosts=max(stage_counts), devices_per_host=1)
    try:
        from examples import gpt

        assert all(
            np.array_equal(gpt.make_batch(BATCH, SEQ, MODEL["vocab"], i)[k], make_batch(i)[k])
            for i in range(3)
            for k in ("inputs", "targets")
        )
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        holder: dict = {}
        times, loss = _jax_single(steps, warmup)
        ref = statistics.median(times)
        rows = [
            dict(
                framework="meshshard",
                schedule=f"jax.jit single process, {os.cpu_count()} cores",
                stages=1,
                step_s=ref,
                loss0=loss,
                load=round(os.getloadavg()[0], 1),
            )
        ]
        ref1 = statistics.median(_spawned(_jax_single_pinned, steps, warmup)[0])
        rows.append(
            dict(
                framework="meshshard",
                schedule="jax.jit single process, 1 core",
                stages=1,
                step_s=ref1,
                loss0=loss,
                load=round(os.getloadavg()[0], 1),
            )
        )
        for stages, schedule, remat in itertools.product(stage_counts, schedules, remats):
            if schedule == "interleaved_1f1b" and MODEL["num_layers"] % (2 * stages):
                continue  # as in torch: the blocks must divide into 2 x stages pieces
            label = schedule if remat is None else f"{schedule} remat={remat}"
            try:
                method = _meshshard_method(schedule, stages, micro_batches, remat)
                step = meshshard.parallelize(gpt.train_step, method=method)
                holder["s"] = state0

                def ms_step(i, step=step):
                    holder["s"], loss = step(holder["s"], make_batch(i))
                    return float(loss)

                times, loss = _timed(ms_step, steps, warmup)
                work = _stage_work(step, holder["s"], make_batch(0))
            except Exception as exc:  # a schedule this stage count cannot run
                rows.append(
                    dict(
                        framework="meshshard",
                        schedule=label,
                        stages=stages,
                        skipped=f"{type(exc).__name__}: {str(exc)[:120]}",
                    )
                )
                continue
            med = statistics.median(times)
            rows.append(
                dict(
                    framework="meshshard",
                    schedule=label,
                    stages=stages,
                    step_s=med,
                    efficiency=ref / med,
                    efficiency_1core=ref1 / med,
                    busiest_stage_compute_s=work,
                    efficiency_bound=ref / work,
                    loss0=loss,
                    load=round(os.getloadavg()[0], 1),
                )
            )
        return rows
    finally:
        meshshard.shutdown()


def print_table(rows: list[dict]) -> None:
    print(
        f"{'framework':<10} {'schedule':<30} {'S':>2} {'step ms':>9} {'efficiency (1 core)':>21} "
        f"{'loss step 1':>11} {'load':>5} {'stage ms':>8} {'bound':>5}"
    )
    for r in rows:
        if "skipped" in r:
            print(
                f"{r['framework']:<10} {r['schedule']:<30} {r['stages']:>2}  skipped: "
                f"{r['skipped']}"
            )
            continue
        eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "ref"
        if "efficiency_1core" in r:
            eff += f" ({r['efficiency_1core']:.3f})"
        print(
            f"{r['framework']:<10} {r['schedule']:<30} {r['stages']:>2} "
            f"{r['step_s'] * 1e3:>9.1f} {eff:>21} {r['loss0']:>11.4f} {r.get('load', 0):>5}"
            + (
                f" {r['busiest_stage_compute_s'] * 1e3:>8.1f} {r['efficiency_bound']:>5.2f}"
                if "efficiency_bound" in r
                else ""
            )
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", default=None)
    ap.add_argument("--d-model", type=int, default=MODEL["d_model"], help="the GPT's width")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    ap.add_argument(
        "--all-schedules",
        action="store_true",
        help="every meshshard schedule, not only those torch also has",
    )
    ap.add_argument(
        "--remat",
        nargs="+",
        default=["none", "dots"],
        choices=["none", "dots", "full"],
        help="PipeshardParallel.remat settings each meshshard schedule runs under",
    )
    args = ap.parse_args(argv)
    set_size(args.d_model, args.batch, args.seq)
    paired = None if args.all_schedules else [m for _, m in TORCH_SCHEDULES.values() if m]
    remats = [None if r == "none" else r for r in args.remat]
    # Ray first: its workers must not fork a process that already runs JAX threads.
    rows = run_meshshard(args.steps, args.warmup, args.micro_batches, args.stages, paired, remats)
    rows += run_torch(args.steps, args.warmup, args.micro_batches, args.stages)
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
