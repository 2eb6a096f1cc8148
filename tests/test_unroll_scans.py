"""Scans over stacked layers are cut into pieces a pipeline can split (passes/unroll_scans.py).

A model that stacks its layers under ``nn.scan`` traced to one indivisible equation: a
``mark_pipeline_boundary()`` in the scanned block was refused, and ``layers=N`` put every
scanned layer into one stage.  The pass unrolls a scan whose body marks boundaries and
splits a scan over stacked weights into shorter scans; the step still computes what
``jax.jit`` computes.  Workers are threads of this process.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.extend.core import jaxpr_as_fun

import meshshard
from meshshard import PipeshardParallel
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.layer_cluster import eqn_flops
from meshshard.passes.unroll_scans import (
    counter_indexed_stacks,
    layer_stack_scans,
    marked_scans,
    piece_bounds,
    split_scans,
)
from tests.random_parity import check_step_parity

CLUSTER = ClusterSpec("scans-4x2", 4, 2)


def _stacked(ws, x, reverse=False):
    """Stacked tanh layers with a per-layer output and a constant read by every layer."""
    scale = jnp.float32(0.5)

    def body(h, w):
        h = jnp.tanh(h @ w) * scale + h
        return h, h.sum(-1)

    h, ys = jax.lax.scan(body, x, ws, reverse=reverse)
    return h, ys


@pytest.mark.fast
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("pieces", [1, 2, 3, 5])
def test_split_scans_computes_what_the_scan_computes(pieces, reverse):
    rng = np.random.RandomState(0)
    ws = jnp.asarray(rng.randn(5, 4, 4).astype(np.float32) * 0.5)
    x = jnp.asarray(rng.randn(3, 4).astype(np.float32))
    closed = jax.make_jaxpr(lambda w, x: _stacked(w, x, reverse))(ws, x)
    (i,) = [k for k, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "scan"]
    split = split_scans(closed, {i: pieces})
    scans = [e.params["length"] for e in split.jaxpr.eqns if e.primitive.name == "scan"]
    sizes = [b - a for a, b in piece_bounds(5, pieces)]
    pieces_run = [s for s in sizes if s > 1]  # one-iteration pieces are inlined
    assert scans == (pieces_run[::-1] if reverse else pieces_run)  # last piece first
    want = jaxpr_as_fun(closed)(ws, x)
    got = jaxpr_as_fun(split)(ws, x)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


@pytest.mark.fast
def test_piece_bounds_cover_the_scan_in_near_equal_pieces():
    assert piece_bounds(5, 2) == [(0, 2), (2, 5)] or piece_bounds(5, 2) == [(0, 3), (3, 5)]
    assert piece_bounds(4, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    bounds = piece_bounds(48, 20)
    assert bounds[0][0] == 0 and bounds[-1][1] == 48
    assert {b - a for a, b in bounds} == {2, 3}
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:], strict=False))


@pytest.mark.fast
def test_a_scan_counts_its_body_once_per_iteration():
    ws, x = jnp.ones((6, 4, 4)), jnp.ones((3, 4))
    closed = jax.make_jaxpr(_stacked)(ws, x)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    one = jax.make_jaxpr(lambda w, h: jnp.tanh(h @ w) * 0.5 + h)(ws[0], x)
    matmul = 2 * 3 * 4 * 4
    assert eqn_flops(scan) >= 6 * matmul
    assert eqn_flops(scan) == pytest.approx(6 * sum(eqn_flops(e) for e in one.jaxpr.eqns), rel=0.3)


@pytest.mark.fast
def test_only_scans_over_the_differentiated_weights_are_layer_stacks():
    ws, x = jnp.ones((4, 4, 4)), jnp.ones((6, 3, 4))

    def over_layers(ws, x):
        return _stacked(ws, x[0])[0].sum()

    def over_time(w, x):  # an RNN: scans over the time steps of the data
        return jax.lax.scan(lambda h, xt: (jnp.tanh(h @ w + xt), None), x[0], x)[0].sum()

    j = jax.make_jaxpr(over_layers)(ws, x).jaxpr
    assert len(layer_stack_scans(j, [True, False])) == 1
    assert layer_stack_scans(j, [False, True]) == []  # the stack is not what is differentiated
    j = jax.make_jaxpr(over_time)(ws[0], x).jaxpr
    assert layer_stack_scans(j, [True, False]) == []


class Block(nn.Module):
    """A residual block that marks a boundary after itself; dropout when ``rate``."""

    rate: float = 0.0
    mark: bool = True

    @nn.compact
    def __call__(self, x, _):
        x = x + nn.Dense(16)(jnp.tanh(x))
        x = nn.Dropout(self.rate, deterministic=self.rate == 0.0)(x)
        if self.mark:
            meshshard.mark_pipeline_boundary()
        return x, jnp.mean(x, axis=-1)


class Stacked(nn.Module):
    """An embedding, ``depth`` blocks under ``nn.scan``, and a head reading every block's
    per-example output."""

    depth: int = 4
    rate: float = 0.0
    mark: bool = True
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        block = nn.remat(Block) if self.remat else Block
        layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.depth,
        )
        x, per_layer = layers(self.rate, self.mark)(x, None)
        return nn.Dense(1)(x) + per_layer.sum(0)[:, None]


def _case(model):
    rng = np.random.RandomState(0)
    batches = [
        {
            "x": rng.randn(8, 6).astype(np.float32),
            "y": rng.randn(8, 1).astype(np.float32),
            "key": np.asarray(jax.random.key_data(jax.random.key(i))),
        }
        for i in range(2)
    ]
    params = model.init(jax.random.key(0), batches[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    return state, batches


def train_step(state, batch):
    def loss_fn(params):
        keys = {"dropout": jax.random.wrap_key_data(batch["key"])}
        pred = state.apply_fn({"params": params}, batch["x"], rngs=keys)
        return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _stage_lines(step, state, batch):
    return [
        ln
        for ln in str(step.lower(state, batch, cluster=CLUSTER)).splitlines()
        if ln.startswith("  stage")
    ]


@pytest.mark.fast
def test_boundaries_inside_nn_scan_cut_one_stage_per_layer():
    # was: "mark_pipeline_boundary() is called inside lax.scan / nn.scan ... put the
    # boundary outside it", which nn.scan's stacked layers cannot do
    state, batches = _case(Stacked())
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 5)
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches[0], cluster=CLUSTER
    )
    stages = [ln for ln in str(plan).splitlines() if ln.startswith("  stage")]
    assert len(stages) == 5
    assert all("dot_general" in ln for ln in stages)  # every stage computes a layer
    assert any(
        "lax.scan at test_unroll_scans.py" in n
        and "(4 iterations) unrolled: its body calls mark_pipeline_boundary()" in n
        for n in plan.notes
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 5, schedule="eager_1f1b"),
    ],
    ids=["1f1b-2x2", "eager-5x1"],
)
@pytest.mark.parametrize("rate", [0.0, 0.3], ids=["plain", "dropout"])
def test_boundaries_inside_nn_scan_match_jit(threads_cluster, method, rate):
    state, batches = _case(Stacked(rate=rate))
    check_step_parity(train_step, method, state, batches)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_layers_cut_a_scan_over_stacked_layers(threads_cluster, remat):
    # was: the scan was one equation, so layers=2 gave stage 0 the embedding alone and
    # stage 1 all four blocks
    state, batches = _case(Stacked(depth=4, mark=False, remat=remat))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)
    step = check_step_parity(train_step, method, state, batches)
    plan = step.lower(state, batches[0], cluster=CLUSTER)
    flops = {str(p.name): p.flops for p in plan.programs}
    embed, block = 2 * 4 * 6 * 16, 2 * 4 * 16 * 16  # per micro-batch of 4 rows
    assert flops["s0.F"] >= embed + block  # stage 0 runs scanned blocks, not the embedding alone
    assert flops["s1.F"] >= 2 * block
    assert any("(4 iterations) unrolled: a scan over stacked layers" in n for n in plan.notes)


@pytest.mark.slow
def test_an_inference_step_through_nn_scan_layers_that_mark_is_pipelined(threads_cluster):
    # was refused: "the model's pipeline boundaries are all inside the body of a
    # jax.lax.scan, fori_loop or nn.scan ... loop in Python instead"
    state, batches = _case(Stacked())

    def predict(params, batch):  # (the parity helper passes the first result on)
        return params, state.apply_fn({"params": params}, batch["x"])

    inputs = [{"x": b["x"]} for b in batches]
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 5)
    step = check_step_parity(predict, method, state.params, inputs)
    plan = step.lower(state.params, inputs[0], cluster=CLUSTER)
    assert len([ln for ln in str(plan).splitlines() if ln.startswith("  stage")]) == 5


@pytest.mark.fast
def test_a_scan_over_time_stays_whole_under_layers():
    class RNN(nn.Module):
        @nn.compact
        def __call__(self, x):  # x: (batch, time, features)
            cell = nn.scan(
                nn.SimpleCell,
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=1,
                out_axes=1,
            )(features=8)
            h = nn.Dense(8)(x[:, 0])
            _, hs = cell(h, x)
            return nn.Dense(1)(jnp.tanh(nn.Dense(8)(hs[:, -1])))

    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(8, 5, 8).astype(np.float32), "y": rng.randn(8, 1).astype(np.float32)}
    model = RNN()
    params = model.init(jax.random.key(0), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)], layers=2)
    plan = meshshard.parallelize(step, method=method).lower(state, batch, cluster=CLUSTER)
    assert not [n for n in plan.notes if "lax.scan at" in n]


@pytest.mark.fast
def test_a_boundary_inside_a_remat_inside_a_scan_is_still_named():
    state, batches = _case(Stacked(remat=True))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    with pytest.raises(MeshshardInputError, match=r"inside jax.checkpoint / nn.remat"):
        meshshard.parallelize(train_step, method=method).lower(state, batches[0], cluster=CLUSTER)


@pytest.mark.fast
def test_marked_scans_finds_markers_in_nested_bodies():
    def f(ws, x):
        def body(h, w):
            h = jnp.tanh(h @ w)
            meshshard.mark_pipeline_boundary()
            return h, None

        return jax.lax.scan(body, x, ws)[0].sum()

    j = jax.make_jaxpr(f)(jnp.ones((3, 4, 4)), jnp.ones((2, 4))).jaxpr
    assert list(marked_scans(j).values()) == [3]
    j = jax.make_jaxpr(lambda ws, x: _stacked(ws, x)[0].sum())(
        jnp.ones((3, 4, 4)), jnp.ones((2, 4))
    ).jaxpr
    assert marked_scans(j) == {}


@pytest.mark.slow
def test_boundaries_inside_a_fori_loop_over_stacked_weights_match_jit(threads_cluster):
    # fori_loop with static bounds is a scan whose body indexes the stack by its counter
    rng = np.random.RandomState(0)
    params = {
        "stack": (rng.randn(4, 16, 16) * 0.3).astype(np.float32),
        "out": (rng.randn(16, 1) * 0.3).astype(np.float32),
    }
    batches = [
        {"x": rng.randn(8, 16).astype(np.float32), "y": rng.randn(8, 1).astype(np.float32)}
        for _ in range(2)
    ]

    def step(params, batch):
        def loss_fn(p):
            def layer(i, h):
                h = h + jnp.tanh(h @ p["stack"][i])
                meshshard.mark_pipeline_boundary()
                return h

            h = jax.lax.fori_loop(0, 4, layer, batch["x"])
            return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 4)
    step = check_step_parity(step, method, params, batches)
    plan = step.lower(params, batches[0], cluster=CLUSTER)
    stages = [ln for ln in str(plan).splitlines() if ln.startswith("  stage")]
    assert len(stages) == 4 and all("dot_general" in ln for ln in stages)


@pytest.mark.fast
def test_weights_differentiated_by_a_negative_argnum_are_found():
    state, batches = _case(Stacked(mark=False))

    def step(state, batch):
        def loss_fn(batch, params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn, argnums=-1)(batch, state.params)
        return state.apply_gradients(grads=grads), loss

    inputs = {"x": batches[0]["x"], "y": batches[0]["y"]}
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)
    plan = meshshard.parallelize(step, method=method).lower(state, inputs, cluster=CLUSTER)
    assert any("a scan over stacked layers" in n for n in plan.notes)


@pytest.mark.fast
@pytest.mark.parametrize("sharding", ["auto", "zero2", "zero3"])
def test_the_sharding_ilp_gets_stacked_layers_unrolled(sharding):
    # was: "mesh0 scan runs replicated (no sharding rule)": the ILP has no rule for a
    # scan, so every device computed the whole batch through all the stacked layers
    state, batches = _case(Stacked(mark=False))
    method = meshshard.ShardParallel((1, 2), sharding=sharding)
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches[0], cluster=CLUSTER
    )
    assert not [n for n in plan.notes if "scan runs replicated" in n]
    assert any("which the sharding ILP would lay out as one" in n for n in plan.notes)


@pytest.mark.fast
def test_plain_data_parallelism_keeps_the_scan():
    state, batches = _case(Stacked(mark=False))
    method = meshshard.DataParallel((1, 2))
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches[0], cluster=CLUSTER
    )
    assert not [n for n in plan.notes if "lax.scan at" in n]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        meshshard.ShardParallel((1, 2), sharding="auto", num_micro_batches=2),
        meshshard.ShardParallel((1, 2), sharding="zero3", num_micro_batches=2),
    ],
    ids=["auto", "zero3"],
)
def test_unrolled_stacked_layers_under_the_sharding_ilp_match_jit(threads_cluster, method):
    state, batches = _case(Stacked(mark=False, rate=0.2))
    check_step_parity(train_step, method, state, batches, rtol=1e-4)  # sharded sums' order


class GatedBlock(nn.Module):
    """A residual block that also returns its gate's load, a mean over the batch (an MoE
    layer's balancing loss), one per layer through the scan."""

    mark: bool = False

    @nn.compact
    def __call__(self, x, _):
        gate = nn.softmax(nn.Dense(4)(x))
        load = jnp.mean(gate**2)
        x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
        if self.mark:
            meshshard.mark_pipeline_boundary()
        return x, load


class Gated(nn.Module):
    mark: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        layers = nn.scan(
            GatedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        x, loads = layers(self.mark)(x, None)
        return nn.Dense(1)(x), loads


def gated_step(state, batch):
    def loss_fn(params):
        pred, loads = state.apply_fn({"params": params}, batch["x"])
        mse = jnp.mean((pred - batch["y"]) ** 2)
        return mse + 0.01 * loads.sum(), loads

    (loss, loads), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), (loss, loads)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mark,method",
    [
        (False, PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)),
        (False, PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers="auto")),
        (True, PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 5)),
        (False, meshshard.ShardParallel((1, 2), sharding="zero2", num_micro_batches=2)),
    ],
    ids=["layers2", "layers-auto", "markers", "zero2"],
)
def test_per_layer_losses_of_a_split_scan_combine_over_micro_batches(threads_cluster, mark, method):
    # was refused: "it applies concatenate to a value reduced over the batch": the pieces
    # of a split scan join its per-layer means with a concatenate, which the loss's
    # classification did not know as linear (the scan itself, under DataParallel, ran)
    state, batches = _case(Gated(mark=mark))
    batches = [{"x": b["x"], "y": b["y"]} for b in batches]  # no dropout key
    check_step_parity(gated_step, method, state, batches, rtol=1e-4)


@pytest.mark.fast
def test_the_full_batch_trace_takes_the_micro_batch_cuts():
    # layers= weighs the bytes crossing each cut: activations grow with the batch, values
    # of the weights alone do not, so the micro-batch (4 rows) and the full batch (8 rows)
    # chose cuts 3 equations apart, the two traces no longer paired equation by equation,
    # and the loss was refused ("the step traces differently at micro-batch and
    # full-batch shape")
    from meshshard.autodiff import AutoLayers, LayerCuts, SharingLayerCuts

    state, batches = _case(Gated())
    step = AutoLayers(gated_step, "auto")
    full = {"x": batches[0]["x"], "y": batches[0]["y"]}
    micro = {k: v[:4] for k, v in full.items()}
    full_cuts, micro_cuts = LayerCuts(), LayerCuts()
    jax.make_jaxpr(SharingLayerCuts(step, full_cuts))(state, full)
    jax.make_jaxpr(SharingLayerCuts(step, micro_cuts))(state, micro)
    assert full_cuts.disagrees(micro_cuts)  # each shape alone cuts elsewhere
    shared = LayerCuts(micro_cuts.chosen)
    again = jax.make_jaxpr(SharingLayerCuts(step, shared))(state, full)
    assert shared.chosen == micro_cuts.chosen
    boundaries = [
        i for i, e in enumerate(again.jaxpr.eqns) if e.primitive.name == "pipeline_boundary"
    ]
    micro_trace = jax.make_jaxpr(SharingLayerCuts(step, LayerCuts(micro_cuts.chosen)))(state, micro)
    assert boundaries == [
        i for i, e in enumerate(micro_trace.jaxpr.eqns) if e.primitive.name == "pipeline_boundary"
    ]


def _fori_step(read_row, lo=0, hi=6):
    """Embedding, ``fori_loop(lo, hi)`` over a stack of 8 layers reading ``read_row(ws,
    i)``, head: SGD."""

    def step(params, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["emb"])
            h = jax.lax.fori_loop(lo, hi, lambda i, h: h + jnp.tanh(h @ read_row(p["ws"], i)), h)
            return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def _fori_case():
    rng = np.random.RandomState(0)
    params = {
        "emb": (rng.randn(6, 16) * 0.3).astype(np.float32),
        "ws": (rng.randn(8, 16, 16) * 0.3).astype(np.float32),
        "head": (rng.randn(16, 1) * 0.3).astype(np.float32),
    }
    batches = [
        {"x": rng.randn(8, 6).astype(np.float32), "y": rng.randn(8, 1).astype(np.float32)}
        for _ in range(2)
    ]
    return params, batches


def _row(ws, i):
    return ws[i]


@pytest.mark.fast
@pytest.mark.parametrize(
    "read_row,found",
    [
        (_row, True),
        (lambda ws, i: jax.lax.dynamic_slice_in_dim(ws, i, 1)[0], True),
        # a jit-wrapped helper hides the row read in its own body: not followed (the
        # loop stays whole, as before)
        (lambda ws, i: jax.lax.dynamic_index_in_dim(ws, i, keepdims=False), False),
        (lambda ws, i: ws[i + 1], False),  # the next row: not row i
        (lambda ws, i: ws[i] + ws.mean(0), False),  # the whole stack too
        (lambda ws, i: ws[0], False),  # a fixed row
    ],
    ids=["index", "dynamic-slice", "jitted-index", "next-row", "whole-stack-too", "fixed-row"],
)
def test_a_fori_loop_reading_stacked_rows_by_its_counter_is_found(read_row, found):
    params, batches = _fori_case()

    def loss(p, x):
        h = jnp.tanh(x @ p["emb"])
        return jax.lax.fori_loop(0, 6, lambda i, h: h + jnp.tanh(h @ read_row(p["ws"], i)), h)

    jaxpr = jax.make_jaxpr(loss)(params, batches[0]["x"]).jaxpr
    weights = [True] * 3 + [False]
    assert bool(counter_indexed_stacks(jaxpr, weights)) == found


@pytest.mark.slow
@pytest.mark.parametrize("lo,hi", [(0, 6), (2, 8)])
def test_layers_split_a_fori_loop_over_stacked_weights(threads_cluster, lo, hi):
    # was: the fori_loop stayed one equation, so layers=2 gave stage 0 the embedding
    # alone and stage 1 all six layers and the head
    params, batches = _fori_case()
    step = _fori_step(_row, lo, hi)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)
    step = check_step_parity(step, method, params, batches)
    plan = step.lower(params, batches[0], cluster=CLUSTER)
    flops = {str(p.name): p.flops for p in plan.programs}
    layer = 2 * 4 * 16 * 16  # one stacked layer's matmul on a micro-batch of 4 rows
    assert flops["s0.F"] >= 2 * layer and flops["s1.F"] >= 2 * layer
    assert any("fori_loop at test_unroll_scans.py" in n for n in plan.notes)


@pytest.mark.slow
def test_a_fori_loop_reading_the_next_row_stays_whole_and_matches_jit(threads_cluster):
    params, batches = _fori_case()
    step = _fori_step(lambda ws, i: ws[i + 1], 0, 6)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], layers=2)
    check_step_parity(step, method, params, batches)


@pytest.mark.slow
def test_a_fori_loop_over_stacked_weights_under_zero3_matches_jit(threads_cluster):
    params, batches = _fori_case()
    method = meshshard.ShardParallel((1, 2), sharding="zero3", num_micro_batches=2)
    step = check_step_parity(_fori_step(_row), method, params, batches, rtol=1e-4)
    plan = step.lower(params, batches[0], cluster=CLUSTER)
    assert not [n for n in plan.notes if "scan runs replicated" in n]
