"""Running a step from a saved plan (``parallelize(..., plan=...)``), as Alpa's
``plan_to_method`` does (alpa-projects/alpa tests/runtime/test_parallel_plan.py): the
plan runs without planning again, and a plan of another program, method or cluster size
is refused with what differs."""

import jax
import pytest

import meshshard
from examples import gpt
from meshshard import MeshshardInputError, PipeshardParallel, ShardParallel
from meshshard.cluster import ClusterSpec
from tests.conftest import assert_trees_close

METHOD = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], sharding="auto")


def _case(batch_size=8):
    model = gpt.GPT(num_layers=2)  # a block per stage: the plan, not the model, is tested
    batch = gpt.make_batch(batch_size=batch_size)
    return gpt.make_state(model, batch["inputs"]), batch


@pytest.mark.slow
def test_a_saved_plan_runs_again_without_planning(threads_cluster, tmp_path, monkeypatch):
    state, batch = _case()
    first = meshshard.parallelize(gpt.train_step, method=METHOD)
    expected = first(state, batch)
    path = tmp_path / "plan.json"
    path.write_text(first.plan.to_json())

    from meshshard.passes import pipeline

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(pipeline, "plan_traced", no_planning)
    for given in (path, path.read_text()):  # a file, its text
        again = meshshard.parallelize(gpt.train_step, method=METHOD, plan=given)
        assert again.lower(state, batch) == first.plan
        assert_trees_close(expected, again(state, batch), rtol=0)  # the same programs
        assert again.plan == first.plan


def test_a_plan_of_another_program_method_or_cluster_is_refused(tmp_path):
    state, batch = _case()
    method = ShardParallel((1, 2))
    one_host = ClusterSpec(num_hosts=1, devices_per_host=2)
    plan = meshshard.parallelize(gpt.train_step, method=method).lower(
        state, batch, cluster=one_host, costs=False
    )

    def lower(method=method, batch=batch, cluster=one_host, plan=plan):
        step = meshshard.parallelize(gpt.train_step, method=method, plan=plan)
        return step.lower(state, batch, cluster=cluster)

    assert lower() == plan
    with pytest.raises(MeshshardInputError, match="made for another program"):
        lower(batch=gpt.make_batch(batch_size=16))
    with pytest.raises(MeshshardInputError, match="pass the method the plan was made with"):
        lower(method=ShardParallel((1, 2), num_micro_batches=2))
    with pytest.raises(MeshshardInputError, match=r"1 hosts x 2 devices\), but this cluster"):
        lower(cluster=ClusterSpec())
    with pytest.raises(MeshshardInputError, match="is not a file"):
        lower(plan=str(tmp_path / "missing.json"))
    with pytest.raises(MeshshardInputError, match="plan must be a Plan"):
        lower(plan=3)
    with pytest.raises(MeshshardInputError, match="cannot run schedule='2bw'"):
        two_bw = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
        meshshard.parallelize(gpt.train_step, method=two_bw, plan=plan)


@pytest.mark.ray
def test_a_plan_made_without_a_cluster_runs_on_ray(ray_cluster):
    state, batch = _case()
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    plan = meshshard.parallelize(gpt.train_step, method=method).lower(
        state, batch, cluster=ClusterSpec(), costs=False
    )
    step = meshshard.parallelize(gpt.train_step, method=method, plan=plan.to_json())
    assert_trees_close(jax.jit(gpt.train_step)(state, batch), step(state, batch))


@pytest.mark.slow
def test_profiling_a_given_automatic_plan_times_it_without_planning_again(threads_cluster):
    # stages="auto" with profile=True plans again from the measured stage times; a plan
    # given with plan= is what runs, so it is timed as it is (it was refused as made
    # with another method: the re-plan had changed the method's stage_times)
    state, batch = _case()
    method = PipeshardParallel(num_micro_batches=2, stages="auto")
    plan = meshshard.parallelize(gpt.train_step, method=method).lower(state, batch, costs=False)
    step = meshshard.parallelize(gpt.train_step, method=method, plan=plan)
    assert step.lower(state, batch, profile=True) == plan
    assert step.method == method  # not planned again from the measured stage times
    assert step.program_times and set(step.program_times) <= {str(p.name) for p in plan.programs}
