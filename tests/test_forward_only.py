"""Steps without gradients (eval, inference) as forward-only pipelines; FollowParallel
runs them with a train step's placement; ``method`` defaults to data parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

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


def metrics_step(state, batch):
    """Results of every kind a forward-only step combines over micro-batches."""
    pred = state.apply_fn({"params": state.params}, batch["x"])
    return {
        "loss": jnp.mean((pred - batch["y"]) ** 2),  # mean over the batch
        "sse": jnp.sum((pred - batch["y"]) ** 2),  # sum
        "worst": jnp.max(jnp.abs(pred)),  # max
        "best": jnp.min(jnp.abs(pred)),  # min
        "hits": jnp.sum(pred[:, 0] > 0),  # integer count
        "logits": pred,  # per example: concatenated
        "next_step": state.step + 1,  # no batch: the same on every micro-batch
    }


@pytest.mark.parametrize("m,s", [(2, 2), (4, 2), (2, 4)])
def test_pipelined_forward_only_with_micro_batches_matches_jit(threads_cluster, m, s):
    state, batch = setup()
    step = meshshard.parallelize(
        metrics_step, method=PipeshardParallel(num_micro_batches=m, stages=[(1, 2)] * s)
    )
    got = step(state, batch)
    want = jax.jit(metrics_step)(state, batch)
    # min |pred| is a small number whose rounding error scales with pred's magnitude
    # (another program split rounds pred differently): compare it against that scale
    best, want_best = float(got.pop("best")), float(want.pop("best"))
    assert abs(best - want_best) <= 1e-5 * float(want["worst"]), (best, want_best)
    assert_trees_close(want, got)
    plan = step.plan
    assert verify(plan) == []
    assert plan.schedule.name == "inference"
    # every stage runs F0 .. F(M-1), pipelined: M + S - 1 ticks
    assert len(plan.schedule.ticks) == m + s - 1
    ticks = plan.schedule.ticks
    order = {k: [t.mb for row in ticks for t in row if t and t.stage == k] for k in range(s)}
    assert order == {k: list(range(m)) for k in range(s)}
    notes = "\n".join(plan.notes)
    assert f"out['logits']: concat over {m} micro-batches" in notes
    assert f"out['worst']: max over {m} micro-batches" in notes
    assert f"out['sse']: sum over {m} micro-batches" in notes
    assert f"out['next_step']: same over {m} micro-batches" in notes
    last = f"m{s - 1}.apply"
    assert last in {str(p.name) for p in plan.programs}


@pytest.mark.parametrize("m", [2, 4])
def test_forward_only_replicas_concatenate_their_rows(threads_cluster, m):
    """Two data-parallel replicas each run half of the micro-batches.  Their per-example
    results were summed like gradients: rows 0-7 of the logits came back as zeros and rows
    8-15 as the sum of the two replicas' rows.  Now each replica's rows are all-gathered
    and placed in micro-batch order, and the max, sum and mean equal jax.jit's too."""
    state, batch = setup()
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 1)] * 2, data_parallel=2)
    step = meshshard.parallelize(metrics_step, method=method)
    got = step(state, batch)
    want = jax.jit(metrics_step)(state, batch)
    best, want_best = float(got.pop("best")), float(want.pop("best"))
    assert abs(best - want_best) <= 1e-5 * float(want["worst"]), (best, want_best)
    assert_trees_close(want, got)
    assert "concat" in {e.reduce for e in step.plan.gathered}
    assert verify(step.plan) == []


def _rnn_eval(params, batch, loop):
    """An evaluation that runs a recurrent cell over the features with ``loop`` and
    returns the error summed over steps and examples, its mean, and the last state's
    sum: totals carried beside per-row states."""

    def cell(t, h, total):
        x_t = jax.lax.dynamic_slice_in_dim(batch["x"], t, 1, axis=1)
        h = jnp.tanh(h @ params["w"] + x_t * params["u"])
        err = jnp.sum((h @ params["v"] - batch["y"]) ** 2)
        return h, total + err

    return loop(cell, batch["x"].shape[1], jnp.zeros((batch["x"].shape[0], 8)))


def _while_loop(cell, n, h0):
    def body(c):
        t, h, total = c
        return (t + 1, *cell(t, h, total))

    _, h, total = jax.lax.while_loop(lambda c: c[0] < n, body, (0, h0, 0.0))
    return {"total": total, "mean": total / h0.shape[0], "h": jnp.sum(h)}


def _fori_loop_unrolled_by_jax(cell, n, h0):
    h, total = h0, 0.0
    for t in range(n):
        h, total = cell(t, h, total)
    return {"total": total, "mean": total / h0.shape[0], "h": jnp.sum(h)}


@pytest.mark.parametrize("loop", [_while_loop, _fori_loop_unrolled_by_jax])
def test_forward_only_totals_carried_by_a_while_loop_match_jit(threads_cluster, loop):
    """A while loop's outputs hold per-row states beside the totals, so the loop was not
    seen to reduce the batch: its totals were traced as the same on every micro-batch
    and averaged (half jax.jit's sum at M=2)."""
    _, batch = setup()
    k = jax.random.split(jax.random.key(3), 3)
    params = {
        "w": jax.random.normal(k[0], (8, 8)) * 0.3,
        "u": jax.random.normal(k[1], (1, 8)),
        "v": jax.random.normal(k[2], (8, batch["y"].shape[1])) * 0.3,
    }

    def step(params, batch):
        return _rnn_eval(params, batch, loop)

    par = meshshard.parallelize(step, method=DataParallel((1, 2), num_micro_batches=2))
    assert_trees_close(jax.jit(step)(params, batch), meshshard.fetch(par(params, batch)))


def test_forward_results_computed_from_the_batch_size_are_the_full_batch_s(threads_cluster):
    """An evaluation returning its number of examples (to weigh its mean by across
    batches) returned the micro-batch's: 8 of 16 rows, as did values computed from it."""
    state, batch = setup()

    def evaluate(state, batch):
        pred = state.apply_fn({"params": state.params}, batch["x"])
        n = batch["x"].shape[0]
        return {
            "mse": jnp.mean((pred - batch["y"]) ** 2),
            "examples": n,
            "as_float": jnp.float32(n),
            "inverse": 1.0 / n,
            "filled": jnp.full((2,), n),
        }

    step = meshshard.parallelize(evaluate, method=DataParallel((1, 2), num_micro_batches=2))
    got = meshshard.fetch(step(state, batch))
    assert int(got["examples"]) == batch["x"].shape[0] == 16
    assert_trees_close(jax.jit(evaluate)(state, batch), got)


def test_forward_only_result_mixing_examples_is_refused():
    """A per-example result normalized by the batch's own mean is not a concatenation."""
    state, batch = setup()

    def centred(state, batch):
        pred = state.apply_fn({"params": state.params}, batch["x"])
        return pred - jnp.mean(pred, axis=0)

    step = meshshard.parallelize(
        centred, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    with pytest.raises(
        MeshshardInputError, match=r"step result out: .*each row depends on other rows .*aux_sum"
    ):
        step.lower(state, batch, cluster=CLUSTER)


def jax_grad_step(state, batch):
    """A train step written with jax.grad: meshshard sees no backward to pipeline."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("m,s", [(2, 1), (1, 2), (2, 2)])
def test_jax_grad_step_is_refused_when_pipelined(m, s):
    state, batch = setup()
    method = (
        DataParallel(num_micro_batches=m)
        if s == 1
        else PipeshardParallel(num_micro_batches=m, stages=[(1, 2)] * s)
    )
    for fn in (jax_grad_step, jax.jit(jax_grad_step)):
        step = meshshard.parallelize(fn, method=method)
        with pytest.raises(
            MeshshardInputError,
            match=rf"jax.grad or jax.value_and_grad .*over {s} stage\(s\) with "
            rf"num_micro_batches={m}; .*meshshard.grad or meshshard.value_and_grad",
        ):
            step.lower(state, batch, cluster=CLUSTER)


class _Unmarked(nn.Module):
    """Two dense layers without mark_pipeline_boundary(): no layers to pipeline either."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))


@pytest.mark.parametrize(
    "stages", [[(1, 2)] * 2, "uniform", "auto"], ids=["listed", "uniform", "auto"]
)
def test_jax_grad_without_markers_is_told_to_use_meshshard_grad_first(stages):
    """Both are missing, but with meshshard.grad ``layers="auto"`` would cut the layers;
    with jax.grad nothing can: the error names meshshard.grad, not the markers."""
    _, batch = setup()
    model = _Unmarked()
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=stages, layers="auto")
    step = meshshard.parallelize(jax_grad_step, method=method)
    with pytest.raises(MeshshardInputError, match=r"meshshard.value_and_grad") as err:
        step.lower(state, batch, cluster=CLUSTER)
    assert "mark_pipeline_boundary" not in str(err.value)


def test_jax_grad_step_on_uniform_stages_of_a_one_layer_model_still_plans_one_stage():
    """Uniform stages take at most one per layer: an unmarked model gets one stage, so
    a jax.grad step with one micro-batch is planned as before, not refused."""
    _, batch = setup()
    state = mlp.make_state(_Unmarked(), batch["x"])
    step = meshshard.parallelize(jax_grad_step, method=PipeshardParallel(num_micro_batches=1))
    plan = step.lower(state, batch, cluster=CLUSTER)
    assert len(plan.stages) == 1


def test_jax_grad_step_runs_on_one_stage_with_one_micro_batch():
    state, batch = setup()
    with use_cluster(ThreadsCluster(1, 2)):
        got, loss = meshshard.parallelize(jax_grad_step)(state, batch)
    ref, ref_loss = jax.jit(jax_grad_step)(state, batch)
    assert_trees_close((ref.params, ref_loss), (got.params, loss))


@pytest.mark.parametrize("eval_m,d", [(1, 1), (4, 1), (1, 2), (4, 2)])
def test_eval_follows_train_step_placement_without_moving_parameters(monkeypatch, eval_m, d):
    """``d=2``: the train step's stages have two data-parallel replicas (that failed
    with "2 stages but 4 meshes"); the eval splits its micro-batches between them, or
    runs on the first replica alone when they do not divide (one micro-batch)."""
    state, batch = setup()
    stages = [(1, 2), (1, 2)] if d == 1 else [(1, 1), (1, 1)]
    method = PipeshardParallel(num_micro_batches=4, stages=stages, data_parallel=d)
    with use_cluster(ThreadsCluster(4, 2)):
        train = meshshard.parallelize(mlp.train_step, method=method)
        got, _ = train(state, batch)
        ref, _ = jax.jit(mlp.train_step)(state, batch)
        evaluate = meshshard.parallelize(
            eval_step, method=FollowParallel(train, num_micro_batches=eval_m)
        )

        def no_fetch(self):
            raise AssertionError(f"{self} was moved through the driver")

        monkeypatch.setattr(RemoteArray, "fetch", no_fetch)
        loss, pred = evaluate(got, batch)
        monkeypatch.undo()
    ref_loss, ref_pred = jax.jit(eval_step)(ref, batch)
    assert_trees_close((ref_loss, ref_pred), (np.asarray(loss), np.asarray(pred)))
    replicas = d if eval_m % d == 0 else 1
    assert evaluate.plan.meshes == train.plan.meshes[: len(train.plan.meshes) * replicas // d]
    assert evaluate.plan.method == "FollowParallel(train_step)"
    assert [st.layers for st in evaluate.plan.stages] == [st.layers for st in train.plan.stages]
    assert evaluate.plan.num_micro_batches == eval_m


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


@pytest.mark.parametrize(
    "layers,stages,d",
    [(2, [(1, 2)] * 2, 1), ("auto", "auto", 1), (2, [(1, 1)] * 2, 2)],
    ids=["layers2", "auto", "replicas"],
)
def test_eval_follows_a_train_step_cut_into_layers(monkeypatch, layers, stages, d):
    # was refused: "the followed step was cut into layers automatically (layers=2),
    # which this step does not follow"
    _, batch = setup()
    state = mlp.make_state(_Deep(), batch["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=stages, layers=layers, data_parallel=d)
    with use_cluster(ThreadsCluster(2, 2)):
        train = meshshard.parallelize(mlp.train_step, method=method)
        got, _ = train(state, batch)
        evaluate = meshshard.parallelize(eval_step, method=FollowParallel(train, 2))

        def no_fetch(self):
            raise AssertionError(f"{self} was moved through the driver")

        monkeypatch.setattr(RemoteArray, "fetch", no_fetch)
        loss, pred = evaluate(got, batch)
        monkeypatch.undo()
    ref, _ = jax.jit(mlp.train_step)(state, batch)
    assert_trees_close(jax.jit(eval_step)(ref, batch), (np.asarray(loss), np.asarray(pred)))
    assert len(train.plan.stages) > 1
    assert [st.layers for st in evaluate.plan.stages] == [st.layers for st in train.plan.stages]
    assert evaluate.plan.meshes == train.plan.meshes


def test_state_kept_by_another_step_is_said_to_move_through_the_driver(caplog):
    """Another layout's state reaches a step by value, through the driver: said once per
    compiled step; its own results are then read in place, and nothing more is said."""
    state, batch = setup()
    pipeline = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    with use_cluster(ThreadsCluster(2, 2)):
        trained, _ = meshshard.parallelize(mlp.train_step, method=pipeline)(state, batch)
        one_mesh = meshshard.parallelize(mlp.train_step, method=DataParallel((1, 2)))
        with caplog.at_level("WARNING", logger="meshshard.runtime.executable"):
            got, _ = one_mesh(trained, batch)
            got, _ = one_mesh(got, batch)
    said = [r.getMessage() for r in caplog.records if "fetches them to the driver" in r.message]
    assert len(said) == 1, said
    # stage 1's (stage 0's mesh is the one-mesh step's: its arrays are read in place)
    assert said[0].startswith("6 state arrays (3.8 KiB: args[0].params['dense2']['kernel']")
    ref = state
    for _ in range(3):
        ref, _ = jax.jit(mlp.train_step)(ref, batch)
    assert_trees_close(ref.params, got.params)


def test_layers_on_a_marked_inference_step_names_the_step():
    """The refusal spoke of "the loss" where the step has none."""
    state, batch = setup()  # mlp.MLP marks its layers
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2, layers=2)
    step = meshshard.parallelize(eval_step, method=method)
    with pytest.raises(
        MeshshardInputError,
        match=r"cuts the step into layers automatically, but the step already calls "
        r"mark_pipeline_boundary\(\) 3 times",
    ):
        step.lower(state, batch, cluster=CLUSTER)


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


class _Deep(nn.Module):
    """Three dense layers and no mark_pipeline_boundary(): layers= cuts them."""

    @nn.compact
    def __call__(self, x):
        for width in (16, 16):
            x = jnp.tanh(nn.Dense(width)(x))
        return nn.Dense(1)(x)


@pytest.mark.parametrize("m", [1, 2])
def test_layers_cut_an_inference_step(threads_cluster, m):
    # was refused: "2 pipeline stages were asked for, but the model has no pipeline
    # boundary": layers= cut only a loss inside meshshard.grad
    _, batch = setup()
    state = mlp.make_state(_Deep(), batch["x"])
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2), (1, 2)], layers=2)
    step = meshshard.parallelize(eval_step, method=method)
    assert_trees_close(jax.jit(eval_step)(state, batch), step(state, batch))
    plan = step.lower(state, batch, cluster=CLUSTER)
    stages = [ln for ln in str(plan).splitlines() if ln.startswith("  stage")]
    assert len(stages) == 2 and all("dot_general" in ln for ln in stages)  # a layer each


def test_layers_split_a_scan_over_stacked_layers_in_an_inference_step(threads_cluster):
    from tests.test_unroll_scans import Gated, _case

    state, batches = _case(Gated())

    def predict(params, x):
        return state.apply_fn({"params": params}, x)

    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 4, layers=4)
    step = meshshard.parallelize(predict, method=method)
    x = batches[0]["x"]
    assert_trees_close(jax.jit(predict)(state.params, x), step(state.params, x))
    plan = step.lower(state.params, x, cluster=CLUSTER)
    assert len(plan.stages) == 4
    assert any("which layers=4 may cut between pieces" in n for n in plan.notes)
