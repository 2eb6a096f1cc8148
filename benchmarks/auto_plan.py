"""Automatic stage plans vs every Megatron grid plan, pure DP and ZeRO-3, in the cost model.

    python benchmarks/auto_plan.py [--models 350M,1.3B,...] [--clusters ...] [--json OUT.json]

For each GPT configuration (the GPT-3 paper's 350M / 1.3B / 2.6B / 6.7B shapes, sequence
1024, vocabulary 51200) and cluster preset, the model is traced with abstract shapes
only (``jax.eval_shape`` for the parameters, ``jax.make_jaxpr`` for the loss; no array is
allocated), cut into layers (the example's pipeline boundaries, one per block; the
``layers=auto`` rows use :mod:`meshshard.passes.layer_cluster` instead) and planned by
:mod:`meshshard.passes.stage_dp`.  Every plan is scored by the same model
(:mod:`meshshard.passes.stage_cost`, resharding from our planner): the auto plan, every
valid grid plan ``dp x tp x pp`` (1F1B, tp inside a host, uniform stages, those that fit
memory), pure data parallelism and ZeRO-3.  The auto plan and the grid plans are each
searched with and without full activation recomputation (Megatron's; "remat" says
whether the auto plan recomputes, "(remat)" whether the best grid plan does); pure DP
and ZeRO-3 are scored like the auto plan.  ``--costs ilp`` (default) prices every plan with the sharding ILP's
per-layer plans (:mod:`meshshard.passes.stage_ilp_cost`), ``--costs analytic`` with
:mod:`meshshard.passes.stage_cost`'s Megatron model.  Mixed precision is assumed (fp16 compute at
the device's fp16 peak, 16 bytes of state per parameter, activations at 2 bytes).
``compile_s`` is the whole automatic plan's wall time on this machine: tracing, layer
statistics (and clustering), the per-layer ILP solves, the stage DP with its resharding
plans; ``compile_cpu_s`` its CPU time (the machine is shared, so wall time includes waiting for a core).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from examples import gpt  # noqa: E402
from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.errors import MeshshardInputError  # noqa: E402
from meshshard.jaxpr_util import is_marker  # noqa: E402
from meshshard.passes.layer_cluster import cluster_layers  # noqa: E402
from meshshard.passes.stage_cost import AnalyticCost, CostOptions, layer_stats  # noqa: E402
from meshshard.passes.stage_dp import fits, grid_plans, stage_dp, zero3_plan  # noqa: E402
from meshshard.passes.stage_ilp_cost import IlpCost  # noqa: E402

MODELS = {  # name: (d_model, layers, heads), GPT-3 paper Table 2.1
    "350M": (1024, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
}
CLUSTERS = (("aws-p3.16xlarge", 2), ("aws-p3.16xlarge", 4), ("dgx-a100", 1), ("dgx-a100", 2))
SEQ, VOCAB, BATCH, MICRO = 1024, 51200, 1024, 32


def trace_gpt(name: str):
    """The loss jaxpr of GPT ``name`` at micro-batch shape, and its parameter count."""
    d, n_layers, heads = MODELS[name]
    model = gpt.GPT(vocab=VOCAB, d_model=d, num_heads=heads, num_layers=n_layers, max_len=SEQ)
    tokens = jax.ShapeDtypeStruct((BATCH // MICRO, SEQ), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]

    def loss(p, inputs, targets):
        logits = model.apply({"params": p}, inputs)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    closed = jax.make_jaxpr(loss)(params, tokens, tokens)
    n_params = len(jax.tree.leaves(params))
    return closed.jaxpr, set(range(n_params))


def marker_cuts(jaxpr) -> tuple[int, ...]:
    return tuple(i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "mark", "fwd"))


def make_cost(costs: str, jaxpr, cuts, params, stats, cluster, opts):
    """The stage cost model: ``ilp`` (per-layer sharding ILP plans) or ``analytic``."""
    if costs == "analytic":
        return AnalyticCost(stats, cluster, opts)
    bounds = [0, *cuts, len(jaxpr.eqns)]
    eqns = [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return IlpCost(jaxpr, eqns, params, stats, cluster, opts)


def run_case(model: str, preset: str, hosts: int, auto_layers: bool, costs: str = "ilp") -> dict:
    cluster = ClusterSpec.preset(preset, num_hosts=hosts)
    opts = CostOptions(compute_dtype="float16", act_scale=0.5)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    jaxpr, params = trace_gpt(model)
    trace_s = time.perf_counter() - t0
    n_blocks = MODELS[model][1]
    cuts = cluster_layers(jaxpr, n_blocks) if auto_layers else marker_cuts(jaxpr)
    stats = layer_stats(jaxpr, cuts, params)
    plain = make_cost(costs, jaxpr, cuts, params, stats, cluster, opts)
    remat = copy.copy(plain)  # shares the ILP's memo: recomputation changes no layer plan
    remat.options = replace(opts, remat=True)
    autos = []
    for cost in (plain, remat):
        try:
            autos.append((stage_dp(cost, MICRO), cost))
        except MeshshardInputError:  # this one fits nowhere; the other may
            pass
    if not autos:
        raise MeshshardInputError(f"no plan fits {model} on {cluster}, even recomputing")
    auto, cost = min(autos, key=lambda a: a[0].seconds)
    compile_s = time.perf_counter() - t0
    compile_cpu_s = time.process_time() - c0
    grid = [(p, c) for c in (plain, remat) for p in grid_plans(c, MICRO) if fits(p, c)]
    best, best_cost = min(grid, key=lambda g: g[0].seconds) if grid else (None, None)
    grid_remat = best_cost is remat
    grid = [p for p, c in grid if c is cost]
    dp = next((p for p in grid if p.name.endswith("tp1 pp1")), None)
    z3 = zero3_plan(cost, MICRO)
    z3_fits = fits(z3, cost)
    return {
        "model": model,
        "cluster": f"{preset} x{hosts}",
        "layers": "auto" if auto_layers else "markers",
        "remat": cost.options.remat,
        "auto_s": auto.seconds,
        "auto_plan": [str(s) for s in auto.stages],
        "best_grid": (best.name + (" (remat)" if grid_remat else "")) if best else None,
        "best_grid_s": best.seconds if best else None,
        "grid_plans_fit": len(grid),
        "pure_dp_s": dp.seconds if dp else None,
        "zero3_s": z3.seconds if z3_fits else None,
        "ratio_vs_grid": auto.seconds / best.seconds if best else None,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "trace_s": trace_s,
        "notes": list(auto.notes) + ([cost.summary()] if costs == "ilp" else []),
        "costs": costs,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def _fmt(x, scale=1.0, spec=".4g"):
    return "-" if x is None else format(x * scale, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default=",".join(f"{p}:{h}" for p, h in CLUSTERS))
    ap.add_argument("--auto-layers", action="store_true", help="also rows with layers='auto'")
    ap.add_argument("--costs", default="ilp", choices=("ilp", "analytic"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    head = f"{'model':>5} {'cluster':>18} {'layers':>7} {'remat':>5} {'auto s':>8} {'grid s':>8} {'auto/grid':>9} {'DP s':>8} {'ZeRO3 s':>8} {'compile':>7} {'cpu':>6}  best grid / auto plan"
    print(head)
    for model in args.models.split(","):
        for spec in args.clusters.split(","):
            preset, hosts = spec.split(":")
            for auto_layers in (False, True) if args.auto_layers else (False,):
                r = run_case(model, preset, int(hosts), auto_layers, args.costs)
                rows.append(r)
                print(
                    f"{r['model']:>5} {r['cluster']:>18} {r['layers']:>7} {str(r['remat']):>5} {_fmt(r['auto_s'])} "
                    f"{_fmt(r['best_grid_s']):>8} {_fmt(r['ratio_vs_grid'], spec='.4f'):>9} "
                    f"{_fmt(r['pure_dp_s']):>8} {_fmt(r['zero3_s']):>8} {r['compile_s']:7.2f} {r['compile_cpu_s']:6.2f}  "
                    f"{r['best_grid']} / {'; '.join(r['auto_plan'])}  "
                    f"[load {r['load_before']:.1f}; {'; '.join(r['notes'][1:])}]",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
