"""The sharding ILP's rules for ``lax.scan`` over time and ``lax.cond`` (``passes/shard_loops.py``).

A recurrent layer used to run replicated under ``sharding="auto"`` (no rule for a
scan): every device computed the whole batch.  Its forward and backward loops now split
the batch as their bodies allow, and the backward's weight gradients, summed in carries,
are reduced once after the loop.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import meshshard
from meshshard.cluster import ClusterSpec
from meshshard.passes.pipeline import plan_step
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.shard_ilp import solve_stage
from meshshard.passes.shard_loops import (
    body_layouts,
    cond_strategies,
    loop_flops,
    scan_strategies,
)
from tests.test_shard_accumulate import (
    _all_reduced_bytes,
    _recurrent_case,
    _step_collectives,
    recurrent_step,
)

MESH = LogicalMesh(("host", "device"), (1, 4), (1e-5, 1e-5), (1e-9, 1e-9))
B, H, T = 8, 4, 5


def _rnn_loss(w, x):
    h0 = jnp.zeros(x.shape[1:])
    h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(h @ w + xt), None), h0, x)
    return (h**2).mean()


def _scans():
    jx = jax.make_jaxpr(jax.grad(_rnn_loss))(jnp.ones((H, H)), jnp.ones((T, B, H))).jaxpr
    fwd, bwd = [e for e in jx.eqns if e.primitive.name == "scan"]
    return fwd, bwd


def test_a_forward_loop_splits_the_batch_with_no_collective():
    fwd, _ = _scans()
    whole, *parallel = scan_strategies(fwd, MESH)
    assert whole.name == "loop whole" and whole.split == 1
    (batch,) = [s for s in parallel if s.ins[1] == (("device",), ())]  # the hidden state
    assert batch.ins[0] == ((), ())  # the weight stays whole
    assert batch.ins[2] == ((), ("device",), ())  # the inputs: time whole, batch split
    assert batch.comms == () and batch.split == 4


def test_a_backward_loop_reduces_its_weight_gradient_once_not_per_time_step():
    """The backward carries dW (starts at zeros, adds x_t^T dh_t over the split batch)
    and dh: split over the batch, dW's all-reduce is priced once, not T times."""
    _, bwd = _scans()
    split = [s for s in scan_strategies(bwd, MESH) if any(any(d) for d in s.outs[1])]
    assert split
    best = min(split, key=lambda s: len(s.comms))
    reduces = [c for c in best.comms if c.kind == "all-reduce"]
    assert len(reduces) == 1 and reduces[0].nbytes == H * H * 4  # once: dW's bytes


def test_a_running_total_over_the_batch_is_reduced_once_after_the_loop():
    """A carry summing the batch at every step (a loss summed over time) is held as
    partial sums through the loop: one all-reduce after it, not one per time step."""

    def total(x):
        return jax.lax.scan(lambda c, xt: (c + xt.sum(), None), 0.0, x)[0]

    (scan,) = jax.make_jaxpr(total)(jnp.ones((T, B))).jaxpr.eqns
    _, split = scan_strategies(scan, MESH)
    assert split.ins[1] == ((), ("device",))
    assert [c.kind for c in split.comms] == ["all-reduce"]  # once, not T times


def test_a_scan_with_nothing_parallel_still_runs_replicated():
    """Rows and features that do not divide over the mesh leave nothing to split: the
    replicated strategy alone, named so (the plan notes it)."""
    jx = jax.make_jaxpr(_rnn_loss)(jnp.ones((3, 3)), jnp.ones((T, 3, 3))).jaxpr
    (scan,) = [e for e in jx.eqns if e.primitive.name == "scan"]
    (only,) = scan_strategies(scan, MESH)
    assert only.name == "replicated"


def test_the_body_layout_follows_the_operands_the_strategy_reads():
    fwd, _ = _scans()
    batch = next(s for s in scan_strategies(fwd, MESH) if s.ins[1] == (("device",), ()))
    body = body_layouts(fwd, MESH, batch.ins)
    assert body is not None and (("device",), ()) in body.values()
    assert body_layouts(fwd, MESH, [None] * len(fwd.invars)) is None  # nothing split


def test_the_solver_prices_the_body_every_time_step_and_splits_the_batch():
    """Priced with its body's work every time step, a large recurrent forward splits
    the batch (priced as one cheap equation, it stayed replicated)."""
    jx = jax.make_jaxpr(_rnn_loss)(jnp.ones((256, 256)), jnp.ones((16, 256, 256)))
    (scan,) = [e for e in jx.jaxpr.eqns if e.primitive.name == "scan"]
    assert loop_flops(scan) == 16 * 2 * 256 * 256 * 256
    sol = solve_stage(jx, LogicalMesh.of((1, 4), ClusterSpec()), ClusterSpec())
    assert sol.specs[1] == (None, "device")  # x: its batch split, not whole


@pytest.mark.slow
def test_an_lstm_under_auto_sharding_splits_its_loops_and_reduces_once():
    """``ShardParallel`` (the ILP) on an LSTM: no equation runs replicated, no collective
    runs inside a loop, and one step all-reduces about the gradient's bytes once."""
    state, x, y = _recurrent_case()
    method = meshshard.ShardParallel((1, 4))
    cluster = ClusterSpec(num_hosts=1, devices_per_host=4)
    plan, traced = plan_step(
        recurrent_step, (state, x, y), method=method, cluster=cluster, batch_argnums=(1, 2)
    )
    assert "runs replicated" not in str(plan)
    got = _step_collectives(plan, traced)
    assert all(c.runs == 1 for c, _ in got), [str(c) for c, _ in got]
    grads = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.params))
    assert _all_reduced_bytes(plan, traced) < 1.1 * grads


def test_a_cond_on_activations_splits_the_batch_in_every_branch():
    """``lax.cond`` / ``lax.switch`` on the batch's activations ran replicated (no rule):
    each branch now follows the operand's split, and the branches agree."""

    def f(flag, h):
        return jax.lax.switch(
            flag, [jnp.tanh, lambda a: a * 2.0, lambda a: a - a.mean(1)[:, None]], h
        )

    (cond,) = jax.make_jaxpr(f)(1, jnp.ones((B, H))).jaxpr.eqns[-1:]
    assert cond.primitive.name == "cond"
    whole, *split = cond_strategies(cond, MESH)
    assert whole.name == "branch whole"
    (rows,) = [s for s in split if s.ins[1] == (("device",), ())]
    assert rows.outs == ((("device",), ()),) and rows.comms == ()


def test_a_cond_s_branches_agree_through_zeros_and_passed_operands():
    """A differentiated cond returns zeros (or an operand passed through) for the other
    branch's residuals: those take the computed results' layout."""

    def f(flag, h):
        return jax.lax.cond(flag > 0, jnp.tanh, lambda a: a, h).sum()

    jx = jax.make_jaxpr(jax.grad(f, argnums=1))(1, jnp.ones((B, H))).jaxpr
    conds = [e for e in jx.eqns if e.primitive.name == "cond" and len(e.invars) > 1]
    assert conds
    for cond in conds:
        assert len(cond_strategies(cond, MESH)) > 1, cond


def cond_step(state, batch, flag):
    """The recurrent model on inputs a ``lax.cond`` transforms first."""

    def loss_fn(params):
        x = jax.lax.cond(flag > 0, jnp.tanh, lambda a: a * 0.5, batch["x"])
        return jnp.mean((state.apply_fn({"params": params}, x) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.slow
@pytest.mark.parametrize("flag", [0, 1])
def test_a_model_with_a_cond_before_its_loops_runs_nothing_replicated(flag):
    """Equal to ``jax.jit`` with either branch taken, and the plan's notes name no
    equation run replicated (the cond, its gradient's cond and the loops all split)."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.conftest import with_fabric_costs
    from tests.random_parity import check_step_parity

    state, x, y = _recurrent_case(batch=8)
    method = meshshard.ShardParallel((1, 4), num_micro_batches=2)
    with use_cluster(with_fabric_costs(ThreadsCluster(1, 4))):
        batches = [{"x": x, "y": y}, {"x": x[::-1].copy(), "y": y[::-1].copy()}]
        par = check_step_parity(cond_step, method, state, batches, jnp.int32(flag), rtol=1e-4)
    assert "runs replicated" not in str(par.plan), str(par.plan)


def test_a_dropped_loop_output_before_a_used_one_keeps_the_used_one_s_layout():
    """A node numbers an equation's outputs without the dropped ones (``_``); a
    strategy's layouts are per output, dropped ones included, so a scan whose final
    carry is dropped read the carry's layout for its stacked outputs."""
    from meshshard._compat import DropVar
    from meshshard.passes.shard_ilp import _live_outputs

    fwd, _ = _scans()
    carry, *rest = fwd.outvars
    dropped = fwd.replace(outvars=[DropVar(carry.aval), *rest])
    whole, *split = scan_strategies(fwd, MESH)
    for full, live in zip(split, _live_outputs(dropped, split), strict=True):
        assert live.outs == full.outs[1:]  # the stacked outputs' own layouts
        assert all(len(lay) == 3 for lay in live.outs)  # (time, batch, hidden)


class _DropoutCell(nn.RNNCellBase):
    """A simple recurrent cell with dropout on its output, drawn every time step."""

    features: int = 16

    @nn.compact
    def __call__(self, carry, x):
        h = jnp.tanh(nn.Dense(self.features)(x) + nn.Dense(self.features, use_bias=False)(carry))
        h = nn.Dropout(0.2, deterministic=False)(h)
        return h, h

    def initialize_carry(self, rng, input_shape):
        return jnp.zeros(input_shape[:-1] + (self.features,))

    @property
    def num_feature_axes(self) -> int:
        return 1


class _DropoutRecurrent(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(_DropoutCell(), split_rngs={"params": False, "dropout": True})(x)
        return nn.Dense(1)(h[:, -1])


class _KeyedState(TrainState):
    key: jax.Array


def dropout_step(state, batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)

    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
        return jnp.mean((out - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_loop_drawing_dropout_every_step_splits_the_batch(micro_batches):
    """Dropout inside the loop: the mask's bits are drawn whole (for the full batch,
    with micro-batches, and sliced), read as floats (``bitcast_convert_type``), and
    each device slices its rows; the loop no longer runs replicated.  Equal to
    ``jax.jit``'s draws."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.conftest import with_fabric_costs
    from tests.random_parity import check_step_parity

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal((16, 6, 5)).astype(np.float32),
            "y": rng.standard_normal((16, 1)).astype(np.float32),
        }
        for _ in range(2)
    ]
    model = _DropoutRecurrent()
    keys = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    params = jax.tree.map(lambda a: a + 0.03, model.init(keys, batches[0]["x"])["params"])
    state = _KeyedState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.adam(1e-3),
        key=jax.random.key_data(jax.random.key(3)),
    )
    method = meshshard.ShardParallel((1, 4), num_micro_batches=micro_batches)
    with use_cluster(with_fabric_costs(ThreadsCluster(1, 4))):
        par = check_step_parity(dropout_step, method, state, batches, rtol=1e-4)
    assert "runs replicated" not in str(par.plan), str(par.plan)


def test_a_stacked_layer_s_gradient_reduce_is_priced_once_not_per_layer():
    """Stacked weights scanned over (``nn.scan`` layers): each iteration's weight
    gradient is a scanned output that local accumulation holds, so its reduce is priced
    once for the stack, as for a carry."""

    def stack(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

    jx = jax.make_jaxpr(jax.grad(stack))(jnp.ones((T, H, H)), jnp.ones((B, H))).jaxpr
    (bwd,) = [e for e in jx.eqns if e.primitive.name == "scan" and e.params["reverse"]]
    batch = [s for s in scan_strategies(bwd, MESH) if any(any(d) for d in s.outs[0])]
    assert batch
    best = min(batch, key=lambda s: len(s.comms))
    reduces = [c for c in best.comms if c.kind == "all-reduce"]
    assert len(reduces) == 1 and reduces[0].nbytes == T * H * H * 4  # the stack's, once
