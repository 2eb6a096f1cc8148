"""Step time with and without fusing a stage's back-to-back forward and backward.

    python benchmarks/fuse_forward_backward.py [--stages 2 4] [--blocks 8] [--steps 25]
                                               [--json OUT.json]

The GPT of ``benchmarks/peer_torch_pipe.py`` (4 blocks, d_model 64, batch 16, M=4) on
the local Ray cluster, one host-actor with one CPU device per stage.  For each schedule
whose streams run some stage's forward and backward of a micro-batch back to back
(``1f1b``, ``eager_1f1b``, ``zb_h1``, ``interleaved_1f1b``; and one stage with M
micro-batches, the gradient accumulation of a ``DataParallel`` step), two steps are compiled side by side:
``PipeshardParallel(fuse_forward_backward=True)`` (the default: one ``s{i}.FB`` program
per such pair) and ``False`` (every forward and backward a program of its own).  They
run in alternating blocks of ``--steps`` timed steps (order swapped every block, so
drift hits both alike); the table gives each one's median step and fused / apart.
Both are first checked to give the same parameters after three steps (within float
rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.peer_torch_pipe import BATCH, MODEL, SEQ, make_batch  # noqa: E402

SCHEDULES = ("1f1b", "eager_1f1b", "zb_h1", "interleaved_1f1b")
M = 4


def _method(schedule: str | None, stages: int, fuse: bool):
    """The method of one row; ``schedule`` None: one stage, M micro-batches (gradient
    accumulation on one device, the shape a ``DataParallel`` step with micro-batches has)."""
    import meshshard

    kw = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}
    return meshshard.PipeshardParallel(
        num_micro_batches=M,
        stages=[(1, 1)] * stages,
        schedule=schedule or "1f1b",
        fuse_forward_backward=fuse,
        **kw,
    )


def compare(schedule: str | None, stages: int, blocks: int, steps: int) -> dict:
    """Median step (ms) fused and apart, alternating blocks, one compiled step each."""
    import jax

    import meshshard
    from examples import gpt

    state0 = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
    made, state = {}, {}
    for fuse in (True, False):
        method = _method(schedule, stages, fuse)
        step = meshshard.parallelize(gpt.train_step, method=method, donate_argnums=(0,))
        s = meshshard.fetch(state0)
        for i in range(3):
            s, loss = step(s, make_batch(i))
        made[fuse], state[fuse] = step, s
    a = jax.tree.leaves(meshshard.fetch(state[True].params))
    b = jax.tree.leaves(meshshard.fetch(state[False].params))
    diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True)
    )
    batch = make_batch(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for blk in range(blocks):
        for fuse in (True, False) if blk % 2 == 0 else (False, True):
            step, s = made[fuse], state[fuse]
            for _ in range(3):
                s, loss = step(s, batch)
            float(loss)
            for _ in range(steps):
                t0 = time.perf_counter()
                s, loss = step(s, batch)
                float(loss)
                times[fuse].append(time.perf_counter() - t0)
            state[fuse] = s
    fused = statistics.median(times[True]) * 1e3
    apart = statistics.median(times[False]) * 1e3
    programs = sorted({str(p.name) for p in made[True].plan.programs if "FB" in str(p.name)})
    for step in made.values():
        step.release()
    return dict(
        schedule=schedule or "one stage",
        stages=stages,
        fused_ms=round(fused, 2),
        apart_ms=round(apart, 2),
        ratio=round(fused / apart, 3),
        fused_programs=programs,
        max_param_diff=diff,
        load=round(os.getloadavg()[0], 1),
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    import meshshard

    rows = []
    meshshard.init(num_hosts=max(args.stages), devices_per_host=1)
    try:
        configs = [(None, 1)] + [
            (s, n)
            for n in args.stages
            for s in SCHEDULES
            # two model chunks per mesh need 2 x stages blocks
            if s != "interleaved_1f1b" or MODEL["num_layers"] >= 2 * n
        ]
        for schedule, stages in configs:
            row = compare(schedule, stages, args.blocks, args.steps)
            rows.append(row)
            print(
                f"{row['schedule']:>17} S={stages}  fused {row['fused_ms']:7.2f} ms  "
                f"apart {row['apart_ms']:7.2f} ms  fused/apart {row['ratio']:.3f}  "
                f"({', '.join(row['fused_programs'])}; max param diff "
                f"{row['max_param_diff']:.1e}; load {row['load']})",
                flush=True,
            )
    finally:
        meshshard.shutdown()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"batch": BATCH, "seq": SEQ, "model": MODEL, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
