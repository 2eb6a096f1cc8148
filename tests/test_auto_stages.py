"""stages="auto" and layers=: parity with single-device jax.jit (threads), plans, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from meshshard import PipeshardParallel
from meshshard.errors import MeshshardInputError
from tests.conftest import assert_trees_close
from tests.parity import check_parity


def _no_marker_step(params, batch):
    """Five tanh layers and no mark_pipeline_boundary(): layers= must cut it."""

    def loss(ps):
        h = batch["x"]
        for w, b in ps:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h - batch["y"]) ** 2)

    value, grads = meshshard.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def _no_marker_state(seed=0):
    rng = np.random.default_rng(seed)
    dims = [8, 32, 32, 16, 16, 4]
    return [
        (
            jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            jnp.zeros((b,), jnp.float32),
        )
        for a, b in zip(dims, dims[1:], strict=False)
    ]


def _batch(seed):
    rng = np.random.default_rng(100 + seed)
    return {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 4)).astype(np.float32),
    }


@pytest.mark.slow
@pytest.mark.parametrize("remat", [None, "dots"])
def test_layers_auto_cuts_a_loss_without_markers_and_keeps_parity(threads_cluster, remat):
    """With ``remat``, each automatic layer runs under its own ``jax.checkpoint``."""
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4, layers="auto", remat=remat)
    step = meshshard.parallelize(_no_marker_step, method=method)
    ref_step = jax.jit(_no_marker_step)
    ref = got = _no_marker_state()
    for i in range(2):
        ref, ref_loss = ref_step(ref, _batch(i))
        got, got_loss = step(got, _batch(i))
        assert_trees_close(ref, got)
        assert_trees_close(ref_loss, got_loss)
    # five matmuls -> five layers -> four stages of consecutive layers
    layers = [st.layers for st in step.plan.stages]
    assert sorted(x for g in layers for x in g) == list(range(5))
    assert len(layers) == 4


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_stages_auto_keeps_parity(model):
    """Two hosts of two devices, one-host stages: the DP picks where to cut 4 layers."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    method = PipeshardParallel(num_micro_batches=4, stages="auto", submeshes=[(1, 2)])
    with use_cluster(ThreadsCluster(2, 2)):
        step = check_parity(model, method, steps=2 if model == "mlp" else 1)
    plan = step.plan
    assert any(n.startswith("auto: 2 stages") for n in plan.notes), plan.notes
    assert [m.shape for m in plan.meshes] == [(1, 2), (1, 2)]
    assert sorted(x for st in plan.stages for x in st.layers) == [0, 1, 2, 3]


def test_layers_with_markers_is_refused():
    from examples import mlp

    model = mlp.MLP(num_layers=3)
    batch = mlp.make_batch()
    state = mlp.make_state(model, batch["x"])
    step = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(num_micro_batches=1, layers=2)
    )
    with pytest.raises(
        MeshshardInputError,
        match=r"layers=2\) cuts the loss into layers automatically, but the loss already "
        r"calls mark_pipeline_boundary\(\) 2 times; drop layers=",
    ):
        step.lower(state, batch, costs=False)


def test_method_errors_name_the_argument():
    with pytest.raises(MeshshardInputError, match=r"layers=0: pass 'auto', a positive int"):
        PipeshardParallel(num_micro_batches=1, layers=0)
    with pytest.raises(MeshshardInputError, match=r"stages='auto', num_stages=2\): the stage DP"):
        PipeshardParallel(num_micro_batches=1, stages="auto", num_stages=2)
    with pytest.raises(MeshshardInputError, match=r"'uniform', 'auto' or a list of mesh shapes"):
        PipeshardParallel(num_micro_batches=1, stages="best")
    assert "layers='auto'" in repr(PipeshardParallel(num_micro_batches=1, layers="auto"))
    assert "layers" not in repr(PipeshardParallel(num_micro_batches=1))
    with pytest.raises(
        MeshshardInputError, match=r"submeshes=\[\(1, 2\)\] lists the shapes stages='auto' may"
    ):
        PipeshardParallel(num_micro_batches=1, submeshes=[(1, 2)])


def test_step_layer_stats_of_the_mlp():
    """Per layer of the 4-layer MLP (hidden 16, micro-batch 4 of 16 rows): the kernel and
    bias it reads, the 4x16 float32 activation crossing each boundary, and a backward
    with more FLOPs than the forward (two matmuls per forward matmul)."""
    from examples import mlp
    from meshshard.passes.slicing import slice_layers
    from meshshard.passes.stage_cost import step_layer_stats
    from meshshard.passes.trace import trace_step

    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    traced = trace_step(mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=4)
    stats = step_layer_stats(traced, slice_layers(traced.jaxpr))
    assert [s.param_count for s in stats] == [8 * 16 + 16, 16 * 16 + 16, 16 * 16 + 16, 16 * 4 + 4]
    assert [s.out_bytes for s in stats] == [4 * 16 * 4] * 3 + [0]
    assert [s.flops_fwd >= 2 * 4 * 8 * 16 for s in stats[:1]] == [True]
    assert all(s.flops_bwd > s.flops_fwd for s in stats)


def test_stages_auto_on_a_cluster_too_small_says_what_would_fit():
    """Through the API: the 4-layer MLP's 756 parameters (16 bytes each) on 4 devices
    of 2 KiB: no split fits; the error names the model, the cluster and what fits."""
    from examples import mlp
    from meshshard.cluster import ClusterSpec

    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    step = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(num_micro_batches=2, stages="auto")
    )
    tiny = ClusterSpec(num_hosts=2, devices_per_host=2, device_memory=2048)
    with pytest.raises(
        MeshshardInputError,
        match=r"no stage plan fits device memory: the model \(756 parameters, 4 layers\) "
        r"needs 11.8 KiB of parameter state \(16 bytes/parameter\), at best 2.95 KiB per "
        r"device over all 4 devices of local \(2 hosts x 2 devices\), and a device holds "
        r"1.8 KiB usable .* at least 7 such devices, and this cluster holds at most ~461 "
        r"parameters' state: use more or larger devices",
    ):
        step.lower(state, batch, cluster=tiny, costs=False)


def test_stages_auto_with_too_few_layers_for_the_cluster_leaves_devices_idle(
    threads_cluster, caplog
):
    """Three layers on 4 hosts of 2 devices, meshes inside one host (the in-process
    backend's): no three submeshes tile 8 devices, and the step was refused ("cannot
    tile the 8 devices"); the plan now runs on 6 of them, and says so."""
    state = _no_marker_state()[:3]  # three tanh layers, cut by layers="auto"
    method = PipeshardParallel(num_micro_batches=2, stages="auto", layers="auto")
    step = meshshard.parallelize(_no_marker_step, method=method)
    with caplog.at_level("WARNING", logger="meshshard"):
        got, got_loss = step(state, _three_layer_batch(0))
    ref, ref_loss = jax.jit(_no_marker_step)(state, _three_layer_batch(0))
    assert_trees_close(ref, got)
    assert_trees_close(ref_loss, got_loss)
    assert sum(h * d for h, d in (m.shape for m in step.plan.meshes)) == 6
    assert any(
        "the automatic stages use 6 of the 8 devices" in r.getMessage() for r in caplog.records
    )


def _three_layer_batch(seed):
    rng = np.random.default_rng(200 + seed)
    return {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 16)).astype(np.float32),
    }
