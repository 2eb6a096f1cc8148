"""Embedding gradients of data-parallel replicas moved as their touched rows (TriRace's
``sparse`` dimension on real plans): which tensors qualify, the wire format, the plan,
the simulator's sizes, and training that is bit-identical to the dense all-reduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from examples import gpt
from meshshard import PipeshardParallel
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardRuntimeError
from meshshard.instructions import Collective
from meshshard.jaxpr_util import var_ids
from meshshard.passes.comm_schedule import COMM_SWITCHES
from meshshard.passes.pipeline import plan_step
from meshshard.passes.sparse_rows import row_bound
from meshshard.plan import Plan
from meshshard.sim import simulate
from meshshard.sparse_grads import pack_rows, sum_rows, unpack_rows
from meshshard.verify import verify
from tests.parity import run_steps

CLUSTER = ClusterSpec(num_hosts=4, devices_per_host=2)


def _bound(fn, *args) -> int | None:
    """``row_bound`` of the (only) output of ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return row_bound(jaxpr, var_ids(jaxpr)[jaxpr.outvars[0]])


TABLE = jnp.ones((50, 4))
IDS = jnp.arange(6).reshape(2, 3) % 50


@pytest.mark.fast
def test_row_bound_reads_lookup_gradients_off_the_trace():
    lookup = jax.grad(lambda t: jnp.sum(t[IDS] ** 2))
    assert _bound(lookup, TABLE) == 6  # one row per looked-up id
    two = jax.grad(lambda t: jnp.sum(jnp.take(t, IDS, axis=0)) + jnp.sum(t[IDS[0]] * 3.0))
    assert _bound(two, TABLE) == 9  # two lookups: their rows add up
    scaled = jax.grad(lambda t: jnp.mean(t[IDS] ** 2) / 7.0)
    assert _bound(scaled, TABLE) == 6
    scaled_after = lambda t: jax.grad(lambda u: jnp.sum(u[IDS]))(t) * 0.5  # noqa: E731
    assert _bound(scaled_after, TABLE) == 6
    # read any other way too: the gradient is dense
    tied = jax.grad(lambda t: jnp.sum(t[IDS] @ t.T))
    assert _bound(tied, TABLE) is None
    decayed = jax.grad(lambda t: jnp.sum(t[IDS]) + 1e-3 * jnp.sum(t**2))
    assert _bound(decayed, TABLE) is None
    shifted = lambda t: jax.grad(lambda u: jnp.sum(u[IDS]))(t) + 1.0  # noqa: E731
    assert _bound(shifted, TABLE) is None


@pytest.mark.fast
def test_rows_sum_to_the_dense_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    grads, touched = [], []
    for _ in range(3):
        g = np.zeros((40, 3), np.float32)
        idx = rng.choice(np.arange(10, 40), 7, replace=False)
        g[idx] = rng.normal(size=(7, 3)).astype(np.float32)
        grads.append(g)
        touched.append(sorted(idx.tolist() + [5]))
    for g in grads:  # signed zeros: -0.0 survives only where every member has -0.0
        g[5] = -0.0
    grads[0][9] = -0.0
    touched[0] = sorted(touched[0] + [9])
    parts = [unpack_rows(pack_rows(g, 12), g.shape, g.dtype, 12) for g in grads]
    assert [i.tolist() for i, _ in parts] == touched  # a -0.0 row travels, +0.0 rows not
    dense = grads[0] + grads[1] + grads[2]
    got = sum_rows(parts, (40, 3), np.float32, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), dense.view(np.uint32))
    # a transport that sums in float64 (torch's): the same rule in float64
    dense64 = (grads[0].astype(np.float64) + grads[1] + grads[2]).astype(np.float32)
    got64 = sum_rows(parts, (40, 3), np.float32, np.float64)
    np.testing.assert_array_equal(got64.view(np.uint32), dense64.view(np.uint32))


@pytest.mark.fast
def test_more_rows_than_planned_is_a_named_error():
    g = np.ones((10, 2), np.float32)
    with pytest.raises(MeshshardRuntimeError, match="wte of A0 has 10 nonzero rows.*'sparse'"):
        pack_rows(g, 4, "wte of A0")
    assert pack_rows(np.zeros((10, 2), np.float32), 4).nbytes == 4 * (4 + 8)


def _gpt_plan(vocab: int, switches, tied: bool = False):
    model = gpt.GPT(vocab=vocab, num_layers=2, tie_embeddings=tied)
    batch = gpt.make_batch(batch_size=8, vocab=vocab)
    state = gpt.make_state(model, batch["inputs"])
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2, comm_schedule=switches
    )
    plan, _ = plan_step(gpt.train_step, (state, batch), method=method, cluster=CLUSTER)
    return plan


@pytest.fixture(scope="module")
def sparse_plan():
    return _gpt_plan(1024, {"sparse"})


@pytest.mark.fast
def test_the_plan_moves_the_token_table_as_rows(sparse_plan):
    plan = sparse_plan
    assert verify(plan) == []
    # 2 micro-batches of 2 x 16 tokens per replica: at most 64 rows of 1024
    assert [(str(r.group), r.max_rows) for r in plan.sparse_rows] == [("A0", 64), ("A2", 64)]
    for r in plan.sparse_rows:
        t = plan.buffer(r.group).tensors[r.tensor]
        assert t.shape == (1024, 32)
        dense, rows = plan.grad_nbytes(r.group)
        assert dense == plan.buffer(r.group).nbytes - t.nbytes
        assert rows == 64 * (32 * 4 + 4)
    text = str(plan)
    assert "sparse gradients:\n  A0[13] as touched rows (at most 64)" in text
    w0 = [str(x) for x in plan.streams[0].instructions if isinstance(x, Collective)]
    assert w0 == ["COLL allgather A0 #0 [w0,w2] !20002", "COLL allreduce A0 #0 [w0,w2]"]
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.fast
def test_small_tables_and_other_stages_stay_dense():
    plan = _gpt_plan(64, {"sparse"})  # 64 rows: the all-gather would move more
    assert plan.sparse_rows == ()
    kinds = {
        x.kind.value for s in plan.streams for x in s.instructions if isinstance(x, Collective)
    }
    assert kinds == {"allreduce"}


@pytest.mark.fast
def test_the_simulator_sizes_the_rows_and_the_rest(sparse_plan):
    """The all-gather carries every member's rows, the all-reduce only the dense rest:
    stage 0's hosts send the table's bytes less its rows fewer (a ring of two sends each
    member's whole tensor once, an all-gather of two its rows once)."""
    dense = _gpt_plan(1024, set())
    _, rows = sparse_plan.grad_nbytes(sparse_plan.sparse_rows[0].group)
    for host in (0, 2):
        link = f"h{host}.nic0.out"
        sent = simulate(dense, CLUSTER).link(link).moved
        less = sent - simulate(sparse_plan, CLUSTER).link(link).moved
        assert less == pytest.approx(1024 * 32 * 4 - rows)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,tied", [("1f1b", False), ("2bw", True)])
def test_training_with_sparse_rows_is_bit_identical(threads_cluster, schedule, tied):
    model = gpt.GPT(vocab=1024, num_layers=2, tie_embeddings=tied)
    batches = [gpt.make_batch(batch_size=8, vocab=1024, seed=s) for s in range(2)]
    # one state (so one optimizer, one tree structure): the two steps share its traces;
    # every switch on (sparse rows among them) against none
    state = gpt.make_state(model, batches[0]["inputs"])
    outs = []
    for sw in (frozenset(), frozenset(COMM_SWITCHES)):
        method = PipeshardParallel(
            num_micro_batches=4,
            stages=[(1, 1)] * 2,
            data_parallel=2,
            schedule=schedule,
            comm_schedule=sw,
        )
        step = meshshard.parallelize(gpt.train_step, method=method)
        assert bool(step.lower(state, batches[0]).sparse_rows) == ("sparse" in sw)
        outs.append(run_steps(step, state, batches))
    for got in outs[1:]:
        jax.tree.map(np.testing.assert_array_equal, outs[0][0], got[0])
        np.testing.assert_array_equal(outs[0][1], got[1])
