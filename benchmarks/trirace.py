"""TriRace-like setups, simulated: communication scheduling on 2BW + data parallelism.

    python benchmarks/trirace.py [--json OUT.json] [--quick]
    python benchmarks/trirace.py --real [--steps 6] [--json OUT.json]   (measured on Ray:
        benchmarks/trirace_real.py)

Models (fp16, sequence s, micro-batch of b sequences split over the d replicas):
GPT 1.3B-like (24 layers, d 2048, vocab 51200, s 1024, b 8) and BERT-large-like (24
layers, d 1024, vocab 30522, s 512, b 16): large vocabularies, as in TriRace's
embedding-heavy models.  Clusters: V100 hosts of 4 GPUs (``aws-p3.8xlarge``) or 8 GPUs
(``aws-p3.16xlarge``), NIC set to 25 or 100 Gb/s; 16 or 32 GPUs, i.e. S stages x d
replicas, one host per stage replica (the host runs its stage tensor-parallel over its
GPUs at 40% of fp16 peak; the in-host tensor-parallel traffic is not modelled, so every
variant pays the same for it).  M = 4 S micro-batches per step.

Traffic per stage replica: activations and their gradients to the same replica of the
neighbouring stages (2 b s d / d_rep bytes), one gradient bucket per layer
(12 d^2 params, fp16), the token embedding (|V| x d) on stage 0 and the output head
(|V| x d, dense) on the last stage.  An embedding replica's touched rows are at most
the tokens of its step (M b s / d_rep) rows of d values plus an int32 index.  Buckets
are cut into 25 MB chunks (DDP's bucket size), the granularity at which admission can
let higher-priority traffic pass.

Variants per setup: 2BW without scheduling (the all-reduce after the step, as 2BW's
reference code), 2BW + each switch alone, all three, all three + topology-aware
admission, and a Megatron-style baseline (1F1B with a flush, DP all-reduce after the
flush, no scheduling).  2BW's time per step is its steady state ((T(4 steps) -
T(2 steps)) / 2).  The paper reports 1.07-1.45x over 2BW and 1.24-1.81x over Megatron
on its own testbed; these are simulated figures on stated assumptions, not a
reproduction of its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshshard.cluster import ClusterSpec, gbit  # noqa: E402
from meshshard.passes.comm_schedule import schedule_comm  # noqa: E402
from meshshard.passes.schedules import make_schedule  # noqa: E402
from meshshard.sim.dp_plans import replicate, sparse_grads  # noqa: E402
from meshshard.sim.engine import SimOptions  # noqa: E402
from meshshard.sim.schedule_plans import StageCosts, schedule_plan  # noqa: E402
from meshshard.sim.simulator import simulate  # noqa: E402
from meshshard.sparse_grads import rows_nbytes  # noqa: E402

MODELS = {  # layers, d, vocab, seq, micro-batch
    "gpt-1.3b": (24, 2048, 51200, 1024, 8),
    "bert-large": (24, 1024, 30522, 512, 16),
}
SETUPS = [  # gpus, gpus per host, stages, replicas
    (16, 4, 2, 2),
    (32, 4, 4, 2),
    (32, 8, 2, 2),
]
NICS = (25, 100)
MFU, PEAK, CHUNK = 0.4, 125e12, 25 << 20
VARIANTS = {
    "2bw": (),
    "+p2p": ("p2p",),
    "+sparse": ("sparse",),
    "+allreduce": ("allreduce",),
    "all3": ("allreduce", "sparse", "p2p"),
    "all3+topology": ("allreduce", "sparse", "p2p", "topology"),
}


def cluster(gpus_per_host: int, hosts: int, nic: int) -> ClusterSpec:
    base = "aws-p3.8xlarge" if gpus_per_host == 4 else "aws-p3.16xlarge"
    return replace(ClusterSpec.preset(base, num_hosts=hosts), nic_bandwidth=gbit(nic))


def costs(model: str, S: int, d: int) -> tuple[StageCosts, list[int], dict]:
    """Per-replica stage costs, the gradient chunks of a stage, the embedding entries."""
    L, h, V, s, b = MODELS[model]
    br = b // d
    layer = 24 * br * s * h * h + 4 * br * s * s * h
    fwd = (L * layer + 2 * br * s * h * V) / S / MFU
    act = 2 * br * s * h
    layer_bytes = 2 * 12 * h * h * (L // S)
    chunks = [CHUNK] * (layer_bytes // CHUNK) + (
        [layer_bytes % CHUNK] if layer_bytes % CHUNK else []
    )
    emb_dense = 2 * V * h
    M = 4 * S
    embed = {0: (emb_dense, rows_nbytes(M * br * s, V, h)), S - 1: (emb_dense, emb_dense)}
    return StageCosts(fwd, fwd, fwd, act, act, param_bytes=1 << 20), chunks, embed


def step_time(schedule: str, switches, model: str, g: int, S: int, d: int, nic: int) -> float:
    """Simulated seconds per step of one variant."""
    c, chunks, embed = costs(model, S, d)
    cl = cluster(g, S * d, nic)

    def run(steps: int | None) -> float:
        opts = {"steps": steps} if steps else {}
        base = schedule_plan(make_schedule(schedule, S, 4 * S, **opts), c, devices=g, cluster=cl)
        plan = replicate(base, d, bucket_bytes=chunks, embed=embed, cluster=cl)
        plan = schedule_comm(plan, switches, sparse=sparse_grads(plan), chunk_bytes=CHUNK)
        opt = SimOptions(admission="topology" in switches, record=False)
        return simulate(plan, cl, options=opt).iteration_time

    if schedule != "2bw":
        return run(None)
    return (run(4) - run(2)) / 2


def measure(quick: bool) -> list[dict]:
    rows = []
    models = ["bert-large"] if quick else list(MODELS)
    setups = SETUPS[:1] if quick else SETUPS
    for model in models:
        for gpus, g, S, d in setups:
            for nic in (25,) if quick else NICS:
                t = {
                    name: step_time("2bw", sw, model, g, S, d, nic) for name, sw in VARIANTS.items()
                }
                t["megatron"] = step_time("1f1b", (), model, g, S, d, nic)
                for name, v in t.items():
                    rows.append(
                        dict(
                            model=model,
                            gpus=gpus,
                            gpus_per_host=g,
                            stages=S,
                            replicas=d,
                            nic_gbps=nic,
                            variant=name,
                            step_ms=v * 1e3,
                            speedup_vs_2bw=t["2bw"] / v,
                            speedup_vs_megatron=t["megatron"] / v,
                        )
                    )
    return rows


def _print(rows: list[dict]) -> None:
    print(
        f"{'model':>10} {'gpus':>4} {'g/h':>3} {'S':>2} {'d':>2} {'NIC':>4} "
        f"{'variant':>14} {'step ms':>9} {'vs 2bw':>7} {'vs Megatron':>11}"
    )
    for r in rows:
        print(
            f"{r['model']:>10} {r['gpus']:>4} {r['gpus_per_host']:>3} {r['stages']:>2} "
            f"{r['replicas']:>2} {r['nic_gbps']:>4} {r['variant']:>14} {r['step_ms']:>9.1f} "
            f"{r['speedup_vs_2bw']:>7.2f} {r['speedup_vs_megatron']:>11.2f}"
        )
    best = [r for r in rows if r["variant"] == "all3+topology"]
    if best:
        a = [r["speedup_vs_2bw"] for r in best]
        m = [r["speedup_vs_megatron"] for r in best]
        print(
            f"\nall3+topology: {min(a):.2f}-{max(a):.2f}x over 2BW (paper 1.07-1.45x), "
            f"{min(m):.2f}-{max(m):.2f}x over Megatron (paper 1.24-1.81x)"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--quick", action="store_true", help="one model, one setup, one NIC")
    ap.add_argument("--real", action="store_true", help="measure on the local Ray cluster")
    ap.add_argument("--steps", type=int, default=6, help="--real: timed steps per variant")
    ap.add_argument("--schedule", default="1f1b", help="--real: the pipeline schedule")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="--real: all-reduce chunk")
    ap.add_argument("--variants", nargs="+", default=None, help="--real: only these rows")
    args = ap.parse_args(argv)
    if args.real:
        from benchmarks.trirace_real import print_real, run_real

        res = run_real(args.steps, args.schedule, args.chunk_kib, args.variants)
        print_real(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "trirace --real", "args": vars(args), **res}, f, indent=1)
        return
    rows = measure(args.quick)
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "trirace", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
