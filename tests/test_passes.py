"""The declared pass list: checks after every pass name the pass that broke the IR, and
``lower()`` and a call make the same plan (costs are only an annotation)."""

from dataclasses import replace

import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, PipeshardParallel
from meshshard.instructions import Free, WorkerStream
from meshshard.passes.annotate import strip_annotations
from meshshard.passes.checks import checks_enabled, state_problems
from meshshard.passes.pipeline import PASSES, plan_traced
from meshshard.passes.state import Pass, PassCheckError
from meshshard.passes.trace import trace_step
from meshshard.refs import BufferKind, BufferRef
from meshshard.verify import verify

CLUSTER = ClusterSpec("passes-4x2", 4, 2)
METHOD = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


@pytest.fixture(scope="module")
def traced():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    return trace_step(mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=2)


def _replace_pass(name, broken):
    """PASSES with pass ``name`` followed by ``broken`` applied to its result."""
    out = []
    for p in PASSES:
        out.append(Pass(p.name, (lambda st, p=p: broken(p.run(st)))) if p.name == name else p)
    return tuple(out)


def _double_free(st):
    s0 = st.streams[0]
    extra = Free(buffer=BufferRef(BufferKind.BATCH, 0, 0))
    bad = WorkerStream(s0.worker, s0.instructions[:-1] + (extra,) + s0.instructions[-1:])
    return replace(st, streams=(bad,) + st.streams[1:])


def _drop_edge(st):
    return replace(st, graph=replace(st.graph, edges=st.graph.edges[:-1]))


def test_the_suite_runs_with_checks_on():
    assert checks_enabled()


def test_every_pass_leaves_a_sound_state(traced):
    plan = plan_traced(traced, method=METHOD, cluster=CLUSTER, check=True)
    assert verify(plan) == [] and [p.name for p in PASSES][-4:] == [
        "assemble",
        "fuse_forward_backward",
        "fuse_step",
        "comm_schedule",
    ]


@pytest.mark.parametrize(
    "name, broken, symptom",
    [
        ("emit", _double_free, r"X0@0 freed 2 times"),
        ("stage_graph", _drop_edge, r"s1\.B uses t1, which is not edge 1's value"),
    ],
)
def test_a_broken_pass_is_named(traced, name, broken, symptom):
    passes = _replace_pass(name, broken)
    with pytest.raises(PassCheckError, match=rf"(?s)after pass '{name}'.*{symptom}"):
        plan_traced(traced, method=METHOD, cluster=CLUSTER, passes=passes, check=True)


def test_without_checks_the_break_surfaces_only_in_the_plan(traced):
    passes = _replace_pass("emit", _double_free)
    plan = plan_traced(traced, method=METHOD, cluster=CLUSTER, passes=passes, check=False)
    assert any("X0@0 freed 2 times" in p for p in verify(plan))


def test_state_problems_is_empty_before_any_pass(traced):
    from meshshard.passes.state import CompileState

    assert state_problems(CompileState(traced, METHOD, CLUSTER)) == []


@pytest.mark.parametrize(
    "method",
    [
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        PipeshardParallel(num_micro_batches=4, stages=[(1, 1), (1, 2), (1, 1)], schedule="gpipe"),
        DataParallel(mesh_shape=(1, 2)),
    ],
    ids=repr,
)
def test_lower_and_call_make_the_same_plan(threads_cluster, method):
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    step = meshshard.parallelize(mlp.train_step, method=method)
    lowered = step.lower(state, batch, cluster=threads_cluster.spec)
    step(state, batch)
    assert any(p.flops is not None for p in lowered.programs)
    assert all(t.sim_time_s is not None for t in lowered.transfers)
    assert strip_annotations(lowered) == step.plan
    assert strip_annotations(step.plan) == step.plan  # a call carries no annotations
