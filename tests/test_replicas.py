"""Data-parallel replicas of pipeline stages (``PipeshardParallel(data_parallel=d)``),
their chunked gradient all-reduce, and the topology-aware comm thread (TriRace)."""

import json
import threading
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.admission import InFlight, comm_links
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.instructions import Collective, Load, Run, Wait, WorkerStream
from meshshard.methods import SCHEDULES
from meshshard.passes.comm_schedule import COMM_SWITCHES
from meshshard.passes.pipeline import plan_step, plan_traced
from meshshard.passes.trace import trace_step
from meshshard.plan import Plan
from meshshard.refs import BufferKind, CollectiveKind, Phase
from meshshard.runtime.overlap import CommQueue, overtakes
from meshshard.sim import simulate
from meshshard.verify import verify
from tests.conftest import assert_trees_close
from tests.parity import check_parity, run_steps
from tests.random_parity import check_step_parity
from tests.two_bw_reference import check_2bw

CLUSTER = ClusterSpec(num_hosts=4, devices_per_host=2)


def mlp_plan(**kw):
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    opts = dict(num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2) | kw
    plan, _ = plan_step(
        mlp.train_step, (state, batch), method=PipeshardParallel(**opts), cluster=CLUSTER
    )
    return plan


@pytest.fixture(scope="module")
def plan():
    return mlp_plan()


@pytest.mark.fast
def test_each_replica_loads_its_micro_batches_and_all_reduces_once(plan):
    assert verify(plan) == []
    assert [m.hosts for m in plan.meshes] == [(0,), (1,), (2,), (3,)]
    for st in plan.streams:
        ins = st.instructions
        loads = sorted({x.mb for x in ins if isinstance(x, Load)})
        assert loads == ([0, 1] if st.worker < 2 else [2, 3])
        colls = [i for i, x in enumerate(ins) if isinstance(x, Collective)]
        assert len(colls) == 1  # one all-reduce of the accumulators per step
        coll = ins[colls[0]]
        assert coll.buffer.kind is BufferKind.ACCUMULATORS and coll.buffer.owner == st.worker
        assert coll.group == (st.worker % 2, st.worker % 2 + 2)
        assert isinstance(ins[colls[0] + 1], Wait)
        apply = next(
            i for i, x in enumerate(ins) if isinstance(x, Run) and x.program.phase is Phase.APPLY
        )
        assert colls[0] < apply
    # the streams travel to Ray actors as text: they must parse back as they run
    assert all(WorkerStream.parse(st.worker, st.tokens()) == st for st in plan.streams)
    # state goes to both replicas, results come from both
    assert {str(g) for g, _ in plan.inputs[1].slots} == {"P0", "P2"}
    assert "data_parallel=2" in str(plan)


@pytest.mark.fast
def test_every_schedule_plans_replicas_that_verify():
    """2bw and every flush schedule: the replicated plan passes the verifier and the IR
    checks (on in tests), each replica's streams are the base streams renamed."""
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    traced = trace_step(
        mlp.train_step,
        (mlp.make_state(model, batch["x"]), batch),
        batch_argnums=(1,),
        num_micro_batches=4,
    )
    for schedule in SCHEDULES:
        kw = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}
        method = PipeshardParallel(
            num_micro_batches=4, stages=[(1, 1)] * 2, schedule=schedule, data_parallel=2, **kw
        )
        plan = plan_traced(traced, method=method, cluster=CLUSTER)
        assert verify(plan) == [], schedule
        runs = {
            st.worker: [x.program.phase for x in st.instructions if isinstance(x, Run)]
            for st in plan.streams
        }
        assert runs[0] == runs[2] and runs[1] == runs[3], schedule


@pytest.mark.fast
def test_allreduce_switch_cuts_the_gradient_into_chunks():
    plan = mlp_plan(comm_schedule={"allreduce", "p2p"}, comm_chunk_bytes=512)
    assert verify(plan) == []
    for st in plan.streams:
        colls = [x for x in st.instructions if isinstance(x, Collective)]
        nbytes = plan.buffer(colls[0].buffer).nbytes
        assert [c.message for c in colls] == list(range(-(-nbytes // 512)))
        assert len({c.priority for c in colls}) == 1
    first = {
        st.worker: next(x for x in st.instructions if isinstance(x, Collective))
        for st in plan.streams
    }
    assert first[0].priority == first[2].priority > first[1].priority  # stage 0 first
    assert "chunks of 512 B" in str(plan)


@pytest.mark.fast
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(data_parallel=3), r"data_parallel=3 must divide num_micro_batches=4"),
        (dict(data_parallel=0), r"data_parallel must be a positive int"),
        (dict(stages="auto"), r"data_parallel=2, stages='auto'"),
        (dict(stages=[(1, 2)] * 3, num_micro_batches=2), r"needs 2 x 3 hosts"),
        (dict(stages=[(2, 1)]), r"span several hosts.*one-host mesh"),
    ],
)
def test_bad_replica_requests_are_named(kw, match):
    with pytest.raises(MeshshardInputError, match=match):
        mlp_plan(**kw)


@pytest.mark.slow
def test_replicas_match_single_device_gpt(threads_cluster):
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 1)] * 2, schedule="gpipe", data_parallel=2
    )
    step = check_parity("gpt_small", method, steps=2)
    assert len(step.plan.meshes) == 4


@pytest.mark.slow
def test_replicas_of_multi_device_meshes_match_jit(threads_cluster):
    """Stage meshes of two devices hold gradient accumulators as per-device partial sums
    (``(2, *shape)``); the replicas exchange them summed to the traced shape, and the
    update still equals jax.jit on the full batch."""
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, data_parallel=2)
    step = check_parity("mlp", method, steps=2)
    accs = [b for b in step.plan.buffers if b.name.kind is BufferKind.ACCUMULATORS]
    assert accs and all(t.unreduced for b in accs for t in b.tensors)


def aux_step(reduce: str):
    """A two-stage train step whose aux values combine by mean, integer sum and
    ``reduce`` ("max" or "min") over the batch."""
    marker = meshshard.aux_max if reduce == "max" else meshshard.aux_min
    extreme = jnp.max if reduce == "max" else jnp.min

    def train_step(p, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            meshshard.mark_pipeline_boundary()
            per_row = jnp.mean((h @ p["w2"] - batch["y"]) ** 2, axis=-1)
            aux = {"m": jnp.mean(per_row), "n": jnp.sum(per_row > 1.0)}
            return jnp.mean(per_row), aux | {"x": marker(extreme(per_row))}

        (loss, aux), g = meshshard.value_and_grad(loss_fn, has_aux=True)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), (loss, aux)

    return train_step


def aux_args(seed: int = 0):
    r = np.random.default_rng(seed)
    params = {"w1": jnp.full((8, 16), 0.1), "w2": jnp.full((16, 4), 0.1)}
    batch = {
        "x": r.normal(size=(16, 8)).astype(np.float32),
        "y": r.normal(size=(16, 4)).astype(np.float32),
    }
    return params, batch


REPLICAS_1D = dict(num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2)


@pytest.mark.fast
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_max_min_accumulators_are_gathered_not_summed(reduce):
    """A max/min aux accumulator leaves the replicas' summed vector for an all-gather
    before it; the plan records it, prints it, round-trips it through JSON, and the
    simulator prices the all-gather: each host of the ring of two moves the same bytes as
    when the value is summed (an all-gather of two sends each member's keys once)."""
    method = PipeshardParallel(**REPLICAS_1D)
    plan, _ = plan_step(aux_step(reduce), aux_args(), method=method, cluster=CLUSTER)
    assert verify(plan) == []
    assert [(str(e.group), e.reduce) for e in plan.gathered] == [("A1", reduce), ("A3", reduce)]
    for e in plan.gathered:
        t = plan.buffer(e.group).tensors[e.tensor]
        assert plan.grad_nbytes(e.group) == (plan.buffer(e.group).nbytes - t.nbytes, t.nbytes)
    w1 = [str(x) for x in plan.streams[1].instructions if isinstance(x, Collective)]
    assert w1 == ["COLL allgather A1 #0 [w1,w3]", "COLL allreduce A1 #0 [w1,w3]"]
    assert f"gathered accumulators:\n  A1[{plan.gathered[0].tensor}] by {reduce}" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan
    # a plan saved before ``extremes`` was renamed ``gathered`` still loads
    old = json.loads(plan.to_json())
    old["extremes"] = old.pop("gathered")
    assert Plan.from_json(json.dumps(old)) == plan
    summed = replace(plan, gathered=(), streams=tuple(map(_without_gathers, plan.streams)))
    for host in (1, 3):
        link = f"h{host}.nic0.out"
        moved = simulate(plan, CLUSTER).link(link).moved
        assert moved == pytest.approx(simulate(summed, CLUSTER).link(link).moved)


def _without_gathers(st: WorkerStream) -> WorkerStream:
    keep = tuple(
        x
        for x in st.instructions
        if not (isinstance(x, Collective) and x.kind is CollectiveKind.ALLGATHER)
    )
    return WorkerStream(st.worker, keep)


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_replicas_combine_max_min_aux_by_max_min(threads_cluster, reduce):
    """aux_max / aux_min over two replicas equal jax.jit's full-batch max / min (a sum
    over the replicas gave 4.55 for a max of 3.01); the mean and integer-sum aux values
    and the parameters stay equal too."""
    fn = aux_step(reduce)
    step = meshshard.parallelize(fn, method=PipeshardParallel(**REPLICAS_1D))
    params, ref = aux_args()[0], aux_args()[0]
    for seed in range(2):
        batch = aux_args(seed)[1]
        ref, ref_out = jax.jit(fn)(ref, batch)
        params, out = step(params, batch)
        assert_trees_close(ref_out, jax.tree.map(np.asarray, out))
        assert_trees_close(ref, jax.tree.map(np.asarray, params))
    assert len(step.plan.gathered) == 2


@pytest.mark.slow
def test_replicas_under_2bw_follow_the_2bw_rule(threads_cluster):
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 1)] * 2, schedule="2bw", data_parallel=2
    )
    check_2bw(method, steps=3)


@pytest.mark.slow
def test_chunked_admitted_allreduce_is_bit_identical(threads_cluster):
    """MLP, 1F1B: without switches it equals jax.jit on the full batch; all switches
    (chunks of 256 B, the comm thread admitting by the in-flight table) give the same
    bits as none."""
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=16, seed=s) for s in range(2)]
    outs = []
    for sw in (frozenset(), frozenset(COMM_SWITCHES)):
        method = PipeshardParallel(
            num_micro_batches=4,
            stages=[(1, 1)] * 2,
            data_parallel=2,
            comm_schedule=sw,
            comm_chunk_bytes=256,
        )
        step = meshshard.parallelize(mlp.train_step, method=method)
        outs.append(run_steps(step, mlp.make_state(model, batches[0]["x"]), batches))
    ref = mlp.make_state(model, batches[0]["x"])
    for b in batches:
        ref, ref_loss = jax.jit(mlp.train_step)(ref, b)
    assert_trees_close(ref.params, outs[0][0])
    assert_trees_close(ref_loss, outs[0][1][-1])
    jax.tree.map(np.testing.assert_array_equal, outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


# --- the topology-aware comm thread on its own -----------------------------------------


def _eventually(pred, timeout: float = 30.0) -> bool:
    """``pred()`` became true within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class Held:
    """A handle whose ``wait()`` blocks until ``release`` is set."""

    def __init__(self, release):
        self.release = release

    def wait(self):
        self.release.wait()
        return "done"


@pytest.mark.fast
def test_admission_holds_bulk_behind_higher_priority_on_its_links():
    table = InFlight()
    q = CommQueue("adm", table)
    on_wire = threading.Event()
    q.submit(30_000, lambda: Held(on_wire), links=("h0.nic0.out",))  # a p2p in flight
    assert _eventually(lambda: q.issued == [0])
    bulk = q.submit(10, lambda: Held(threading.Event()), links=("h0.nic0.out",))
    other = q.submit(10, lambda: Held(threading.Event()), links=("h1.nic0.out",))
    # polled, not slept: under load the comm thread may take a while to get there
    assert _eventually(lambda: other.done and q.refused > 0)
    assert not bulk.done  # held: the p2p is still on its link; the other link is free
    on_wire.set()
    bulk.result()
    assert q.issued == [0, 2, 1]
    q.close()


@pytest.mark.fast
def test_a_p2p_overtakes_a_queued_allreduce_chunk():
    """Chunks of one channel go out one at a time; a p2p queued after chunk 1 goes out
    before it, and the timeline's issue log shows the overtake."""
    q = CommQueue("chunks", InFlight())
    links = ("h0.nic0.out",)
    wire = [threading.Event() for _ in range(2)]
    log = []

    def op(kind, k, release):
        entry = [k, kind, 0, time.perf_counter_ns(), 0]
        log.append(entry)

        def fn():
            entry[4] = time.perf_counter_ns()
            return Held(release)

        return fn

    q.submit(10, op("allreduce", 0, wire[0]), channel="grads:0,2", links=links)
    q.submit(10, op("allreduce", 1, wire[1]), channel="grads:0,2", links=links)
    time.sleep(0.05)
    sent = threading.Event()
    sent.set()  # the p2p finishes at once; chunk 1 then goes
    q.submit(30_000, op("p2p", 2, sent), links=links)
    time.sleep(0.05)
    wire[0].set()
    wire[1].set()
    time.sleep(0.05)
    assert q.issued == [0, 2, 1]
    ((fast, slow),) = overtakes(log)
    assert (fast[0], slow[0]) == (2, 1)
    q.close()


@pytest.mark.fast
def test_comm_links_come_from_the_cluster_description():
    links = comm_links(ClusterSpec(num_hosts=3), 0, (1, 2))
    assert "h0.nic0.out" in links and "h2.nic0.in" in links and comm_links(CLUSTER, 1, (1,)) == ()


@pytest.mark.ray
def test_replicas_on_ray_with_every_switch(ray_cluster):
    """Host-actor processes: the gradient chunks go over torch.distributed groups of the
    replicas, admitted by each process's in-flight table, and the embedding gradient's
    touched rows over a torch.distributed all-gather; parity with jax.jit."""
    method = PipeshardParallel(
        num_micro_batches=4,
        stages=[(1, 1)] * 2,
        data_parallel=2,
        comm_schedule=frozenset(COMM_SWITCHES),
        comm_chunk_bytes=4096,  # 118 collectives a step (512 B: 918; each a gloo round trip)
    )
    step = check_parity("gpt_vocab", method, steps=2)
    rows = step.plan.sparse_rows  # the token table wte, in both replicas of stage 0
    assert [step.plan.buffer(r.group).tensors[r.tensor].shape for r in rows] == [(1024, 32)] * 2
    kinds = {
        x.kind.value for s in step.plan.streams for x in s.instructions if isinstance(x, Collective)
    }
    assert "allgather" in kinds
    assert (
        max(
            x.message
            for s in step.plan.streams
            for x in s.instructions
            if isinstance(x, Collective)
        )
        > 0
    )


def _clipped_state(tx):
    model = mlp.MLP(num_layers=4)
    params = model.init(jax.random.key(0), mlp.make_batch(16)["x"])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _norm_plus_one_step(state, batch):
    """Gradients over sqrt(1 + their squared norm): a cross-mesh all-reduce with a
    literal term, which each replica must add once."""

    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    leaves = jax.tree.leaves(grads)
    sq = jnp.sum(leaves[0] ** 2)
    for g in leaves[1:]:
        sq = sq + jnp.sum(g**2)
    scale = 1.0 / jnp.sqrt(sq + 1.0)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g * scale, grads)), loss


@pytest.mark.parametrize(
    "schedule,stages,v", [("1f1b", [(1, 2)] * 2, 1), ("interleaved_1f1b", [(1, 1)] * 2, 2)]
)
def test_replicas_with_global_norm_clipping_match_jit(threads_cluster, schedule, stages, v):
    """Refused before ("replicas do not support yet"): each replica now runs the update's
    cross-mesh all-reduce over its own meshes, after the replicas' gradient all-reduce."""
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
    method = PipeshardParallel(
        num_micro_batches=4, stages=stages, schedule=schedule, virtual_stages=v, data_parallel=2
    )
    batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(2)]
    par = check_step_parity(mlp.train_step, method, _clipped_state(tx), batches)
    groups = [r.group for r in par.plan.reductions]
    assert len(groups) == 2 and not set(groups[0]) & set(groups[1])  # one per replica


def test_replicas_add_an_all_reduce_literal_once_each(threads_cluster):
    """The literal term went to mesh 0 only: replica 1 left it out (2.6e-2 off)."""
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, data_parallel=2)
    batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(2)]
    par = check_step_parity(_norm_plus_one_step, method, _clipped_state(optax.sgd(0.1)), batches)
    assert all(r.literals == (1.0,) for r in par.plan.reductions)
