"""Gradients of parameter slices are accumulated at the slice's size (passes/narrow_gradients.py).

A layer reading ``stack[i]`` of weights stacked for ``nn.scan`` got from JAX a gradient
zero-padded to the whole stack: every micro-batch wrote and added the whole array, and
a stage holding a few layers sent a whole-size gradient to the stack's owner once per
step.  The pass accumulates the slice and pads (or joins the slices) in the update;
the update placement moves the slices, not their padding (passes/apply_placement.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import meshshard
from meshshard import PipeshardParallel
from meshshard.jaxpr_util import is_marker
from meshshard.passes.narrow_gradients import narrow_padded_gradients
from meshshard.primitives import boundary_p
from tests.test_unroll_scans import CLUSTER, Stacked, _case, train_step


def _step(read):
    """A step whose loss reads rows of ``w`` through ``read(w, i)`` for three layers, and
    whose gradient passes through a ``grad_end`` marker."""

    def step(w, x):
        def loss(w):
            h = x
            for i in range(3):
                h = jnp.tanh(h @ read(w, i))
            return jnp.sum(h)

        g = jax.grad(loss)(w)
        (g,) = boundary_p.bind(g, kind="grad_end", index=0, reduce=(("grad", "", ""),))
        return g * 2.0

    return step


def _grad_end_shapes(closed):
    return [
        tuple(v.aval.shape) for e in closed.jaxpr.eqns if is_marker(e, "grad_end") for v in e.invars
    ]


@pytest.mark.fast
@pytest.mark.parametrize(
    "read, narrowed",
    [
        (lambda w, i: w[i], [(1, 4, 4)] * 3),  # stacked layers: one row each
        (lambda w, i: w[i + 1], [(1, 4, 4)] * 3),  # rows 1..3 of 5: zeros around them
        (lambda w, i: w[i : i + 2].sum(0), [(2, 4, 4)] * 3),  # overlapping rows: padded, added
        (lambda w, i: w[0, :, i : i + 2] @ jnp.ones((2, 4)), [(1, 4, 2)] * 3),  # another axis
    ],
    ids=["rows", "rows-inside", "overlapping", "columns"],
)
def test_narrowed_gradients_equal_the_padded_ones(read, narrowed):
    rng = np.random.RandomState(0)
    w = jnp.asarray(rng.randn(5, 4, 4).astype(np.float32) * 0.5)
    x = jnp.asarray(rng.randn(2, 4).astype(np.float32))
    closed = jax.make_jaxpr(_step(read))(w, x)
    assert _grad_end_shapes(closed) == [(5, 4, 4)]
    out = narrow_padded_gradients(closed)
    assert _grad_end_shapes(out) == narrowed
    (want,) = jaxpr_as_fun(closed)(w, x)
    (got,) = jaxpr_as_fun(out)(w, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.fast
def test_a_gradient_read_whole_is_left_alone():
    closed = jax.make_jaxpr(
        lambda w, x: boundary_p.bind(
            jax.grad(lambda w: jnp.sum(x @ w))(w),
            kind="grad_end",
            index=0,
            reduce=(("grad", "", ""),),
        )
    )(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert narrow_padded_gradients(closed) is closed


@pytest.mark.fast
def test_a_padded_aux_value_is_left_alone():
    # aux values may combine by concatenation, which a pad along the batch does not
    # commute with; only gradients are narrowed
    def step(x):
        aux = jax.lax.pad(jnp.tanh(x), 0.0, [(0, 2, 0), (0, 0, 0)])  # as a slice's transpose
        return boundary_p.bind(
            aux, kind="grad_end", index=0, reduce=(("aux['padded']", "concat", "declared"),)
        )

    closed = jax.make_jaxpr(step)(jnp.ones((4, 3)))
    assert narrow_padded_gradients(closed) is closed


@pytest.mark.fast
def test_each_stage_accumulates_and_sends_only_its_layers_rows():
    # was: A1 held the whole stack's gradient (2 kernels of [4,16,16] and 2 biases of
    # [4,16]) and sent it whole to stage 0 once per step
    state, batches = _case(Stacked(depth=4))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    plan = meshshard.parallelize(train_step, method=method).lower(
        state, batches[0], cluster=CLUSTER
    )
    stack = state.params["ScanBlock_0"]
    stack_bytes = sum(a.nbytes for a in jax.tree.leaves(stack))
    rows_per_stage = 2  # 5 layers (4 blocks and the head) over 2 stages: blocks 0-1, 2-3
    accumulated = sum(t.nbytes for b in plan.buffers if str(b.name) == "A1" for t in b.tensors)
    assert accumulated < stack_bytes
    back = [
        t
        for t in plan.transfers
        if t.src_mesh == 1 and t.dst_mesh == 0 and str(t.producer).startswith("m1.")
    ]
    assert back and sum(t.tensor.nbytes for t in back) <= stack_bytes * rows_per_stage // 4
    # the stage's adjacent rows are joined there and move as one message per stacked
    # leaf (was: one per row, 4 messages for these 2 leaves)
    assert len(back) == len(jax.tree.leaves(stack))
    assert all(t.tensor.shape[0] == rows_per_stage for t in back)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_narrowed_stacked_gradients_match_jit(threads_cluster, schedule):
    from tests.random_parity import check_step_parity

    state, batches = _case(Stacked(depth=4, rate=0.2))
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)], schedule=schedule)
    check_step_parity(train_step, method, state, batches)


def column_step(params, batch):
    """Two stages reading the two column halves of one weight: their gradients are
    padded and added, not joined."""

    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w"][:, :32]) @ jnp.ones((32, 64))
        meshshard.mark_pipeline_boundary()
        return jnp.mean((h @ p["w"][:, 32:] - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss


def _column_case(seed, steps=1):
    rng = np.random.RandomState(seed)
    params = {"w": rng.randn(64, 64).astype(np.float32) * 0.1}
    batches = [
        {"x": rng.randn(8, 64).astype(np.float32), "y": rng.randn(8, 32).astype(np.float32)}
        for _ in range(steps)
    ]
    return params, batches


@pytest.mark.fast
def test_a_padded_gradient_moves_unpadded_to_the_owner():
    # the update sends stage 1's [64, 32] slice and pads it again on stage 0 (was:
    # stage 1 padded it to [64, 64] and sent that)
    params, (batch,) = _column_case(0)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    plan = meshshard.parallelize(column_step, method=method).lower(params, batch, cluster=CLUSTER)
    back = [t for t in plan.transfers if t.src_mesh == 1 and str(t.producer).startswith("m1.")]
    assert [t.tensor.shape for t in back] == [(64, 32)]


@pytest.mark.slow
def test_a_padded_gradient_moved_unpadded_matches_jit(threads_cluster):
    from tests.random_parity import check_step_parity

    params, batches = _column_case(1, steps=2)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    check_step_parity(column_step, method, params, batches)
