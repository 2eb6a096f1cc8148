"""Update steps that combine every stage's values: global-norm clipping, MultiSteps,
learning-rate schedules; partial reductions per mesh plus a cross-mesh all-reduce."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import meshshard
from examples import gpt, mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.passes.apply_placement import ALLREDUCE_MAX_BYTES
from meshshard.verify import verify
from tests.conftest import assert_trees_close

CLUSTER = ClusterSpec("golden-4x2", 4, 2)


def clip_adamw():
    return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))


def multi_steps():
    return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


def scheduled():
    return optax.adam(optax.linear_schedule(1e-2, 1e-3, transition_steps=3))


OPTIMIZERS = {"clip_adamw": clip_adamw, "multisteps": multi_steps, "schedule": scheduled}


def mlp_setup(tx, num_layers=4):
    model = mlp.MLP(num_layers=num_layers)
    batch = mlp.make_batch(batch_size=16)
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, lambda i: mlp.make_batch(batch_size=16, seed=i), mlp.train_step


def gpt_setup(tx, tied=False):
    model = gpt.GPT(num_layers=4, tie_embeddings=tied)
    batch = gpt.make_batch(batch_size=8)
    params = model.init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, lambda i: gpt.make_batch(batch_size=8, seed=i), gpt.train_step


def check(setup, method, steps=3, rtol=1e-5):
    """Parameters, optimizer state and loss after each step equal single-device jax.jit."""
    state, batches, train_step = setup
    ref_step = jax.jit(train_step)
    step = meshshard.parallelize(train_step, method=method)
    ref, got = state, state
    for i in range(steps):
        ref, ref_loss = ref_step(ref, batches(i))
        got, got_loss = step(got, batches(i))
        assert_trees_close(ref.params, got.params, rtol=rtol)
        assert_trees_close(ref.opt_state, got.opt_state, rtol=rtol)
        assert_trees_close(ref_loss, got_loss, rtol=rtol)
    return step


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stages", [2, 4])
def test_cross_stage_update_matches_jit(threads_cluster, opt, stages):
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * stages)
    step = check(mlp_setup(OPTIMIZERS[opt]()), method)
    assert verify(step.plan) == []


def test_clipping_gpt_four_stages_gpipe(threads_cluster):
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 4, schedule="gpipe")
    check(gpt_setup(clip_adamw()), method, rtol=2e-5)


def test_clip_plan_shows_one_allreduce_of_the_squared_norm():
    state, batches, train_step = mlp_setup(clip_adamw())
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches(0), cluster=CLUSTER
    )
    assert verify(plan) == []
    assert [r.op for r in plan.reductions] == ["sum"]
    (r,) = plan.reductions
    assert r.tensor.shape == () and r.group == (0, 1) and r.leaders == (0, 1)
    # optax sums the squared norms leaf by leaf (dense0, dense1 on mesh0, then dense2,
    # dense3 on mesh1): mesh0's running sum is one term, mesh1 adds its four leaves
    terms = {m: len(vs) for m, vs in r.parts}
    assert terms == {0: 1, 1: 4}
    text = str(plan)
    assert re.search(r"all-reduces:\n  r0  %\d+  f32\[\]  4 B  all-reduce sum of mesh0", text)
    for w in (0, 1):
        tokens = next(s for s in plan.streams if s.worker == w).tokens()
        assert "COLL allreduce r0 #0 [w0,w1]" in tokens
        run = f"RUN m{w}.apply0 (A{w} P{w} S{w} K{w}) -> (K{w} r0)"
        assert tokens.index(run) < tokens.index("COLL allreduce r0 #0 [w0,w1]")
        assert tokens.index("COLL allreduce r0 #0 [w0,w1]") < tokens.index("WAIT r0")
    assert meshshard.Plan.from_json(plan.to_json()) == plan


def test_all_gradients_check_combines_with_and():
    """``all(g <= 1)`` over every gradient: an ``and`` all-reduce; the update uses it."""

    def step_fn(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        small = jax.tree_util.tree_reduce(
            jnp.logical_and, jax.tree.map(lambda g: jnp.all(jnp.abs(g) <= 0.05), grads)
        )
        grads = jax.tree.map(lambda g: jnp.where(small, g, 0.5 * g), grads)
        return state.apply_gradients(grads=grads), (loss, small)

    state, batches, _ = mlp_setup(optax.sgd(0.1))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    with meshshard.runtime.cluster.use_cluster(meshshard.runtime.cluster.ThreadsCluster(4, 2)):
        step = meshshard.parallelize(step_fn, method=method)
        ref, got = state, state
        for i in range(2):
            ref, (ref_loss, ref_small) = jax.jit(step_fn)(ref, batches(i))
            got, (got_loss, got_small) = step(got, batches(i))
            assert bool(ref_small) == bool(got_small)
            assert_trees_close(ref.params, got.params)
    assert [r.op for r in step.plan.reductions] == ["and"]


def test_large_cross_stage_value_moves_through_the_resharding_planner():
    """A combination of values too big for an all-reduce is computed on one mesh: the
    other mesh's operand arrives as a transfer between update phases."""

    def step_fn(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        first, last = grads["dense0"]["kernel"], grads["dense1"]["kernel"]
        mixed = first[:, :4] @ last[:4, :]  # (8, 4) from both stages' gradients
        return state.apply_gradients(grads=grads), mixed

    state, batches, _ = mlp_setup(optax.sgd(0.1), num_layers=2)
    assert state.params["dense0"]["kernel"].size * 4 > ALLREDUCE_MAX_BYTES // 16
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    with meshshard.runtime.cluster.use_cluster(meshshard.runtime.cluster.ThreadsCluster(4, 2)):
        step = meshshard.parallelize(step_fn, method=method)
        ref, ref_mixed = jax.jit(step_fn)(state, batches(0))
        got, got_mixed = step(state, batches(0))
    # compared as a whole (norm of the difference): the micro-batches' gradient sums
    # round differently from the full batch's, and a 1e-4 entry can move by 1e-5 of itself
    assert_trees_close(ref_mixed, got_mixed)
    assert_trees_close(ref.params, got.params)
    moves = [(str(t.producer), str(t.consumer)) for t in step.plan.transfers]
    moves = [m for m in moves if ".apply" in m[0]]
    assert moves in ([("m0.apply0", "m1.apply1")], [("m1.apply0", "m0.apply1")])
    assert verify(step.plan) == []


def test_tied_embedding_plan_shows_owner_copies_and_gradient_sum():
    state, batches, train_step = gpt_setup(optax.adam(1e-2), tied=True)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches(0), cluster=CLUSTER, costs=False
    )
    assert verify(plan) == []
    wte = "args[0].params['wte']['embedding']"
    (leaf,) = [i for i in plan.inputs if i.path == wte]
    assert [str(b) for b, _ in leaf.slots] == ["P0"]  # lives on its owner only
    copies = [t for t in plan.transfers if t.tensor.name == wte]
    assert [(str(t.producer), str(t.consumer)) for t in copies] == [("s0.F", "s3.F")]
    # stage 3's gradient contribution (the embedding's shape) goes to stage 0 once per
    # step, in the update (tests/test_shared_params.py counts the bytes)
    back = [
        t
        for t in plan.transfers
        if t.tensor.shape == (64, 32) and (t.src_mesh, t.dst_mesh) == (3, 0)
    ]
    assert len(back) == 1 and str(back[0].producer) == "m3.apply0"
    assert any(n.startswith(f"shared parameter {wte}: owner stage 0 (P0)") for n in plan.notes)
    assert "t0 -> s3.F" in str(plan)


# the tied GPT clipped on four stages (with adamw): test_shared_params
@pytest.mark.parametrize("stages,clip", [(2, False)], ids=["2stages"])
def test_tied_embeddings_match_jit(threads_cluster, stages, clip):
    """SGD (optionally after global-norm clipping) checks the summed gradient itself:
    Adam would amplify the rounding of near-zero gradient entries summed in another
    order over micro-batches."""
    tx = optax.sgd(0.1)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(0.05), tx)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * stages)
    step = check(gpt_setup(tx, tied=True), method)
    assert any(n.startswith("shared parameter") for n in step.plan.notes)
    assert bool(step.plan.reductions) == clip
