"""Every runnable schedule equals single-device ``jax.jit`` (threads backend).

Sizes are chosen so that each schedule's warm-up differs from 1F1B's on some stage
(the full sweep of stages x micro-batches runs in benchmarks/schedules_sim.py)."""

import pytest

from meshshard import PipeshardParallel
from meshshard.passes.schedule_verify import activation_peaks, schedule_problems
from tests.parity import check_parity

pytestmark = pytest.mark.slow

CASES = [
    ("mlp", "eager_1f1b", [(1, 2)] * 2, 4),
    ("mlp", "eager_1f1b", [(1, 1)] * 4, 8),
]


@pytest.mark.parametrize("model,schedule,stages,micro_batches", CASES)
def test_schedule_matches_single_device(threads_cluster, model, schedule, stages, micro_batches):
    method = PipeshardParallel(num_micro_batches=micro_batches, stages=stages, schedule=schedule)
    step = check_parity(model, method, steps=2)
    sched = step.plan.schedule
    assert sched.name == schedule and schedule_problems(sched) == []
    S = len(stages)
    if schedule == "eager_1f1b":
        assert activation_peaks(sched) == [min(2 * (S - i) - 1, micro_batches) for i in range(S)]
