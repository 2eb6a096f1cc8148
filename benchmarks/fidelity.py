"""Simulator fidelity: predicted vs measured step time of GPT pipelines on the local Ray cluster.

    python benchmarks/fidelity.py [--steps 15] [--rounds 5] [--json OUT.json]
                                  [--trace OUT_trace.json] [--save OUT.pkl]

For every plan, in one run: the median of ``--steps`` timed steps, one recorded step per
round (host overheads, the side-by-side trace) and one profiled step per round (every
RUN waits for its outputs: program times on the real mesh).  Plans that share a mesh
layout are compiled together and measured in ``--rounds`` interleaved rounds (each
round: one untimed step after the switch, then the timed, recorded and profiled ones),
so a drift of the machine's speed reaches every plan alike.  Only the *calibration* set
(models A and C, d_model 64 and 128, on 2 stages; ``--cal-models A`` for A alone) has
its profiles used for prediction.  Then, with the cluster shut down:

- fit the host overheads (runtime per instruction, driver per step) and a calibrated
  roofline (launch + FLOPs + bytes + collectives read from each program's compiled HLO)
  on the calibration set only;
- predict every plan with the simulator: calibration plans from their profiled program
  times, *held-out* plans (model B: d_model 96 and twice the layers, a size no
  calibration plan has; 4 stages, and (2,2) meshes) from the calibrated roofline alone;
- two host models side by side: ``in-situ`` (profiled times as measured, cores not
  modelled) and ``cores`` (profiles with the slow-down from sharing cores removed, the
  simulator sharing ``os.cpu_count()`` cores, as the local clusters declare; or, with
  ``--fit-cores``, the count that fits the calibration set best); plus the uncalibrated
  ``local`` roofline;
- ``oracle`` and ``oracle cores`` columns: every plan from its own profiled program
  times, as measured and made isolated (held-out plans are profiled too, in their
  rounds, for these columns only), which split a held-out miss into the calibrated
  roofline's part and the host model's part.
- ``cores cpu`` and ``oracle cores cpu``: the same two with the cores each program keeps
  busy measured from its CPU time while profiled (``program_demands``) instead of one per
  device; a held-out program takes the calibrated median demand of its class (devices
  per host, split or replicated, update or not).  ``--residuals`` prints where the
  calibrated rooflines miss, per plan group and program kind;
- the schedule ranking: Kendall's tau, and the pairs of schedules whose timed steps
  the measurement separates (Mann-Whitney, p < 0.05) with how many the prediction
  orders alike (the others swap between runs of this machine).

Also the recording overhead (steps with and without ``trace=``, interleaved blocks on
the first plan) and one Perfetto file with the measured and the predicted timeline of
one plan as two process groups.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the driver compiles each program on its mesh shape to read its collectives (HLO)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import meshshard  # noqa: E402
from benchmarks.step_timing import timed_steps  # noqa: E402
from examples import gpt  # noqa: E402
from meshshard import DataParallel, PipeshardParallel  # noqa: E402

MODELS = {
    "A": dict(model=dict(d_model=64, num_layers=4, max_len=32), batch=16),
    "B": dict(model=dict(d_model=96, num_layers=8, max_len=32), batch=24),
    "C": dict(model=dict(d_model=128, num_layers=4, max_len=32), batch=32),
}


def _pipe(m, stages, schedule, virtual=1):
    return PipeshardParallel(
        num_micro_batches=m, stages=stages, schedule=schedule, virtual_stages=virtual
    )


S2, S2W, S4 = [(1, 2)] * 2, [(2, 2)] * 2, [(1, 2)] * 4
#: (name, set, model, method).  Calibration set "cal" = models A and C (d_model 64 and
#: 128) on 2 stages (and data parallel); held-out = model B (d_model 96, twice the
#: layers: a size between, never profiled for prediction) on 4 stages and on (2,2)
#: meshes.  Every schedule that exists, M in {2, 4, 8}, meshes (1,2) and (2,2).  (2,2)
#: meshes last: they regroup the actors.
PLANS = [
    ("A 2x(1,2) 1f1b M=2", "cal", "A", _pipe(2, S2, "1f1b")),
    ("A 2x(1,2) gpipe M=4", "cal", "A", _pipe(4, S2, "gpipe")),
    ("A 2x(1,2) 1f1b M=8", "cal", "A", _pipe(8, S2, "1f1b")),
    ("A 2x(1,2) eager_1f1b M=4", "cal", "A", _pipe(4, S2, "eager_1f1b")),
    ("A dp (1,2)", "cal", "A", DataParallel(mesh_shape=(1, 2))),
    ("C 2x(1,2) 1f1b M=4", "cal", "C", _pipe(4, S2, "1f1b")),
    ("C 2x(1,2) gpipe M=8", "cal", "C", _pipe(8, S2, "gpipe")),
    ("B 4x(1,2) gpipe M=4", "held-out", "B", _pipe(4, S4, "gpipe")),
    ("B 4x(1,2) 1f1b M=4", "held-out", "B", _pipe(4, S4, "1f1b")),
    ("B 4x(1,2) eager_1f1b M=4", "held-out", "B", _pipe(4, S4, "eager_1f1b")),
    ("B 4x(1,2) interleaved_1f1b M=4", "held-out", "B", _pipe(4, S4, "interleaved_1f1b", 2)),
    ("B 4x(1,2) zb_h1 M=4", "held-out", "B", _pipe(4, S4, "zb_h1")),
    ("B 4x(1,2) 2bw M=4", "held-out", "B", _pipe(4, S4, "2bw")),
    ("B 4x(1,2) 1f1b M=8", "held-out", "B", _pipe(8, S4, "1f1b")),
    ("B 4x(1,2) gpipe M=2", "held-out", "B", _pipe(2, S4, "gpipe")),
    ("A 2x(2,2) 1f1b M=4", "cal", "A", _pipe(4, S2W, "1f1b")),
    ("C 2x(2,2) 1f1b M=4", "cal", "C", _pipe(4, S2W, "1f1b")),
    ("B 2x(2,2) gpipe M=4", "held-out", "B", _pipe(4, S2W, "gpipe")),
    ("B dp (2,2)", "held-out", "B", DataParallel(mesh_shape=(2, 2))),
    # replicated: 2 rows per micro-batch over 4 devices, each computes all of it (the
    # regime of the held-out B 2x(2,2) gpipe and B 4x(1,2) M=8, which over-predicted)
    ("A 2x(2,2) gpipe M=8", "cal", "A", _pipe(8, S2W, "gpipe")),
]
#: --quick: one plan of each kind the fit needs, and a held-out plan of each mesh.
QUICK = [0, 1, 4, 5, 7, 8, 15, 17]
#: The schedules ranked against each other (same model, stages and M).
RANKED = [n for n, *_ in PLANS if n.startswith("B 4x(1,2)") and n.endswith("M=4")]


def _setup(model_key):
    cfg = MODELS[model_key]
    model = gpt.GPT(vocab=64, num_heads=4, **cfg["model"])
    batch = gpt.make_batch(cfg["batch"], seq_len=32)
    return gpt.make_state(model, batch["inputs"]), batch


def _overhead(step, state, batch, path, rounds=4, block=5):
    """Median step with and without recording, interleaved blocks (same plan, same run)."""
    on, off = [], []
    for _ in range(rounds):
        step.record(None)
        state, t = timed_steps(step, state, batch, block)
        off += t
        step.record(path)
        state, t = timed_steps(step, state, batch, block)
        on += t
    step.record(None)
    return statistics.median(on), statistics.median(off)


def _inner(step, state, batch):
    """The compiled step that runs and its arguments: under 2BW the steady variant,
    called with the weight stash first (see meshshard.two_bw); else the step itself."""
    two_bw = getattr(step, "_two_bw", None)
    if two_bw is None:
        return step, (state, batch)
    return two_bw.steady, (two_bw.stash, state, batch)


def _layout(method):
    """The mesh shapes a plan's method asks for: plans with the same set share the
    host-actors as they are, so they can be held compiled at once and interleaved."""
    stages = getattr(method, "stages", None)
    shapes = stages if isinstance(stages, (list, tuple)) else [method.mesh_shape]
    return frozenset(tuple(s) for s in shapes)


def compile_plan(name, kind, model_key, method):
    """Compile one plan (three untimed calls: 2BW compiles its steady variant at call 2)."""
    state, batch = _setup(model_key)
    step = meshshard.parallelize(gpt.train_step, method=method)
    t0 = time.perf_counter()
    state, _ = timed_steps(step, state, batch, 3)
    live = dict(name=name, kind=kind, step=step, state=state, batch=batch)
    live["rec"] = dict(name=name, set=kind, compile_s=time.perf_counter() - t0, times=[])
    live["rec"]["model"] = model_key
    live["rec"]["round_medians"] = []
    live["load"] = [os.getloadavg()[0]]
    return live


def measure_round(live, n):
    """One round of one plan: a step after the switch from the previous plan (untimed),
    ``n`` timed steps, one recorded step (host overheads) and one profiled step (every
    RUN waits for its outputs: program times).  A 2BW step is settled after its round,
    so its trailing work does not run into the next plan's."""
    from meshshard.runtime.trace_record import TraceLog

    step, batch, rec = live["step"], live["batch"], live["rec"]
    live["state"], _ = timed_steps(step, live["state"], batch, 1)
    live["state"], times = timed_steps(step, live["state"], batch, n)
    rec["times"] += times
    rec["round_medians"].append(statistics.median(times))
    inner, _ = _inner(step, live["state"], batch)
    exe = inner.executable
    live.setdefault("measured", TraceLog(os.devnull, keep=100))
    live.setdefault("profile", TraceLog(os.devnull, keep=100))
    for log, sync in ((live["measured"], False), (live["profile"], True)):
        exe.record(log, sync=sync)
        live["state"], _ = timed_steps(step, live["state"], batch, 1)
        exe.record(None)
    if getattr(step, "_two_bw", None) is not None:
        step._two_bw.settle()
    live["load"].append(os.getloadavg()[0])


def finish_plan(live, args, tmp):
    """The plan's record from its rounds, then released: the recorded and profiled steps,
    the recording overhead (on ``--overhead-plan``), the collectives of its programs."""
    from meshshard.passes.trace import trace_step
    from meshshard.profiling import program_collectives
    from meshshard.sim.fidelity import isolated_program_times, opcode_overheads, program_times

    step, state, batch, rec = live["step"], live["state"], live["batch"], live["rec"]
    rec["loadavg"] = (min(live["load"]), max(live["load"]))
    inner, inner_args = _inner(step, state, batch)
    if args.overhead_plan == rec["name"]:
        rec["traced_s"], rec["untraced_s"] = _overhead(inner, state, batch, f"{tmp}/ovh.json")
    exe = inner.executable
    rec["measured_steps"] = list(live["measured"].steps)
    plan = inner.lower(*inner_args)  # the same plan, with each program's cost analysis
    assert [str(p.name) for p in plan.programs] == [str(p.name) for p in exe.plan.programs]
    # what step.profile() does, keeping the log for the isolated times; a held-out
    # plan's profile is kept apart ("oracle") and used by the oracle variant only
    profile = live["profile"].steps
    rec["profile_steps"] = list(profile)  # to redo the isolation for other core counts
    if rec["set"] == "cal":
        rec["profiled"] = program_times(profile)
        rec["opcodes"] = opcode_overheads(profile)
        rec["isolated"] = isolated_program_times(profile, plan, os.cpu_count() or 1)
    else:
        rec["oracle"] = program_times(profile)
    fn, abstract, batch_argnums = exe._compile_args
    traced = trace_step(
        fn, abstract, batch_argnums=batch_argnums, num_micro_batches=plan.num_micro_batches
    )
    rec["collectives"] = program_collectives(plan, traced)
    rec["plan"] = plan
    step.release() if getattr(step, "_two_bw", None) is None else _release_2bw(step)
    return rec


def _release_2bw(step):
    step._two_bw.first.release()
    step._two_bw.steady.release()


def _collective_s(rec, cluster):
    from meshshard.sim.fidelity import collective_seconds

    plan = rec["plan"]
    shapes = {m.id: m.shape for m in plan.meshes}
    mesh_of = {str(p.name): p.mesh for p in plan.programs}
    return {
        name: collective_seconds(colls, shapes[mesh_of[name]], cluster)
        for name, colls in rec["collectives"].items()
    }


def isolated_for(records, cores: int) -> list:
    """``records`` with each plan's isolated program times redone for ``cores`` shared
    cores from its kept profile steps (records without them, as in older pickles, keep
    the times isolated for the measuring machine's count): with one core per device
    (``isolated``), and with the cores each program kept busy by its CPU time
    (``demands``, ``isolated_cpu``; empty for profiles recorded before CPU times).  A
    held-out plan's are kept under ``oracle_`` keys (oracle variants only)."""
    from meshshard.sim.fidelity import isolated_program_times, program_demands

    out = []
    for r in records:
        if "profile_steps" in r:
            steps, plan = r["profile_steps"], r["plan"]
            demands = program_demands(steps, plan, cores)
            pre = "" if r["set"] == "cal" else "oracle_"
            r = {
                **r,
                f"{pre}isolated": isolated_program_times(steps, plan, cores),
                f"{pre}demands": demands,
                f"{pre}isolated_cpu": isolated_program_times(steps, plan, cores, demands),
            }
        out.append(r)
    return out


def demand_classes(plan) -> dict[str, tuple]:
    """What each program's core demand is predicted from for an unprofiled plan: its
    devices per host, whether its work is split over them or replicated, and whether
    it is an optimizer update."""
    from meshshard.sim.fidelity import devices_per_host, work_devices

    devices = devices_per_host(plan)
    return {
        str(p.name): (
            devices[str(p.name)],
            work_devices(plan, p) > 1,
            str(p.name).endswith("apply"),
        )
        for p in plan.programs
    }


def fit_demands(cal) -> dict:
    """Median measured demand of the calibration programs of each of
    :func:`demand_classes`."""
    samples: dict[tuple, list[float]] = {}
    for r in cal:
        measured = r.get("demands", {})
        for name, cls in demand_classes(r["plan"]).items():
            if name in measured:
                samples.setdefault(cls, []).append(measured[name])
    return {k: statistics.median(v) for k, v in sorted(samples.items())}


def predicted_demands(plan, classes) -> dict[str, float]:
    """Each program's demand from its class's calibrated median (none: one per device)."""
    return {name: classes[cls] for name, cls in demand_classes(plan).items() if cls in classes}


def fit(records, cluster):
    """Host overheads and calibrated rooflines (in-situ and isolated) from the calibration set."""
    from meshshard.sim.fidelity import (
        CalibratedRoofline,
        dispatch_overhead,
        fit_dispatch,
        sample_of,
        zeros_tensors,
    )

    cal = [r for r in records if r["set"] == "cal"]
    ops = sorted({op for r in cal for op in r["opcodes"]})
    opcodes = {
        op: statistics.median(r["opcodes"][op] for r in cal if op in r["opcodes"]) for op in ops
    }
    per_tensor = [
        r["opcodes"]["ZEROS"] / zeros_tensors(r["plan"]) for r in cal if "ZEROS" in r["opcodes"]
    ]
    opcodes["ZEROS"] = statistics.median(per_tensor) if per_tensor else 0.0  # per tensor
    dispatch = [(len(r["plan"].workers), dispatch_overhead(r["measured_steps"])) for r in cal]
    overheads = (opcodes, fit_dispatch(dispatch), fit_demands(cal))
    fits = {}
    for variant, key in (
        ("in-situ", "profiled"),
        ("cores", "isolated"),
        ("cores cpu", "isolated_cpu"),
    ):
        if not all(key in r for r in cal):
            continue
        samples = []
        for r in cal:
            coll = _collective_s(r, cluster)
            for p in r["plan"].programs_run():  # a fused pair's F and B never run
                n = str(p.name)
                samples.append(sample_of(r["plan"], p, coll[n], r[key][n]))
        fits[variant] = CalibratedRoofline.fit(samples)
    return overheads, fits


def _host(cluster, overheads, plan):
    """``cluster`` with the fitted host overheads: the dispatch for ``plan``'s workers,
    ZEROS for its accumulators' tensors."""
    from meshshard.sim.fidelity import zeros_tensors

    d0, d1 = overheads[1]
    dispatch = d0 + d1 * len(plan.workers)
    ops = dict(overheads[0])
    ops["ZEROS"] = ops.get("ZEROS", 0.0) * zeros_tensors(plan)  # fitted per tensor
    return replace(cluster, opcode_overheads=ops, dispatch_overhead=dispatch)


VARIANTS = (
    "in-situ",
    "cores",
    "cores cpu",
    "local roofline",
    "oracle",
    "oracle cores",
    "oracle cores cpu",
)


def predict(rec, cluster, overheads, fits, cores=None, variants=VARIANTS):
    """Predicted step seconds per model variant (``cores``: the cores the ``cores``
    variant shares, default this machine's)."""
    from meshshard.sim import SimOptions, simulate

    plan = rec["plan"]
    out = {}
    if "local roofline" in variants:
        out["local roofline"] = simulate(plan, replace(cluster, host_cores=0)).iteration_time
    host = _host(cluster, overheads, plan)
    coll = _collective_s(rec, cluster)
    n = cores or os.cpu_count()
    # (variant, program times from the first of these record keys, cores shared, whether
    # the calibrated roofline and demand classes stand in when the record has none, the
    # record keys of measured core demands: none = one core per device).  The oracles
    # take each plan's own profile (held-out plans' under their own keys): the host
    # model's error.
    table = (
        ("in-situ", ("profiled",), 0, True, None),
        ("cores", ("isolated",), n, True, None),
        ("cores cpu", ("isolated_cpu",), n, True, ("demands",)),
        ("oracle", ("profiled", "oracle"), 0, False, None),
        ("oracle cores", ("isolated", "oracle_isolated"), n, False, None),
        ("oracle cores cpu", ("isolated_cpu", "oracle_isolated_cpu"), n, False, ("demands", "oracle_demands")),
    )  # fmt: skip
    for variant, keys, shared, fitted, demand_keys in table:
        if variant not in variants:
            continue
        times = next((rec[k] for k in keys if rec.get(k)), None)
        if times is None and fitted and variant in fits:
            times = fits[variant].program_times(plan, coll)
        demands = None
        if demand_keys:
            demands = next((rec[k] for k in demand_keys if rec.get(k)), None)
            if demands is None and fitted:
                demands = predicted_demands(plan, overheads[2])
        opts = SimOptions(core_demands=tuple(sorted((demands or {}).items())))
        out[variant] = (
            simulate(
                plan, replace(host, host_cores=shared), program_times=times, options=opts
            ).iteration_time
            if times
            else float("nan")
        )
    return out


def split(rec, cluster, overheads):
    """Where the step's time goes, measured (recorded steps, medians) vs predicted: the
    driver's own dispatch and the workers' span (first instruction to last)."""
    from meshshard.sim.fidelity import dispatch_overhead

    steps = rec["measured_steps"]
    workers = statistics.median(
        next(b - a for n, a, b in step.driver if n == "workers") / 1e9 for _, step in steps
    )
    return dict(
        measured_dispatch_s=dispatch_overhead(steps),
        measured_workers_s=workers,
        predicted_dispatch_s=_host(cluster, overheads, rec["plan"]).dispatch_overhead,
    )


def fit_cores(records, cluster, choices=(1, 2, 3, 4)):
    """The cores the ``cores`` variant shares, fitted on the calibration set, and the
    records and fit made with it: for each count the isolated program times are redone for that many
    cores and the roofline refitted, and the count with the least median error on the
    calibration plans wins (a loaded machine leaves a run fewer cores than it has, and a
    small program may keep fewer cores busy than its mesh has devices)."""

    def err(n):
        redone = isolated_for(records, n)
        overheads, fits = fit(redone, cluster)
        ratios = [
            predict(r, cluster, overheads, fits, n, ("cores",))["cores"]
            / statistics.median(r["times"])
            for r in redone
            if r["set"] == "cal"
        ]
        return statistics.median(abs(x - 1) for x in ratios), redone, overheads, fits

    scored = {n: err(n) for n in choices}
    best = min(choices, key=lambda n: scored[n][0])
    return (best, *scored[best][1:])


def residuals(records, cluster, fits) -> dict:
    """For each roofline variant, the median of (roofline prediction / isolated time)
    over the programs of each group of plans (model, mesh shape, M=8) and program kind
    (F, B, W, apply): where the calibrated roofline misses a held-out plan's programs
    (their own profiles, ``oracle_`` keys; the calibration plans' from their fit)."""
    from meshshard.sim.fidelity import sample_of

    out: dict = {}
    for variant, key in (("cores", "isolated"), ("cores cpu", "isolated_cpu")):
        if variant not in fits:
            continue
        groups: dict[str, list[float]] = {}
        for r in records:
            times = r.get(key if r["set"] == "cal" else f"oracle_{key}")
            if not times:
                continue
            coll = _collective_s(r, cluster)
            mesh = "(2,2)" if "(2,2)" in r["name"] else "(1,2)"
            group = f"{r.get('model', r['name'][0])} {mesh}{' dp' if ' dp ' in r['name'] else ''}"
            group += " M=8" if r["name"].endswith("M=8") else ""
            for p in r["plan"].programs_run():  # a fused pair's F and B never run
                n = str(p.name)
                kind = n.split(".")[-1].rstrip("0123456789") if "." in n else n
                sample = sample_of(r["plan"], p, coll[n], times[n])
                ratio = fits[variant].seconds(sample) / sample.seconds
                groups.setdefault(f"{group:<14} {kind}", []).append(ratio)
        out[variant] = {g: (statistics.median(v), len(v)) for g, v in sorted(groups.items())}
    return out


def side_by_side(rec, cluster, overheads, fits, path):
    """Measured (last traced step) and predicted (in-situ model) timelines in one file."""
    from meshshard.runtime.trace_record import measured_trace
    from meshshard.sim import simulate

    plan = rec["plan"]
    measured = measured_trace(rec["measured_steps"][-1:])
    host = _host(cluster, overheads, plan)
    times = rec.get("profiled") or fits["in-situ"].program_times(plan, _collective_s(rec, cluster))
    predicted = simulate(plan, host, program_times=times).to_chrome_trace()
    for e in predicted["traceEvents"]:
        e["pid"] = e.get("pid", 0) + 100
        if e.get("name") == "process_name":
            e["args"]["name"] += " (predicted)"
    events = measured["traceEvents"] + predicted["traceEvents"]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def report(records, preds, variant, stat=statistics.median):
    """Per-set error summaries of one model variant against ``stat`` of each plan's
    timed steps (the median; ``min``: the fastest step, what a loaded machine disturbs
    least, since interference only adds time)."""
    out = {}
    for kind in ("cal", "held-out"):
        errs = [
            abs(p[variant] / stat(r["times"]) - 1)
            for r, p in zip(records, preds, strict=True)
            if r["set"] == kind
        ]
        if not errs:
            continue
        out[kind] = dict(median_abs_err=statistics.median(errs), worst_abs_err=max(errs))
    return out


def measure_all(plans, args, tmp):
    """Measure every plan on a fresh local Ray cluster (shut down after).  Plans that
    share a mesh layout are compiled together and measured in ``--rounds`` interleaved
    rounds, so a drift of this VM's speed during the run spreads over all of them
    instead of landing on whichever plan ran then; with ``--save``, the records so far
    are pickled after each layout group."""
    meshshard.init()
    records = []
    try:
        groups = [list(g) for _, g in itertools.groupby(plans, key=lambda p: _layout(p[3]))]
        per_round = -(-args.steps // args.rounds)
        for group in groups:
            live = []
            for name, kind, model_key, method in group:
                try:
                    live.append(compile_plan(name, kind, model_key, method))
                except Exception as e:  # one broken plan must not lose the others
                    print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
            for i in range(args.rounds):
                t0 = time.perf_counter()
                for x in live:
                    measure_round(x, per_round)
                print(
                    f"round {i + 1}/{args.rounds} of {len(live)} plans in "
                    f"{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            for x in live:
                r = finish_plan(x, args, tmp)
                x.clear()  # drop its state before the next group regroups the actors
                records.append(r)
                rounds = ", ".join(f"{m * 1e3:.0f}" for m in r["round_medians"])
                print(
                    f"measured {r['name']}: median {statistics.median(r['times']) * 1e3:.1f} ms"
                    f" (rounds {rounds}), load {r['loadavg'][0]:.1f}-{r['loadavg'][1]:.1f}",
                    flush=True,
                )
            if args.save:
                with open(args.save, "wb") as f:
                    pickle.dump(records, f)
    finally:
        meshshard.shutdown()
    return records


def ranking(records, preds, variant, alpha=0.05):
    """The RANKED schedules fastest first, measured and predicted; Kendall's tau; and the
    pairs the measurement separates (their timed steps differ by a two-sided
    Mann-Whitney test at ``alpha``) with how many of them the prediction orders alike.
    Schedules whose steps the measurement cannot tell apart have no measured order for
    a prediction to match (they swap between runs on this machine)."""
    from scipy.stats import kendalltau, mannwhitneyu

    rows = [
        (r["name"], r["times"], p[variant])
        for r, p in zip(records, preds, strict=True)
        if r["name"] in RANKED
    ]
    if len(rows) < 2:
        return None
    short = {n: n.split()[2] for n, _, _ in rows}
    med = {n: statistics.median(t) for n, t, _ in rows}
    measured = [short[n] for n, _, _ in sorted(rows, key=lambda x: med[x[0]])]
    predicted = [short[n] for n, _, _ in sorted(rows, key=lambda x: x[2])]
    tau = kendalltau([med[n] for n, _, _ in rows], [p for _, _, p in rows]).statistic
    separated, agree = [], 0
    for i, (a, ta, pa) in enumerate(rows):
        for b, tb, pb in rows[i + 1 :]:
            if mannwhitneyu(ta, tb).pvalue < alpha:
                faster, slower = (a, b) if med[a] < med[b] else (b, a)
                separated.append(f"{short[faster]} < {short[slower]}")
                agree += (pa < pb) == (med[a] < med[b])
    return dict(
        measured=measured,
        predicted=predicted,
        tau=float(tau),
        separated_pairs=separated,
        separated_agree=agree,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds the timed steps are split into (1: each plan's steps in one block)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default="fidelity_trace.json")
    ap.add_argument("--save", default=None, help="pickle the measurements here")
    ap.add_argument("--load", default=None, help="predict from pickled measurements")
    ap.add_argument("--quick", action="store_true", help=f"plans {QUICK} only")
    ap.add_argument("--only", type=int, default=None, help="first N plans (quick check)")
    ap.add_argument("--select", default=None, help="comma-separated plan indices to run")
    ap.add_argument(
        "--residuals",
        action="store_true",
        help="print the calibrated rooflines' misses per plan group and program kind",
    )
    ap.add_argument("--overhead-plan", default=PLANS[1][0])
    ap.add_argument(
        "--cal-models",
        default="A,C",
        help="models whose calibration plans the fit uses (the others are left out of "
        "the report too): 'A' is the one-size calibration of earlier runs",
    )
    ap.add_argument(
        "--fit-cores",
        action="store_true",
        help="fit the cores the 'cores' model shares on the calibration set (1-4) "
        "instead of using this machine's count",
    )
    args = ap.parse_args(argv)
    import tempfile

    tmp = tempfile.mkdtemp(prefix="meshshard-fidelity-")
    plans = PLANS[: args.only] if args.only else PLANS
    if args.quick:
        plans = [PLANS[i] for i in QUICK]
    if args.select:
        plans = [PLANS[int(i)] for i in args.select.split(",")]
    if args.load:
        with open(args.load, "rb") as f:
            records = pickle.load(f)
    else:
        records = measure_all(plans, args, tmp)
    cal_models = set(args.cal_models.split(","))
    records = [
        r for r in records if r["set"] != "cal" or r.get("model", r["name"][0]) in cal_models
    ]
    cluster = replace(meshshard.ClusterSpec.preset("local"), num_hosts=4)
    if args.fit_cores:
        cores, records, overheads, fits = fit_cores(records, cluster)
        print(f"cores shared, fitted on the calibration set: {cores}")
    else:  # what the local clusters declare (ClusterSpec.host_cores): a fact, not a fit
        cores = os.cpu_count() or 1
        records = isolated_for(records, cores)
        overheads, fits = fit(records, cluster)
        print(f"cores shared: {cores} (this machine's)")
    preds = [predict(r, cluster, overheads, fits, cores) for r in records]
    for r in records:
        r["split"] = split(r, cluster, overheads)
    side_by_side(records[1], cluster, overheads, fits, args.trace)
    _print(records, preds, overheads, fits)
    if args.residuals:
        for variant, groups in residuals(records, cluster, fits).items():
            print(f"\nroofline ({variant}) / isolated program time, median per group:")
            for g, (ratio, n) in groups.items():
                print(f"  {g:<22} {ratio:5.2f}  ({n} programs)")
    if args.json:
        _write_json(args.json, records, preds, overheads, fits, args)
    return 0


def _print(records, preds, overheads, fits):
    per_op = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in overheads[0].items())
    per_op = per_op.replace("ZEROS", "ZEROS (per tensor)")
    d0, d1 = (x * 1e3 for x in overheads[1])
    print(f"\nhost ms per instruction: {per_op}; driver {d0:.2f} + {d1:.2f} ms/worker per step")
    for v, f in fits.items():
        print(f"{v}: {f}")
    if overheads[2]:
        classes = ", ".join(
            f"{d}/host {'split' if sp else 'replicated'}{' apply' if ap else ''} {x:.2f}"
            for (d, sp, ap), x in overheads[2].items()
        )
        print(
            f"cores each program keeps busy (calibrated, by devices per host and work): {classes}"
        )
    head = f"{'plan':<31} {'set':<9} {'load':>9} {'measured ms':>11} {'fastest':>7} "
    print(head + " ".join(f"{v:>15}" for v in VARIANTS))
    for r, p in zip(records, preds, strict=True):
        m = statistics.median(r["times"])
        cells = " ".join(f"{p[v] * 1e3:7.1f} ({p[v] / m:4.2f})" for v in VARIANTS)
        load = "{:.0f}-{:.0f}".format(*r["loadavg"])
        fast = min(r["times"]) * 1e3
        print(f"{r['name']:<31} {r['set']:<9} {load:>9} {m * 1e3:>11.1f} {fast:>7.1f} {cells}")
    for v in VARIANTS:
        s = report(records, preds, v)
        fastest = report(records, preds, v, min)
        for label, summary in (("median step", s), ("fastest step", fastest)):
            cells = "; ".join(
                f"{kind}: median {e['median_abs_err']:.1%} worst {e['worst_abs_err']:.1%}"
                for kind, e in summary.items()
            )
            print(f"{v:<15} vs {label:<12} {cells}")
    print("\nwhere the time goes (ms): measured dispatch / workers span; predicted dispatch")
    for r in records:
        x = {k: v * 1e3 for k, v in r["split"].items()}
        print(
            f"{r['name']:<31} {x['measured_dispatch_s']:7.1f} / {x['measured_workers_s']:7.1f}"
            f"; {x['predicted_dispatch_s']:7.1f}"
        )
    for v in VARIANTS:
        rank = ranking(records, preds, v)
        if rank:
            print(f"ranking ({v}): measured {rank['measured']}")
            print(
                f"{'':>{len(v) + 11}}predicted {rank['predicted']} (Kendall tau {rank['tau']:.2f})"
            )
            print(
                f"{'':>{len(v) + 11}}pairs the measurement separates (Mann-Whitney p < 0.05): "
                f"{rank['separated_agree']} of {len(rank['separated_pairs'])} ordered alike "
                f"{rank['separated_pairs']}"
            )
    for r in records:
        if "traced_s" in r:
            ovh = r["traced_s"] / r["untraced_s"] - 1
            print(
                f"recording overhead on {r['name']}: {ovh:+.1%} "
                f"({r['traced_s'] * 1e3:.1f} vs {r['untraced_s'] * 1e3:.1f} ms median)"
            )


def _write_json(path, records, preds, overheads, fits, args):
    rows = []
    for r, p in zip(records, preds, strict=True):
        m = statistics.median(r["times"])
        row = dict(plan=r["name"], set=r["set"], measured_s=m, times_s=r["times"])
        row["loadavg_1min_before_after"] = r["loadavg"]
        row.update(r.get("split", {}))
        row.update({f"predicted_{v}_s": p[v] for v in VARIANTS})
        row.update({f"ratio_{v}": p[v] / m for v in VARIANTS})
        for k in ("traced_s", "untraced_s"):
            if k in r:
                row[k] = r[k]
        rows.append(row)
    out = dict(
        steps=args.steps,
        cpu_count=os.cpu_count(),
        opcode_overheads_s=overheads[0],
        dispatch_overhead_s_plus_per_worker=overheads[1],
        core_demands_by_class=[
            dict(devices_per_host=d, split=sp, apply=ap, demand=x)
            for (d, sp, ap), x in overheads[2].items()
        ],
        fits={v: dict(coef=f.coef, samples=f.samples) for v, f in fits.items()},
        summary={v: report(records, preds, v) for v in VARIANTS},
        summary_vs_fastest_step={v: report(records, preds, v, min) for v in VARIANTS},
        ranking={v: ranking(records, preds, v) for v in VARIANTS},
        plans=rows,
    )
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
