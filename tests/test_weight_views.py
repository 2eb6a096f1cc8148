"""The backward recomputes the views of the weights it reads (a stacked layer's row, a
weight cast to bfloat16) instead of keeping them per micro-batch as residuals
(``passes/weight_views.py``); a stage's backward reads the shared copy its forward
receives."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.jaxpr_util import is_marker
from meshshard.passes.weight_views import recompute_weight_views, weight_views
from meshshard.refs import BufferKind, Phase
from tests.random_parity import check_step_parity
from tests.test_unroll_scans import Stacked, _case, train_step

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


def _loss_through_a_view(w, x):
    v = w[1].astype(jnp.bfloat16).astype(jnp.float32)  # a row, cast: a view of w
    return jnp.sum(jnp.tanh(jnp.tanh(x @ v) @ v))  # the second product's backward reads v


def test_the_backward_reads_a_view_recomputed_from_the_weights():
    w = jnp.arange(48.0).reshape(3, 4, 4) / 50
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    closed = jax.make_jaxpr(meshshard.value_and_grad(_loss_through_a_view))(w, x)
    eqns = closed.jaxpr.eqns
    loss = next(i for i, e in enumerate(eqns) if is_marker(e, "loss"))
    views = weight_views(closed.jaxpr, [False, True], loss)
    assert sorted(eqns[i].primitive.name for i in views.values()) == [
        "convert_element_type",
        "convert_element_type",
        "slice",
        "squeeze",
    ]
    after = recompute_weight_views(closed, [False, True])
    a_eqns = after.jaxpr.eqns
    a_loss = next(i for i, e in enumerate(a_eqns) if is_marker(e, "loss"))
    end = next(i for i, e in enumerate(a_eqns) if is_marker(e, "grad_end"))
    forward_made = {v for e in a_eqns[:a_loss] for v in e.outvars}
    backward_reads = {v for e in a_eqns[a_loss + 1 : end] for v in e.invars if hasattr(v, "count")}
    # the backward reads no view the forward made (only x's values and its own views)
    fw_views = {
        v for v in forward_made if v in set(weight_views(after.jaxpr, [False, True], a_loss))
    }
    assert not fw_views & backward_reads
    assert len(a_eqns) == len(eqns) + 4  # the four view equations, once more
    got = jax.core.eval_jaxpr(after.jaxpr, after.consts, w, x)
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, w, x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _residual_bytes(plan):
    return {b.mesh: b.nbytes for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS}


@pytest.mark.parametrize("mark", [True, False], ids=["markers", "layers2"])
def test_stacked_layers_keep_no_weight_rows_per_micro_batch(mark):
    """Each stage kept its layers' weight rows (16 x 16 each) per micro-batch, as the
    forward sliced them out of the stack; a looped model keeps none."""
    state, batches = _case(Stacked(depth=4, mark=mark))
    stages = [(1, 1)] * 5 if mark else [(1, 2)] * 2
    method = PipeshardParallel(num_micro_batches=2, stages=stages, layers=None if mark else 2)
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches[0], cluster=CLUSTER
    )
    kept = [t for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS for t in b.tensors]
    assert kept and all(t.shape != (16, 16) for t in kept), [t.shape for t in kept]
    # a later stage's backward reads the stack's copy its forward receives: one transfer
    stack = [t for t in plan.transfers if t.tensor.name.endswith("['Dense_0']['kernel']")]
    assert stack and all(t.consumer.phase is Phase.FORWARD for t in stack)
    assert len({t.dst_mesh for t in stack}) == len(stack)
    backward = {str(p.name): set(map(str, p.inputs)) for p in plan.programs}
    for t in stack:
        reads = backward.get(f"s{t.dst_mesh}.B") or backward[f"s{t.dst_mesh}.FB"]
        assert str(t.name) in reads


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 4, layers=4, schedule="zb_h1"),
        PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 5),
    ],
    ids=["layers2", "zb_h1-layers4", "markers-5"],
)
def test_recomputed_views_match_jit(threads_cluster, method):
    mark = method.layers is None
    state, batches = _case(Stacked(depth=4, mark=mark, rate=0.3))
    check_step_parity(train_step, method, state, batches)


class _Mixed(nn.Module):
    """Float32 weights computed in bfloat16: each kernel is cast in the forward."""

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = jnp.tanh(nn.Dense(32, dtype=jnp.bfloat16)(x))
            meshshard.mark_pipeline_boundary()
        return nn.Dense(1, dtype=jnp.bfloat16)(x).astype(jnp.float32)


def test_bfloat16_casts_of_the_weights_are_not_kept_per_micro_batch():
    model = _Mixed()
    x = np.ones((8, 32), np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    batch = {"x": x, "y": np.ones((8, 1), np.float32), "key": np.zeros(2, np.uint32)}
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    plan = meshshard.parallelize(train_step, method=method).lower(state, batch, cluster=CLUSTER)
    kept = [t for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS for t in b.tensors]
    assert not [t for t in kept if t.shape == (32, 32)], "a bfloat16 kernel is kept"


class _ViewCrossesACut(nn.Module):
    """A row of a stacked weight taken before the boundary and read after it: the later
    layer's forward reads the row (carried by the boundary), not the stack."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (3, 8, 8))
        row = w[1]
        (x,) = meshshard.mark_pipeline_boundary(jnp.tanh(x @ w[0]))  # only x is marked
        return jnp.tanh(jnp.tanh(x @ row) @ row).sum(-1, keepdims=True)


def test_a_view_read_by_a_layer_without_its_weights_stays_a_view(threads_cluster):
    """The later layer's backward reads the row the boundary carried; recomputing it
    there from the stack would send that stage the whole stack: it is not."""
    model = _ViewCrossesACut()
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    params = model.init(jax.random.key(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    batches = [{"x": x, "y": np.ones((8, 1), np.float32), "key": np.zeros(2, np.uint32)}] * 2
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 2)
    step = check_step_parity(train_step, method, state, batches)
    plan = step.lower(state, batches[0], cluster=CLUSTER)
    assert not [t for t in plan.transfers if t.tensor.shape == (3, 8, 8)]


@pytest.mark.slow
def test_2bw_backward_reads_the_stack_copy_of_its_own_weight_version(threads_cluster):
    """2BW keeps two steps in flight: a stage's backward now reads the stack's copy its
    forward received, which must be that step's weights, not the next step's. Equal to
    the 2BW rule in plain JAX (gradients at the previous step's weights), 5 steps run
    before any is compared."""
    state, _ = _case(Stacked(depth=4, mark=False))
    rng = np.random.RandomState(1)
    batches = [
        {
            "x": rng.randn(8, 6).astype(np.float32),
            "y": rng.randn(8, 1).astype(np.float32),
            "key": np.zeros(2, np.uint32),
        }
        for _ in range(5)
    ]

    def loss_at(params, batch):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    grad = jax.jit(jax.value_and_grad(loss_at))
    ref, stale, want = state, state.params, []
    for batch in batches:
        loss, g = grad(stale, batch)
        stale = ref.params
        ref = ref.apply_gradients(grads=g)
        want.append(loss)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, layers=2, schedule="2bw")
    step = meshshard.parallelize(train_step, method=method)
    got, losses = state, []
    for batch in batches:
        got, loss = step(got, batch)
        losses.append(loss)
    from tests.conftest import assert_trees_close

    assert_trees_close(ref.params, got.params)
    assert_trees_close(want, [np.asarray(x) for x in losses])
