"""The B/W split pass: B and W partition the backward's equations, B feeds the
upstream gradient only, W the accumulators only, and the emitted plan is sound."""

import re
from dataclasses import replace

import pytest

from examples import mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.passes.pipeline import PASSES, plan_traced
from meshshard.passes.schedule_verify import stream_problems
from meshshard.passes.state import Pass, PassCheckError
from meshshard.passes.trace import trace_step
from meshshard.refs import BufferKind, Phase, ProgramRef
from meshshard.verify import verify

pytestmark = pytest.mark.slow  # traces and plans a whole model (seconds)

CLUSTER = ClusterSpec("split-4x2", 4, 2)
STAGES = [(1, 1)] * 4


@pytest.fixture(scope="module")
def traced():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    return trace_step(mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=4)


@pytest.fixture(scope="module")
def plans(traced):
    def plan(schedule):
        method = PipeshardParallel(num_micro_batches=4, stages=STAGES, schedule=schedule)
        return plan_traced(traced, method=method, cluster=CLUSTER, check=True)

    return plan("1f1b"), plan("zb_h1")


def test_b_and_w_partition_the_backward(plans):
    whole, split = plans
    for s in range(len(STAGES)):
        full = whole.program(ProgramRef(Phase.BACKWARD, s))
        b = split.program(ProgramRef(Phase.BACKWARD, s))
        w = split.program(ProgramRef(Phase.WEIGHT_GRAD, s))
        assert sorted(b.eqns + w.eqns) == sorted(full.eqns)
        assert not set(b.eqns) & set(w.eqns)
        assert all(r.kind is not BufferKind.ACCUMULATORS for r in b.outputs)
        assert [r.kind for r in w.outputs] == [BufferKind.ACCUMULATORS]
        sent = [r for r in full.outputs if r.kind is BufferKind.TRANSFER]
        assert [r for r in b.outputs if r.kind is BufferKind.TRANSFER] == sent
    # stage 0 sends no gradient upstream: its B is empty, W does all of its backward
    assert split.program(ProgramRef(Phase.BACKWARD, 0)).eqns == ()


def test_split_plan_is_sound_and_frees_each_carry_once(plans):
    _, split = plans
    assert verify(split) == [] and stream_problems(split) == []
    carries = [b for b in split.buffers if b.name.kind is BufferKind.BACKWARD_CARRY]
    assert carries and all(b.per_micro_batch for b in carries)
    text = "\n".join(str(i) for st in split.streams for i in st.instructions)
    assert "RUN s1.W mb3" in text and "FREE D1@3" in text


def test_a_broken_schedule_pass_is_reported_with_the_marked_grid(traced):
    def swap_first_b_and_w(st):
        ticks = [list(r) for r in st.schedule.ticks]
        b = next(t for t, r in enumerate(ticks) if r[3] is not None and r[3].kind.value == "B")
        w = next(t for t, r in enumerate(ticks) if r[3] is not None and r[3].kind.value == "W")
        ticks[b][3], ticks[w][3] = ticks[w][3], ticks[b][3]
        return replace(st, schedule=replace(st.schedule, ticks=tuple(map(tuple, ticks))))

    passes = tuple(
        Pass(p.name, (lambda st, p=p: swap_first_b_and_w(p.run(st)))) if p.name == "schedule" else p
        for p in PASSES
    )
    method = PipeshardParallel(num_micro_batches=4, stages=STAGES, schedule="zb_h1")
    with pytest.raises(PassCheckError) as err:
        plan_traced(traced, method=method, cluster=CLUSTER, passes=passes, check=True)
    text = str(err.value)
    assert re.search(
        r"after pass 'schedule'.*task s3\.W0 at tick \d+ runs before its dependency s3\.B0",
        text,
        re.S,
    )
    assert re.search(r"\n\s+\d+( +\S+){3} +>W0<", text)
