"""``PipeshardParallel(stage_layers=...)``: the user says which layers each stage runs
(Alpa's ``ManualStageOption.forward_stage_layer_ids``); the plan keeps them and the
step equals single-device jax.jit; bad lists are refused by name."""

import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.errors import MeshshardInputError
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.parity import check_parity


def _layers_per_stage(step) -> list[tuple[int, ...]]:
    return [tuple(s.layers) for s in step.plan.stages]


@pytest.mark.parametrize(
    "method, want",
    [
        (
            PipeshardParallel(2, stages=[(1, 2)] * 2, stage_layers=[[0], [1, 2, 3]]),
            [(0,), (1, 2, 3)],
        ),
        (  # one list per model chunk; chunk L runs on mesh L % 2
            PipeshardParallel(
                4,
                stages=[(1, 1)] * 2,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                stage_layers=[[0], [1], [2], [3]],
            ),
            [(0,), (1,), (2,), (3,)],
        ),
    ],
    ids=["listed", "interleaved"],
)
def test_stages_run_the_layers_given_and_equal_jit(threads_cluster, method, want):
    step = check_parity("mlp", method, steps=2)
    assert _layers_per_stage(step) == want


def test_uniform_stages_are_as_many_as_the_lists():
    with use_cluster(ThreadsCluster(2, 2)):  # one host per uniform stage
        method = PipeshardParallel(2, stage_layers=[[0, 1, 2], [3]], schedule="gpipe")
        step = check_parity("mlp", method, steps=2)
    assert _layers_per_stage(step) == [(0, 1, 2), (3,)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage_layers": [[0, 2], [1, 3]]}, "consecutive layer indices"),
        ({"stage_layers": [[1], [2, 3]]}, "consecutive layer indices"),
        ({"stage_layers": [[0], [], [1]]}, "consecutive layer indices"),
        ({"stage_layers": [["a"], [1]]}, "consecutive layer indices"),
        ({"stage_layers": [[0], [1], [2, 3]]}, "3 lists for 2 stages"),
        ({"stages": "auto", "stage_layers": [[0], [1]]}, "stage DP chooses"),
    ],
)
def test_bad_stage_layers_are_refused_by_name(kwargs, match):
    kwargs = {"stages": [(1, 2)] * 2, **kwargs}
    with pytest.raises(MeshshardInputError, match=match):
        PipeshardParallel(2, **kwargs)


def test_stage_layers_must_cover_the_steps_layers(threads_cluster):
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    method = PipeshardParallel(2, stages=[(1, 2)] * 2, stage_layers=[[0], [1, 2]])
    step = meshshard.parallelize(mlp.train_step, method=method)
    with pytest.raises(MeshshardInputError, match="covers layers 0..2, but the step has 4"):
        step.lower(state, batch)
