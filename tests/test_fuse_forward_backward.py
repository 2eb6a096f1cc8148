"""The fusing pass: a stage's forward and backward that a worker runs back to back for
one micro-batch become one ``s{i}.FB`` run whose residuals never leave the program;
everything else, and what the step computes, stays as it was."""

from dataclasses import replace

import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, PipeshardParallel
from meshshard.errors import MeshshardInputError
from meshshard.instructions import Free, Run
from meshshard.passes.fuse_forward_backward import fuse_forward_backward
from meshshard.passes.pipeline import PASSES, plan_traced
from meshshard.passes.schedule_verify import stream_problems
from meshshard.passes.trace import trace_step
from meshshard.refs import BufferKind, Phase, ProgramRef
from meshshard.verify import verify
from tests.parity import MODELS, check_parity

CLUSTER = ClusterSpec("fuse-4x2", 4, 2)
M = 4


@pytest.fixture(scope="module")
def traced():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    return trace_step(mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=M)


def _plan(traced, fuse=True, **kw):
    kw = {"stages": [(1, 2)] * 2, "schedule": "1f1b", **kw}
    method = PipeshardParallel(num_micro_batches=M, fuse_forward_backward=fuse, **kw)
    return plan_traced(traced, method=method, cluster=CLUSTER, check=True)


def _runs(plan, worker):
    stream = next(s for s in plan.streams if s.worker == worker)
    return [(str(i.program), i.mb) for i in stream.instructions if isinstance(i, Run)]


def test_the_last_stage_runs_one_program_per_micro_batch(traced):
    fused, apart = _plan(traced), _plan(traced, fuse=False)
    assert verify(fused) == [] and stream_problems(fused) == []
    # stage 0 waits for the gradient between its F and B: unchanged
    assert _runs(fused, 0) == _runs(apart, 0)
    assert _runs(fused, 1) == [("s1.FB", k) for k in range(M)] + [("m1.apply", None)]
    fb = fused.program(ProgramRef(Phase.FORWARD_BACKWARD, 1))
    f = fused.program(ProgramRef(Phase.FORWARD, 1))
    b = fused.program(ProgramRef(Phase.BACKWARD, 1))
    assert fb.eqns == tuple(sorted(f.eqns + b.eqns)) and fb.mesh == f.mesh
    assert BufferKind.RESIDUALS not in {g.kind for g in fb.inputs + fb.outputs}
    # no residual of the last stage is made, read or freed any more
    w1 = next(s for s in fused.streams if s.worker == 1)
    touched = {r for i in w1.instructions for r in (*i.reads, *i.writes)}
    assert not any(r.kind is BufferKind.RESIDUALS for r in touched)
    assert (
        sum(isinstance(i, Free) for i in w1.instructions)
        == sum(
            isinstance(i, Free)
            for i in next(s for s in apart.streams if s.worker == 1).instructions
        )
        - M
    )


def test_the_pass_is_pure_and_off_when_asked(traced):
    apart = _plan(traced, fuse=False)
    assert not any(p.name.phase is Phase.FORWARD_BACKWARD for p in apart.programs)
    again = fuse_forward_backward(apart, traced)
    assert replace(again, method="") == replace(_plan(traced), method="")
    assert apart == _plan(traced, fuse=False)  # the pass made a new plan
    assert "fuse_forward_backward" in [p.name for p in PASSES]
    with pytest.raises(MeshshardInputError, match="fuse_forward_backward"):
        PipeshardParallel(num_micro_batches=2, fuse_forward_backward="yes")
    assert "fuse_forward_backward" not in repr(PipeshardParallel(num_micro_batches=2))


def test_only_the_programs_that_run_are_compiled_for_their_collectives(traced):
    """The HLO reading behind the fidelity fit compiles the fused ``s1.FB`` but not the
    ``s1.F`` and ``s1.B`` it replaced, which no stream runs."""
    import jax

    from meshshard.hlo_collectives import program_collectives

    plan = _plan(traced)
    got = program_collectives(plan, traced, 1, jax.devices()[2:4])
    assert set(got) == {str(p.name) for p in plan.programs_run() if p.mesh == 1}
    assert set(got) == {"s1.FB", "m1.apply"}
    assert {"s1.F", "s1.B"} <= {str(p.name) for p in plan.programs}


def test_gpipe_runs_no_pair_back_to_back_and_fuses_nothing(traced):
    """GPipe's last stage runs every forward, then the backwards from micro-batch 0."""
    gpipe = _plan(traced, schedule="gpipe")
    assert replace(gpipe, method="") == replace(_plan(traced, False, schedule="gpipe"), method="")
    assert [p for p, _ in _runs(gpipe, 1)] == ["s1.F"] * M + ["s1.B"] * M + ["m1.apply"]


def test_zero_bubble_fuses_f_with_b_and_keeps_w(traced):
    runs = _runs(_plan(traced, schedule="zb_h1", stages=[(1, 2)] * 2), 1)
    assert [p for p, _ in runs].count("s1.FB") == M and [p for p, _ in runs].count("s1.W") == M


def test_data_parallel_micro_batches_fuse(traced):
    plan = plan_traced(traced, method=DataParallel(num_micro_batches=M), cluster=CLUSTER)
    assert verify(plan) == []
    assert [p for p, _ in _runs(plan, 0)] == ["s0.FB"] * M + ["m0.apply"]


@pytest.mark.parametrize(
    "schedule,extra",
    [("1f1b", {}), ("zb_h1", {}), ("interleaved_1f1b", {"virtual_stages": 2})],
)
def test_fused_schedules_match_single_device(threads_cluster, schedule, extra):
    """Fused runs train equal to jax.jit; with the switch off the same step plans no
    fused program (unfused F and B runs are every other parity test's warm-up and
    cool-down, and all of GPipe's)."""
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule=schedule, **extra)
    model_name = "gpt" if schedule == "interleaved_1f1b" else "gpt_small"  # 4 chunks: 4 layers
    step = check_parity(model_name, method, steps=2)
    assert any(p.name.phase is Phase.FORWARD_BACKWARD for p in step.plan.programs)
    module, model, batch = MODELS[model_name]()
    off = meshshard.parallelize(
        module.train_step, method=replace(method, fuse_forward_backward=False)
    )
    plan = off.lower(module.make_state(model, batch["inputs"]), batch)
    assert not any(p.name.phase is Phase.FORWARD_BACKWARD for p in plan.programs)
    assert verify(plan) == []
