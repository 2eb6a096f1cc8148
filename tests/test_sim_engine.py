"""The execution model against closed forms: bubbles, overlap, order effects, memory.

Most tests use synthetic plans (meshshard.sim.synthetic) on clusters whose figures
make the expected time a short formula.
"""

import json
import re
from dataclasses import replace

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Free, Recv, Send, Wait, WaitAll, WorkerStream
from meshshard.plan import Plan, ProgramSpec
from meshshard.sim import SimOptions, SimulationDeadlock, simulate
from meshshard.sim.costs import program_cost
from meshshard.sim.synthetic import (
    stage_order,
    synthetic_collective,
    synthetic_exchange,
    synthetic_pipeline,
)
from meshshard.sim.trace import assign_lanes

FREE = ClusterSpec(
    name="free",
    num_hosts=16,
    devices_per_host=1,
    nic_latency=0.0,
    intra_latency=0.0,
    launch_overhead=0.0,
)


def times(S, f=1.0, b=2.0):
    return {f"s{s}.F": f for s in range(S)} | {f"s{s}.B": b for s in range(S)}


def close(a, b, rel=1e-9):
    return a == pytest.approx(b, rel=rel)


# --- pipeline bubbles -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S, M", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_bubble_fraction_with_free_communication(schedule, S, M):
    plan = synthetic_pipeline(S, M, schedule=schedule, activation_bytes=0, cluster=FREE)
    r = simulate(plan, FREE, program_times=times(S))
    assert close(r.iteration_time, (M + S - 1) * 3.0)
    for w in r.workers:
        assert close(w.compute, M * 3.0)
        assert close(w.idle_fraction, (S - 1) / (M + S - 1))


def test_stage_orders():
    assert " ".join(map(str, stage_order("gpipe", 2, 3, 1))) == "F0 F1 F2 B0 B1 B2"
    assert " ".join(map(str, stage_order("1f1b", 4, 4, 1))) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert " ".join(map(str, stage_order("1f1b", 4, 4, 3))) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_schedule_grid_takes_2_m_plus_s_minus_1_ticks():
    plan = synthetic_pipeline(4, 8, schedule="1f1b")
    assert len(plan.schedule.ticks) == 2 * (8 + 4 - 1)


# --- overlap ----------------------------------------------------------------------------


def test_overlap_hides_transfers_that_blocking_runtime_pays_twice():
    # S=2, M=2 GPipe, F=1 s, B=2 s, each transfer tau = alpha + n/B.  Async: the
    # critical path crosses two transfers (9 + 2 tau); blocking sends and receives put
    # four on it (9 + 4 tau).  Derivation in the PR notes of issue 3.
    c = ClusterSpec(
        name="c",
        num_hosts=2,
        devices_per_host=1,
        nic_bandwidth=1e9,
        nic_latency=1e-3,
        launch_overhead=0.0,
    )
    n = 100_000_000
    tau = 1e-3 + n / 1e9
    plan = synthetic_pipeline(2, 2, schedule="gpipe", activation_bytes=n, cluster=c)
    on = simulate(plan, c, program_times=times(2))
    off = simulate(plan, c, overlap=False, program_times=times(2))
    assert close(on.iteration_time, 9 + 2 * tau)
    assert close(off.iteration_time, 9 + 4 * tau)
    assert on.overlap and not off.overlap
    via_options = simulate(plan, c, program_times=times(2), options=SimOptions(overlap=False))
    assert via_options.iteration_time == off.iteration_time


def test_mesh_program_starts_when_all_mesh_workers_reach_it():
    c = ClusterSpec(
        name="c",
        num_hosts=4,
        devices_per_host=1,
        nic_bandwidth=1e9,
        nic_latency=0.0,
        launch_overhead=0.0,
    )
    plan = synthetic_pipeline(2, 1, mesh_shape=(2, 1), activation_bytes=2_000_000, cluster=c)
    # make the message into w3 ten times larger than the one into w2
    t0 = plan.transfer("t0")
    slow = replace(t0.messages[1], nbytes=10_000_000)
    plan = replace(
        plan, transfers=(replace(t0, messages=(t0.messages[0], slow)),) + plan.transfers[1:]
    )
    r = simulate(plan, c, program_times=times(2))
    starts = {s.track: s.start for s in r.spans if s.name == "s1.F mb0"}
    assert starts.keys() == {"w2", "w3"}
    assert close(starts["w2"], 1.0 + 10_000_000 / 1e9)
    assert close(starts["w3"], starts["w2"])


# --- order effects under NCCL-like serial communication (PAPER_NOTES 1.7, case 6) ------


def _case6(order):
    # s0=w0, s1=w1 send to d0=w2, d1=w3, d2=w4; A,D carry 2X and B,C carry X; 6X = 2 GiB
    x = 2**31 // 6
    msgs = {"A": (0, 2, 2 * x), "B": (0, 3, x), "C": (1, 3, x), "D": (1, 4, 2 * x)}
    p38 = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=5)
    plan = synthetic_exchange([msgs[k] for k in order], cluster=p38)
    return x, p38, plan


def test_case6_naive_order_costs_twice_the_lower_bound():
    x, p38, naive = _case6("ABCD")  # d1 receives B before C: C waits behind A and B
    _, _, good = _case6("ACBD")  # d1 receives C first: A || C, then B || D
    serial = SimOptions(serial_comm=True)
    t_naive = simulate(naive, p38, options=serial).iteration_time
    t_good = simulate(good, p38, options=serial).iteration_time
    a, bw = p38.nic_latency, p38.nic_bandwidth
    assert close(t_naive, 4 * a + 6 * x / bw)
    assert close(t_good, 2 * a + 3 * x / bw)
    assert t_naive == pytest.approx(1.71, rel=0.01) and t_good == pytest.approx(0.855, rel=0.01)
    # concurrent (async) sends do not suffer from the order: fair sharing reaches the bound
    assert close(simulate(naive, p38).iteration_time, a + 3 * x / bw)


# --- memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_peak_activations_follow_the_schedule(schedule):
    S, M, P, R = 4, 8, 1 << 20, 4 << 20
    plan = synthetic_pipeline(
        S,
        M,
        schedule=schedule,
        activation_bytes=0,
        batch_bytes=0,
        residual_bytes=R,
        param_bytes=P,
        cluster=FREE,
    )
    r = simulate(plan, FREE, program_times=times(S))
    for s, m in enumerate(r.memory):
        in_flight = M if schedule == "gpipe" else S - s
        parts = dict(m.breakdown)
        assert parts["activations"] == in_flight * R
        assert (parts["params"], parts["optimizer"], parts["grads"]) == (P, 2 * P, P)
        assert m.peak == 4 * P + in_flight * R
        assert m.fits


def test_sent_buffer_lives_until_its_send_completes():
    c = ClusterSpec(name="c", num_hosts=2, devices_per_host=1, nic_bandwidth=1e9, nic_latency=0.0)
    plan = synthetic_exchange([(0, 1, 10**9)], cluster=c)
    r = simulate(plan, c)
    sender = r.memory[0]
    assert sender.peak == 10**9 and close(r.iteration_time, 1.0)
    curve = next(cn for cn in r.counters if cn.track == "w0" and cn.name.startswith("memory"))
    assert curve.samples[-1][0] == pytest.approx(1.0)  # freed when the send finished


# --- costs --------------------------------------------------------------------------------


def test_roofline_costs_by_dtype_and_mesh_size():
    dgx = ClusterSpec.preset("dgx-a100", num_hosts=2)
    plan = synthetic_pipeline(
        2, 1, mesh_shape=(1, 8), forward_flops=8 * 312e12, dtype="bfloat16", cluster=dgx
    )
    cost = program_cost(plan, plan.program("s0.F"), dgx)
    assert close(cost.seconds, 1.0 + dgx.launch_overhead) and cost.bound == "compute"
    mem_bound = ProgramSpec("m0.apply", 0, (), ("P0",), (), flops=1e9, bytes_accessed=8 * 2039e9)
    cost = program_cost(plan, mem_bound, dgx)
    assert close(cost.seconds, 1.0 + dgx.launch_overhead) and cost.bound == "memory"
    assert program_cost(plan, plan.program("s0.F"), dgx, {"s0.F": 0.25}).seconds == 0.25
    r = simulate(plan, dgx, program_times={"nope": 1.0})
    assert any("unknown programs ignored: ['nope']" in n for n in r.notes)
    assert any("m0.apply" in p.program for p in r.programs)


# --- errors -------------------------------------------------------------------------------


def test_plan_larger_than_cluster_names_hosts():
    plan = synthetic_pipeline(4, 2)
    small = ClusterSpec.preset("dgx-a100", num_hosts=2)
    with pytest.raises(ValueError, match=r"uses 4 hosts .* has 2; pass --hosts 4"):
        simulate(plan, small)
    wide = synthetic_pipeline(2, 2, mesh_shape=(1, 16))
    with pytest.raises(ValueError, match=r"need 16 devices per host .* has 8"):
        simulate(wide, ClusterSpec.preset("dgx-a100", num_hosts=2))


def test_unmatched_send_is_reported():
    plan = synthetic_exchange([(0, 1, 1000)])
    streams = (plan.streams[0], WorkerStream(1, (WaitAll(),)))
    with pytest.raises(
        SimulationDeadlock, match=r"w0: SEND t0@0 #0 -> w1 has no matching RECV on w1"
    ):
        simulate(replace(plan, streams=streams))


def test_blocking_cycle_is_a_deadlock_but_async_runs():
    plan = synthetic_exchange([(0, 1, 1000), (1, 0, 1000)])
    streams = tuple(
        WorkerStream(
            w,
            (
                Recv(buffer=f"t{1 - w}@0", transfer=f"t{1 - w}", message=0, peer=1 - w),
                Wait(buffer=f"t{1 - w}@0"),
                Send(buffer=f"t{w}@0", transfer=f"t{w}", message=0, peer=1 - w),
                Free(buffer=f"t{w}@0"),
                WaitAll(),
            ),
        )
        for w in (0, 1)
    )
    plan = replace(plan, streams=streams)
    assert simulate(plan).iteration_time > 0
    with pytest.raises(SimulationDeadlock) as e:
        simulate(plan, overlap=False)
    assert re.search(
        r"w0 all queue: RECV t1@0 #0 <- w1  <-- waits for w1#2 SEND t1@0", str(e.value)
    )


def test_collective_missing_a_member():
    plan = synthetic_collective("allreduce", (0, 1, 2), 1000)
    plan = replace(plan, streams=plan.streams[:2] + (WorkerStream(2, ()),))
    with pytest.raises(SimulationDeadlock, match=r"missing on workers \[2\]"):
        simulate(plan)


# --- results, JSON, trace ----------------------------------------------------------------


def test_result_from_json_plan_is_identical():
    plan = synthetic_pipeline(3, 4, mesh_shape=(2, 2))
    a = simulate(plan, ClusterSpec.preset("aws-p3.8xlarge", num_hosts=6))
    b = simulate(Plan.from_json(plan.to_json()), ClusterSpec.preset("aws-p3.8xlarge", num_hosts=6))
    assert a.iteration_time == b.iteration_time
    assert a.to_dict() == b.to_dict()
    json.dumps(a.to_dict())


def test_summary_table():
    plan = synthetic_pipeline(2, 4, activation_bytes=64 << 20)
    r = simulate(plan, ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2))
    text = str(r)
    assert text.startswith(
        "simulated plan 'synthetic-1f1b' on aws-p3.8xlarge (2 hosts x 4 devices), overlap on"
    )
    assert re.search(r"iteration time [\d.]+ ms  \(2 workers, \d+ instructions, 8 flows\)", text)
    assert "h0.nic0.out" in text and "peak mem/dev" in text


def test_chrome_trace_has_a_track_per_worker_and_link(tmp_path):
    plan = synthetic_pipeline(2, 2, activation_bytes=1 << 20)
    r = simulate(plan, ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2))
    path = tmp_path / "trace.json"
    r.write_trace(str(path))
    trace = json.loads(path.read_text())
    ev = trace["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert {"w0 (mesh0, 1 devices)", "w1 (mesh1, 1 devices)", "network links"} <= names
    runs = [e for e in ev if e["ph"] == "X" and e.get("cat") == "run"]
    assert len(runs) == 2 * (2 * 2 + 1)  # F and B per micro-batch, plus apply, per worker
    links = {e["name"] for e in ev if e["ph"] == "C" and e["pid"] == 1_000_000}
    assert "h0.nic0.out" in links and "h1.nic0.out" in links
    assert any(e["ph"] == "X" and e["name"].startswith("SEND") for e in ev)


def test_assign_lanes():
    assert assign_lanes([(0, 2), (1, 3), (2, 4)]) == [0, 1, 0]
    assert assign_lanes([]) == []
