"""Measured stage times in the stage DP (stages="auto" with profiling, issue 11 item 4)."""

import pytest

import meshshard
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.methods import PipeshardParallel
from meshshard.passes.stage_cost import AnalyticCost, LayerStats
from meshshard.passes.stage_dp import stage_dp
from meshshard.passes.stage_measured import measured_stats
from meshshard.profiling import stage_times_of
from tests.parity import check_parity

LAYER = LayerStats(4e9, 8e9, 1e6, 1000, 4000, 1 << 20, 1 << 16)
CLUSTER = ClusterSpec(num_hosts=2, devices_per_host=2)


def _seconds(stats, lo, hi, submesh):
    h, d = submesh
    return AnalyticCost(stats, CLUSTER)(lo, hi, submesh, (h * d, 1)).seconds


def test_measured_ranges_are_reproduced_and_the_rest_take_the_median():
    stats = [LAYER] * 4
    base = [_seconds(stats, i, i + 1, (1, 2)) for i in range(4)]
    fixed = 2 * CLUSTER.launch_overhead
    measured = [
        (0, 1, (1, 2), fixed + 3 * (base[0] - fixed)),
        (1, 2, (1, 2), fixed + (base[1] - fixed)),
    ]
    got, notes = measured_stats(stats, CLUSTER, measured)
    assert _seconds(got, 0, 1, (1, 2)) == pytest.approx(measured[0][3], rel=1e-9)
    assert _seconds(got, 1, 2, (1, 2)) == pytest.approx(measured[1][3], rel=1e-9)
    # layers 2, 3 unmeasured: the median of the ratios (3 and 1) is 2
    assert _seconds(got, 2, 3, (1, 2)) - fixed == pytest.approx(2 * (base[2] - fixed), rel=1e-9)
    assert notes == (
        "stage DP costs from 2 measured stage(s): compute x[3, 1] for measured layers "
        "[0, 1], x2 (their median) for the others",
    )


def test_a_slow_measured_layer_moves_the_stage_cut():
    """Four equal layers on two one-host stages cut 2/2; measured, layer 0 takes 3x its
    modelled time, so the DP gives it a stage with less beside it."""
    stats = [LAYER] * 4
    choices = ((1, 2),)
    before = stage_dp(AnalyticCost(stats, CLUSTER), 8, choices=choices, views="data_parallel")
    assert [(s.lo, s.hi) for s in before.stages] == [(0, 2), (2, 4)]
    fixed = 2 * CLUSTER.launch_overhead
    slow = fixed + 3 * (_seconds(stats, 0, 1, (1, 2)) - fixed)
    rest = [(i, i + 1, (1, 2), _seconds(stats, i, i + 1, (1, 2))) for i in (1, 2, 3)]
    got, _ = measured_stats(stats, CLUSTER, [(0, 1, (1, 2), slow), *rest])
    after = stage_dp(AnalyticCost(got, CLUSTER), 8, choices=choices, views="data_parallel")
    assert [(s.lo, s.hi) for s in after.stages] == [(0, 1), (1, 4)]


def test_bad_measurements_are_refused_with_the_fix():
    with pytest.raises(MeshshardInputError, match=r"the step has 4 layers"):
        measured_stats([LAYER] * 4, CLUSTER, [(2, 5, (1, 2), 1.0)])
    with pytest.raises(MeshshardInputError, match=r"stage_times\[0\]=.*seconds > 0"):
        PipeshardParallel(num_micro_batches=2, stages="auto", stage_times=[(0, 1, (1, 2), -1)])
    with pytest.raises(MeshshardInputError, match=r"with stages='auto'"):
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2)], stage_times=[(0, 1, (1, 2), 1.0)])


@pytest.mark.slow
def test_lower_with_profile_plans_again_from_measured_stages():
    """Threads, two hosts of two devices: the first plan is timed, the DP plans again from
    those times (the method now carries them), and the new plan keeps parity."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.parity import MODELS

    method = PipeshardParallel(num_micro_batches=4, stages="auto", submeshes=[(1, 2)])
    module, model, batch = MODELS["mlp"]()
    state = module.make_state(model, batch["x"])
    with use_cluster(ThreadsCluster(2, 2)):
        step = meshshard.parallelize(module.train_step, method=method)
        first = step.lower(state, batch, costs=False)
        plan = step.lower(state, batch, costs=False, profile=True)
        times = step.method.stage_times
        assert len(times) == len(first.stages) and all(t[2] == (1, 2) for t in times)
        assert [(lo, hi) for lo, hi, *_ in times] == [
            (min(s.layers), max(s.layers) + 1) for s in first.stages
        ]
        assert any(n.startswith(f"stage DP costs from {len(times)} measured") for n in plan.notes)
        assert set(step.program_times) >= {str(p.name) for p in plan.programs_run()}
        measured = PipeshardParallel(
            num_micro_batches=4, stages="auto", submeshes=[(1, 2)], stage_times=times
        )
        check_parity("mlp", measured, steps=1)


def test_stage_times_of_a_split_plan_name_physical_submeshes():
    from examples import mlp

    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(model, batch["x"])
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 1), (1, 1), (1, 4)])
    plan = meshshard.parallelize(mlp.train_step, method=method).lower(
        state, batch, cluster=ClusterSpec(num_hosts=2, devices_per_host=4), costs=False
    )
    times = {str(p.name): 0.001 * (i + 1) for i, p in enumerate(plan.programs)}
    got = stage_times_of(plan, times)
    assert [(lo, hi, sub) for lo, hi, sub, _ in got] == [
        (0, 1, (1, 2)),
        (1, 2, (1, 1)),
        (2, 3, (1, 1)),
        (3, 4, (1, 4)),
    ]
    s0 = times["s0.F"] + times["s0.B"]
    assert got[0][3] == pytest.approx(s0)
    # the last stage runs its forward and backward as one program: counted once
    assert got[3][3] == pytest.approx(times["s3.FB"])
    del times["s1.B"]  # a stage not fully timed is left out
    assert [t[:2] for t in stage_times_of(plan, times)] == [(0, 1), (2, 3), (3, 4)]
