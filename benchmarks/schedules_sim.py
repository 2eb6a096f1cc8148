"""Simulated step time and peak activation memory of every pipeline schedule.

    python benchmarks/schedules_sim.py [--json OUT.json] [--models 1.3B,2.6B] [--stages 2,4,8]

GPT 1.3B (24 layers, d 2048, 32 heads) and 2.6B (32 layers, d 2560, 32 heads), sequence
1024, vocab 51200, fp16, micro-batch of 2 sequences; stage ``i`` of ``S`` gets ``1/S``
of the model's work (layers plus the logits, spread evenly).  Each stage runs on one
``aws-p3.8xlarge``-like host (4 V100, 10 Gb/s NIC) holding the micro-batch data
parallel over its 4 devices at 40% of fp16 peak.  Per micro-batch and stage: forward
F, input-gradient B = F and weight-gradient W = F (B + W in one task for unsplit
schedules); activations cross stages as ``2 s b d`` bytes; a stage keeps
``s b d (34 + 5 a s / d)`` bytes per layer (Korthikanti et al., no recomputation).

For ``S`` in {2, 4, 8} and ``M`` in {S, 2S, 4S, 8S}, every schedule (gpipe, 1f1b,
eager_1f1b, interleaved_1f1b with v=2, zb_h1, 2bw) is simulated with *free*
communication (infinite bandwidth, no latency) and with the p3.8xlarge links.  2BW's
time per step is its steady state: (time of 4 steps - time of 2 steps) / 2.  Printed
per row: step time, bubble (1 - busy / step time of the busiest stage), the closed
form of the bubble, peak activation bytes per device of stage 0 and of the last stage
(grid peak micro-batches x residual bytes per chunk), and the speedup over 1f1b.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.passes.schedule_verify import activation_peaks, check_schedule  # noqa: E402
from meshshard.passes.schedules import make_schedule  # noqa: E402
from meshshard.sim.schedule_plans import StageCosts, schedule_plan  # noqa: E402
from meshshard.sim.simulator import simulate  # noqa: E402

GPT = {"1.3B": (24, 2048, 32), "2.6B": (32, 2560, 32)}
SEQ, VOCAB, MICRO, DEVICES, MFU = 1024, 51200, 2, 4, 0.4
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1", "2bw")
V = 2  # virtual stages of interleaved_1f1b


def stage_costs(model: str, S: int) -> StageCosts:
    """Per-stage, per-micro-batch costs of GPT ``model`` split into ``S`` equal stages."""
    L, d, a = GPT[model]
    layer = 24 * MICRO * SEQ * d * d + 4 * MICRO * SEQ * SEQ * d
    logits = 2 * MICRO * SEQ * d * VOCAB
    fwd = (L * layer + logits) / S / MFU  # the roofline runs flops at peak
    act = 2 * MICRO * SEQ * d  # fp16 boundary activation
    res = SEQ * MICRO * d * (34 + 5 * a * SEQ / d) * (L / S) / DEVICES
    return StageCosts(fwd, fwd, fwd, act, int(res), param_bytes=1 << 20)


def clusters(S: int) -> dict[str, ClusterSpec]:
    """The p3.8xlarge-like cluster of ``S`` hosts, and the same with free communication."""
    real = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=S)
    free = replace(
        real,
        name="free-comm",
        nic_bandwidth=1e18,
        nic_latency=0.0,
        intra_bandwidth=1e18,
        intra_latency=0.0,
    )
    return {"free": free, "real": real}


def closed_form_bubble(name: str, S: int, M: int) -> float:
    """Idle fraction of the busiest stage in the clock model with F = B = W."""
    if name == "2bw":
        return 0.0
    if name == "interleaved_1f1b":
        return (S - 1) / (V * M + S - 1)
    if name == "zb_h1":
        return (S - 1) / (3 * M + S - 1)
    return (S - 1) / (M + S - 1)


def _schedule(name: str, S: int, M: int, steps: int = 1):
    opts = {"interleaved_1f1b": {"virtual_stages": V}, "2bw": {"steps": steps}}.get(name, {})
    sched = make_schedule(name, S, M, **opts)
    check_schedule(sched)
    return sched


def step_time(name: str, S: int, M: int, costs: StageCosts, cluster: ClusterSpec) -> float:
    """Simulated seconds per step (2BW: steady state between steps 2 and 4)."""

    def run(sched) -> float:
        plan = schedule_plan(sched, costs, devices=DEVICES, cluster=cluster)
        return simulate(plan, cluster).iteration_time

    if name != "2bw":
        return run(_schedule(name, S, M))
    return (run(_schedule(name, S, M, 4)) - run(_schedule(name, S, M, 2))) / 2


def measure(model: str, S: int, M: int) -> list[dict]:
    """Rows for every schedule of one (model, S, M) point, both communication models."""
    costs = stage_costs(model, S)
    busy = M * 3 * costs.forward_flops / (DEVICES * 125e12)  # F + B + W per stage
    rows = []
    for comm, cluster in clusters(S).items():
        base = None
        for name in SCHEDULES:
            if name == "2bw" and M < S:
                continue
            t = step_time(name, S, M, costs, cluster)
            peaks = activation_peaks(_schedule(name, S, M))
            per_chunk = costs.residual_bytes / (V if name == "interleaved_1f1b" else 1)
            base = t if name == "1f1b" else base
            rows.append(
                dict(
                    model=model,
                    stages=S,
                    micro_batches=M,
                    comm=comm,
                    schedule=name,
                    step_ms=t * 1e3,
                    bubble=1 - busy / t,
                    closed_form_bubble=closed_form_bubble(name, S, M),
                    act_peak_first_gib=peaks[0] * per_chunk / 2**30,
                    act_peak_last_gib=peaks[-1] * per_chunk / 2**30,
                    act_peak_max_gib=max(peaks) * per_chunk / 2**30,
                    speedup_vs_1f1b=(base / t) if base else None,
                )
            )
    return rows


def _print(rows: list[dict]) -> None:
    head = (
        f"{'model':>5} {'S':>2} {'M':>3} {'comm':>4} {'schedule':>16} {'step ms':>9} "
        f"{'bubble':>7} {'closed':>7} {'act0 GiB':>8} {'actS GiB':>8} {'vs 1f1b':>7}"
    )
    print(head)
    for r in rows:
        sp = f"{r['speedup_vs_1f1b']:.3f}" if r["speedup_vs_1f1b"] else "-"
        print(
            f"{r['model']:>5} {r['stages']:>2} {r['micro_batches']:>3} {r['comm']:>4} "
            f"{r['schedule']:>16} {r['step_ms']:>9.2f} {r['bubble']:>7.3f} "
            f"{r['closed_form_bubble']:>7.3f} {r['act_peak_first_gib']:>8.2f} "
            f"{r['act_peak_last_gib']:>8.2f} {sp:>7}"
        )


def markdown(rows: list[dict]) -> str:
    """Summary tables for RESULTS.md: closed-form check, then speedups and memory."""
    free = [r for r in rows if r["comm"] == "free"]
    worst = max(abs(r["bubble"] - r["closed_form_bubble"]) for r in free)
    out = [
        f"Free communication: largest |simulated bubble - closed form| over {len(free)} rows: "
        f"{worst:.4f}",
        "",
        "| model | S | M | "
        + " | ".join(f"{n} ms" for n in SCHEDULES)
        + " | eager/1f1b | zb_h1/1f1b |",
        "|---|---:|---:|" + "---:|" * (len(SCHEDULES) + 2),
    ]
    real = [r for r in rows if r["comm"] == "real"]
    points = sorted({(r["model"], r["stages"], r["micro_batches"]) for r in real})
    for model, S, M in points:
        at = {
            r["schedule"]: r
            for r in real
            if (r["model"], r["stages"], r["micro_batches"]) == (model, S, M)
        }
        cells = [f"{at[n]['step_ms']:.1f}" if n in at else "-" for n in SCHEDULES]
        e, z = at["eager_1f1b"]["speedup_vs_1f1b"], at["zb_h1"]["speedup_vs_1f1b"]
        out.append(f"| {model} | {S} | {M} | " + " | ".join(cells) + f" | {e:.3f}x | {z:.3f}x |")
    out += [
        "",
        "| model | S | M | " + " | ".join(f"{n} act GiB (s0/last)" for n in SCHEDULES) + " |",
        "|---|---:|---:|" + "---:|" * len(SCHEDULES),
    ]
    for model, S, M in points:
        at = {
            r["schedule"]: r
            for r in real
            if (r["model"], r["stages"], r["micro_batches"]) == (model, S, M)
        }
        cells = [
            f"{at[n]['act_peak_first_gib']:.2f}/{at[n]['act_peak_last_gib']:.2f}"
            if n in at
            else "-"
            for n in SCHEDULES
        ]
        out.append(f"| {model} | {S} | {M} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_out", help="write the rows here")
    p.add_argument("--models", default="1.3B,2.6B")
    p.add_argument("--stages", default="2,4,8")
    p.add_argument("--markdown", help="print the RESULTS.md tables of this JSON and exit")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["rows"]))
        return 0
    t0 = time.perf_counter()
    rows = []
    for model in args.models.split(","):
        for S in (int(s) for s in args.stages.split(",")):
            for M in (S, 2 * S, 4 * S, 8 * S):
                rows += measure(model, S, M)
    # the per-comm rows of one point share a 1f1b base only after it ran: fill the rest
    for r in rows:
        base = next(
            b["step_ms"]
            for b in rows
            if b["schedule"] == "1f1b"
            and (b["model"], b["stages"], b["micro_batches"], b["comm"])
            == (r["model"], r["stages"], r["micro_batches"], r["comm"])
        )
        r["speedup_vs_1f1b"] = base / r["step_ms"]
    _print(rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    if args.json_out:
        meta = dict(seq=SEQ, vocab=VOCAB, micro_batch=MICRO, devices=DEVICES, mfu=MFU, v=V)
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
