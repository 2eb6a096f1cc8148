"""Measured timelines (runtime/trace_record.py): one span per executed instruction,
clocks aligned and monotone per worker, on threads and on Ray host-actors."""

import json

import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.bench import run_script
from meshshard.errors import MeshshardInputError
from meshshard.runtime.trace_record import (
    DRIVER_PID,
    Recorder,
    RecordingTransport,
    StepTrace,
    WorkerTrace,
    measured_trace,
    span_name,
)
from meshshard.runtime.transport import QueueTransport
from tests.test_sim_fidelity import check_recorded_interleaving

METHOD = dict(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="1f1b")


def _run(tmp_path, steps=3):
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    path = tmp_path / "measured.json"
    step = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(**METHOD), trace=str(path)
    )
    for _ in range(steps):
        state, _ = step(state, batch)
    step.write_trace()
    return step, json.loads(path.read_text())


def _check_trace(step, trace, steps, slack_us=0.0):
    """One host span per instruction per step, monotone per worker, inside the driver's
    ``workers`` span of its step (up to ``slack_us`` of clock-alignment error)."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    driver = {
        e["args"]["step"]: e for e in spans if e["pid"] == DRIVER_PID and e["name"] == "workers"
    }
    assert sorted(driver) == list(range(steps))
    for stream in step.plan.streams:
        host = [e for e in spans if e["pid"] == stream.worker and e["tid"] == 0]
        names = [e["name"] for e in host]
        expected = [span_name(ins) for ins in stream.instructions]
        assert names == expected * steps
        ends = 0.0
        for e in host:  # a worker runs one instruction at a time: spans never go back
            assert e["ts"] >= ends - 1e-3 and e["dur"] >= 0
            ends = e["ts"] + e["dur"]
            d = driver[e["args"]["step"]]
            assert d["ts"] - slack_us <= e["ts"] and ends <= d["ts"] + d["dur"] + slack_us
        comm = [e for e in spans if e["pid"] == stream.worker and e["tid"] > 0]
        n_comm = sum(1 for ins in stream.instructions if ins.is_comm)
        assert len(comm) == n_comm * steps


def test_recorder_stamps_issue_and_completion_of_each_message():
    a, b = QueueTransport.group([0, 1]).values()
    rec = Recorder(3)
    ta = RecordingTransport(a, rec)
    assert ta.rank == 0  # everything else is the wrapped transport's
    rec.current = 1
    h = ta.isend(np.arange(3, dtype=np.uint8), 1, 7)
    assert rec.done == [0, 0, 0]
    h.wait()
    assert rec.done[0] == 0 and rec.done[1] > 0 and rec.done[2] == 0
    assert list(b.irecv(3, 0, 7).wait()) == [0, 1, 2]


def test_measured_trace_moves_worker_clocks_onto_the_driver_clock():
    from meshshard.instructions import Free, Run, WorkerStream

    stream = WorkerStream(
        worker=0, instructions=(Run(program="s0.F", mb=0, inputs=(), outputs=()), Free(buffer="A0"))
    )
    wt = WorkerTrace(0, (5_000, 7_000), (6_000, 8_000), (0, 0))
    step = StepTrace((("workers", 1_000, 4_000),), (wt,), offsets=((0, 4_000),))
    events = [e for e in measured_trace([([stream], step)])["traceEvents"] if e["ph"] == "X"]
    host = [(e["name"], e["ts"], e["dur"]) for e in events if e["pid"] == 0]
    assert host == [("s0.F mb0", 0.0, 1.0), ("FREE A0", 2.0, 1.0)]


def test_dispatch_counts_programs_still_running_after_the_last_dispatch_as_worker_time():
    """A worker's last instruction may end (asynchronous dispatch) long before its step
    finishes; the driver's dispatch is what is outside the worker's stamped finish."""
    from meshshard.sim.fidelity import dispatch_overhead

    driver = (("prepare", 0, 1_000_000), ("workers", 1_000_000, 101_000_000))
    early = WorkerTrace(0, (2_000_000, 3_000_000), (3_000_000, 20_000_000), (0, 0))
    assert early.busy_ns == 18_000_000  # finish unknown: the last instruction's end
    finished = WorkerTrace(0, early.start, early.end, early.done, finish=99_000_000)
    assert finished.busy_ns == 97_000_000
    assert dispatch_overhead([([], StepTrace(driver, (early,)))]) == pytest.approx(0.083)
    assert dispatch_overhead([([], StepTrace(driver, (finished,)))]) == pytest.approx(0.004)


def test_trace_must_be_a_path():
    with pytest.raises(MeshshardInputError, match=r"trace must be a file path.*trace='"):
        meshshard.parallelize(mlp.train_step, trace=3)


@pytest.mark.slow
def test_threads_bench_trace_and_simulated_interleaving(threads_cluster, tmp_path):
    """``meshshard bench``'s runner on threads records the timed steps, one span per
    instruction; then the simulator, given the step's measured program times,
    reproduces its recorded interleaving (tests/test_sim_fidelity.py; one compile)."""
    script = tmp_path / "step.py"
    script.write_text(
        "import meshshard\nfrom examples import mlp\n"
        "def setup():\n"
        "    model = mlp.MLP(num_layers=4, hidden=256)\n"
        "    batch = mlp.make_batch(batch_size=256)\n"
        "    state = mlp.make_state(model, batch['x'])\n"
        f"    method = meshshard.PipeshardParallel(**{METHOD!r})\n"
        "    return meshshard.parallelize(mlp.train_step, method=method), (state, batch)\n"
    )
    out = tmp_path / "bench.json"
    result, step = run_script(str(script), steps=3, warmup=1, trace=str(out))
    assert len(result.times) == 3
    trace = json.loads(out.read_text())
    assert trace["otherData"]["steps"] == 3
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, DRIVER_PID}
    _check_trace(step, trace, steps=3)
    step.record(None)
    model = mlp.MLP(num_layers=4, hidden=256)
    batch = mlp.make_batch(batch_size=256)
    check_recorded_interleaving(step, (mlp.make_state(model, batch["x"]), batch))


@pytest.mark.ray
def test_ray_trace_aligns_worker_clocks(ray_cluster, tmp_path):
    step, trace = _run(tmp_path, steps=2)
    exe = step.executable
    rtt_us = max(exe.clock_rtts.values()) / 1e3
    # one machine: the monotonic clock is shared, so the ping estimate is ~0
    for _, offset in exe._offsets:
        assert abs(offset) / 1e3 <= rtt_us
    _check_trace(step, trace, steps=2, slack_us=rtt_us)
    # each worker stamped when its step call finished, after its last instruction,
    # and the trace marks it
    assert len(exe.trace_log.steps) == 2
    for _, recorded in exe.trace_log.steps:
        assert all(wt.finish >= max(wt.end) > 0 for wt in recorded.workers)
    ready = [e for e in trace["traceEvents"] if e["name"] == "outputs ready"]
    assert sorted((e["pid"], e["args"]["step"]) for e in ready) == sorted(
        (w, n) for w in exe.plan.workers for n in range(2)
    )
    step.record(None)
    _check_profile_demands(step)  # the same compiled step, profiled


def _profiled_mlp():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    step = meshshard.parallelize(mlp.train_step, method=PipeshardParallel(**METHOD))
    return step, (mlp.make_state(model, batch["x"]), batch)


def _check_profile_demands(step) -> None:
    """``step.profile_demands`` on the Ray backend (``step`` compiled for ``_run``'s
    arguments): the cores each program keeps busy, between 1 and its devices per host."""
    from dataclasses import replace

    from meshshard.sim import SimOptions, simulate

    args = _profiled_mlp()[1]
    times, demands = step.profile_demands(*args, steps=3, cores=2)
    names = {str(p.name) for p in step.plan.programs_run()}
    assert set(times) == set(demands) == names
    assert all(t > 0 for t in times.values())
    assert all(1.0 <= d <= 2.0 for d in demands.values())  # (1, 2) meshes: 2 threads at most
    # the simulator takes them; fewer busy cores than devices can only shorten the step
    cluster = replace(step.plan.cluster, host_cores=2)
    opts = SimOptions(core_demands=tuple(demands.items()))
    measured = simulate(step.plan, cluster, program_times=times, options=opts).iteration_time
    per_device = simulate(step.plan, cluster, program_times=times).iteration_time
    assert 0 < measured <= per_device * (1 + 1e-9)


@pytest.mark.fast
def test_profile_demands_refuses_workers_that_share_one_process():
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    with use_cluster(ThreadsCluster(2, 2)):
        step, args = _profiled_mlp()
        with pytest.raises(MeshshardInputError, match="one process per worker"):
            step.profile_demands(*args, cores=2)
        with pytest.raises(MeshshardInputError, match="cores=0.*os.cpu_count"):
            step.profile_demands(*args, cores=0)
