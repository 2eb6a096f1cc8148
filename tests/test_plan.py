"""Plans: golden text, JSON round trip, stream invariants, lowering with no cluster running."""

import json

import jax
import pytest

import meshshard
from examples import gpt, mlp
from meshshard import ClusterSpec, DataParallel, PipeshardParallel, Plan
from meshshard.instructions import Free, Recv, Send
from meshshard.tiles import resharding_problem
from meshshard.verify import verify
from tests.golden import check_golden

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


def mlp_plan(method):
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    return meshshard.parallelize(mlp.train_step, method=method).lower(state, batch, cluster=CLUSTER)


def gpt_plan(method):
    model = gpt.GPT(num_layers=4)
    batch = gpt.make_batch(batch_size=8)
    state = gpt.make_state(model, batch["inputs"])
    return meshshard.parallelize(gpt.train_step, method=method).lower(state, batch, cluster=CLUSTER)


def test_golden_mlp_plan_text():
    plan = mlp_plan(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))
    check_golden("mlp_2stages_2mb_1f1b.txt", str(plan))


def test_golden_streams_multi_host_gpipe():
    plan = mlp_plan(
        PipeshardParallel(num_micro_batches=2, stages=[(2, 1), (1, 2)], schedule="gpipe")
    )
    text = "\n".join(str(s) for s in plan.streams) + "\n"
    check_golden("mlp_multihost_gpipe_streams.txt", text)


METHODS = [
    PipeshardParallel(num_micro_batches=1, stages=[(1, 2), (1, 2)]),
    PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (2, 2)], schedule="gpipe"),
    PipeshardParallel(num_micro_batches=8, stages="uniform"),
    PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (2, 2), (1, 2)]),
    DataParallel(),
    DataParallel(mesh_shape=(1, 2), num_micro_batches=4),
]


@pytest.mark.parametrize("method", METHODS, ids=repr)
@pytest.mark.parametrize(
    "make", [mlp_plan, pytest.param(gpt_plan, marks=pytest.mark.slow)], ids=["mlp", "gpt"]
)
def test_plans_verify_and_round_trip(make, method):
    plan = make(method)
    assert verify(plan) == []
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert json.loads(text)["streams"][0]["instructions"][0] == str(plan.streams[0].instructions[0])
    assert str(Plan.from_json(text)) == str(plan)


def test_every_send_has_its_receive_and_bytes_add_up():
    plan = mlp_plan(PipeshardParallel(num_micro_batches=4, stages=[(2, 2), (2, 2)]))
    sent, received = {}, {}
    for s in plan.streams:
        for ins in s.instructions:
            if isinstance(ins, Send):
                nbytes = plan.transfer(ins.transfer).messages[ins.message].nbytes
                sent[(s.worker, ins.peer, ins.buffer, ins.message)] = nbytes
            if isinstance(ins, Recv):
                nbytes = plan.transfer(ins.transfer).messages[ins.message].nbytes
                received[(ins.peer, s.worker, ins.buffer, ins.message)] = nbytes
    assert sent == received and sent
    for t in plan.transfers:  # with broadcasts each host receives each slice it needs once
        problem = resharding_problem(
            t.tensor.shape,
            t.tensor.dtype,
            plan.meshes[t.src_mesh],
            t.tensor.spec,
            plan.meshes[t.dst_mesh],
            t.dst_spec,
        )
        for w in plan.meshes[t.dst_mesh].workers:
            need = sum(
                n.nbytes(problem.itemsize)
                for n in problem.needs
                if w in {h for h, _ in n.receivers}
            )
            got = sum(m.nbytes for m in t.messages if w in m.receivers)
            assert got == need > 0, (t.name, w)


def test_verify_reports_a_double_free():
    plan = mlp_plan(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))
    s0 = plan.streams[0]
    bad = type(s0)(s0.worker, s0.instructions[:-1] + (Free(buffer="X0@0"),) + s0.instructions[-1:])
    broken = Plan(**{**plan.__dict__, "streams": (bad,) + plan.streams[1:]})
    assert any("X0@0 freed 2 times" in p for p in verify(broken))


def test_lower_needs_no_cluster_and_sees_gpu_shapes():
    """Plan for two 8-GPU hosts from this 2-core machine: planning never touches Ray."""
    big = ClusterSpec("dgx-like", 2, 8)
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=32)
    state = mlp.make_state(model, batch["x"])
    plan = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 8), (1, 8)])
    ).lower(state, batch, cluster=big)
    assert [m.shape for m in plan.meshes] == [(1, 8), (1, 8)]
    assert plan.buffer("X0").tensors[0].spec == (("host", "device"),)
    assert jax.tree.leaves(state)  # nothing was moved or consumed


def test_a_batch_the_devices_do_not_divide_is_said_in_the_plan_and_a_warning(
    threads_cluster, caplog
):
    """A batch of 9 on ``DataParallel((1, 2))`` runs whole on both devices (jax.jit's
    numbers, no data parallelism): the plan's notes and a compile-time warning say so,
    instead of the fallback being silent."""
    from tests.random_parity import check_step_parity

    batches = [mlp.make_batch(batch_size=9, seed=i) for i in range(2)]
    state = mlp.make_state(mlp.MLP(num_layers=2), batches[0]["x"])
    with caplog.at_level("WARNING", logger="meshshard"):
        par = check_step_parity(mlp.train_step, DataParallel((1, 2)), state, batches)
    note = (
        "batch not split: micro-batches of 9 rows do not divide over the 2 devices of mesh0, "
        "so its batch values are replicated there"
    )
    assert any(n.startswith(note) for n in par.lower(state, batches[0]).notes)
    assert note in caplog.text
    even = mlp.make_batch(batch_size=8)
    assert not any("batch not split" in n for n in par.lower(state, even).notes)
