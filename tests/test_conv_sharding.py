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
CONV = "conv_general_dilated"


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


def _grouped(groups, in_per_group, out_per_group):
    """The convolutions of a grouped layer's step (forward, kernel and input gradients)."""
    x = jnp.ones((4, 6, 6, groups * in_per_group))
    k = jnp.ones((3, 3, in_per_group, groups * out_per_group))

    def loss(x, k):
        return jnp.sum(_conv(x, k, feature_group_count=groups) ** 2)

    jx = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, k).jaxpr
    return [e for e in jx.eqns if e.primitive.name in ("conv_general_dilated", "reshape")]


def test_a_depthwise_convolution_splits_its_batch_or_whole_groups():
    # one input and one output feature per group: whole groups need no communication,
    # in the forward, the input gradient and the kernel gradient
    fwd, kgrad, *rest = _grouped(16, 1, 1)
    assert kgrad.params["batch_group_count"] == 16
    outs = {s.outs: s for s in strategies(fwd, MESH)}
    assert set(outs) == {(((), (), (), ()),), ((D, (), (), ()),), (((), (), (), D),)}
    assert outs[(((), (), (), D),)].ins == (((), (), (), D), ((), (), (), D))
    assert all(s.comms == () for s in outs.values())
    by_ins = {s.ins: s for s in strategies(kgrad, MESH)}
    groups = by_ins[(((), (), (), D), ((), (), (), D))]  # channels of x and of dy
    assert groups.outs == (((), (), (), D),) and groups.comms == ()
    batch = by_ins[((D, (), (), ()), (D, (), (), ()))]  # the batch, now contracted
    assert batch.outs == (((), (), (), ()),) and [c.kind for c in batch.comms] == ["all-reduce"]
    # the kernel's reshapes (one of them transposing) carry the group split through
    for eqn in rest:
        assert any(any(s.outs[0]) for s in strategies(eqn, MESH)), eqn


def test_other_grouped_convolutions_run_replicated_as_xla_runs_them():
    # two input features per group: XLA's partitioner gathers the input for any split
    fwd, kgrad, *_, dgrad = _grouped(4, 2, 2)
    assert {s.outs for s in strategies(fwd, MESH)} == {(((), (), (), ()),)}
    assert {s.outs for s in strategies(dgrad, MESH)} == {(((), (), (), ()),)}
    # its kernel gradient (batch groups) does split: each group reads its own block
    assert any(s.outs[0][3] for s in strategies(kgrad, MESH))


@pytest.mark.parametrize("shape", [(16, 1, 1), (8, 1, 2), (4, 2, 2)], ids=str)
def test_grouped_convolution_strategies_compile_to_the_collectives_they_price(shape):
    """Each strategy of a grouped layer's convolutions and reshapes, compiled by XLA with
    its layouts: the program holds exactly the collectives the strategy predicts."""
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from meshshard.passes.shard_rules import to_spec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("host", "device"))
    for eqn in _grouped(*shape):
        args = [jnp.ones(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        for s in strategies(eqn, MESH):

            def run(*a, eqn=eqn):
                return eqn.primitive.bind(*a, **eqn.params)

            shard = [NamedSharding(mesh, PartitionSpec(*to_spec(lay))) for lay in s.ins]
            out = NamedSharding(mesh, PartitionSpec(*to_spec(s.outs[0])))
            hlo = jax.jit(run, in_shardings=shard, out_shardings=out).lower(*args).compile()
            found = re.findall(r"(all-reduce|all-gather|all-to-all)(?:-start)?\(", hlo.as_text())
            assert sorted(set(found)) == sorted({c.kind for c in s.comms}), (eqn, s.name)


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


class BatchNormCNN(nn.Module):
    """Alpa's conv test model (tests/shard_parallel/test_conv.py): stride-2 convolutions,
    BatchNorm, ReLU and a stride-1 max-pool."""

    layers: int = 3
    features: int = 16

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.Conv(self.features, (3, 3), strides=(2, 2), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
        return x


def batch_norm_step(state, batch):
    def loss_fn(params):
        variables = {"params": params, "batch_stats": state.batch_stats}
        out, updates = state.apply_fn(variables, batch["x"], mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), updates

    grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])


class BatchStatsState(train_state.TrainState):
    batch_stats: dict


def batch_norm_case(batch, image, features, layers=3):
    """(state, batch) of :class:`BatchNormCNN` on ``batch`` random images."""
    model = BatchNormCNN(layers, features)
    return batch_stats_case(model, batch, image, features, image // 2**layers)


def batch_stats_case(model, batch, image, features, out_side):
    """(state, batch) of a model with ``batch_stats`` on ``batch`` random images, targets
    of ``out_side`` x ``out_side`` x ``features``; momentum SGD."""
    rng = np.random.default_rng(0)
    data = {
        "x": rng.standard_normal((batch, image, image, features)).astype(np.float32),
        "y": rng.standard_normal((batch, out_side, out_side, features)).astype(np.float32),
    }
    variables = model.init(jax.random.key(0), data["x"])
    state = BatchStatsState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.1, momentum=0.9),
        batch_stats=variables["batch_stats"],
    )
    return state, data


def test_a_convolution_reads_its_operands_so_the_ilp_prefers_its_batch_split():
    """Splitting a convolution's output features leaves each device reading the whole
    input; the ILP priced only FLOPs and writes, found the two splits tied, and chose the
    output features for a BatchNorm CNN, which ran 1.8x slower than data parallel."""
    from meshshard.passes.shard_ilp import _strategy_cost

    (eqn,) = _eqns(_conv, jnp.ones((64, 16, 16, 16)), jnp.ones((3, 3, 16, 16)), name=CONV)
    by_ins = {s.ins: s for s in strategies(eqn, MESH)}
    batch = _strategy_cost(eqn, by_ins[((D, (), (), ()), ((), (), (), ()))], MESH)
    features = _strategy_cost(eqn, by_ins[(((), (), (), ()), ((), (), (), D))], MESH)
    read = 64 * 16 * 16 * 16 * 4 * (1 - 1 / 4) - 3 * 3 * 16 * 16 * 4 * (1 - 1 / 4)
    assert features - batch == pytest.approx(read / MESH.memory_bandwidth)

    state, data = batch_norm_case(128, 32, 16)
    step = meshshard.parallelize(batch_norm_step, method=ShardParallel((1, 4)))
    one_host = ClusterSpec(num_hosts=1, devices_per_host=4)
    plan = step.lower(state, data, cluster=one_host, costs=False)
    specs = {t.name: t.spec for b in plan.buffers for t in b.tensors}
    assert specs["args[1]['x']"] == specs["args[1]['y']"] == ("device",)  # data parallel
    kernels = [spec for name, spec in specs.items() if ".params[" in name and "kernel" in name]
    assert len(kernels) == 3 and not any(kernels), specs
