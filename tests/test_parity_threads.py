"""Parity with single-device JAX, workers as threads of this process (fast path)."""

import pytest

from meshshard import DataParallel, PipeshardParallel
from meshshard.methods import RESHARDING_STRATEGIES
from tests.parity import check_parity

# every case traces, compiles and runs a whole model: 20 s to minutes each
pytestmark = pytest.mark.slow

CASES = [
    ("mlp", "1f1b", [(1, 2)] * 2, 1),
    ("mlp", "1f1b", [(1, 2)] * 2, 2),
    ("mlp", "gpipe", [(1, 2)] * 4, 4),
    ("mlp", "1f1b", [(1, 1)] * 4, 8),
    ("mlp", "gpipe", [(1, 2)] * 2, 8),
    ("gpt", "1f1b", [(1, 2)] * 2, 2),
    ("gpt", "gpipe", [(1, 2)] * 4, 4),
]


@pytest.mark.parametrize("model,schedule,stages,micro_batches", CASES)
def test_pipeline_matches_single_device(threads_cluster, model, schedule, stages, micro_batches):
    method = PipeshardParallel(num_micro_batches=micro_batches, stages=stages, schedule=schedule)
    step = check_parity(model, method)
    assert len(step.plan.stages) == len(stages)
    assert len(step.plan.schedule.ticks) == 2 * (micro_batches + len(stages) - 1)


@pytest.mark.parametrize("strategy", RESHARDING_STRATEGIES)
def test_every_resharding_strategy_keeps_parity(threads_cluster, strategy):
    method = PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2), (1, 1), (1, 2)], resharding=strategy
    )
    step = check_parity("mlp", method)
    assert {t.strategy for t in step.plan.transfers} == {strategy}


def test_gpt_data_parallel(threads_cluster):
    """The GPT data parallel over two devices with 2 micro-batches (the (2, 2) mesh
    across two host-actors runs on Ray, test_parity_ray)."""
    step = check_parity("gpt", DataParallel(mesh_shape=(1, 2), num_micro_batches=2))
    assert step.plan.meshes[0].num_devices == 2
