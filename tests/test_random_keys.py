"""Random keys and draws: the pipelined step draws exactly what jax.jit of the full step draws.

Typed keys (``jax.random.key``) and raw ``uint32`` keys in the state, the batch or an
extra argument; dropout in the MLP and GPT examples; ``jax.random.normal`` in the loss;
a key split in the state every step.  Workers are threads of this process.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, PipeshardParallel
from meshshard.passes.hoist import hoist_to_update, values_to_hoist
from meshshard.passes.inline import inline_calls
from meshshard.passes.physical_keys import has_typed_keys, physical_keys
from meshshard.passes.random_draws import INDEX_PATH, find_batch_draws
from meshshard.passes.sharding import UNSPLIT_BATCH
from meshshard.passes.trace import key_inputs
from tests.random_parity import check_step_parity, dropout_case

# every schedule and M in {1, 2, 4} on the MLP; the GPT (a few times the cost) at one
# M > 1 per flush schedule
CASES = (
    [("mlp", schedule, m) for schedule in ("gpipe", "1f1b") for m in (1, 2, 4)]
    + [("mlp", schedule, 4) for schedule in ("eager_1f1b", "zb_h1")]
    + [("gpt", "gpipe", 4), ("gpt", "1f1b", 2)]
)


@pytest.mark.parametrize("model,schedule,m", CASES)
def test_dropout_matches_jit(threads_cluster, model, schedule, m):
    step, state, batches = dropout_case(model)
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2), (1, 2)], schedule=schedule)
    par = check_step_parity(step, method, state, batches)
    index = [i for i in par.plan.inputs if i.path == INDEX_PATH]
    assert len(index) == (m > 1)  # the micro-batch index exists only to slice draws


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_dropout_under_interleaved_1f1b_matches_jit(threads_cluster, model):
    """The dropout key, an integer value (no boundary marker carries it), goes from the
    first chunk to every later one, chunk 2 on the same mesh as chunk 0: refused before
    ("share hosts; cross-mesh resharding plans meshes on disjoint hosts"), it is now a
    local transfer the consumer reads in place."""
    step, state, batches = dropout_case(model)
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="interleaved_1f1b", virtual_stages=2
    )
    par = check_step_parity(step, method, state, batches)
    local = [t for t in par.plan.transfers if t.is_local]
    assert local and all(not t.messages and t.src_mesh % 2 == t.dst_mesh % 2 for t in local)
    assert "local, 0 msgs, 0 B on wire" in str(par.plan)


def test_dropout_under_zero2_matches_jit_and_splits_the_batch(threads_cluster):
    """``sharding="zero2"`` pinned the batch leaves' specs from their full-batch shape:
    the micro-batch index (``int32[M]``, one row per micro-batch) was pinned split over
    the mesh and refused ("splits dim 0 of size 1 over 2 devices"), and a batch of 16
    rows in 4 micro-batches was left whole on every device."""
    step, state, _ = dropout_case("mlp")
    batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(2)]
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], sharding="zero2")
    par = check_step_parity(step, method, state, batches)
    assert "P('device') args[1]['x']" in str(par.plan)  # split over the mesh's 2 devices
    assert not [n for n in par.plan.notes if n.startswith(UNSPLIT_BATCH)]


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_dropout_with_one_row_micro_batches_matches_jit(threads_cluster, model):
    """Micro-batches of one row (the usual setting of large-model pipelines) were
    refused: JAX traces the backward's transposes of size-1 broadcasts as other
    equations, and the draws were matched only when the whole traces paired ("traces to
    different programs at micro-batch and full-batch shape")."""
    step, state, batches = dropout_case(model)  # 8 rows
    method = PipeshardParallel(num_micro_batches=8, stages=[(1, 2), (1, 2)])
    check_step_parity(step, method, state, batches)


def test_dropout_data_parallel_with_micro_batches(threads_cluster):
    step, state, batches = dropout_case("mlp")
    check_step_parity(step, DataParallel(mesh_shape=(1, 2), num_micro_batches=2), state, batches)


def test_dropout_differs_from_micro_batch_shaped_draw(threads_cluster):
    """Guard against a vacuous parity: drawing at micro-batch shape gives other numbers."""
    step, state, batches = dropout_case("mlp")
    ref, _ = jax.jit(step)(state, batches[0])
    halves = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batches[0]) for i in (0, 1)]
    per_half = [jax.jit(step)(state, h)[0].params for h in halves]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *per_half)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), ref.params, mean)
    assert max(jax.tree.leaves(diff)) > 1e-4


def normal_noise_step(state, batch, key):
    """Gaussian noise on the inputs (batch-shaped draw) and a scalar noise on the loss."""

    def loss_fn(params):
        k1, k2 = jax.random.split(key)
        x = batch["x"] + 0.1 * jax.random.normal(k1, batch["x"].shape)
        pred = state.apply_fn({"params": params}, x)
        return jnp.mean((pred - batch["y"]) ** 2) * (1 + 0.01 * jax.random.normal(k2, ()))

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_normal_draws_with_key_argument(threads_cluster, raw):
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(2)]
    state = mlp.make_state(model, batches[0]["x"])
    key = jax.random.PRNGKey(3) if raw else jax.random.key(3)
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule="gpipe")
    check_step_parity(normal_noise_step, method, state, batches, key)


def batch_key_step(state, batch):
    """A raw key inside the batch dict: used as a key, never cut into micro-batches."""
    return normal_noise_step(state, {"x": batch["x"], "y": batch["y"]}, batch["rng"])


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_key_in_batch_is_not_cut(threads_cluster, raw):
    model = mlp.MLP(num_layers=4)
    make_key = jax.random.PRNGKey if raw else jax.random.key
    batches = [dict(mlp.make_batch(batch_size=8, seed=i), rng=make_key(i)) for i in (0, 1)]
    state = mlp.make_state(model, batches[0]["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = check_step_parity(batch_key_step, method, state, batches)
    rng = next(i for i in par.plan.inputs if i.path == "args[1]['rng']")
    assert (rng.kind, rng.shape) == ("state", (2,))


def test_key_in_state_is_split_each_step(threads_cluster):
    step, state, batches = dropout_case("mlp")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = meshshard.parallelize(step, method=method)
    got = par(state, batches[0])[0]
    want = jax.random.split(state.key)[0]
    assert got.key.dtype == state.key.dtype
    np.testing.assert_array_equal(jax.random.key_data(got.key), jax.random.key_data(want))


# --- the passes on their own ---------------------------------------------------------


def _dropout_jaxprs(m):
    step, state, batches = dropout_case("mlp", batch_size=8)
    full_batch = batches[0]
    micro_batch = jax.tree.map(lambda x: x[: 8 // m], full_batch)
    from meshshard.keys import physical_call

    fn, (st, _) = physical_call(step, (state, full_batch))
    trace = lambda b: physical_keys(inline_calls(jax.make_jaxpr(fn)(st, b)))  # noqa: E731
    return trace(micro_batch), trace(full_batch)


def test_find_batch_draws_finds_the_dropout_masks():
    micro, full = _dropout_jaxprs(4)
    draws = find_batch_draws(micro, full, 4)
    assert [(d.axis, d.size, d.full_shape) for d in draws] == [(0, 2, (8, 16))] * 3


def test_typed_keys_live_only_between_neighbouring_equations():
    micro, _ = _dropout_jaxprs(2)
    eqns = micro.jaxpr.eqns
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    typed = [v for v in made if jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)]
    assert typed and has_typed_keys(micro)
    for v in typed:
        readers = {i for i, e in enumerate(eqns) if v in e.invars}
        assert readers == {made[v] + 1}, (v, made[v], readers)
    assert all(
        not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
        for v in (*micro.jaxpr.invars, *micro.jaxpr.outvars)
    )


def test_key_inputs_are_the_operands_of_random_wrap():
    def f(x, k, seed):
        return x + jax.random.normal(k, x.shape) + seed

    closed = physical_keys(inline_calls(jax.make_jaxpr(f)(jnp.ones(3), jax.random.PRNGKey(0), 1.0)))
    assert key_inputs(closed.jaxpr) == frozenset({1})


def test_lower_shows_keys_as_raw_data():
    step, state, batches = dropout_case("mlp")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    plan = meshshard.parallelize(step, method=method).lower(
        state, batches[0], cluster=ClusterSpec("keys-4x2", 4, 2)
    )
    key_in = next(i for i in plan.inputs if i.path == "args[0].key")
    assert (key_in.dtype, key_in.shape, key_in.kind) == ("uint32", (2,), "state")
    assert "key<" not in str(plan)


def test_step_without_keys_gets_no_index_input():
    """A step without keys traces as before (no index input, no key leaves)."""
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    plan = meshshard.parallelize(mlp.train_step, method=method).lower(
        state, batch, cluster=ClusterSpec("keys-4x2", 4, 2)
    )
    assert all(i.path != INDEX_PATH for i in plan.inputs)


def test_hoist_recomputes_the_state_key_split_in_the_update():
    def step(w, key, x):
        new_key, sub = jax.random.split(key)
        g = meshshard.grad(lambda w: jnp.mean((x * w + jax.random.normal(sub, x.shape)) ** 2))(w)
        return w - 0.1 * g, new_key

    closed = physical_keys(
        inline_calls(jax.make_jaxpr(step)(jnp.float32(1), jax.random.PRNGKey(0), jnp.ones(4)))
    )
    is_batch = [False, False, True]
    chain = values_to_hoist(closed.jaxpr, is_batch)
    names = [closed.jaxpr.eqns[i].primitive.name for i in chain]
    assert "random_split" in names and "random_bits" not in names
    hoisted = hoist_to_update(closed, is_batch)
    eqns = hoisted.jaxpr.eqns
    g = next(
        i
        for i, e in enumerate(eqns)
        if e.primitive.name == "pipeline_boundary" and e.params["kind"] == "grad_end"
    )
    assert [e.primitive.name for e in eqns[g + 1 :]].count("random_split") == 1
    made_after = {v for e in eqns[g + 1 :] for v in e.outvars}
    assert hoisted.jaxpr.outvars[1] in made_after  # the new key comes from the update
