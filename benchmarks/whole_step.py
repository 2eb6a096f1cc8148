"""A one-micro-batch step as one program (``s0.step``) or as a stage program and an
update (``ZEROS``, ``s0.FB``, ``m0.apply``), beside ``jax.jit`` on the same devices.

    python benchmarks/whole_step.py [--models mlp gpt] [--steps 20] [--rounds 5] [--ray]
                                    [--json OUT.json]

With ``num_micro_batches=1`` (the default of ``DataParallel`` and ``ShardParallel``)
``passes/fuse_step.py`` runs a mesh's forward, backward and update as one program, as
``jax.jit`` does.  For each model and method this compiles the step twice in one
process on the in-process threads cluster (one (1, 4) mesh of emulated CPU devices):
"fused" (the default plan) and "apart" (the same plan without the pass, given with
``plan=``), and runs them and the peer (``jax.jit`` of the step, batch split over the
same 4 devices with ``NamedSharding``) in interleaved rounds of ``--steps`` timed steps.
Reported: each one's median over rounds of the per-round median step, its ratio to the
peer's, and fused / apart.  Fused and apart are first checked to give the same
parameters after two steps.  ``--ray`` also runs ``DataParallel`` fused and apart on the
local Ray cluster (4 host-actors x 2 CPU devices): a (1, 2) mesh on one host-actor and
a (2, 2) mesh over two (no peer there).

Models: ``mlp``, 4 residual blocks of width 256, batch 64, MSE, Adam; ``gpt``,
``examples/gpt.py`` at the size of the fidelity issue (d_model 128, 4 layers, batch 32,
sequence 16, vocabulary 64), Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recurrent_grads import timed_rounds  # noqa: E402  (one timer for these benchmarks)

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


def _case(name: str):
    """(step, state, batch) of model ``name``; the step returns (state, loss)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard
    from examples import gpt

    if name == "gpt":
        model = gpt.GPT(d_model=128, num_layers=4)
        batch = gpt.make_batch(batch_size=32)
        return gpt.train_step, gpt.make_state(model, batch["inputs"]), batch

    class Residual(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = x + nn.Dense(256)(jax.nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))
            return nn.Dense(1)(x)

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((64, 256)).astype(np.float32),
        "y": rng.standard_normal((64, 1)).astype(np.float32),
    }
    model = Residual()
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]
    return step, TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), batch


def _peer(step, state, batch):
    """``jax.jit`` of the step with the batch split over 4 devices, state replicated."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    fn = jax.jit(step, in_shardings=(whole, rows), out_shardings=(whole, whole))
    on_mesh = jax.device_put(batch, rows)
    return (lambda s: fn(s, on_mesh)), jax.device_put(state, whole)


def _apart(par, state, batch, method):
    """The step under ``par``'s own plan less the whole-step pass (given with ``plan=``)."""
    import meshshard
    from meshshard.passes.pipeline import PASSES, plan_traced
    from meshshard.runtime.cluster import current_cluster

    exe = par._executable_for((state, batch))
    passes = tuple(p for p in PASSES if p.name != "fuse_step")
    plan = plan_traced(exe.traced, method=method, cluster=current_cluster().spec, passes=passes)
    return meshshard.parallelize(par.fn, method=method, plan=plan)


def _pair(step, state, batch, method, calls: dict, label: str) -> None:
    """Add ``label`` fused and apart to ``calls``, checked to compute the same numbers."""
    import jax
    import numpy as np

    import meshshard

    fused = meshshard.parallelize(step, method=method)
    apart = _apart(fused, state, batch, method)
    ran = [str(p.name) for p in fused.plan.programs_run()]
    assert ran == ["s0.step"], ran
    a, b = state, state
    for _ in range(2):
        a, b = fused(a, batch)[0], apart(b, batch)[0]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    calls[f"{label} fused"] = ((lambda s, p=fused, x=batch: p(s, x)), state)
    calls[f"{label} apart"] = ((lambda s, p=apart, x=batch: p(s, x)), state)


def _measure(title: str, model: str, calls: dict, args, rows: list) -> None:
    """Interleaved rounds of every call; prints the table (ratios to the first call)."""
    times, _ = timed_rounds(calls, args.steps, args.rounds, warm=3, swap=True)
    first = next(iter(calls))
    base = statistics.median(times[first])
    print(f"\n{model}: {title}")
    print(f"{'plan':26} {'ms / step':>10} {'vs ' + first:>16} {'fused / apart':>14}")
    for k in calls:
        ms = statistics.median(times[k])
        ratio = ""
        if k.endswith("fused"):
            ratio = f"{ms / statistics.median(times[k.replace('fused', 'apart')]):.2f}"
        print(f"{k:26} {ms * 1e3:>10.2f} {ms / base:>16.2f} {ratio:>14}")
        rows.append({"model": model, "where": title, "plan": k, "s": times[k]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--ray", action="store_true", help="also on the local Ray cluster: (1, 2) and (2, 2)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import meshshard
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    rows: list = []
    with use_cluster(ThreadsCluster(1, 4)):
        for model in args.models:
            step, state, batch = _case(model)
            calls = {"jax.jit": _peer(step, state, batch)}
            _pair(step, state, batch, meshshard.DataParallel((1, 4)), calls, "DataParallel")
            _pair(step, state, batch, meshshard.ShardParallel((1, 4)), calls, "ShardParallel")
            _measure("threads cluster, one (1, 4) mesh, one micro-batch", model, calls, args, rows)
    if args.ray:
        meshshard.init()  # 4 host-actors x 2 CPU devices
        try:
            for model in args.models:
                step, state, batch = _case(model)
                for shape in ((1, 2), (2, 2)):  # apart: each groups the host-actors its way
                    calls: dict = {}
                    _pair(step, state, batch, meshshard.DataParallel(shape), calls, "DataParallel")
                    where = f"local Ray cluster, one {shape} mesh, one micro-batch"
                    _measure(where, model, calls, args, rows)
        finally:
            meshshard.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
