"""Every runnable schedule equals single-device ``jax.jit`` (threads backend).

Sizes are chosen so that each schedule's warm-up differs from 1F1B's on some stage
(the full sweep of stages x micro-batches runs in benchmarks/schedules_sim.py)."""

import pytest

from meshshard import PipeshardParallel
from meshshard.passes.schedule_verify import activation_peaks, schedule_problems
from tests.parity import check_parity
from tests.two_bw_reference import check_2bw

pytestmark = pytest.mark.slow

CASES = [
    ("mlp", "eager_1f1b", [(1, 1)] * 4, 8),
    ("mlp", "zb_h1", [(1, 2)] * 2, 4),
    ("mlp", "interleaved_1f1b", [(1, 2)] * 2, 2),
    ("mlp", "1f1b", [(1, 1)] * 4, 1),  # one micro-batch: no steady phase at all
]


@pytest.mark.parametrize("model,schedule,stages,micro_batches", CASES)
def test_schedule_matches_single_device(threads_cluster, model, schedule, stages, micro_batches):
    v = 2 if schedule == "interleaved_1f1b" else 1
    method = PipeshardParallel(
        num_micro_batches=micro_batches, stages=stages, schedule=schedule, virtual_stages=v
    )
    step = check_parity(model, method, steps=2)
    sched = step.plan.schedule
    assert sched.name == schedule and schedule_problems(sched) == []
    S = len(stages)
    if schedule == "eager_1f1b":
        assert activation_peaks(sched) == [min(2 * (S - i) - 1, micro_batches) for i in range(S)]
    if schedule == "interleaved_1f1b":  # 2 chunks per mesh, 4 logical stages
        assert [m.hosts for m in step.plan.meshes] == [(0,), (1,), (0,), (1,)]
        assert len(step.plan.stages) == 2 * S
    if schedule == "zb_h1":  # B and W ran as separate programs
        names = {str(p.name) for p in step.plan.programs}
        assert {f"s{s}.W" for s in range(S)} <= names


def test_2bw_equals_the_plain_jax_2bw_rule(threads_cluster):
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 2, schedule="2bw")
    step = check_2bw(method, steps=5)
    assert step.plan.schedule.name == "2bw" and schedule_problems(step.plan.schedule) == []
