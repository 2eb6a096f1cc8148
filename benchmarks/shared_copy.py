"""What handing a shared parameter over uncopied saves the owner stage's forward.

    python benchmarks/shared_copy.py [--vocab 16384] [--d-model 256] [--micro-batches 4]
        [--calls 40] [--rounds 3] [--json OUT.json]

A GPT with tied embeddings (``examples/gpt.py``, 4 blocks, 2 stages of ``(1, 2)``): the
token embedding is owned by stage 0 and read again by stage 1's output head, so stage
0's forward program outputs it for the transfer.  XLA copies such an output on every
run (every micro-batch, though the copy crosses once per step); the runtime now hands
back the input array itself (``runtime/programs.py``, ``passed_through``).  This builds
stage 0's forward both ways in one process and times one call of each on the same
inputs, in alternating rounds.  Reported: the median call, the ratio, and the bytes a
step no longer copies (the embedding x micro-batches).

    python benchmarks/shared_copy.py --whole-step REPO [--steps 30]

times the whole step instead, on the local Ray cluster, with the meshshard checked out
at ``REPO`` (a worktree of the commit before the change, then this one, alternately).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--whole-step", metavar="REPO", default=None)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.whole_step:
        return whole_step(args)

    import jax
    import numpy as np

    import meshshard
    from examples import gpt
    from meshshard.passes.trace import trace_step
    from meshshard.runtime import programs

    model = gpt.GPT(vocab=args.vocab, d_model=args.d_model, tie_embeddings=True)
    batch = gpt.make_batch(batch_size=16, vocab=args.vocab)
    state = gpt.make_state(model, batch["inputs"])
    m = args.micro_batches
    method = meshshard.PipeshardParallel(num_micro_batches=m, stages=[(1, 2)] * 2)
    plan = meshshard.parallelize(gpt.train_step, method=method).lower(
        state, batch, cluster=meshshard.ClusterSpec("bench-2x2", 2, 2)
    )
    traced = trace_step(gpt.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=m)
    mesh = programs.make_mesh(jax.devices()[:2], plan.meshes[0].axis_shape)
    name = next(p.name for p in plan.programs if str(p.name) == "s0.F")
    handed = programs.build_programs(traced, plan, 0, mesh)[name]
    keep = programs.passed_through
    programs.passed_through = lambda *a: ()  # the program as it was: XLA copies the output
    try:
        copied = programs.build_programs(traced, plan, 0, mesh)[name]
    finally:
        programs.passed_through = keep
    assert handed.passed and not copied.passed

    by_id = {i: v for v, i in _var_ids(traced).items()}
    rng = np.random.default_rng(0)
    groups = []
    for g in handed.input_groups:
        arrays = []
        specs, shapes = programs._specs_for(plan, g, 0), programs.stored_shapes(plan, g, 0)
        for v, spec, shape in zip(
            programs.group_contents(plan, g).vars, specs, shapes, strict=True
        ):
            aval = by_id[v].aval
            shape = aval.shape if shape is None else shape
            if np.issubdtype(aval.dtype, np.floating):
                x = rng.standard_normal(shape).astype(aval.dtype)
            else:
                x = np.zeros(shape, aval.dtype)
            arrays.append(jax.device_put(x, programs.sharding(mesh, spec)))
        groups.append(tuple(arrays))
    variants = {"copied (before)": copied, "handed over": handed}
    times = {k: [] for k in variants}
    for prog in variants.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(prog(groups))
    for _ in range(args.rounds):
        for k, prog in variants.items():
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(prog(groups))
                times[k].append(time.perf_counter() - t0)
    flat = [a for g in groups for a in g]
    shared = sum(flat[i].nbytes for _, i in handed.passed)
    base = statistics.median(times["copied (before)"])
    rows = [
        {
            "variant": k,
            "median_ms": statistics.median(t) * 1e3,
            "ratio": statistics.median(t) / base,
        }
        for k, t in times.items()
    ]
    print(f"{'s0.F of the tied GPT':<24} {'median ms':>10} {'/ copied':>9}")
    for r in rows:
        print(f"{r['variant']:<24} {r['median_ms']:>10.3f} {r['ratio']:>9.2f}")
    print(f"shared embedding: {shared / 2**20:.2f} MiB, no longer copied {m} times a step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "shared_bytes": shared}, f, indent=1)
    return 0


def whole_step(args) -> int:
    """Median step of the tied GPT on the local Ray cluster, meshshard from ``REPO``."""
    sys.path.insert(0, os.path.abspath(args.whole_step))
    import meshshard
    from examples import gpt

    model = gpt.GPT(vocab=args.vocab, d_model=args.d_model, tie_embeddings=True)
    batch = gpt.make_batch(batch_size=16, vocab=args.vocab)
    state = gpt.make_state(model, batch["inputs"])
    method = meshshard.PipeshardParallel(num_micro_batches=args.micro_batches, stages=[(1, 2)] * 2)
    meshshard.init()
    try:
        step = meshshard.parallelize(gpt.train_step, method=method)
        times = []
        for k in range(3 + args.steps):  # 3 to compile and warm up
            t0 = time.perf_counter()
            state, loss = step(state, batch)
            meshshard.fetch(loss)
            if k >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        meshshard.shutdown()
    median = statistics.median(times) * 1e3
    print(f"meshshard at {args.whole_step}: median step {median:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_ms": median}, f, indent=1)
    return 0


def _var_ids(traced):
    from meshshard.jaxpr_util import var_ids

    return var_ids(traced.jaxpr)


if __name__ == "__main__":
    raise SystemExit(main())
