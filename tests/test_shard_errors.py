"""Issue 11 item 8: bad sharding input fails while planning, naming the value, the mesh
and what would fit."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshshard
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.pipeline import plan_step


def _step(params, batch):
    def loss_fn(w):
        h = meshshard.shard(jnp.tanh(batch["x"] @ w), P(None, "device"), name="hidden")
        return jnp.mean(h**2)

    loss, g = meshshard.value_and_grad(loss_fn)(params)
    return params - 0.1 * g, loss


def _plan(width: int, cluster: ClusterSpec):
    args = (np.ones((8, width), np.float32), {"x": np.ones((16, 8), np.float32)})
    return plan_step(_step, args, method=meshshard.ShardParallel((1, 4)), cluster=cluster)


def test_a_pin_that_does_not_divide_names_the_value_the_mesh_and_what_fits():
    with pytest.raises(
        MeshshardInputError,
        match=r"meshshard\.shard pin P\(None, 'device'\) on 'hidden' \(%\d+\) \(shape \(16, 6\)\) "
        r"splits dim 1 of size 6 over 4 devices of mesh host=1xdevice=4, which does not "
        r"divide it; layouts that fit: P\(\), P\('device'\)",
    ):
        _plan(6, ClusterSpec(num_hosts=1, devices_per_host=4))


def test_a_memory_budget_no_plan_fits_names_budget_mesh_and_what_would_fit():
    tiny = ClusterSpec(num_hosts=1, devices_per_host=4, device_memory=1024.0)
    with pytest.raises(
        MeshshardInputError,
        match=r"memory_budget=0\.0 MiB per device: no sharding of this stage on mesh "
        r"host=1xdevice=4 fits; the most sharded plan needs \d+\.\d MiB per device\. What "
        r"would fit: a budget of at least \d+\.\d MiB \(ClusterSpec\(device_memory=\.\.\.\)\), "
        r"or a larger mesh for this stage \(at least \d+ devices",
    ):
        _plan(64, tiny)
