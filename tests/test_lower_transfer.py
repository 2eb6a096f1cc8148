"""One lowering of every transfer: what the simulator times is what the runtime runs.

The printed simulated time of a resharding (and of a pipeline plan's transfer) must equal
the simulation of exactly the instruction streams the runtime executes: the tests below
record the streams the interpreter is handed when the plan really runs, simulate them,
and compare with the printed figure.
"""

import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.instructions import Collective, Recv, Send, Wait, WaitAll, WorkerStream
from meshshard.passes.emit import transfer_only_plan
from meshshard.passes.lower_transfer import lower_transfer, transfer_streams
from meshshard.plan import MeshSpec, Message, Plan, Schedule, TensorSpec, TransferSpec
from meshshard.resharding import plan_resharding
from meshshard.resharding.result import fmt_seconds
from meshshard.resharding.simulate import resharding_sim_plan
from meshshard.runtime import interpreter
from meshshard.runtime.transfer_run import expected_tiles, run_transfer_threads
from meshshard.sim import SimOptions, simulate
from meshshard.sim.synthetic import stage_order, synthetic_pipeline
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=4)
SERIAL = SimOptions(serial_comm=True, record=False)


def transfer(*messages: Message, name: str = "t0") -> TransferSpec:
    return TransferSpec(name, TensorSpec(0, "x", (8,), "int32", ()), (), 0, 1, "-", "-", messages)


# --- the lowering itself ---------------------------------------------------------------------


def test_two_member_group_runs_as_send_and_receive():
    t = transfer(Message(0, 1, ((0, 8),), 32, group=(0, 1)))
    assert lower_transfer(t, "t0@3", 0) == (Send(buffer="t0@3", transfer="t0", message=0, peer=1),)
    assert lower_transfer(t, "t0@3", 1) == (
        Recv(buffer="t0@3", transfer="t0", message=0, peer=0),
        Wait(buffer="t0@3"),
    )
    assert lower_transfer(t, "t0@3", 2) == ()


def test_group_of_three_is_one_broadcast_on_every_member():
    t = transfer(Message(1, 2, ((0, 8),), 32, group=(1, 2, 3)))
    coll = Collective(
        kind="broadcast", buffer="t0@0", transfer="t0", message=0, group=(1, 2, 3), root=1
    )
    assert lower_transfer(t, "t0@0", 1) == (coll,)
    assert lower_transfer(t, "t0@0", 3) == (coll, Wait(buffer="t0@0"))
    assert lower_transfer(t, "t0@0", 0) == ()


def test_messages_issue_by_round_then_position():
    t = transfer(
        Message(0, 1, ((0, 4),), 16, round=1),
        Message(0, 1, ((4, 8),), 16, round=0),
        Message(0, 1, ((0, 8),), 32, round=1),
    )
    assert [ins.message for ins in lower_transfer(t, "t0@0", 0)] == [1, 0, 2]
    assert [str(i) for i in lower_transfer(t, "t0@0", 1)] == [
        "RECV t0@0 #1 <- w0",
        "RECV t0@0 #0 <- w0",
        "RECV t0@0 #2 <- w0",
        "WAIT t0@0",
    ]


def test_transfer_only_streams_free_on_senders_and_end_in_waitall():
    t = transfer(Message(0, 1, ((0, 8),), 32))
    meshes = (MeshSpec(0, (1, 1), (0,)), MeshSpec(1, (1, 1), (1,)))
    assert [str(s) for s in transfer_streams(t, meshes)] == [
        "w0: SEND t0@0 #0 -> w1\nw0: FREE t0@0\nw0: WAITALL",
        "w1: RECV t0@0 #0 <- w0\nw1: WAIT t0@0\nw1: WAITALL",
    ]


# --- printed simulated time == simulation of the streams the runtime runs ---------------------


def recorded_streams(monkeypatch) -> dict[int, WorkerStream]:
    """Record every stream the runtime's interpreter is handed (by worker)."""
    seen: dict[int, WorkerStream] = {}
    real = interpreter.StreamInterpreter.__init__

    def spy(self, stream, *args, **kwargs):
        seen[stream.worker] = stream
        real(self, stream, *args, **kwargs)

    monkeypatch.setattr(interpreter.StreamInterpreter, "__init__", spy)
    return seen


def run_plan_of(streams: dict[int, WorkerStream], plan: Plan) -> Plan:
    """``plan`` with exactly ``streams`` (what the runtime ran), for the simulator."""
    return Plan(
        method=plan.method,
        cluster=plan.cluster,
        num_micro_batches=1,
        fingerprint="",
        meshes=plan.meshes,
        stages=(),
        programs=(),
        buffers=(),
        transfers=plan.transfers,
        schedule=Schedule("none", 0, 1, ()),
        streams=tuple(streams[w] for w in sorted(streams)),
        inputs=(),
        outputs=(),
    )


CASES = [
    # (src mesh, src spec, dst mesh, dst spec, strategy): each lowers a different way
    ((1, 1), (), (1, 4), (), "broadcast"),  # a two-member group: a send
    ((2, 4), (), (2, 4), ("host",), "broadcast"),  # paper case 2
    ((1, 2), ("device",), (3, 2), (), "broadcast"),  # groups of three and four
    ((2, 2), ("host",), (2, 2), ("device",), "send_recv"),
    ((1, 2), (), (2, 2), (), "broadcast_greedy"),
]


@pytest.mark.parametrize("src_shape,src_spec,dst_shape,dst_spec,strategy", CASES)
def test_printed_sim_time_is_the_simulation_of_the_streams_the_runtime_runs(
    monkeypatch, src_shape, src_spec, dst_shape, dst_spec, strategy
):
    shape = (8, 4 * 1024)
    src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
    dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
    problem = resharding_problem(shape, "float32", src, src_spec, dst, dst_spec)
    planned = plan_resharding(problem, strategy, P38)
    assert planned.gathers == ()  # the runtime has no gather instruction to compare with
    t = TransferSpec(
        "t0", TensorSpec(0, "x", shape, "float32", src_spec), dst_spec, 0, 1, "-", "-",
        planned.messages, planned.strategy,
    )  # fmt: skip
    plan = transfer_only_plan(t, (src, dst), P38)

    seen = recorded_streams(monkeypatch)
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    tiles, _ = run_transfer_threads(plan, full)
    for w in dst.hosts:  # it really ran and delivered
        for d, (idx, data) in expected_tiles(full, plan, w).items():
            assert tiles[w][d][0] == idx
            np.testing.assert_array_equal(tiles[w][d][1], data)
    assert sorted(seen) == sorted(set(src.hosts) | set(dst.hosts))

    ran = simulate(run_plan_of(seen, plan), P38, options=SERIAL).iteration_time
    assert ran == planned.sim_time_s
    assert f"simulated {fmt_seconds(ran)}" in str(planned)
    # and the simulator's own plan holds the very same streams
    sim_plan, _ = resharding_sim_plan(problem, planned.messages, P38)
    assert sim_plan.streams == tuple(seen[w] for w in sorted(seen))


def test_bcast_is_printed_only_for_what_runs_as_a_broadcast():
    kinds = set()
    for src_shape, src_spec, dst_shape, dst_spec, strategy in CASES:
        src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
        dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
        problem = resharding_problem((8, 4096), "float32", src, src_spec, dst, dst_spec)
        planned = plan_resharding(problem, strategy, P38, simulate=False)
        sim_plan, _ = resharding_sim_plan(problem, planned.messages, P38)
        colls = {
            ins.message
            for s in sim_plan.streams
            for ins in s.instructions
            if isinstance(ins, Collective)
        }
        lines = [ln for ln in str(planned).splitlines() if ln.startswith("  #")]
        for i, (m, line) in enumerate(zip(planned.messages, lines, strict=True)):
            assert ("bcast" in line) == (i in colls), line
            kinds.add((len(m.group), "bcast" in line))
    assert {(2, False), (3, True)} <= kinds  # a two-member group prints p2p, three bcast


@pytest.mark.slow
def test_pipeline_transfers_run_what_their_printed_time_simulates(threads_cluster, monkeypatch):
    """In a real pipeline step, each worker issues exactly the lowering of each transfer,
    and those instructions, simulated alone, give the time the plan prints."""
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 1)])
    step = meshshard.parallelize(mlp.train_step, method=method)
    cluster = ClusterSpec("threads-4x2", 4, 2)
    plan = step.lower(state, batch, cluster=cluster)
    seen = recorded_streams(monkeypatch)
    step(state, batch)
    assert sorted(seen) == [w for m in plan.meshes for w in m.workers]
    assert tuple(seen[w] for w in sorted(seen)) == plan.streams
    assert plan.transfers
    for t in plan.transfers:
        assert t.sim_time_s is not None
        buf = t.name.buffer(0)
        streams = {}
        for w in (*plan.meshes[t.src_mesh].workers, *plan.meshes[t.dst_mesh].workers):
            mine = tuple(
                ins
                for ins in seen[w].instructions
                if getattr(ins, "buffer", None) == buf and (ins.is_comm or isinstance(ins, Wait))
            )
            assert mine == lower_transfer(t, buf, w)
            streams[w] = WorkerStream(w, mine + (WaitAll(),))
        alone = run_plan_of(streams, transfer_only_plan(t, plan.meshes, cluster))
        ran = simulate(alone, cluster, options=SERIAL).iteration_time
        assert f"simulated {ran * 1e3:.3f} ms" in str(t)


# --- synthetic pipelines are built like real ones ---------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synthetic_pipelines_follow_the_real_schedule_and_lowering(schedule):
    from meshshard.passes.schedules import make_schedule

    plan = synthetic_pipeline(3, 4, schedule=schedule, mesh_shape=(2, 1), transfer="broadcast")
    assert plan.schedule == make_schedule(schedule, 3, 4)
    for s in range(3):
        real = [row[s] for row in make_schedule(schedule, 3, 4).ticks if row[s] is not None]
        assert stage_order(schedule, 3, 4, s) == real
    by_name = {t.name: t for t in plan.transfers}
    for stream in plan.streams:
        for ins in stream.instructions:
            if ins.is_comm:
                t = by_name[ins.transfer]
                assert ins in lower_transfer(t, ins.buffer, stream.worker)


def test_synthetic_broadcast_to_one_host_is_a_send():
    plan = synthetic_pipeline(2, 1, schedule="gpipe", transfer="broadcast")
    kinds = {type(ins).__name__ for s in plan.streams for ins in s.instructions if ins.is_comm}
    assert kinds == {"Send", "Recv"}
    wide = synthetic_pipeline(2, 1, schedule="gpipe", mesh_shape=(2, 1), transfer="broadcast")
    kinds = {type(ins).__name__ for s in wide.streams for ins in s.instructions if ins.is_comm}
    assert kinds == {"Collective"}


def test_verify_accepts_the_broadcasts_the_lowering_emits():
    """A (1, 2) mesh's backward transfer broadcasts to both hosts of a (2, 2) mesh: the
    receivers' COLL is their receive, so the verifier (run after every pass) accepts it."""
    from meshshard.verify import verify

    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(2, 2), (1, 2)], resharding="broadcast_nolb"
    )
    plan = meshshard.parallelize(mlp.train_step, method=method).lower(
        state, batch, cluster=ClusterSpec("c", 4, 2)
    )
    colls = [
        (s.worker, ins)
        for s in plan.streams
        for ins in s.instructions
        if isinstance(ins, Collective)
    ]
    assert any(w != ins.root for w, ins in colls)
    assert verify(plan) == []
