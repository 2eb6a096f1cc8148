"""What a layer's forward keeps for its backward, and what keeping it costs on XLA:CPU.

    python benchmarks/remat.py [--rows 16 4] [--json OUT.json]

Two tables, one run:

1. **The split, in one process.** The GPT of ``benchmarks/peer_torch_pipe.py`` (4 blocks,
   d_model 64, seq 32) on ``--rows`` rows, one device, ``jax.jit`` each (medians of
   interleaved rounds): the loss alone, the loss with the residuals ``jax.vjp`` keeps
   returned as outputs (what a pipeline's forward program does), the backward from those
   residuals, and the fused gradient, for each rematerialization policy (none,
   ``dots_saveable``, ``nothing_saveable``: ``PipeshardParallel.remat`` None, ``"dots"``,
   ``"full"``).  ``split / fused`` = (forward with residuals + backward) / the fused
   gradient of the same policy; ``/ plain`` the same split over the fused gradient
   without rematerialization (the user's own ``jax.jit`` step, a pipeline's reference).
2. **The plans.** The fidelity benchmark's GPT C (d_model 128, 4 blocks, batch 32) on
   2 stages of (1, 2), M=4, per schedule and ``remat``: the residual bytes of one
   micro-batch over both stages, and the simulator's peak bytes per device (the
   ``local`` preset; buffers only, not the transient values inside a program).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks.peer_torch_pipe import MODEL, make_batch  # noqa: E402
from examples import gpt  # noqa: E402

POLICIES = {
    None: None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _median_ms(fns: dict, rounds: int = 5, calls: int = 12) -> dict[str, float]:
    """Median milliseconds of each of ``fns`` (no arguments), interleaved rounds."""
    for f in fns.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            for _ in range(calls):
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def split_costs(rows: int) -> list[dict]:
    """Table 1 for ``rows`` rows."""
    state = gpt.make_state(gpt.GPT(**MODEL), make_batch(0)["inputs"])
    batch = {k: v[:rows] for k, v in make_batch(0).items()}
    params = state.params

    def loss(p, b):
        logits = state.apply_fn({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    out = []
    for name, policy in POLICIES.items():
        fn = loss if policy is None else jax.checkpoint(loss, policy=policy)

        def forward_res(p, b, fn=fn):
            value, vjp = jax.vjp(fn, p, b)
            return value, jax.tree.leaves(vjp)

        fwd_res = jax.jit(forward_res)
        residuals = [x for x in fwd_res(params, batch)[1] if hasattr(x, "nbytes")]
        _, vjp = jax.vjp(fn, params, batch)
        backward = jax.jit(lambda ct, vjp=vjp: vjp(ct))
        fwd, fused = jax.jit(fn), jax.jit(jax.grad(fn))
        ms = _median_ms(
            dict(
                forward=lambda fwd=fwd: fwd(params, batch),
                forward_residuals=lambda f=fwd_res: f(params, batch),
                backward=lambda b=backward: b(np.float32(1.0)),
                fused=lambda g=fused: g(params, batch),
            )
        )
        out.append(
            dict(
                rows=rows,
                remat=name,
                residuals=len(residuals),
                residual_bytes=sum(int(x.nbytes) for x in residuals),
                **{f"{k}_ms": v for k, v in ms.items()},
                split_over_fused=(ms["forward_residuals"] + ms["backward"]) / ms["fused"],
            )
        )
    plain = out[0]["fused_ms"]
    for r in out:
        r["split_over_plain"] = (r["forward_residuals_ms"] + r["backward_ms"]) / plain
    return out


def plan_memory() -> list[dict]:
    """Table 2."""
    import meshshard
    from meshshard import ClusterSpec, PipeshardParallel
    from meshshard.refs import BufferKind
    from meshshard.sim import simulate

    model = gpt.GPT(vocab=64, num_heads=4, d_model=128, num_layers=4, max_len=32)
    batch = gpt.make_batch(32, seq_len=32)
    state = gpt.make_state(model, batch["inputs"])
    cluster = ClusterSpec.preset("local")
    out = []
    for schedule in ("gpipe", "1f1b"):
        for remat in POLICIES:
            method = PipeshardParallel(
                num_micro_batches=4, stages=[(1, 2)] * 2, schedule=schedule, remat=remat
            )
            plan = meshshard.parallelize(gpt.train_step, method=method).lower(
                state, batch, cluster=cluster
            )
            residual = sum(b.nbytes for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS)
            peaks = [m.peak for m in simulate(plan, cluster).memory]
            out.append(
                dict(schedule=schedule, remat=remat, residual_bytes=residual, peak_bytes=peaks)
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    split = [r for rows in args.rows for r in split_costs(rows)]
    print(
        f"{'rows':>4} {'remat':>5} {'residuals':>9} {'MiB':>6} {'forward':>8} {'fwd+res':>8} "
        f"{'backward':>8} {'fused':>7} {'split / fused':>13} {'/ plain':>7}"
    )
    for r in split:
        print(
            f"{r['rows']:>4} {r['remat'] or 'none':>5} {r['residuals']:>9} "
            f"{r['residual_bytes'] / 2**20:>6.2f} {r['forward_ms']:>8.2f} "
            f"{r['forward_residuals_ms']:>8.2f} {r['backward_ms']:>8.2f} {r['fused_ms']:>7.2f} "
            f"{r['split_over_fused']:>13.2f} {r['split_over_plain']:>7.2f}"
        )
    plans = plan_memory()
    print(
        f"\n{'schedule':<8} {'remat':>5} {'residual MiB / micro-batch':>27} {'peak MiB / device':>22}"
    )
    for r in plans:
        peaks = ", ".join(f"{p / 2**20:.1f}" for p in r["peak_bytes"])
        print(
            f"{r['schedule']:<8} {r['remat'] or 'none':>5} "
            f"{r['residual_bytes'] / 2**20:>27.2f} {peaks:>22}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(split=split, plans=plans), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
