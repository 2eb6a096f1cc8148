"""TriRace's switches measured on the local Ray cluster (``trirace.py --real``).

    python benchmarks/trirace.py --real [--steps 6] [--schedule 1f1b] [--json OUT.json]

A large-vocabulary GPT (vocab 16384, d_model 128, 4 layers, untied: the embedding on
stage 0, the 2 M-parameter head on stage 1) as ``PipeshardParallel(data_parallel=2)``:
2 stages x 2 replicas, one CPU device per host-actor (4 Ray actors), M = 4
micro-batches (2 per replica); ``--schedule interleaved_1f1b`` runs 2 virtual stages
per mesh, where a mesh's later chunk finishes its gradients while its earlier chunk
still sends activation gradients (the case where a P2P can meet queued chunks; under
1F1B every P2P of a replica precedes its all-reduce in the stream).  Variants, measured side by side in one run: no
communication scheduling, each switch alone, all three, all three + topology-aware
admission, and no scheduling again last (the first variant also pays the session's
warm-up; ratios are to the first row, compare the last).  ``sparse`` moves the token table's gradient (16384 x 128 float32, 8 MiB)
as the rows a replica's step touched (at most 2 micro-batches x 4 x 32 = 256 rows, about
129 KiB per replica, padded; :mod:`meshshard.passes.sparse_rows`) in an all-gather; the
``grad MiB`` column is the gradient bytes all workers send per step by the plan, and
``exch ms s0/s1`` per stage (mean of its two replicas, median of 2 recorded steps each)
the time from a worker's first gradient collective handed to the transport to its last
one arrived.  Chunks:
``--chunk-kib`` (default 1024 KiB; the stage-1 gradients are ~9 MiB, so about 9 chunks).

Per variant: the median step time over ``--steps`` steps after 2 warm-up steps, its
ratio to the unscheduled plan, the simulator's prediction of the same plan (programs
timed on their meshes once, the same programs in every variant; admission on for
``topology``; the host overheads per instruction and the driver's dispatch measured in
the same profiled steps) with the profiled times as they are (``pred ms``) and with the times each
program would take alone on cores the simulator shares among the host-actors
(``cores ms``: ``isolated_program_times`` and ``host_cores`` = this machine's cores, as
``benchmarks/fidelity.py``'s ``cores`` variant), and from recorded timelines
(:class:`~meshshard.runtime.overlap.Timeline`) the number of point-to-point ops that
were queued after an all-reduce chunk and issued before it
(:func:`~meshshard.runtime.overlap.overtakes`): the priorities at work.
"""

from __future__ import annotations

import os
import statistics
import time

MODEL = dict(vocab=16384, d_model=128, num_heads=4, num_layers=4, max_len=32)
BATCH, SEQ = 16, 32
VARIANTS = {
    "none": (),
    "+p2p": ("p2p",),
    "+sparse": ("sparse",),
    "+allreduce": ("allreduce",),
    "all3": ("allreduce", "sparse", "p2p"),
    "all3+topology": ("allreduce", "sparse", "p2p", "topology"),
    "none again": (),  # the first variant also pays the session's warm-up: measured twice
}


def make_batch(i: int):
    from examples import gpt

    return gpt.make_batch(batch_size=BATCH, seq_len=SEQ, vocab=MODEL["vocab"], seed=i)


def _method(schedule: str, switches, chunk: int):
    from meshshard import PipeshardParallel

    kw = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}
    return PipeshardParallel(
        num_micro_batches=4,
        stages=[(1, 1)] * 2,
        schedule=schedule,
        **kw,
        data_parallel=2,
        comm_schedule=frozenset(switches),
        comm_chunk_bytes=chunk,
    )


def _time_steps(step, state, first: int, n: int):
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        state, loss = step(state, make_batch(first + i))
        float(loss)
        times.append(time.perf_counter() - t0)
    return state, times


def _overtakes(step, state, first: int, n: int):
    """Overtakes counted from ``n`` recorded steps; the issue logs of the last one."""
    from meshshard.runtime.overlap import overtakes

    backend = step.executable.backend
    backend.runtime_options(timeline=True)
    count, logs, spans = 0, {}, {}
    for i in range(n):
        state, _ = step(state, make_batch(first + i))
        tls = {w: t for w, t in backend.runtime_options().items() if t is not None}
        count += sum(len(overtakes(t.issues)) for t in tls.values())
        logs = {w: [list(x) for x in t.issues] for w, t in tls.items()}
        for w, t in tls.items():
            if (span := _grad_span(t)) is not None:
                spans.setdefault(int(w), []).append(span)
    backend.runtime_options(timeline=False)
    return state, count, logs, {w: statistics.median(v) for w, v in sorted(spans.items())}


def _grad_span(tl) -> float | None:
    """Seconds from a worker's first gradient collective handed to the transport to its
    last one arrived (the replicas' exchange of ``A``: chunks and rows), or None."""
    keys = [k for k in tl.sent if str(k[0]).startswith("A") and k in tl.arrived]
    if not keys:
        return None
    return (max(tl.arrived[k] for k in keys) - min(tl.sent[k] for k in keys)) * 1e-9


def _predict(step, state, times, switches, cores: int = 0) -> float:
    """The simulator on ``step``'s plan with the profiled program times and host
    overheads of ``times``; with ``cores`` the programs of all host-actors share that
    many cores (``ClusterSpec.host_cores``) and the isolated program times are used."""
    from dataclasses import replace

    from meshshard.sim import simulate
    from meshshard.sim.engine import SimOptions

    plan = step.lower(state, make_batch(0))
    opts = SimOptions(admission="topology" in switches, record=False)
    cluster = replace(
        plan.cluster,
        host_cores=cores,
        opcode_overheads=times["opcodes"],
        dispatch_overhead=times["dispatch"],
    )
    programs = times["isolated" if cores else "profiled"]
    return simulate(plan, cluster, program_times=programs, options=opts).iteration_time


def _profile(step, state0) -> dict:
    """Program times, profiled once (3 steps, each program waiting for its outputs): as
    measured (every host-actor's programs sharing this machine's cores) and isolated (the
    time each would take alone, for a simulator that shares the cores itself); and the
    host overheads of the same steps (runtime seconds per instruction, driver dispatch
    per step), as ``benchmarks/fidelity.py`` fits them."""
    from meshshard.profiling import profiled_steps
    from meshshard.sim.fidelity import (
        dispatch_overhead,
        isolated_program_times,
        opcode_overheads,
        program_times,
    )

    steps = profiled_steps(step, (state0, make_batch(0)), 3)
    plan = step.lower(state0, make_batch(0))
    return dict(
        profiled=program_times(steps),
        isolated=isolated_program_times(steps, plan, os.cpu_count() or 1),
        opcodes=opcode_overheads(steps),
        dispatch=dispatch_overhead(steps),
    )


def run_real(steps: int, schedule: str, chunk_kib: int, only=None) -> dict:
    """Every variant measured in one Ray session; rows plus the last issue logs."""
    import meshshard
    from examples import gpt

    meshshard.init(num_hosts=4, devices_per_host=1)
    rows, logs, times = [], {}, None
    try:
        state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
        for name, sw in VARIANTS.items():
            if only and name not in only:
                continue
            try:
                row, logs[name], times = _variant(
                    name, sw, state0, schedule, chunk_kib, steps, times
                )
            except Exception as exc:  # keep the other rows
                rows.append(dict(variant=name, switches=list(sw), error=str(exc)[:300]))
                print(f"{name}: failed: {exc}", flush=True)
                continue
            rows.append(row)
            print(f"{name}: {row}", flush=True)
    finally:
        meshshard.shutdown()
    ok = [r for r in rows if "step_s" in r]
    for r in ok:
        r["vs_none"] = ok[0]["step_s"] / r["step_s"]
        r["predicted_vs_none"] = ok[0]["predicted_s"] / r["predicted_s"]
    return {"rows": rows, "issue_logs": logs, "program_times": times}


def _variant(name, sw, state0, schedule, chunk_kib, steps, times):
    """One variant: (row, issue logs of its last recorded step, program times)."""
    import meshshard
    from examples import gpt

    step = meshshard.parallelize(gpt.train_step, method=_method(schedule, sw, chunk_kib << 10))
    state, _ = _time_steps(step, state0, 0, 2)  # compile + warm-up
    if times is None:  # the same programs in every variant: profile once
        times = _profile(step, state0)
    load = os.getloadavg()[0]
    state, walls = _time_steps(step, state, 2, steps)
    state, n_over, logs, grad_span = _overtakes(step, state, 2 + steps, 2)
    pred = _predict(step, state0, times, sw)
    pred_cores = _predict(step, state0, times, sw, os.cpu_count() or 1)
    colls = sum(1 for s in step.plan.streams for x in s.instructions if x.opcode.value == "COLL")
    grad_bytes = _grad_bytes(step.plan)
    step.release()
    row = dict(
        variant=name,
        switches=list(sw),
        step_s=statistics.median(walls),
        steps=walls,
        predicted_s=pred,
        predicted_cores_s=pred_cores,
        overtakes=n_over,
        collectives=colls,
        grad_bytes=grad_bytes,
        grad_exchange_s=grad_span,
        load1=load,
    )
    return row, logs, times


def _grad_bytes(plan) -> int:
    """Bytes all workers send per step for the replicas' gradients: a ring all-reduce
    sends ``2 (p-1)/p`` of the dense part, an all-gather ``p-1`` copies of the rows."""
    from meshshard.instructions import Collective
    from meshshard.refs import BufferKind

    total = 0.0
    for s in plan.streams:
        for x in s.instructions:
            if not (isinstance(x, Collective) and x.buffer.kind is BufferKind.ACCUMULATORS):
                continue
            if x.message:
                continue  # one line per collective, not per chunk
            p = len(x.group)
            dense, rows = plan.grad_nbytes(x.buffer)
            total += (p - 1) * rows if x.kind.value == "allgather" else 2 * (p - 1) / p * dense
    return int(total)


def _stage_spans(spans: dict) -> str:
    """``exch ms`` of stage 0 (workers 0 and 2) / stage 1 (workers 1 and 3), the mean of
    each stage's two replicas."""
    spans = {int(w): v for w, v in spans.items()}
    per = [[spans[w] for w in ws if w in spans] for ws in ((0, 2), (1, 3))]
    return "/".join(f"{sum(v) / len(v) * 1e3:.1f}" if v else "-" for v in per)


def print_real(res: dict) -> None:
    print(
        f"{'variant':>14} {'step ms':>8} {'speedup':>8} {'pred ms':>8} {'pred spd':>8} "
        f"{'cores ms':>8} "
        f"{'COLLs':>6} {'grad MiB':>8} {'exch ms s0/s1':>13} {'overtakes':>9} {'load1':>6}"
    )
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['variant']:>14} failed: {r['error']}")
            continue
        print(
            f"{r['variant']:>14} {r['step_s'] * 1e3:>8.1f} {r['vs_none']:>7.2f}x "
            f"{r['predicted_s'] * 1e3:>8.1f} {r['predicted_vs_none']:>7.2f}x "
            f"{r.get('predicted_cores_s', 0) * 1e3:>8.1f} "
            f"{r['collectives']:>6} {r.get('grad_bytes', 0) / 2**20:>8.2f} "
            f"{_stage_spans(r.get('grad_exchange_s', {})):>13} "
            f"{r['overtakes']:>9} {r['load1']:>6.1f}"
        )
