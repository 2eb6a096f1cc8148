"""The sharding ILP on meshes of two split axes, with and without its one-axis plans.

    python benchmarks/ilp_one_axis.py [--json OUT.json]

When HiGHS stops at its time limit (a GPT block on 2 x 2 has 190k variables), the plan
kept is the cheapest of the incumbent and heuristic plans; the one-axis plans are
HiGHS's plans for each mesh axis alone and for both as one (``passes/shard_ilp.py``,
``_one_axis_plans``), mapped onto the mesh.  Each row plans one step twice in this
process, once as shipped and once with the one-axis plans left out, and reports the
predicted step time (the ILP's objective), the plan kept and the planning seconds.
Planning only: nothing runs.  The 4-layer MLP row gives HiGHS no time on the whole
mesh (``time_limit=0``) and also reports the optimum it finds with time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _note(plan) -> str:
    return next(n for n in plan.notes if "sharding ILP" in n)


def _objective(note: str) -> float:
    return float(note.split("objective ")[1].split(" ms")[0])


def _kept(note: str) -> str:
    return note.split("kept ")[1].split(";")[0] if "kept " in note else "the ILP's optimum"


def _gpt_rows():
    import meshshard
    from examples import gpt
    from meshshard.cluster import ClusterSpec

    model, batch = gpt.GPT(num_layers=2), gpt.make_batch(batch_size=8)
    state = gpt.make_state(model, batch["inputs"])
    cases = [
        ("GPT 2L, ShardParallel((2, 2)), 2 hosts", meshshard.ShardParallel((2, 2)), (2, 2)),
        (
            "GPT 2L, ShardParallel((1, 4)) viewed as 2x2",
            meshshard.ShardParallel((1, 4), logical_shape=(2, 2)),
            (1, 4),
        ),
    ]
    for label, method, (hosts, devices) in cases:
        cluster = ClusterSpec(num_hosts=hosts, devices_per_host=devices)
        yield label, gpt.train_step, (state, batch), method, cluster


def _bert_row():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard
    from examples.bert import EncoderLayer
    from meshshard.cluster import ClusterSpec

    class Layers(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = jnp.ones((x.shape[0], 1, x.shape[1], x.shape[1]), bool)
            for k in range(2):
                x = EncoderLayer(128, 8, 0.0, name=str(k))(x, mask)
            return x

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((8, 8, 128)).astype(np.float32) for k in ("x", "y")}
    model = Layers()
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), batch["x"]), tx=optax.adam(1e-2)
    )
    method = meshshard.ShardParallel((1, 4), logical_shape=(2, 2))
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    return (
        "BERT 2 layers d128, 8x8 tokens, (1, 4) viewed as 2x2",
        step,
        (state, batch),
        method,
        cluster,
    )


def _plan_row(label, fn, args, method, cluster, with_one_axis: bool) -> dict:
    from meshshard.passes import shard_ilp
    from meshshard.passes.pipeline import plan_step

    saved = shard_ilp._one_axis_meshes
    if not with_one_axis:
        shard_ilp._one_axis_meshes = lambda mesh: []
    try:
        t0 = time.perf_counter()
        plan, _ = plan_step(fn, args, method=method, cluster=cluster)
        seconds = time.perf_counter() - t0
    finally:
        shard_ilp._one_axis_meshes = saved
    note = _note(plan)
    return {
        "case": label,
        "one_axis_plans": with_one_axis,
        "predicted_ms": _objective(note),
        "kept": _kept(note),
        "plan_seconds": round(seconds, 1),
    }


def _mlp_rows() -> list[dict]:
    from meshshard.cluster import ClusterSpec
    from meshshard.passes import shard_ilp
    from meshshard.passes.shard_costs import LogicalMesh
    from tests.test_shard_ilp import tanh_mlp_jaxpr

    closed = tanh_mlp_jaxpr()
    cluster = ClusterSpec()
    mesh = LogicalMesh.of((2, 2), cluster)
    label = "MLP 4x512, 16 rows, 2x2, time_limit=0"
    rows = []
    saved = shard_ilp._one_axis_meshes
    for with_one_axis in (True, False):
        if not with_one_axis:
            shard_ilp._one_axis_meshes = lambda mesh: []
        try:
            t0 = time.perf_counter()
            sol = shard_ilp.solve_stage(closed, mesh, cluster, time_limit=0.0)
            seconds = time.perf_counter() - t0
        finally:
            shard_ilp._one_axis_meshes = saved
        rows.append(
            {
                "case": label,
                "one_axis_plans": with_one_axis,
                "predicted_ms": round(sol.objective * 1e3, 4),
                "kept": sol.status.split("kept ")[1] if "kept " in sol.status else sol.status,
                "plan_seconds": round(seconds, 1),
            }
        )
    optimal = shard_ilp.solve_stage(closed, mesh, cluster)
    rows.append(
        {
            "case": label.replace("time_limit=0", "optimum"),
            "one_axis_plans": None,
            "predicted_ms": round(optimal.objective * 1e3, 4),
            "kept": optimal.status,
            "plan_seconds": None,
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = _mlp_rows()
    for case in [*_gpt_rows(), _bert_row()]:
        for with_one_axis in (True, False):
            rows.append(_plan_row(*case, with_one_axis))
            print(rows[-1], flush=True)
    print(f"\n{'case':55} {'one-axis':>8} {'predicted ms':>13} {'plan s':>7}  kept")
    for r in rows:
        flag = {True: "yes", False: "no", None: "-"}[r["one_axis_plans"]]
        secs = "-" if r["plan_seconds"] is None else f"{r['plan_seconds']:.1f}"
        print(f"{r['case']:55} {flag:>8} {r['predicted_ms']:>13.4g} {secs:>7}  {r['kept']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
