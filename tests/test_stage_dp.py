"""Stage x submesh DP: exact against brute force, never behind the Megatron grid."""

import itertools

import numpy as np
import pytest

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.meshes import logical_shapes, submesh_choices
from meshshard.passes.stage_cost import AnalyticCost, CostOptions, LayerStats
from meshshard.passes.stage_dp import Stage, evaluate, fits, grid_plans, stage_dp

CLUSTER = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2)  # 2 hosts x 4 V100
OPTS = CostOptions(compute_dtype="float16", act_scale=0.5)


def _layer(flops, params, out, act=None, tp=None):
    act = 8 * out if act is None else act
    tp = 2 * out if tp is None else tp
    return LayerStats(
        flops_fwd=flops,
        flops_bwd=2 * flops,
        bytes_fwd=0.0,
        param_count=params,
        param_bytes=4 * params,
        act_bytes=act,
        out_bytes=out,
        tp_fwd_bytes=tp,
        tp_bwd_bytes=tp,
    )


def _random_layers(seed, n=4):
    rng = np.random.default_rng(seed)
    return [
        _layer(
            float(rng.uniform(0.5, 4) * 1e13),
            int(rng.uniform(0.2, 2) * 1e8),
            int(rng.uniform(0.1, 4) * 2**24),
        )
        for _ in range(n)
    ]


def _brute_force(cost, m):
    """Every split of the layers into consecutive stages, every submesh and view per
    stage, using all devices: the best fitting plan's time."""
    big_l, n = len(cost.layers), cost.cluster.num_devices
    choices = submesh_choices(cost.cluster)
    best = np.inf
    for s in range(1, big_l + 1):
        for cuts in itertools.combinations(range(1, big_l), s - 1):
            bounds = (0, *cuts, big_l)
            for subs in itertools.product(choices, repeat=s):
                if sum(h * d for h, d in subs) != n:
                    continue
                views = [logical_shapes(sub, cost.cluster.devices_per_host) for sub in subs]
                for vs in itertools.product(*views):
                    stages = [Stage(bounds[i], bounds[i + 1], subs[i], vs[i]) for i in range(s)]
                    p = evaluate(stages, cost, m)
                    if fits(p, cost):
                        best = min(best, p.seconds)
    return best


@pytest.mark.parametrize("seed", [0, 1])
def test_dp_matches_brute_force(seed):
    cost = AnalyticCost(_random_layers(seed), CLUSTER, OPTS)
    plan = stage_dp(cost, 8, tolerance=1e-3)
    truth = _brute_force(cost, 8)
    assert sum(h * d for h, d in plan.submeshes) == CLUSTER.num_devices
    assert fits(plan, cost)
    assert truth <= plan.seconds <= truth * 1.003, (plan, truth)


def test_never_behind_the_best_grid_plan_on_uniform_layers():
    cost = AnalyticCost([_layer(2e13, 10**8, 2**25)] * 8, CLUSTER, OPTS)
    plan = stage_dp(cost, 16)
    grid = min((p for p in grid_plans(cost, 16) if fits(p, cost)), key=lambda p: p.seconds)
    assert plan.seconds <= grid.seconds * 1.005


def test_uneven_layers_get_uneven_stages_and_beat_the_grid():
    """A heavy last layer (an output head): uniform stages are unbalanced, the DP is not.
    Parameter state too large for one stage on all devices makes every plan a pipeline."""
    layers = [_layer(1e13, 6 * 10**8, 2**24)] * 7 + [_layer(6e13, 6 * 10**8, 2**24)]
    cost = AnalyticCost(layers, CLUSTER, OPTS)
    plan = stage_dp(cost, 32)
    grid = min((p for p in grid_plans(cost, 32) if fits(p, cost)), key=lambda p: p.seconds)
    sizes = {st.hi - st.lo for st in plan.stages}
    assert len(plan.stages) > 1 and len(sizes) > 1, str(plan)
    assert plan.seconds < 0.97 * grid.seconds, (str(plan), str(grid))


def test_resharding_time_moves_the_cut_off_a_wide_boundary():
    """Four equal layers on two stages cut in the middle, unless the middle boundary
    carries a huge activation: then the cut moves to a narrow boundary."""
    narrow = [_layer(4e13, 10**8, 2**22, act=2**24, tp=2**22)] * 4
    wide = list(narrow)
    wide[1] = _layer(4e13, 10**8, 2**31, act=2**24, tp=2**22)  # 2 GiB cross after layer 1
    limit = [(1, 4)]  # two stages, one per host: only the cut is free
    for layers, expect_mid in ((narrow, True), (wide, False)):
        plan = stage_dp(AnalyticCost(layers, CLUSTER, OPTS), 64, choices=limit)
        cuts = [st.lo for st in plan.stages[1:]]
        assert (cuts == [2]) == expect_mid, str(plan)


def test_a_model_too_large_for_any_split_names_sizes_and_cluster():
    cost = AnalyticCost([_layer(1e12, 4 * 10**9, 2**20)] * 4, CLUSTER, OPTS)
    with pytest.raises(
        MeshshardInputError,
        match=r"no stage plan fits device memory: the model \(16,000,000,000 parameters, 4 "
        r"layers\) needs 238 GiB of parameter state .* at best 29.8 GiB per "
        r"device over all 8 devices of aws-p3.8xlarge \(2 hosts x 4 devices\), and a device "
        r"holds 14.4 GiB usable .* at least 17 such devices, and this cluster holds at most "
        r"~7,730,941,13\d parameters' state",
    ):
        stage_dp(cost, 4)


def test_auto_plans_tile_the_cluster_with_mixed_submeshes():
    """Whatever shapes the DP picks, they pack onto the hosts (Alpa's tiling claim)."""
    from meshshard.passes.meshes import place_submeshes

    cluster = ClusterSpec.preset("aws-p3.16xlarge", num_hosts=2)
    for seed in (0,):
        cost = AnalyticCost(_random_layers(seed, 4), cluster, OPTS)
        plan = stage_dp(cost, 8)
        spots = place_submeshes(list(plan.submeshes), cluster)
        used = {
            (h, off + k)
            for (hosts, off), (_, d) in zip(spots, plan.submeshes, strict=True)
            for h in hosts
            for k in range(d)
        }
        assert len(used) == cluster.num_devices
    with pytest.raises(MeshshardInputError, match=r"leave devices .* unused \(8 free\)"):
        place_submeshes([(1, 8)], cluster)
    with pytest.raises(MeshshardInputError, match=r"do not tile .*: no room for \(1, 4\)"):
        place_submeshes([(2, 8), (1, 4)], cluster)


def test_remat_keeps_layer_inputs_and_runs_the_forward_twice():
    from dataclasses import replace

    layers = [_layer(1e13, 10**8, 2**24, act=2**28)] * 4
    plain = AnalyticCost(layers, CLUSTER, OPTS)(0, 4, (1, 4), (4, 1))
    remat = AnalyticCost(layers, CLUSTER, replace(OPTS, remat=True))(0, 4, (1, 4), (4, 1))
    # per micro-batch in flight: the inputs of layers 1..3 (fp16, over 4 devices)
    assert remat.act_bytes == 3 * 2**24 * 0.5 / 4
    assert remat.transient_bytes == 2**28 * 0.5 / 4  # one layer's activations
    assert plain.act_bytes == 4 * 2**28 * 0.5 / 4
    assert remat.memory(4) < plain.memory(4)
    # compute-bound: 4 passes' worth of FLOPs instead of 3
    assert remat.seconds == pytest.approx(plain.seconds * 4 / 3, rel=0.01)
