"""Convolutional models under the sharding ILP: rules for convolutions, pooling, pads,
reversals and cumulative sums, their FLOPs, and a CNN whose plan splits its convolutions
(it modelled them replicated, predicting all-gathers of every activation)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshshard
from meshshard import PipeshardParallel, ShardParallel
from meshshard.cluster import ClusterSpec
from meshshard.jaxpr_util import contraction_flops
from meshshard.passes.layer_cluster import eqn_flops
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.shard_ilp import solve_stage
from meshshard.passes.shard_rules import strategies
from runtime.programs import _usable_donations
from tests.random_parity import check_step_parity

CLUSTER = ClusterSpec()
MESH = LogicalMesh.of((1, 4), CLUSTER)
D = ("device",)


def _eqns(fn, *args, name):
    jx = jax.make_jaxpr(fn)(*args).jaxpr
    return [e for e in jx.eqns if e.primitive.name == name]


def _conv(x, k, **kw):
    return jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw
    )


X = jnp.ones((8, 6, 6, 4))
K = jnp.ones((3, 3, 4, 8))


def test_a_convolution_splits_its_batch_its_output_features_or_its_input_features():
    (eqn,) = _eqns(_conv, X, K, name="conv_general_dilated")
    by_ins = {s.ins: s for s in strategies(eqn, MESH)}
    batch = by_ins[((D, (), (), ()), ((), (), (), ()))]  # data parallel: kernel whole
    assert batch.outs == ((D, (), (), ()),) and batch.comms == () and batch.split == 4
    feat = by_ins[(((), (), (), ()), ((), (), (), D))]  # tensor parallel: output channels
    assert feat.outs == (((), (), (), D),) and feat.comms == ()
    contracted = by_ins[(((), (), (), D), ((), (), D, ()))]  # input channels: all-reduce
    assert contracted.outs == (((), (), (), ()),)
    assert [(c.kind, c.nbytes) for c in contracted.comms] == [("all-reduce", 8 * 6 * 6 * 8 * 4)]
    # spatial dims never split (a window reads its neighbours' rows)
    assert all(not s.ins[0][1] and not s.ins[0][2] for s in strategies(eqn, MESH))


def test_the_kernel_gradient_of_a_batch_split_convolution_all_reduces():
    def loss(k, x):
        return jnp.sum(_conv(x, k) ** 2)

    convs = _eqns(jax.grad(loss), K, X, name="conv_general_dilated")
    (kernel_grad,) = [e for e in convs if e.outvars[0].aval.shape == K.shape]
    by_lhs = {s.ins[0]: s for s in strategies(kernel_grad, MESH)}
    split = by_lhs[(D, (), (), ())]  # the activations' batch, now the contracted dim
    assert split.outs == (((), (), (), ()),)
    assert [(c.kind, c.nbytes) for c in split.comms] == [("all-reduce", K.size * 4)]


def test_a_grouped_convolution_splits_its_batch_only():
    (eqn,) = _eqns(
        lambda x, k: _conv(x, k, feature_group_count=4),
        X,
        jnp.ones((3, 3, 1, 8)),
        name="conv_general_dilated",
    )
    outs = {s.outs for s in strategies(eqn, MESH)}
    assert outs == {(((), (), (), ()),), ((D, (), (), ()),)}


def test_convolution_flops_count_the_kernel_window_in_any_layout():
    (hwio,) = _eqns(_conv, X, K, name="conv_general_dilated")
    want = 2 * (8 * 6 * 6 * 8) * (3 * 3 * 4)
    assert contraction_flops(hwio) == eqn_flops(hwio) == want  # was 2*out*3*4*8: HWIO read as OIHW

    def oihw(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")

    (eqn,) = _eqns(
        oihw, jnp.ones((8, 4, 6, 6)), jnp.ones((8, 4, 3, 3)), name="conv_general_dilated"
    )
    assert contraction_flops(eqn) == want


def test_pooling_pads_reversals_and_cumulative_sums_split_the_dims_they_leave_alone():
    def pools(x):
        a = nn.max_pool(x, (2, 2), strides=(2, 2))
        b = nn.avg_pool(x, (3, 3), padding="SAME")
        c = jnp.pad(x, ((0, 0), (1, 1), (0, 0), (0, 0)))
        return a, b, c, jnp.flip(x, axis=2), jnp.cumsum(x, axis=1)

    jx = jax.make_jaxpr(pools)(X).jaxpr
    for e in jx.eqns:
        name = e.primitive.name
        if name not in ("reduce_window_max", "reduce_window_sum", "pad", "rev", "cumsum"):
            continue
        split_dims = {d for s in strategies(e, MESH) for d, axes in enumerate(s.outs[0]) if axes}
        assert split_dims == {0, 3} if name != "cumsum" else {0, 2, 3}, name
        assert all(s.comms == () for s in strategies(e, MESH))

    # the max-pool gradient too
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) ** 2)))(X)
    (sas,) = [e for e in grad.jaxpr.eqns if e.primitive.name == "select_and_scatter_add"]
    split = [s for s in strategies(sas, MESH) if s.outs[0][0]]
    assert split and all(s.ins[0][0] == s.ins[1][0] == s.outs[0][0] for s in split)


def test_the_ilp_runs_a_convolutional_step_data_parallel():
    def step(k1, k2, x):
        def loss(k1, k2):
            h = jax.nn.relu(_conv(x, k1))
            h = nn.avg_pool(h, (2, 2), (2, 2))
            return jnp.mean(_conv(h, k2) ** 2)

        g1, g2 = jax.grad(loss, argnums=(0, 1))(k1, k2)
        return k1 - 0.1 * g1, k2 - 0.1 * g2

    closed = jax.make_jaxpr(step)(K, jnp.ones((3, 3, 8, 8)), jnp.ones((256, 16, 16, 4)))
    sol = solve_stage(closed, MESH, CLUSTER)
    assert not [n for n in sol.notes if "runs replicated" in n], sol.notes
    assert sol.specs[2] == D  # the batch split
    assert sol.specs[0] == () and sol.specs[1] == ()  # small kernels whole
    kinds = {c.kind for _, c in sol.comms}
    assert kinds == {"all-reduce"}  # the kernel gradients only, no gather of activations


def test_only_donations_an_output_can_take_are_made():
    keys = [("a", (4,), "P()"), ("a", (4,), "P(d)"), ("b", (2,), "P()")]
    # an update's accumulators: one whole (no whole output of its shape), two sharded
    ins = [keys[0], keys[1], keys[1], keys[2]]
    outs = [keys[1], keys[1], keys[2]]
    assert _usable_donations([0, 1, 2, 3], ins, outs) == (1, 2, 3)
    assert _usable_donations([1, 2], ins, [keys[1]]) == (1,)


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        meshshard.mark_pipeline_boundary()
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def _cnn_case():
    rng = np.random.RandomState(0)
    batches = [
        {
            "x": rng.randn(8, 8, 8, 3).astype(np.float32),
            "y": rng.randint(0, 10, 8).astype(np.int32),
        }
        for _ in range(2)
    ]
    model = SmallCNN()
    params = model.init(jax.random.key(0), batches[0]["x"])["params"]
    tx = optax.sgd(0.05, momentum=0.9)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, batches


def cnn_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize(
    "method",
    [
        ShardParallel(mesh_shape=(1, 2)),
        ShardParallel(mesh_shape=(1, 2), num_micro_batches=2, sharding="zero3"),
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], sharding="auto"),
    ],
    ids=["auto", "zero3-m2", "pipeshard-auto"],
)
def test_a_cnn_runs_its_convolutions_split_and_equals_jit(sharded_threads_cluster, method):
    state, batches = _cnn_case()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = check_step_parity(cnn_step, method, state, batches)
    assert not [w for w in caught if "donated buffers" in str(w.message)]
    notes = par.plan.notes
    assert not [n for n in notes if "runs replicated" in n], notes
    if isinstance(method, ShardParallel) and method.num_micro_batches == 1:
        # the whole batch of 8 on 2 devices: every 4-d activation is split
        acts = [
            t for b in par.plan.buffers for t in b.tensors if len(t.shape) == 4 and t.shape[0] == 8
        ]
        assert acts and all(t.spec for t in acts), [(t.shape, t.spec) for t in acts]


def test_a_convolutions_input_counts_as_a_saved_activation():
    from meshshard.passes.stage_cost import layer_stats

    def loss(k, x):  # the backward keeps x for the kernel gradient
        return jnp.sum(_conv(x, k))

    jaxpr = jax.make_jaxpr(loss)(K, X).jaxpr
    (stats,) = layer_stats(jaxpr, [], params=[0])
    assert stats.act_bytes == X.size * 4  # was 0: only matmul operands were counted
    assert stats.flops_fwd >= 2 * (8 * 6 * 6 * 8) * (3 * 3 * 4)
