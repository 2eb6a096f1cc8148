"""The simulator runs the compiler's own plans unchanged (integration with passes/)."""

import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.instructions import Run
from meshshard.plan import Plan
from meshshard.refs import Phase
from meshshard.sim import SimOptions, simulate
from meshshard.sim.simulator import iteration_time


@pytest.fixture(scope="module")
def plan():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(num_micro_batches=4, stages=[(2, 1), (2, 1)], schedule="1f1b")
    step = meshshard.parallelize(mlp.train_step, method=method)
    return Plan.from_json(step.lower(state, batch, cluster=ClusterSpec()).to_json())


@pytest.mark.parametrize("overlap", [True, False])
def test_compiled_plan_simulates(plan, overlap):
    cluster = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=4)
    r = simulate(plan, cluster, overlap=overlap)
    runs = sum(isinstance(i, Run) for s in plan.streams for i in s.instructions)
    assert r.iteration_time > 0
    assert sum(1 for s in r.spans if s.category == "run") == runs
    assert r.num_flows == sum(len(t.messages) for t in plan.transfers) * plan.num_micro_batches
    for w in r.workers:
        assert 0 <= w.idle_fraction < 1
    # the searches' shortcut (no timeline records, no summary) predicts the same time
    assert iteration_time(plan, cluster, SimOptions(overlap=overlap)) == r.iteration_time


def test_measured_program_times_drive_the_timeline(plan):
    # a fused forward and backward (the last stage's s{i}.FB) takes both their times
    seconds = {Phase.FORWARD: 0.010, Phase.BACKWARD: 0.020, Phase.FORWARD_BACKWARD: 0.030}
    times = {str(p.name): seconds.get(p.name.phase, 0.0) for p in plan.programs}
    r = simulate(plan, ClusterSpec.preset("dgx-a100", num_hosts=4), program_times=times)
    S, M = len(plan.stages), plan.num_micro_batches
    # transfers of a few KiB over 200 Gb/s cost microseconds: the bubble formula holds to 1%
    assert r.iteration_time == pytest.approx((M + S - 1) * 0.030, rel=0.01)
