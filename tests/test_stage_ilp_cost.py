"""Stage costs from the sharding ILP: memoised per layer signature, TP/DP where they must
win, a memory budget that makes the DP take the parameter-sharding plan, one price."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from meshshard.cluster import ClusterSpec
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.stage_cost import (
    AnalyticCost,
    CostOptions,
    layer_stats,
    ring_allreduce_s,
)
from meshshard.passes.stage_dp import Stage, evaluate, fits, stage_dp
from meshshard.passes.stage_ilp_cost import IlpCost, layer_signature

CLUSTER = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2)  # 2 hosts x 4 V100
OPTS = CostOptions(compute_dtype="float16", act_scale=0.5)


def _chain(batch: int, width: int, layers: int = 4):
    """``layers`` tanh(x @ w) layers: the jaxpr, each layer's equations, the params."""

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x)

    ws = [jnp.zeros((width, width), jnp.float32)] * layers
    closed = jax.make_jaxpr(loss)(ws, jnp.zeros((batch, width), jnp.float32))
    jaxpr = closed.jaxpr
    dots = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]
    bounds = [*dots, len(jaxpr.eqns)]
    bounds[0] = 0
    eqns = [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return jaxpr, eqns, set(range(layers))


def _cost(batch, width, cluster=CLUSTER, opts=OPTS, layers=4):
    jaxpr, eqns, params = _chain(batch, width, layers)
    stats = layer_stats(jaxpr, [e[0] for e in eqns[1:]], params)
    return IlpCost(jaxpr, eqns, params, stats, cluster, opts)


def test_identical_layers_share_one_signature_and_one_solve_per_mesh():
    jaxpr, eqns, params = _chain(64, 128)
    ps = {jaxpr.invars[i] for i in params}
    sigs = [layer_signature(jaxpr, e, ps) for e in eqns]
    # the last layer also takes the mean
    assert sigs[0] == sigs[1] == sigs[2] != sigs[3]
    cost = _cost(64, 128)
    assert cost.distinct_layers == 2
    cost(0, 4, (1, 4), (4, 1, "fast"))
    cost(0, 4, (1, 4), (4, 1, "fast"))
    assert cost.solves == 2  # dp4 x tp1: the two signatures' plans on one device
    cost(1, 3, (2, 4), (2, 4, "fast"))  # tp4: one signature (layers 1, 2), one more solve
    cost(0, 3, (1, 4), (1, 4, "fast"))
    assert cost.solves == 3


def test_tensor_parallel_wins_for_big_weights_and_data_parallel_for_big_batches():
    """Per step (32 micro-batches), on one host of 4: a 4096-wide chain on 8 rows is
    cheaper split over the weights (the DP view would all-reduce 4 x 64 MiB of
    gradients), a 64-wide chain on 8192 rows cheaper split over the batch."""

    def step(cost, view):
        c = cost(0, 4, (1, 4), view)
        return 32 * c.seconds + c.allreduce_s

    wide = _cost(8, 4096)
    dp, tp = step(wide, (4, 1, "fast")), step(wide, (1, 4, "lean"))
    assert tp < dp, (tp, dp)
    tall = _cost(8192, 64)
    assert wide(0, 4, (1, 4), (1, 4, "lean")).state_bytes < wide(0, 4, (1, 4), (4, 1)).state_bytes
    assert step(tall, (4, 1, "fast")) <= step(tall, (1, 4, "lean"))


def test_memory_makes_the_dp_choose_parameter_sharding_plans():
    """Weights of 4 x 4096^2 x 16 bytes = 1 GiB do not fit 0.4 GiB devices replicated
    (two stages at most hold two layers each); the DP then picks tensor-parallel views whose ILP plans
    shard them, and its plan fits."""
    small = replace(CLUSTER, device_memory=0.4 * 2**30)
    cost = _cost(64, 4096, cluster=small)
    dp_only = [Stage(0, 2, (1, 4), (4, 1, "fast")), Stage(2, 4, (1, 4), (4, 1, "fast"))]
    assert not fits(evaluate(dp_only, cost, 4), cost)
    plan = stage_dp(cost, 4, choices=[(1, 4), (2, 4)])
    assert fits(plan, cost), str(plan)
    assert all(st.logical[1] > 1 for st in plan.stages), str(plan)
    assert "4 layers, 2 distinct" in cost.summary(), cost.summary()


def test_stage_costs_and_the_ilp_share_one_collective_price():
    mesh = LogicalMesh.of((1, 4), CLUSTER)
    n = 3e7
    assert ring_allreduce_s(n, 4, CLUSTER.intra_bandwidth, CLUSTER.intra_latency) == (
        pytest.approx(mesh.collective_time("all-reduce", ("device",), n))
    )
    analytic = AnalyticCost([], CLUSTER, OPTS)
    hosts = LogicalMesh.of((2, 1), CLUSTER)
    # two replicas, one per host: only the NIC ring
    assert analytic.dp_allreduce_s(n, (2, 4), 2) == pytest.approx(
        hosts.collective_time("all-reduce", ("host",), n)
    )
