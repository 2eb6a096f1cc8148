"""Steps without gradients (eval, inference) as forward-only pipelines; FollowParallel
runs them with a train step's placement; ``method`` defaults to data parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, FollowParallel, PipeshardParallel
from meshshard.errors import MeshshardInputError
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from meshshard.runtime.executable import RemoteArray
from meshshard.verify import verify
from tests.conftest import assert_trees_close

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


def eval_step(state, batch):
    """Loss and predictions of the current parameters: no gradient."""
    pred = state.apply_fn({"params": state.params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), pred


def setup():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    return mlp.make_state(model, batch["x"]), batch


def test_forward_only_pipeline_matches_jit(threads_cluster):
    state, batch = setup()
    step = meshshard.parallelize(
        eval_step, method=PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 4)
    )
    loss, pred = step(state, batch)
    ref_loss, ref_pred = jax.jit(eval_step)(state, batch)
    assert_trees_close((ref_loss, ref_pred), (loss, pred))
    plan = step.plan
    assert verify(plan) == []
    assert plan.schedule.name == "inference"
    assert {t.kind.value for row in plan.schedule.ticks for t in row if t} == {"F"}
    assert len(plan.schedule.ticks) == 4  # one forward per stage, one micro-batch
    assert [str(p.name) for p in plan.programs] == ["s0.F", "s1.F", "s2.F", "s3.F"]
    assert all(st.backward is None for st in plan.stages)
    assert meshshard.Plan.from_json(plan.to_json()) == plan


def test_forward_only_with_micro_batches_is_refused():
    state, batch = setup()
    step = meshshard.parallelize(
        eval_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    with pytest.raises(MeshshardInputError, match=r"forward-only .*num_micro_batches=1"):
        step.lower(state, batch, cluster=CLUSTER)


def test_eval_follows_train_step_placement_without_moving_parameters(monkeypatch):
    state, batch = setup()
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    with use_cluster(ThreadsCluster(4, 2)):
        train = meshshard.parallelize(mlp.train_step, method=method)
        got, _ = train(state, batch)
        ref, _ = jax.jit(mlp.train_step)(state, batch)
        evaluate = meshshard.parallelize(eval_step, method=FollowParallel(train))

        def no_fetch(self):
            raise AssertionError(f"{self} was moved through the driver")

        monkeypatch.setattr(RemoteArray, "fetch", no_fetch)
        loss, pred = evaluate(got, batch)
        monkeypatch.undo()
    ref_loss, ref_pred = jax.jit(eval_step)(ref, batch)
    assert_trees_close((ref_loss, ref_pred), (np.asarray(loss), np.asarray(pred)))
    assert evaluate.plan.meshes == train.plan.meshes
    assert evaluate.plan.method == "FollowParallel(train_step)"
    assert [st.layers for st in evaluate.plan.stages] == [st.layers for st in train.plan.stages]


def test_follow_parallel_needs_a_plan_and_the_same_layers():
    state, batch = setup()
    train = meshshard.parallelize(mlp.train_step, method=PipeshardParallel(num_micro_batches=1))
    follow = meshshard.parallelize(eval_step, method=FollowParallel(train))
    with pytest.raises(MeshshardInputError, match=r"FollowParallel\(train_step\).*no plan yet"):
        follow.lower(state, batch, cluster=CLUSTER)
    train.lower(state, batch, cluster=CLUSTER)
    small = mlp.MLP(num_layers=2)
    small_state = mlp.make_state(small, batch["x"])
    with pytest.raises(MeshshardInputError, match=r"this step has 2 layers .* hold 4"):
        follow.lower(small_state, batch, cluster=CLUSTER)


def test_method_defaults_to_data_parallel_over_the_cluster():
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step)
    assert step.method == DataParallel()
    plan = step.lower(state, batch, cluster=CLUSTER)
    assert [m.shape for m in plan.meshes] == [(4, 2)]
    with use_cluster(ThreadsCluster(1, 2)):
        got, loss = meshshard.parallelize(mlp.train_step)(state, batch)
    ref, ref_loss = jax.jit(mlp.train_step)(state, batch)
    assert_trees_close(ref.params, got.params)
    assert_trees_close(ref_loss, loss)


def test_forward_only_reads_optax_free_state():
    """A forward-only step ignores the optimizer state: those leaves stay unused."""
    state, batch = setup()
    state = state.replace(tx=optax.sgd(0.1), opt_state=optax.sgd(0.1).init(state.params))
    plan = meshshard.parallelize(
        eval_step, method=PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    ).lower(state, batch, cluster=CLUSTER)
    kinds = {i.path: i.kind.value for i in plan.inputs}
    assert kinds["args[0].step"] == "unused"
    assert kinds["args[1]['x']"] == "batch"
    assert all(k == "state" for p, k in kinds.items() if ".params[" in p)
