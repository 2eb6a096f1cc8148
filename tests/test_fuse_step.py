"""The whole-step pass: with one micro-batch a mesh's stage run and its update are one
``s{i}.step`` program, no accumulator zeroed or stored; everything else, and what the
step computes, stays as it was."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, PipeshardParallel, ShardParallel
from meshshard.instructions import Run
from meshshard.passes.fuse_step import fuse_step
from meshshard.passes.pipeline import plan_traced
from meshshard.passes.schedule_verify import stream_problems
from meshshard.passes.trace import trace_step
from meshshard.refs import BufferKind, Phase, ProgramRef
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from meshshard.verify import verify
from tests.conftest import assert_trees_close, with_fabric_costs
from tests.parity import check_parity
from tests.random_parity import check_step_parity
from tests.test_shard_accumulate import _tied_case, tied_step

CLUSTER = ClusterSpec("fuse-step-4x2", 4, 2)


def _traced(micro_batches: int = 1):
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    return trace_step(
        mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=micro_batches
    )


def _stream(plan, worker: int) -> list[str]:
    return [str(i) for i in next(s for s in plan.streams if s.worker == worker).instructions]


def test_one_micro_batch_runs_one_program_per_step():
    plan = plan_traced(_traced(), method=DataParallel((2, 2)), cluster=CLUSTER, check=True)
    assert verify(plan) == [] and stream_problems(plan) == []
    want = ["LOAD X0@0", "RUN s0.step mb0 (P0 X0@0 S0) -> (O0)", "FREE X0@0", "WAITALL"]
    assert _stream(plan, 0) == want and _stream(plan, 1) == want  # the mesh's two workers
    step = plan.program(ProgramRef(Phase.STEP, 0))
    fb = plan.program(ProgramRef(Phase.FORWARD_BACKWARD, 0))
    apply = plan.program(ProgramRef(Phase.APPLY, 0))
    assert step.eqns == tuple(sorted(fb.eqns + apply.eqns)) and step.mesh == 0
    assert BufferKind.ACCUMULATORS not in {g.kind for g in step.inputs + step.outputs}
    assert [p.name for p in plan.programs_run()] == [step.name]


def test_several_micro_batches_and_pipeline_sends_are_left_alone():
    traced = _traced(micro_batches=2)
    plan = plan_traced(traced, method=DataParallel((1, 2), num_micro_batches=2), cluster=CLUSTER)
    assert fuse_step(plan) is plan
    assert {str(p.name) for p in plan.programs_run()} == {"s0.FB", "m0.apply"}
    # one micro-batch on two stages: stage 0's backward and update are back to back and
    # are fused; the last stage sends its gradient between them and keeps both
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    plan = plan_traced(_traced(), method=method, cluster=CLUSTER, check=True)
    assert verify(plan) == [] and stream_problems(plan) == []
    runs = {
        s.worker: [str(i.program) for i in s.instructions if isinstance(i, Run)]
        for s in plan.streams
    }
    assert runs == {0: ["s0.F", "s0.step"], 1: ["s1.FB", "m1.apply"]}
    assert "RUN s0.step mb0 (P0 X0@0 R0@0 t1@0 S0) -> (O0)" in _stream(plan, 0)
    apart = replace(method, fuse_forward_backward=False)
    plan = plan_traced(_traced(), method=apart, cluster=CLUSTER)
    assert not any(p.name.phase is Phase.STEP for p in plan.programs)


def test_the_pass_is_pure():
    traced = _traced()
    method = DataParallel((1, 2))
    plan = plan_traced(traced, method=method, cluster=CLUSTER)
    before = [p for p in plan.programs if p.name.phase is not Phase.STEP]
    unfused = replace(plan, programs=tuple(before), streams=_unfused_streams(traced, method))
    assert fuse_step(unfused) == plan and unfused.programs == tuple(before)


def _unfused_streams(traced, method):
    from meshshard.passes.pipeline import PASSES

    passes = tuple(p for p in PASSES if p.name != "fuse_step")
    return plan_traced(traced, method=method, cluster=CLUSTER, passes=passes).streams


def _metrics_step(state, batch):
    """Mean loss, its batch maximum and an auxiliary output, one Adam step."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        per_row = jnp.mean((pred - batch["y"]) ** 2, axis=-1)
        return per_row.mean(), (per_row.max(), pred.sum())

    (loss, (worst, total)), grads = meshshard.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "worst": worst, "sum": total}


def _mlp_case(hidden: int = 16):
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(hidden=hidden, num_layers=3), batch["x"])
    batches = [mlp.make_batch(batch_size=16, seed=s) for s in range(3)]
    return state, batches


@pytest.mark.parametrize(
    "method",
    [DataParallel((1, 2)), ShardParallel((1, 2))],
    ids=["dp-1x2", "ilp-1x2"],
)
def test_fused_steps_equal_jit(threads_cluster, method):
    state, batches = _mlp_case()
    par = check_step_parity(_metrics_step, method, state, batches, rtol=1e-5)
    assert [p.name.phase for p in par.plan.programs_run()] == [Phase.STEP]


def test_an_inferred_plan_keeps_its_gradient_layouts_inside():
    """Under the sharding ILP the fused program pins the gradients to the accumulators'
    inferred specs where the update reads them, as the two programs' boundary did."""
    state, batches = _mlp_case(hidden=64)
    with use_cluster(ThreadsCluster(1, 4)) as cluster:
        with_fabric_costs(cluster)
        par = check_step_parity(_metrics_step, ShardParallel((1, 4)), state, batches)
    plan = par.plan
    step = plan.program(ProgramRef(Phase.STEP, 0))
    accs = plan.buffer("A0").tensors
    pinned = dict(step.constraints)
    assert all(pinned[t.var] == t.spec for t in accs)
    assert any(any(e is not None for e in t.spec) for t in accs)  # some gradient split


def test_a_tied_gradient_held_as_partial_sums_inside_one_program():
    state, ids, labels = _tied_case()
    with use_cluster(ThreadsCluster(1, 4)):
        step = meshshard.parallelize(tied_step, method=DataParallel((1, 4)), batch_argnums=(1, 2))
        got = step(step(state, ids, labels), ids, labels)
    ref = jax.jit(tied_step)
    assert_trees_close(ref(ref(state, ids, labels), ids, labels).params, got.params, rtol=1e-4)
    (run,) = step.plan.programs_run()
    assert run.name.phase is Phase.STEP and run.unreduced


def test_update_reading_the_loss_and_a_zero_gradient(threads_cluster):
    """An update that reads a forward value (``reduce_on_plateau``'s loss) and a
    parameter the loss never touches (a literal-zero gradient) inside one program."""
    batch = mlp.make_batch(batch_size=16)
    model = mlp.MLP(num_layers=2)
    params = {"net": model.init(jax.random.PRNGKey(0), batch["x"])["params"]}
    params["unused"] = jnp.ones((3,), jnp.float32)
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(p):
            pred = state.apply_fn({"params": p["net"]}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        updates, opt = state.tx.update(grads, state.opt_state, state.params, value=loss)
        new = state.replace(
            step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt
        )
        return new, loss

    batches = [mlp.make_batch(batch_size=16, seed=s) for s in range(4)]
    par = check_step_parity(step, DataParallel((1, 2)), state, batches)
    assert [p.name.phase for p in par.plan.programs_run()] == [Phase.STEP]


def test_results_equal_the_two_programs_run_apart(threads_cluster):
    """The fused program computes what the stage program and the update computed: zeros
    plus a contribution is the contribution."""
    from meshshard.passes.pipeline import PASSES

    state, batches = _mlp_case()
    method = DataParallel((1, 2))
    fused = meshshard.parallelize(_metrics_step, method=method)
    traced = trace_step(_metrics_step, (state, batches[0]), batch_argnums=(1,), num_micro_batches=1)
    passes = tuple(p for p in PASSES if p.name != "fuse_step")
    plan = plan_traced(traced, method=method, cluster=threads_cluster.spec, passes=passes)
    assert {str(p.name) for p in plan.programs_run()} == {"s0.FB", "m0.apply"}
    apart = meshshard.parallelize(_metrics_step, method=method, plan=plan)
    a, b = state, state
    for batch in batches:
        a, b = fused(a, batch), apart(b, batch)
        assert_trees_close(b, a, rtol=1e-6)
        a, b = a[0], b[0]
    assert {str(p.name) for p in fused.plan.programs_run()} == {"s0.step"}


@pytest.mark.parametrize("schedule", ["zb_h1", "eager_1f1b", "gpipe"])
def test_a_first_stage_fuses_its_last_run_with_its_update(threads_cluster, schedule):
    """One micro-batch on two stages: stage 0's last run (its backward, or zero-bubble's
    weight-gradient half) and its update are one program; the numbers equal ``jax.jit``'s."""
    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2, schedule=schedule)
    step = check_parity("mlp", method, steps=2)
    first = next(s for s in step.plan.streams if s.worker == 0)
    runs = [i.program for i in first.instructions if isinstance(i, Run)]
    assert runs[-1].phase is Phase.STEP and not any(p.phase is Phase.APPLY for p in runs)
    last = "W" if schedule == "zb_h1" else "B"
    stage = step.plan.program(ProgramRef(Phase(last), 0))
    fused = step.plan.program(runs[-1])
    assert set(stage.eqns) <= set(fused.eqns)
