"""The simulator's host model (issue 10): shared CPU cores, runtime and driver overheads."""

from dataclasses import replace

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Run
from meshshard.sim import simulate
from meshshard.sim.synthetic import synthetic_pipeline

TIMES = {"s0.F": 1.0, "s1.F": 1.0, "s0.B": 2.0, "s1.B": 2.0}


def _plan(mesh_shape=(1, 1)):
    return synthetic_pipeline(2, 4, schedule="1f1b", mesh_shape=mesh_shape)


def _iteration(plan, **fields):
    cluster = replace(plan.cluster, **fields)
    return simulate(plan, cluster, program_times=TIMES).iteration_time


def test_programs_sharing_one_core_take_their_summed_work():
    plan = _plan()
    free = _iteration(plan)
    assert free == pytest.approx(15.0, abs=0.01)  # (M + S - 1) * (F + B)
    # one core: both stages' 4 x (1 + 2) s of work run one after the other, at best
    shared = _iteration(plan, host_cores=1)
    assert 24.0 <= shared <= 24.0 + 0.01 + (free - 15.0)
    assert _iteration(plan, host_cores=2) == pytest.approx(free)  # enough cores: no effect


def test_a_program_demands_one_core_per_device_of_its_mesh():
    plan = _plan(mesh_shape=(1, 2))
    # each stage keeps 2 cores busy: on 2 cores the stages share as on 1 core above
    assert _iteration(plan, host_cores=2) >= 24.0
    assert _iteration(plan, host_cores=4) == pytest.approx(_iteration(plan), rel=1e-9)


def test_runtime_and_driver_overheads_add_host_time():
    plan = _plan()
    base = _iteration(plan)
    assert _iteration(plan, dispatch_overhead=0.5) == pytest.approx(base + 0.5)
    per_ins = _iteration(plan, instruction_overhead=0.01)
    assert base + 0.01 < per_ins < base + 0.01 * sum(len(s.instructions) for s in plan.streams)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("host_cores", -1, r"host_cores must be an int >= 0.*host_cores=os.cpu_count\(\)"),
        ("instruction_overhead", -1e-6, r"instruction_overhead must be a number of seconds"),
        ("dispatch_overhead", "1ms", r"dispatch_overhead must be a number of seconds"),
    ],
)
def test_host_fields_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**{field: value})


def check_recorded_interleaving(step, args) -> None:
    """Record 4 steps of a compiled 2-stage ``step`` (every RUN waiting for its outputs)
    and feed their program and host times to the simulator: the simulated order of
    programs across the two workers is the recorded one (each RUN's median over the 4
    steps; pairs closer than half a program are not judged).  Run by
    tests/test_trace_record.py on the step its bench test compiled (one compile)."""
    from meshshard.runtime.trace_record import TraceLog
    from meshshard.sim.fidelity import order_disagreements

    exe = step._executable_for(args)  # the compiled version these arguments run
    for attempt in range(2):  # a second recording when another process stole the cores
        log = TraceLog("unused.json", keep=4)
        exe.record(log, sync=True)
        for _ in range(4):
            step(*args)
        exe.record(None)
        found = _recorded_order_check(exe, log)
        if not found[0] or attempt == 1:
            break
    disagreements, exe_plan, cluster, times, measured, margin, simulated = found
    _assert_cpu_per_run(log.steps)
    assert disagreements == [], [
        (k, "simulated", simulated[k], "measured", measured[k])
        for pair in disagreements
        for k in pair
    ]
    # the check has teeth: the same programs run as GPipe (every forward first) order
    # differently.  (A slower stage would not do: a 2-stage 1F1B's order across workers
    # is fixed by its dependencies.)
    gpipe = synthetic_pipeline(
        2, exe_plan.num_micro_batches, schedule="gpipe", mesh_shape=exe_plan.meshes[0].shape
    )
    wrong = simulate(gpipe, cluster, program_times={**TIMES, **times})
    spans = {
        (int(s.track[1:]), s.name): (s.start, s.end) for s in wrong.spans if s.category == "run"
    }
    assert order_disagreements(spans, measured, margin)


def _assert_cpu_per_run(steps) -> None:
    """A profiled (sync) recording holds a CPU time for every RUN, and for nothing else."""
    from meshshard.instructions import Run

    for streams, step in steps:
        by_worker = {s.worker: s for s in streams}
        for wt in step.workers:
            kinds = [isinstance(i, Run) for i in by_worker[wt.worker].instructions]
            assert any(kinds) and len(wt.cpu) == len(kinds)
            assert all((c > 0) == run for c, run in zip(wt.cpu, kinds, strict=True))


def _recorded_order_check(exe, log):
    """(disagreements, plan, cluster, program times, measured spans, margin) of one
    recording against the simulator given its measured program and host times."""
    import statistics

    from meshshard.sim.fidelity import (
        opcode_overheads,
        order_disagreements,
        program_times,
        run_spans,
    )

    times = program_times(log.steps)
    cluster = replace(exe.plan.cluster, opcode_overheads=opcode_overheads(log.steps))
    sim = simulate(exe.plan, cluster, program_times=times)
    simulated = {
        (int(s.track[1:]), s.name): (s.start, s.end) for s in sim.spans if s.category == "run"
    }
    per_step = [run_spans(log.steps, n) for n in range(len(log.steps))]
    measured = {
        k: tuple(
            statistics.median(spans[k][i] - min(s for s, _ in spans.values()) for spans in per_step)
            for i in (0, 1)
        )
        for k in per_step[0]
    }
    runs = sum(isinstance(i, Run) for s in exe.plan.streams for i in s.instructions)
    assert set(simulated) == set(measured) and len(measured) == runs
    margin = statistics.median(times.values()) / 2
    found = order_disagreements(simulated, measured, margin)
    return found, exe.plan, cluster, times, measured, margin, simulated


def test_calibrated_roofline_recovers_known_costs():
    from meshshard.sim.fidelity import CalibratedRoofline, ProgramSample

    # launch, 20 us per op, 5 GFLOP/s, no memory term, fabrics
    truth = (2e-3, 2e-5, 1 / 5e9, 0.0, 3.0, 40.0)
    samples = []
    for i, (ops, flops, d, intra, cross) in enumerate(
        [
            (40, 1e8, 2, 0, 0),
            (90, 4e8, 2, 1e-4, 0),
            (60, 2e9, 4, 0, 5e-4),
            (200, 8e8, 2, 2e-4, 0),
            (120, 3e9, 4, 1e-4, 1e-3),
            (300, 5e8, 2, 0, 0),
        ]
    ):
        feats = [1.0, ops, flops / d, 0.0, intra, cross]
        t = sum(c * f for c, f in zip(truth, feats, strict=True))
        samples.append(ProgramSample(f"p{i}", flops, 0.0, d, (intra, cross), t, ops))
    fit = CalibratedRoofline.fit(samples)
    assert fit.coef == pytest.approx(truth, rel=1e-6, abs=1e-12)
    assert "5 GFLOP/s" in str(fit)


def test_collectives_are_priced_on_the_fabric_they_cross():
    from meshshard.hlo_collectives import Collective
    from meshshard.sim.fidelity import collective_seconds

    cluster = ClusterSpec(
        nic_bandwidth=1e9, nic_latency=1e-4, intra_bandwidth=1e10, intra_latency=0.0
    )
    ar = Collective("all-reduce", "ar", "f32", (250,), 1000, groups=((0, 1), (2, 3)))
    # (2, 2) mesh: devices 0, 1 are host 0: a pair within one host, over memcpy
    assert collective_seconds([ar], (2, 2), cluster) == pytest.approx((2 * 500 / 1e10, 0.0))
    across = Collective("all-reduce", "ar", "f32", (250,), 1000, groups=((0, 2), (1, 3)))
    assert collective_seconds([across], (2, 2), cluster) == pytest.approx(
        (0.0, 2 * (1e-4 + 500 / 1e9))
    )
    # in a loop body of 20 iterations (an RNN's backward over time): 20 times the time
    looped = replace(ar, runs=20)
    assert collective_seconds([looped], (2, 2), cluster) == pytest.approx((40 * 500 / 1e10, 0.0))


@pytest.mark.parametrize("batch_size, split", [(16, 4), (8, 1)])
def test_a_replicated_micro_batch_is_not_divided_over_the_mesh(batch_size, split):
    """4 micro-batches of 4 rows split over a (2, 2) mesh's 4 devices; of 2 rows they
    cannot, and each device runs the whole program: its FLOPs count whole."""
    import meshshard
    from examples import mlp
    from meshshard import PipeshardParallel
    from meshshard.sim.fidelity import sample_of, work_devices

    batch = mlp.make_batch(batch_size)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    method = PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (2, 2)])
    step = meshshard.parallelize(mlp.train_step, method=method)
    plan = step.lower(state, batch, cluster=ClusterSpec("fidelity-4x2", 4, 2))
    forward = next(p for p in plan.programs if str(p.name) == "s0.F")
    assert work_devices(plan, forward) == split
    assert sample_of(plan, forward, (0.0, 0.0)).devices == split


def test_isolated_times_remove_the_sharing_of_cores_between_workers():
    """Two (1, 2)-mesh programs that overlap on 2 cores each ran at half speed: alone
    they take half their recorded span; a program that ran alone keeps its span."""
    from meshshard.instructions import Run
    from meshshard.runtime.trace_record import StepTrace, WorkerTrace
    from meshshard.sim.fidelity import isolated_program_times, program_times

    plan = synthetic_pipeline(2, 1, schedule="gpipe", mesh_shape=(1, 2))
    ms = 1_000_000
    spans = {  # recorded RUN spans (ms): both applies overlap, the rest runs alone
        "s0.F": (0, 2), "s1.F": (2, 4), "s1.B": (4, 8), "s0.B": (8, 10),
        "m0.apply": (10, 14), "m1.apply": (10, 14),
    }  # fmt: skip
    workers = []
    for stream in plan.streams:
        start, end = [], []
        for ins in stream.instructions:
            s, e = spans[str(ins.program)] if isinstance(ins, Run) else (0, 0)
            start.append(1_000 * ms + s * ms if isinstance(ins, Run) else 0)
            end.append(1_000 * ms + e * ms if isinstance(ins, Run) else 0)
        workers.append(WorkerTrace(stream.worker, tuple(start), tuple(end), (0,) * len(start)))
    steps = [(plan.streams, StepTrace((("workers", 0, 2_000 * ms),), tuple(workers)))]
    recorded = program_times(steps)
    alone = isolated_program_times(steps, plan, cores=2)
    assert recorded["m0.apply"] == pytest.approx(4e-3)
    assert alone == pytest.approx({**recorded, "m0.apply": 2e-3, "m1.apply": 2e-3})
    # with 4 cores nothing was shared
    assert isolated_program_times(steps, plan, cores=4) == pytest.approx(recorded)


def test_measured_core_demands_replace_one_core_per_device():
    from meshshard.sim import SimOptions

    plan = _plan(mesh_shape=(1, 2))
    cluster = replace(plan.cluster, host_cores=2)

    def iteration(demand):
        opts = SimOptions(core_demands=tuple((str(p.name), demand) for p in plan.programs))
        return simulate(plan, cluster, program_times=TIMES, options=opts).iteration_time

    # one busy core per program: the two stages fit the 2 cores, as with no sharing
    assert iteration(1.0) == pytest.approx(_iteration(plan), rel=1e-9)
    assert iteration(2.0) == pytest.approx(_iteration(plan, host_cores=2), rel=1e-9)
    assert iteration(1.0) < iteration(1.5) < iteration(2.0)


def test_program_demands_are_cpu_time_over_the_time_alone():
    """A run alone for 2 ms that used 3 ms of CPU kept 1.5 cores busy; one that used more
    than its devices allow is held to them; two overlapping programs that used 3 ms of
    CPU each in 4 ms did not fill 2 cores, so neither slowed the other: one core each."""
    from meshshard.instructions import Run
    from meshshard.runtime.trace_record import StepTrace, WorkerTrace
    from meshshard.sim.fidelity import isolated_program_times, program_demands

    plan = synthetic_pipeline(2, 1, schedule="gpipe", mesh_shape=(1, 2))
    ms = 1_000_000
    spans = {  # (start, end, CPU) in ms; s1.F recorded no CPU time
        "s0.F": (0, 2, 3), "s1.F": (2, 4, 0), "s1.B": (4, 8, 10), "s0.B": (8, 10, 2),
        "m0.apply": (10, 14, 3), "m1.apply": (10, 14, 3),
    }  # fmt: skip
    workers = []
    for stream in plan.streams:
        start, end, cpu = [], [], []
        for ins in stream.instructions:
            s, e, c = spans[str(ins.program)] if isinstance(ins, Run) else (0, 0, 0)
            run = isinstance(ins, Run)
            start.append(1_000 * ms + s * ms if run else 0)
            end.append(1_000 * ms + e * ms if run else 0)
            cpu.append(c * ms)
        zeros = (0,) * len(start)
        workers.append(WorkerTrace(stream.worker, tuple(start), tuple(end), zeros, 0, tuple(cpu)))
    steps = [(plan.streams, StepTrace((("workers", 0, 2_000 * ms),), tuple(workers)))]
    demands = program_demands(steps, plan, cores=2)
    assert demands == pytest.approx(
        {"s0.F": 1.5, "s1.B": 2.0, "s0.B": 1.0, "m0.apply": 1.0, "m1.apply": 1.0}
    )
    # with those demands the overlapping applies did not slow each other down
    alone = isolated_program_times(steps, plan, cores=2, demands=demands)
    assert alone["m0.apply"] == pytest.approx(4e-3)
    assert isolated_program_times(steps, plan, cores=2)["m0.apply"] == pytest.approx(2e-3)
