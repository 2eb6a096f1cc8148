"""Behaviour-level pipeline tests of Alpa (alpa-projects/alpa, tests/pipeline_parallel/),
ported to meshshard's API: the facts each test checks carry over, the code does not.
Each test names its origin; what could not be ported is listed in tests/peer/README.md.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state
from jax import lax

import meshshard
from examples import bert, mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from meshshard.verify import verify
from tests.conftest import assert_trees_close

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined model

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


class TiedModel(nn.Module):
    """Tied input and output embedding with one boundary between them."""

    vocab: int = 256
    hidden: int = 16

    def setup(self):
        self.embed = nn.Embed(self.vocab, self.hidden)

    def __call__(self, x):
        x = self.embed(x)
        meshshard.mark_pipeline_boundary()
        return x @ self.embed.variables["params"]["embedding"].T


def tied_train_step(state, batch):
    def loss_fn(params):
        out = state.apply_fn(params, batch["x"])
        y = jax.nn.one_hot(batch["y"], out.shape[-1])
        return -jnp.sum(y * jax.nn.log_softmax(out, axis=-1), axis=-1).sum()  # a summed loss

    grads = meshshard.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


def test_tied_embedding_pipeshard(threads_cluster):
    # origin: tests/pipeline_parallel/test_tied_embedding.py::test_tied_embedding_pipeshard_parallel
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.integers(0, 256, (8, 8)).astype(np.int32),
        "y": rng.integers(0, 256, (8, 8)).astype(np.int32),
    }
    model = TiedModel()
    params = model.init(jax.random.PRNGKey(0), batch["x"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    step = meshshard.parallelize(
        tied_train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    got = step(state, batch)
    assert_trees_close(jax.jit(tied_train_step)(state, batch).params, got.params)


def mlp_inference_step(state, batch):
    out = state.apply_fn({"params": state.params}, batch["x"])
    return out, jnp.mean((out - batch["y"]) ** 2)


def test_mlp_inference_micro_batches(threads_cluster):
    # origin: tests/pipeline_parallel/test_inference_only.py::test_mlp (schedule
    # "inference", 4 micro-batches, per-example outputs and the loss)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(
        mlp_inference_step, method=PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    )
    got = step(state, batch)
    assert_trees_close(jax.jit(mlp_inference_step)(state, batch), got)
    assert step.plan.schedule.name == "inference"


def test_outputs_of_a_step_without_arguments(threads_cluster):
    # origin: tests/pipeline_parallel/test_inference_only.py::test_output (a step of no
    # arguments, two stages, returning arrays it makes and a Python int)
    def func():
        a = jnp.ones(32)
        meshshard.mark_pipeline_boundary()
        b = jnp.ones(32) * 2
        return a, b, 3

    step = meshshard.parallelize(
        func, method=PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    )
    a, b, c = step()
    np.testing.assert_array_equal(np.asarray(a), np.ones(32, np.float32))
    np.testing.assert_array_equal(np.asarray(b), np.full(32, 2.0, np.float32))
    assert int(c) == 3 and np.asarray(c).dtype == np.int32
    ref = jax.jit(func)()
    assert [(np.shape(x), np.asarray(x).dtype) for x in (a, b, c)] == [
        (np.shape(x), x.dtype) for x in ref
    ]
    assert len(step.plan.meshes) == 2


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=1, stages="auto", sharding="auto"),
        PipeshardParallel(num_micro_batches=2, stages="auto"),
    ],
    ids=["auto-sharding-m1", "m2"],
)
def test_mlp_inference_auto_stages(threads_cluster, method):
    # origin: tests/pipeline_parallel/test_inference_auto.py::test_mlp (schedule
    # "inference", stages and meshes chosen by the stage DP)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(mlp_inference_step, method=method)
    got = step(state, batch)
    assert_trees_close(jax.jit(mlp_inference_step)(state, batch), got)
    assert step.plan.schedule.name == "inference"


def global_norm_and_all_le_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    grads = meshshard.grad(loss_fn)(state.params)
    norm = optax.global_norm(grads)
    new_grads = jax.tree.map(lambda g: g / norm, grads)
    all_le = jnp.array(True)
    for g in jax.tree.leaves(grads):
        all_le &= jnp.all(lax.le(g, 1.0))
    return state.apply_gradients(grads=new_grads), (new_grads, all_le)


def test_global_norm_and_all_le_are_cross_mesh_all_reduces(threads_cluster):
    # origin: tests/pipeline_parallel/test_global_norm.py::test_glob_norm_and_all_le
    # (Alpa checks two CrossMeshAllReduce ops, SUM and AND, in the HLO; meshshard shows
    # them in the plan and runs them as COLL allreduce)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(
        global_norm_and_all_le_step,
        method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
    )
    got_state, (got_grads, got_le) = step(state, batch)
    ref_state, (ref_grads, ref_le) = jax.jit(global_norm_and_all_le_step)(state, batch)
    assert_trees_close((ref_state.params, ref_grads), (got_state.params, got_grads))
    assert bool(got_le) == bool(ref_le)
    assert sorted(r.op for r in step.plan.reductions) == ["and", "sum"]
    assert verify(step.plan) == []


class RematMLP(nn.Module):
    """``num_layers`` Dense+tanh layers, each optionally under ``nn.remat``, a boundary
    between them, or none (``markers=False``) for automatic layer slicing."""

    hidden: int = 16
    num_layers: int = 4
    remat: bool = False
    markers: bool = True

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(nn.Dense) if self.remat else nn.Dense
        for i in range(self.num_layers):
            x = jnp.tanh(layer(self.hidden, name=f"dense{i}")(x))
            if self.markers and i < self.num_layers - 1:
                meshshard.mark_pipeline_boundary()
        return x


def mlp_value_and_grad_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def mlp_grad_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return state.apply_gradients(grads=meshshard.grad(loss_fn)(state.params))


def _mlp_state_and_batch(model, batch_size=64, hidden=16):
    batch = mlp.make_batch(batch_size=batch_size, in_dim=hidden, out_dim=hidden)
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    return state, batch


@pytest.mark.parametrize(
    "model, step, layers",
    [
        # origin: tests/pipeline_parallel/test_numerical_correctness.py::test_mlp (run_mlp:
        # manual markers, 4 micro-batches, uniform stages, value_and_grad)
        (RematMLP(), mlp_value_and_grad_step, None),
        # origin: the same with grad instead of value_and_grad (run_mlp's other form)
        (RematMLP(), mlp_grad_step, None),
        # origin: tests/pipeline_parallel/test_remat.py::test_mlp_remat
        (RematMLP(remat=True), mlp_value_and_grad_step, None),
        # origin: run_mlp(manual_pipeline_layer=False): AutoLayerOption(layer_num=2)
        (RematMLP(markers=False), mlp_value_and_grad_step, 2),
    ],
    ids=["manual", "grad", "remat", "auto_layers"],
)
def test_mlp_pipeshard(threads_cluster, model, step, layers):
    state, batch = _mlp_state_and_batch(model)
    method = PipeshardParallel(num_micro_batches=4, layers=layers, stages=[(1, 2)] * 2)
    got = meshshard.parallelize(step, method=method)(state, batch)
    assert_trees_close(jax.jit(step)(state, batch), got)


def mlp_grads_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return meshshard.grad(loss_fn)(state.params)


def test_2_layer_mlp_returns_gradients(threads_cluster):
    # origin: tests/pipeline_parallel/test_mlp.py::test_2_layer_mlp_pipeshard_parallel
    # (the step returns the gradients themselves, PipeshardParallel's defaults)
    state, batch = _mlp_state_and_batch(RematMLP(hidden=64, num_layers=2), hidden=64)
    got = meshshard.parallelize(
        mlp_grads_step, method=PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    )(state, batch)
    assert_trees_close(jax.jit(mlp_grads_step)(state, batch), got)


def test_two_graphs_run_side_by_side(threads_cluster):
    # origin: tests/pipeline_parallel/test_multi_graph.py::test_2_mlp (two parallelized
    # steps with one method compile two executables; each computes its own step)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    state_a, batch_a = _mlp_state_and_batch(RematMLP(), batch_size=16)
    state_b, batch_b = _mlp_state_and_batch(
        RematMLP(num_layers=2, hidden=8), batch_size=16, hidden=8
    )
    step_a = meshshard.parallelize(mlp_value_and_grad_step, method=method)
    step_b = meshshard.parallelize(mlp_value_and_grad_step, method=method)
    ref = jax.jit(mlp_value_and_grad_step)
    for step, state, batch in [(step_a, state_a, batch_a), (step_b, state_b, batch_b)] * 2:
        assert_trees_close(ref(state, batch), step(state, batch))
    assert step_a.plan is not step_b.plan
    assert step_a.plan.fingerprint != step_b.plan.fingerprint


@pytest.mark.parametrize("num_layers", [2])
def test_n_layer_bert(threads_cluster, num_layers):
    # origin: tests/pipeline_parallel/test_numerical_correctness.py::test_2_layer_bert
    # (value_and_grad, uniform stages, one boundary per encoder layer)
    batch = bert.make_batch(batch_size=4)
    state = bert.make_state(
        bert.Encoder(d_model=16, num_heads=2, num_layers=num_layers, dropout=0.0), batch
    )
    step = meshshard.parallelize(
        bert.train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    ref_state, ref_loss = jax.jit(bert.train_step)(state, batch)
    got_state, got_loss = step(state, batch)
    assert_trees_close((ref_state.params, ref_loss), (got_state.params, got_loss), rtol=1e-4)


class ScaledBertState(bert.KeyedState):
    dynamic_scale: flax_dynamic_scale.DynamicScale


def bert_dynamic_scale_step(state, batch):
    key, dropout_key = jax.random.split(state.key)
    loss_fn = bert.loss_of(state, batch, dropout_key)
    dyn, finite, loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(state.params)
    new = state.apply_gradients(grads=grads)
    keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
    return new.replace(
        params=jax.tree.map(keep, new.params, state.params),
        opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
        dynamic_scale=dyn,
        key=key,
    ), (loss, finite)


def test_bert_global_norm_dynamic_scale(threads_cluster):
    # origin: tests/pipeline_parallel/test_global_norm.py::test_global_norm_dynamic_scale
    # (and ::test_dynamic_scale, which it contains; both skipped in Alpa: "no data to test
    # efficiently"): a 2-layer BERT with dynamic loss scaling and global-norm clipping.
    # The reference runs Flax's DynamicScale under jax.jit
    batch = bert.make_batch(batch_size=4)
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3))
    model = bert.Encoder(d_model=16, num_heads=2, num_layers=2, dropout=0.1)
    keyed = bert.make_state(model, batch, tx=tx)
    fields = {
        f: getattr(keyed, f) for f in ("step", "apply_fn", "params", "tx", "opt_state", "key")
    }
    ref = ScaledBertState(**fields, dynamic_scale=flax_dynamic_scale.DynamicScale())
    got = ScaledBertState(**fields, dynamic_scale=meshshard.DynamicScale())
    step = meshshard.parallelize(
        bert_dynamic_scale_step,
        method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
    )
    ref_step = jax.jit(bert_dynamic_scale_step)
    for seed in range(2):
        batch = bert.make_batch(batch_size=4, seed=seed)
        ref, (ref_loss, ref_finite) = ref_step(ref, batch)
        got, (loss, finite) = step(got, batch)
        assert bool(finite) and bool(ref_finite)
        assert int(got.dynamic_scale.fin_steps) == int(ref.dynamic_scale.fin_steps) == seed + 1
        assert_trees_close((ref.params, ref_loss), (got.params, loss), rtol=1e-4)
    assert "sum" in [r.op for r in step.plan.reductions]  # the norm is a cross-mesh sum


def test_pipeline_marker_is_an_identity():
    # origin: tests/pipeline_parallel/test_pipeline_marker.py::test_jax_graph and
    # ::test_transpose (the marker computes nothing, with or without jit)
    x = np.random.default_rng(0).random((10, 8)).astype(np.float32)
    y = np.random.default_rng(1).random((10, 8)).astype(np.float32)

    def f(x, y):
        a, b = meshshard.mark_pipeline_boundary(x + y, x * y)
        (z,) = meshshard.mark_pipeline_boundary(a + b)
        return z

    def g(x):
        (x,) = meshshard.mark_pipeline_boundary(x)
        meshshard.mark_pipeline_boundary()
        return jnp.transpose(x, (1, 0))

    np.testing.assert_allclose(f(x, y), x + y + x * y, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, y), x + y + x * y, rtol=1e-6)
    np.testing.assert_array_equal(g(x), x.T)
    np.testing.assert_array_equal(jax.jit(g)(x), x.T)
    np.testing.assert_allclose(jax.grad(lambda x: f(x, y).sum())(x), 1 + y, rtol=1e-6)


# Alpa's "small_power_of_two" submeshes on one host: (1, 1), (1, 2); the threads backend
# runs single-host meshes (Alpa's (h, D) choices need Ray)
ONE_HOST_SUBMESHES = [(1, 1), (1, 2)]


@pytest.mark.parametrize(
    "model, layers",
    [
        # origin: tests/pipeline_parallel/test_stage_construction.py::test_mlp_stage_construction
        (RematMLP(), None),
        # origin: tests/pipeline_parallel/test_stage_construction.py::test_mlp_layer_and_stage
        (RematMLP(markers=False), "auto"),
    ],
    ids=["stage", "layer_and_stage"],
)
def test_mlp_auto_stage_construction(threads_cluster, model, layers):
    state, batch = _mlp_state_and_batch(model)
    method = PipeshardParallel(
        num_micro_batches=4, stages="auto", layers=layers, submeshes=ONE_HOST_SUBMESHES
    )
    step = meshshard.parallelize(mlp_value_and_grad_step, method=method)
    got = step(state, batch)
    assert_trees_close(jax.jit(mlp_value_and_grad_step)(state, batch), got)
    assert all(m.shape in ONE_HOST_SUBMESHES for m in step.plan.meshes)
    assert verify(step.plan) == []


def bert_inference_step(state, batch):
    logits = state.apply_fn(
        {"params": state.params}, batch["tokens"], batch["segments"], batch["padding"]
    )
    return logits, bert.mlm_loss(logits, batch)


def test_bert_inference_micro_batches(threads_cluster):
    # origin: tests/pipeline_parallel/test_inference_only.py::test_bert (forward only,
    # per-example outputs concatenated, the loss combined over micro-batches)
    batch = bert.make_batch(batch_size=8)
    state = bert.make_state(bert.Encoder(d_model=16, num_heads=2, num_layers=2, dropout=0.0), batch)
    step = meshshard.parallelize(
        bert_inference_step, method=PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2)
    )
    assert_trees_close(jax.jit(bert_inference_step)(state, batch), step(state, batch), rtol=1e-4)
    assert step.plan.schedule.name == "inference"


def test_bert_inference_auto_stages():
    # origin: tests/pipeline_parallel/test_inference_auto.py::test_bert (schedule
    # "inference", manual layers, stages chosen by the stage DP on (1, 2) submeshes of
    # one 4-device host, the sharding inside each chosen by the ILP; one micro-batch)
    batch = bert.make_batch(batch_size=8)
    state = bert.make_state(bert.Encoder(d_model=16, num_heads=2, num_layers=2, dropout=0.0), batch)
    method = PipeshardParallel(
        num_micro_batches=1, stages="auto", sharding="auto", submeshes=[(1, 2)]
    )
    step = meshshard.parallelize(bert_inference_step, method=method)
    with use_cluster(ThreadsCluster(1, 4)):
        got = step(state, batch)
        assert_trees_close(jax.jit(bert_inference_step)(state, batch), got, rtol=1e-4)
    assert step.plan.schedule.name == "inference"
    assert [tuple(m.shape) for m in step.plan.meshes] == [(1, 2), (1, 2)]


def test_mlp_inference_auto_stages_from_measured_stages():
    # origin: tests/pipeline_parallel/test_inference_auto.py::test_mlp_1d (as test_mlp,
    # with the stage DP's layer costs profiled: Alpa's layer_profile_mode="individual"
    # times each layer alone; lower(profile=True) times the first plan's stages on the
    # cluster and plans again from them)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    method = PipeshardParallel(num_micro_batches=1, stages="auto", submeshes=[(1, 2)])
    step = meshshard.parallelize(mlp_inference_step, method=method)
    with use_cluster(ThreadsCluster(1, 4)):
        plan = step.lower(state, batch, profile=True)
        got = step(state, batch)
        assert_trees_close(jax.jit(mlp_inference_step)(state, batch), got)
    assert step.plan.fingerprint == plan.fingerprint
    assert any(n.startswith("stage DP costs from 2 measured stage(s)") for n in step.plan.notes)
    assert step.plan.schedule.name == "inference"
    assert [tuple(m.shape) for m in step.plan.meshes] == [(1, 2), (1, 2)]
