"""Issue 11: gradient accumulation runs no collective per micro-batch.

Each micro-batch's weight gradient stays a per-device partial sum (accumulator with a
leading axis of partial sums); the update reduces once per step.  Collectives are
counted in the compiled HLO of every program, parity is against single-device jax.jit.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import meshshard
from examples import bert, mlp
from meshshard.cluster import ClusterSpec
from meshshard.hlo_collectives import count_by_kind, program_collectives
from meshshard.instructions import Run
from meshshard.jaxpr_util import var_ids
from meshshard.passes.pipeline import plan_step
from meshshard.passes.shard_unreduced import unreduced_values
from meshshard.plan import Plan
from meshshard.refs import BufferKind, Phase
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.conftest import assert_trees_close, with_fabric_costs
from tests.parity import MODELS, check_parity

M = 4


def _step_collectives(plan, traced, mesh: int = 0) -> list[tuple[object, int]]:
    """(collective, runs per step) of each collective in the HLO of ``mesh``'s programs."""
    first = sum(m.num_devices for m in plan.meshes[:mesh])
    devices = jax.devices()[first : first + plan.meshes[mesh].num_devices]
    got = program_collectives(plan, traced, mesh, devices)
    stream = next(s for s in plan.streams if s.worker == plan.meshes[mesh].workers[0])
    out = []
    for p in plan.programs_run():
        if p.mesh != mesh:
            continue
        runs = sum(isinstance(i, Run) and i.program == p.name for i in stream.instructions)
        out += [(c, runs) for c in got[str(p.name)]]
    return out


def _collectives_per_step(plan, traced, mesh: int = 0) -> dict[str, int]:
    """Collectives one step runs on ``mesh``: each program's HLO count times its runs."""
    per_step: dict[str, int] = {}
    for c, runs in _step_collectives(plan, traced, mesh):
        per_step[c.kind] = per_step.get(c.kind, 0) + runs * c.runs  # c.runs: loop trips
    return per_step


def _mlp_plan(monkeypatch, mode: str):
    monkeypatch.setenv("MESHSHARD_ACCUMULATE", mode)
    batch = mlp.make_batch(batch_size=32)
    state = mlp.make_state(mlp.MLP(hidden=32, num_layers=2), batch["x"])
    method = meshshard.DataParallel(mesh_shape=(1, 4), num_micro_batches=M)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    return plan_step(mlp.train_step, (state, batch), method=method, cluster=cluster)


@pytest.mark.slow
def test_data_parallel_reduces_once_per_step_not_per_micro_batch(monkeypatch):
    before = _collectives_per_step(*_mlp_plan(monkeypatch, "reduced"))
    plan, traced = _mlp_plan(monkeypatch, "local")
    after = _collectives_per_step(plan, traced)
    # per micro-batch: the fused forward and backward (one program, s0.FB) reduce the
    # gradients and the loss in one all-reduce XLA combines
    assert before == {"all-reduce": M}, before
    assert after == {"all-reduce": 1}, after  # the update's, once per step
    (acc,) = [b for b in plan.buffers if b.name.kind is BufferKind.ACCUMULATORS]
    assert all(t.unreduced == ("device",) for t in acc.tensors)  # host has size 1
    assert "unreduced[device]" in str(acc)


def _auto_plan(monkeypatch, mode: str):
    monkeypatch.setenv("MESHSHARD_ACCUMULATE", mode)
    module, model, batch = MODELS["mlp_long_batch"]()
    state = module.make_state(model, batch["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, sharding="auto")
    cluster = ClusterSpec(num_hosts=2, devices_per_host=2)
    return plan_step(module.train_step, (state, batch), method=method, cluster=cluster)


@pytest.mark.slow
def test_auto_sharding_reduces_once_per_step_where_it_splits_the_batch(monkeypatch):
    """Under sharding="auto" the solver splits the last stage's batch; its gradients
    stay partial sums and the update reduces them once, as the plan predicts."""
    plan, traced = _auto_plan(monkeypatch, "reduced")
    before = _collectives_per_step(plan, traced, mesh=1)
    plan, traced = _auto_plan(monkeypatch, "local")
    after = _collectives_per_step(plan, traced, mesh=1)
    assert before == {"all-reduce": 2}, before  # gradients and loss, combined, per micro-batch
    assert after == {"all-reduce": 1}, after  # the update's, once per step
    (back,) = [p for p in plan.programs if p.mesh == 1 and p.name.phase is Phase.BACKWARD]
    assert back.unreduced
    notes = "\n".join(plan.notes)
    assert f"{back.name} predicted comm: no collectives" in notes, notes
    assert "m1.apply predicted comm: all-reduce[device]" in notes, notes


@pytest.mark.slow
def test_every_mesh_compiles_for_the_fidelity_benchmark_with_partial_sums(monkeypatch):
    """``meshshard.profiling.program_collectives`` (the fidelity benchmark's) compiles the
    partial-sum accumulators at their stored shape: it used to compile them at the
    gradient's shape, and a pipelined plan with local accumulation failed to compile."""
    from meshshard.profiling import program_collectives as all_meshes

    plan, traced = _auto_plan(monkeypatch, "local")
    got = all_meshes(plan, traced)
    assert set(got) == {str(p.name) for p in plan.programs_run()}
    assert count_by_kind(got["m1.apply"]) == {"all-reduce": 1}, got["m1.apply"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,method",
    [
        ("mlp", meshshard.DataParallel(mesh_shape=(1, 2), num_micro_batches=M)),
        ("mlp", meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])),
        (
            "mlp_long_batch",
            meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, sharding="auto"),
        ),
    ],
)
def test_local_accumulation_matches_single_device(sharded_threads_cluster, model, method):
    step = check_parity(model, method, steps=2)
    progs = [p for p in step.plan.programs if p.name.phase is Phase.BACKWARD]
    if "sharding ILP" in "".join(step.plan.notes):  # the solver's replicated stage: no sums
        progs = progs[-1:]
    assert progs and all(p.unreduced for p in progs), [str(p) for p in step.plan.programs]


def test_rule_keeps_contractions_over_the_split_batch_and_what_follows_them():
    def grads(x, dy, table_ids):
        gw = 0.5 * jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))  # made, then mapped
        gb = dy.sum(0)  # made by a reduce_sum over the split dim
        emb = jnp.zeros((10, 4)).at[table_ids].add(dy)  # scatter-add of split rows
        whole = jnp.tanh(dy.sum(0))  # not linear: reduced where it is read
        return gw, gb, emb, whole

    args = (jnp.ones((8, 3)), jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
    jx = jax.make_jaxpr(grads)(*args).jaxpr
    ids = var_ids(jx)
    # the data-parallel rule: every value with the batch (8) as its leading dim is split
    split = {i: {0: ("device",)} for v, i in ids.items() if v.aval.shape[:1] == (8,)}
    found = unreduced_values(jx, range(len(jx.eqns)), split.get, jx.outvars)
    names = {
        jx.eqns[i].primitive.name
        for i, e in enumerate(jx.eqns)
        for o in e.outvars
        if ids[o] in found
    }
    assert {ids[v] for v in jx.outvars[:3]} <= set(found)
    assert ids[jx.outvars[3]] not in found
    assert {"dot_general", "mul", "reduce_sum", "scatter-add"} <= names


@pytest.mark.slow
def test_the_solver_prices_locally_accumulated_reduces_once_per_step():
    """The contractions local accumulation can hold as partial sums reach the sharding
    solver with weight 1/M: their reduce runs once per step, not once per micro-batch."""
    from meshshard.passes.checks import run_passes
    from meshshard.passes.pipeline import PASSES
    from meshshard.passes.shard_accumulate import accumulable_eqns
    from meshshard.passes.state import CompileState
    from meshshard.passes.trace import trace_step

    module, model, batch = MODELS["mlp_long_batch"]()
    state = module.make_state(model, batch["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=M, stages=[(1, 2)] * 2, sharding="auto")
    traced = trace_step(module.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=M)
    st = run_passes(
        CompileState(traced, method, ClusterSpec(num_hosts=2, devices_per_host=2)), PASSES, False
    )
    for mesh in st.meshes:
        got = accumulable_eqns(traced, st.graph, mesh)
        names = {traced.jaxpr.eqns[i].primitive.name for i in got}
        assert got and set(got.values()) == {1 / M}, got
        assert names <= {"dot_general", "reduce_sum", "scatter-add"}, names
        mine = {i for p in st.graph.programs if p.stage == mesh.id for i in p.eqns}
        assert set(got) <= mine


def test_rule_holds_a_scatter_of_split_rows_whose_indices_are_whole():
    """An embedding gradient whose indices the solver keeps whole: each device scatters
    its own rows (reading its part of the whole indices) into a partial sum."""

    def grads(dy, table_ids):
        return jnp.zeros((10, 4)).at[table_ids].add(dy)

    jx = jax.make_jaxpr(grads)(jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32)).jaxpr
    ids = var_ids(jx)
    dy = ids[jx.invars[0]]
    (scatter,) = [e for e in jx.eqns if e.primitive.name == "scatter-add"]
    split = {dy: {0: ("device",)}}  # the indices (and their reshape) whole
    found = unreduced_values(jx, range(len(jx.eqns)), split.get, jx.outvars)
    assert found[ids[scatter.outvars[0]]].split == (0, 0), found


def test_rule_holds_a_contraction_of_split_rows_with_a_whole_operand():
    """The solver keeps one operand of a weight gradient whole and splits the other's
    rows: each device contracts its rows against its part of the whole operand."""

    def grads(x, dy):
        return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))

    jx = jax.make_jaxpr(grads)(jnp.ones((8, 3)), jnp.ones((8, 4))).jaxpr
    ids = var_ids(jx)
    x, dy = (ids[v] for v in jx.invars)
    for split in ({dy: {0: ("device",)}}, {x: {0: ("device",)}}):
        found = unreduced_values(jx, range(len(jx.eqns)), split.get, jx.outvars)
        assert found[ids[jx.outvars[0]]].split == (0, 0), found
    other = {x: {0: ("host",)}, dy: {0: ("device",)}}  # split over different axes: no
    assert unreduced_values(jx, range(len(jx.eqns)), other.get, jx.outvars) == {}


def test_rule_holds_values_the_solver_splits_on_the_way_to_a_gradient():
    """The solver's split of a value between the contraction and the gradient (here a
    reduce then a row split) does not stop the partial sum; a gradient it splits
    does where ZeRO keeps gradients split (``keep_split``), and only there."""

    def grads(x, dy):
        g = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))  # (3, 4)
        return g.T  # the accumulated gradient (4, 3)

    jx = jax.make_jaxpr(grads)(jnp.ones((8, 3)), jnp.ones((8, 4))).jaxpr
    ids = var_ids(jx)
    x, dy = (ids[v] for v in jx.invars)
    g, out = ids[jx.eqns[0].outvars[0]], ids[jx.outvars[0]]
    eqns = range(len(jx.eqns))
    split = {x: {0: ("device",)}, dy: {0: ("device",)}, g: {0: ("device",)}}
    assert set(unreduced_values(jx, eqns, split.get, jx.outvars, keep_split=True)) == {g, out}
    split[out] = {1: ("device",)}  # the gradient itself split: ZeRO's reduce-scatter
    assert unreduced_values(jx, eqns, split.get, jx.outvars, keep_split=True) == {}
    assert set(unreduced_values(jx, eqns, split.get, jx.outvars)) == {g, out}
    # only the equations named may make a partial sum
    assert unreduced_values(jx, eqns, split.get, jx.outvars, made_by=()) == {}


class TiedEmbedding(nn.Module):
    """Alpa's tests/shard_parallel/test_bert.py::test_embedding_2d_mesh model: the
    embedding table is also the output matrix."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(1024, 8)
        return embed.attend(embed(ids))


def tied_step(state, ids, labels):
    def loss_fn(params):
        logits = state.apply_fn(params, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    return state.apply_gradients(grads=meshshard.grad(loss_fn)(state.params))


def _tied_case():
    rng = np.random.default_rng(0)
    ids, labels = (rng.integers(0, 1024, (8, 8)).astype(np.int32) for _ in range(2))
    model = TiedEmbedding()
    params = model.init(jax.random.PRNGKey(0), ids)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    return state, ids, labels


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tied", "bert"])
def test_auto_sharding_accumulates_every_gradient_once_per_step(case):
    """ShardParallel(sharding="auto") with 2 micro-batches reduces each gradient once per
    step, as data parallelism does and as the solver priced it.  The solver's plans
    used to keep some contributions whole per micro-batch: the tied table's (the lookup's
    indices whole, the head's contraction split over the sequence) and BERT's embedding
    tables' (indices whole), each all-reduced once per micro-batch."""
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    method = meshshard.ShardParallel((1, 4), num_micro_batches=2)
    if case == "tied":
        state, ids, labels = _tied_case()
        plan, traced = plan_step(
            tied_step, (state, ids, labels), method=method, cluster=cluster, batch_argnums=(1, 2)
        )
    else:
        model = bert.Encoder(num_layers=2, dropout=0.0)
        batch = bert.make_batch(batch_size=8)
        state = bert.make_state(model, batch)
        # plan_step traces raw arrays (parallelize turns typed keys into their data first)
        args = (state.replace(key=jax.random.key_data(state.key)), batch)
        plan, traced = plan_step(bert.train_step, args, method=method, cluster=cluster)
    per_step = _collectives_per_step(plan, traced)
    assert per_step.pop("all-reduce") == 1, per_step  # the update's
    # (the solver may split Adam's update over the devices and all-gather the result)
    assert set(per_step) <= {"all-gather"}, per_step
    (fb,) = [p for p in plan.programs_run() if p.name.phase is not Phase.APPLY]
    assert fb.unreduced
    notes = "\n".join(plan.notes)
    assert "s0.B predicted comm: no collectives" in notes, notes


@pytest.mark.slow
def test_tied_embedding_accumulated_locally_matches_single_device():
    state, ids, labels = _tied_case()
    method = meshshard.ShardParallel((1, 4), num_micro_batches=2)
    with use_cluster(ThreadsCluster(1, 4)):
        step = meshshard.parallelize(tied_step, method=method, batch_argnums=(1, 2))
        got = step(state, ids, labels)
    assert_trees_close(jax.jit(tied_step)(state, ids, labels).params, got.params, rtol=1e-4)
    (fb,) = [p for p in step.plan.programs_run() if p.name.phase is not Phase.APPLY]
    assert fb.unreduced


def _all_reduced_bytes(plan, traced) -> int:
    """Bytes one step all-reduces on mesh 0 (each program's HLO times its runs)."""
    return sum(
        runs * c.runs * int(c.nbytes)
        for c, runs in _step_collectives(plan, traced)
        if c.kind == "all-reduce"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data_parallel", "auto"])
def test_one_micro_batch_reduces_a_tied_gradient_once(mode):
    """With one micro-batch a tied table's two gradients (the lookup's and the output
    head's) were all-reduced apiece, as ``jax.jit`` does: twice the table's bytes.  They
    are now summed as per-device partial sums and reduced once; an untied model's plan
    holds nothing (one contraction per gradient: nothing to save)."""
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    method = (
        meshshard.DataParallel((1, 4))
        if mode == "data_parallel"
        else meshshard.ShardParallel((1, 4))
    )
    state, ids, labels = _tied_case()
    plan, traced = plan_step(
        tied_step, (state, ids, labels), method=method, cluster=cluster, batch_argnums=(1, 2)
    )
    table = 1024 * 8 * 4
    assert table <= _all_reduced_bytes(plan, traced) < 1.1 * table
    batch = mlp.make_batch(batch_size=32)
    state = mlp.make_state(mlp.MLP(hidden=32, num_layers=2), batch["x"])
    plan, _ = plan_step(mlp.train_step, (state, batch), method=method, cluster=cluster)
    assert not any(p.unreduced for p in plan.programs)


@pytest.mark.slow
def test_tied_gradient_held_with_one_micro_batch_matches_single_device():
    state, ids, labels = _tied_case()
    with use_cluster(ThreadsCluster(1, 4)):
        step = meshshard.parallelize(
            tied_step, method=meshshard.DataParallel((1, 4)), batch_argnums=(1, 2)
        )
        got = step(state, ids, labels)
        got = step(got, ids, labels)
    ref = jax.jit(tied_step)
    want = ref(ref(state, ids, labels), ids, labels)
    assert_trees_close(want.params, got.params, rtol=1e-4)
    assert any(p.unreduced for p in step.plan.programs)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_solver_prices_a_tied_gradient_reduced_once(micro_batches):
    """A gradient summed from two contractions (the tied table's lookup and output head)
    is reduced once per step: each contraction's reduce is priced at ``1 / (2 M)``."""
    from meshshard.passes.checks import run_passes
    from meshshard.passes.pipeline import PASSES
    from meshshard.passes.shard_accumulate import accumulable_eqns
    from meshshard.passes.state import CompileState
    from meshshard.passes.trace import trace_step

    state, ids, labels = _tied_case()
    traced = trace_step(
        tied_step, (state, ids, labels), batch_argnums=(1, 2), num_micro_batches=micro_batches
    )
    method = meshshard.ShardParallel((1, 4), num_micro_batches=micro_batches)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    st = run_passes(CompileState(traced, method, cluster), PASSES, False)
    got = accumulable_eqns(traced, st.graph, st.meshes[0])
    by_name = {traced.jaxpr.eqns[i].primitive.name: f for i, f in got.items()}
    tied = 1 / (2 * micro_batches)
    assert by_name.pop("dot_general") == by_name.pop("scatter-add") == tied, got
    # with micro-batches the summed loss is accumulated too: one contraction, 1 / M
    assert by_name == ({} if micro_batches == 1 else {"reduce_sum": 1 / micro_batches}), got


def test_rule_holds_a_gradient_summed_over_a_scan_in_its_carry():
    """A recurrent layer's weight gradient is a carry of the backward scan, one partial
    sum added per time step: held through the loop (a leading axis of partial sums),
    it is reduced once after it, not once per step.  The hidden state's cotangent (a
    carry with the batch's rows) and a carry not starting at zeros stay whole."""

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(h @ w + xt), None), jnp.zeros((8, 3)), x)
        return (h**2).mean()

    jx = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 3)), jnp.ones((5, 8, 3))).jaxpr
    ids = var_ids(jx)
    (back,) = [
        i for i, e in enumerate(jx.eqns) if e.primitive.name == "scan" and e.params["reverse"]
    ]

    def loop_split(eqn):  # inside the body: values with the batch (8) in front are split
        body_ids = var_ids(eqn.params["jaxpr"].jaxpr)
        rows = {i for v, i in body_ids.items() if v.aval.shape[:1] == (8,)}
        return (lambda vid: {0: ("device",)} if vid in rows else None), ("device",)

    found = unreduced_values(
        jx, range(len(jx.eqns)), lambda _: None, jx.outvars, loop_split=loop_split
    )
    (grad,) = jx.outvars
    held = found[ids[grad]]
    assert held.loop_outs == (0,) and held.axes == ("device",)  # dW's carry, not dh's
    assert [u.split for u in held.inner if u.split] == [(0, 0)]  # x_t^T dh_t over the batch
    assert "scan(outs 0;" in str(held)
    assert unreduced_values(jx, range(len(jx.eqns)), lambda _: None, jx.outvars) == {}


class _Recurrent(nn.Module):
    """An LSTM over time, then a GRU run backwards over its outputs."""

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(16))(x)
        h = nn.RNN(nn.GRUCell(16), reverse=True, keep_order=True)(h)
        meshshard.mark_pipeline_boundary()
        return nn.Dense(1)(h[:, -1])


def _recurrent_case(batch: int = 16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 6, 5)).astype(np.float32)
    y = rng.standard_normal((batch, 1)).astype(np.float32)
    model = _Recurrent()
    params = jax.tree.map(lambda a: a + 0.03, model.init(jax.random.PRNGKey(0), x)["params"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return state, x, y


def recurrent_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_recurrent_gradient_is_reduced_once_per_step_not_per_time_step(micro_batches):
    """``jax.jit`` with the batch split all-reduces an LSTM's weight gradient inside
    the backward loop, once per time step (6 here, per micro-batch).  Held as partial
    sums through the loop, it is all-reduced once per step: no collective runs in a
    loop, and one step all-reduces the gradient's bytes about once."""
    state, x, y = _recurrent_case()
    method = meshshard.DataParallel((1, 4), num_micro_batches=micro_batches)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    plan, traced = plan_step(
        recurrent_step, (state, x, y), method=method, cluster=cluster, batch_argnums=(1, 2)
    )
    got = _step_collectives(plan, traced)
    assert got and all(c.runs == 1 for c, _ in got), [str(c) for c, _ in got]
    grads = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.params))
    assert grads <= _all_reduced_bytes(plan, traced) < 1.1 * grads
    assert Plan.from_json(plan.to_json()) == plan  # the loops' held values travel in JSON


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        meshshard.DataParallel((1, 2)),
        meshshard.DataParallel((1, 2), num_micro_batches=2),
        meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
        meshshard.ShardParallel((1, 2)),
        meshshard.ShardParallel((1, 4), num_micro_batches=2, logical_shape=(2, 2)),
    ],
    ids=["dp", "dp-m2", "1f1b", "auto", "auto-2x2-m2"],
)
def test_recurrent_gradients_held_through_the_loop_match_single_device(method):
    state, x, y = _recurrent_case(batch=8)
    with use_cluster(with_fabric_costs(ThreadsCluster(1, 4))):  # the ILP splits these loops
        step = meshshard.parallelize(recurrent_step, method=method, batch_argnums=(1, 2))
        got, ref = state, state
        for _ in range(2):
            got, loss = step(got, x, y)
            ref, want = jax.jit(recurrent_step)(ref, x, y)
            np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert_trees_close(ref.params, got.params, rtol=1e-4)
    held = [u for p in step.plan.programs_run() for u in p.unreduced if u.loop_outs]
    assert held  # the loops' carries were held, not only the dense layer's gradient


class _ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(16)(jnp.tanh(nn.Dense(16)(h))), None


class _Stacked(nn.Module):
    """Four residual blocks stacked with ``nn.scan`` (weights with a leading layer axis)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        scanned = nn.scan(
            _ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        h, _ = scanned()(h, None)
        meshshard.mark_pipeline_boundary()
        return nn.Dense(1)(h)


def _stacked_case():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 1)).astype(np.float32)
    model = _Stacked()
    params = jax.tree.map(lambda a: a + 0.03, model.init(jax.random.PRNGKey(0), x)["params"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return state, x, y


@pytest.mark.slow
def test_stacked_layer_gradients_are_reduced_once_per_step_not_per_layer():
    """A stacked layer's weight gradient is a scanned output of the backward loop, one
    slice per layer: ``jax.jit`` all-reduces each layer's inside the loop, per
    micro-batch (4 layers x 4 micro-batches here).  Held as partial sums in the stack,
    one all-reduce per step sums them all."""
    state, x, y = _stacked_case()
    method = meshshard.DataParallel((1, 4), num_micro_batches=M)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    plan, traced = plan_step(
        recurrent_step, (state, x, y), method=method, cluster=cluster, batch_argnums=(1, 2)
    )
    assert _collectives_per_step(plan, traced) == {"all-reduce": 1}
    grads = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.params))
    assert grads <= _all_reduced_bytes(plan, traced) < 1.1 * grads


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        meshshard.DataParallel((1, 4), num_micro_batches=4),
        meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2),
    ],
    ids=["dp-m4", "1f1b"],
)
def test_stacked_layer_gradients_held_in_the_stack_match_single_device(method):
    state, x, y = _stacked_case()
    with use_cluster(ThreadsCluster(1, 4)):
        step = meshshard.parallelize(recurrent_step, method=method, batch_argnums=(1, 2))
        got, ref = state, state
        for _ in range(2):
            got, _ = step(got, x, y)
            ref, _ = jax.jit(recurrent_step)(ref, x, y)
    assert_trees_close(ref.params, got.params, rtol=1e-4)
    held = [u for p in step.plan.programs_run() for u in p.unreduced if u.loop_outs]
    assert held
