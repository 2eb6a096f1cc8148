"""Layer clustering: balanced FLOPs, a heavy op per layer, fewest bytes across cuts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshshard.errors import MeshshardInputError
from meshshard.passes.layer_cluster import (
    auto_layer_count,
    cluster_layers,
    crossing_bytes,
    eqn_flops,
)


def _jaxpr(f, *args):
    return jax.make_jaxpr(f)(*args).jaxpr


def test_crossing_bytes_counts_values_live_across_each_cut():
    # a = x*2 (used by eqn 1 and eqn 2), b = a+1 (used by eqn 2)
    j = _jaxpr(lambda x: (x * 2 + 1) * (x * 2), jnp.ones(4))
    assert [e.primitive.name for e in j.eqns] == ["mul", "add", "mul", "mul"]
    # mul x 2 is computed twice (jax does not CSE); cuts before eqns 1..3
    got = crossing_bytes(j)
    assert got.tolist() == [0, 16, 16, 32, 16]


def test_dot_flops_and_elementwise_flops():
    j = _jaxpr(lambda a, b: jnp.tanh(a @ b), jnp.ones((3, 5)), jnp.ones((5, 7)))
    assert eqn_flops(j.eqns[0]) == 2 * 3 * 7 * 5
    assert eqn_flops(j.eqns[1]) == 3 * 7


def test_cut_goes_through_the_narrow_waist():
    """Four matmuls; the second projects 64 -> 2 columns, so the cheapest place for the
    one cut of two layers is right after it (2 columns cross instead of 64)."""

    def f(w1, w2, w3, w4, x):
        h = jnp.tanh(x @ w1)  # 64 wide
        h = h @ w2  # 2 wide: the waist
        h = jnp.tanh(h @ w3)  # 64 wide
        return jnp.sum(h @ w4)

    args = (
        jnp.ones((64, 64)),
        jnp.ones((64, 2)),
        jnp.ones((2, 64)),
        jnp.ones((64, 64)),
        jnp.ones((8, 64)),
    )
    j = _jaxpr(f, *args)
    (cut,) = cluster_layers(j, 2, eps=2.0)
    # the value crossing the cut is the waist h (8 x 2 floats)
    assert crossing_bytes(j)[cut] == 8 * 2 * 4
    names = [e.primitive.name for e in j.eqns]
    assert names[cut - 1] == "dot_general" and j.eqns[cut - 1].outvars[0].aval.shape == (8, 2)


def test_flops_balance_bound_overrides_a_cheap_but_lopsided_cut():
    """The narrowest point is right after the first (tiny) matmul; with a loose balance
    bound the cut goes there, with eps=0 it moves to where the FLOPs split evenly."""

    def f(w1, w2, w3, w4, x):
        h = x @ w1  # 32 -> 1: the waist, almost no FLOPs before it
        h = jnp.tanh(h @ w2)
        h = jnp.tanh(h @ w3)
        return jnp.sum(h @ w4)

    args = (jnp.ones((32, 1)), jnp.ones((1, 32)), jnp.ones((32, 32)), jnp.ones((32, 32)))
    j = _jaxpr(f, *args, jnp.ones((4, 32)))
    flops = np.array([eqn_flops(e) for e in j.eqns])
    (loose,) = cluster_layers(j, 2, eps=10.0)
    assert crossing_bytes(j)[loose] == 4 * 1 * 4 and flops[:loose].sum() / flops.sum() < 0.05
    (tight,) = cluster_layers(j, 2, eps=0.0)
    assert 0.4 < flops[:tight].sum() / flops.sum() < 0.6


def test_every_layer_has_a_heavy_op_and_cuts_ascend():
    def f(*ws_x):
        *ws, x = ws_x
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    ws = [jnp.ones((16, 16))] * 6
    j = _jaxpr(f, *ws, jnp.ones((4, 16)))
    cuts = cluster_layers(j, 6)
    bounds = [0, *cuts, len(j.eqns)]
    assert list(cuts) == sorted(cuts) and len(cuts) == 5
    for a, b in zip(bounds, bounds[1:], strict=False):
        assert sum(e.primitive.name == "dot_general" for e in j.eqns[a:b]) == 1
    assert auto_layer_count(j) == 6
    assert cluster_layers(j, "auto") == cuts


def test_more_layers_than_heavy_ops_is_refused():
    j = _jaxpr(lambda w, x: jnp.sum(x @ w), jnp.ones((4, 4)), jnp.ones((2, 4)))
    with pytest.raises(MeshshardInputError, match=r"layers=3 .* \(1 dot_general/conv .*at most 1"):
        cluster_layers(j, 3)
    with pytest.raises(MeshshardInputError, match=r"layers=0: pass 'auto' or a positive int"):
        cluster_layers(j, 0)


@pytest.mark.parametrize("blocks,layers", [(4, 2), (6, 2), (6, 3), (8, 4)])
def test_equal_blocks_crossing_equal_bytes_split_evenly(blocks, layers):
    # was: among cuts crossing the same bytes the first in the balance window won, so
    # four equal blocks split 136 : 153 FLOPs (the cut fell before a block's tanh)
    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    j = jax.make_jaxpr(f)([jnp.ones((4, 4))] * blocks, jnp.ones((2, 4))).jaxpr
    cuts = cluster_layers(j, layers)
    per_block = len(j.eqns) // blocks  # dot, tanh
    assert cuts == tuple(per_block * blocks // layers * k for k in range(1, layers))
