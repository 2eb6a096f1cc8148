"""Issue 11: gradient accumulation runs no collective per micro-batch.

Each micro-batch's weight gradient stays a per-device partial sum (accumulator with a
leading axis of partial sums); the update reduces once per step.  Collectives are
counted in the compiled HLO of every program, parity is against single-device jax.jit.
"""

import jax
import jax.numpy as jnp
import pytest

import meshshard
from examples import mlp
from meshshard.cluster import ClusterSpec
from meshshard.hlo_collectives import count_by_kind, program_collectives
from meshshard.instructions import Run
from meshshard.jaxpr_util import var_ids
from meshshard.passes.pipeline import plan_step
from meshshard.passes.shard_unreduced import unreduced_values
from meshshard.refs import BufferKind, Phase
from tests.parity import MODELS, check_parity

M = 4


def _collectives_per_step(plan, traced, mesh: int = 0) -> dict[str, int]:
    """Collectives one step runs on ``mesh``: each program's HLO count times its runs."""
    first = sum(m.num_devices for m in plan.meshes[:mesh])
    devices = jax.devices()[first : first + plan.meshes[mesh].num_devices]
    got = program_collectives(plan, traced, mesh, devices)
    per_step: dict[str, int] = {}
    stream = next(s for s in plan.streams if s.worker == plan.meshes[mesh].workers[0])
    for p in plan.programs_run():
        if p.mesh != mesh:
            continue
        runs = sum(isinstance(i, Run) and i.program == p.name for i in stream.instructions)
        for kind, n in count_by_kind(got[str(p.name)]).items():
            per_step[kind] = per_step.get(kind, 0) + n * runs
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
