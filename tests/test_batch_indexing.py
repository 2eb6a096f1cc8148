"""Batch data that address the batch's own rows (a graph batch's edge lists) are refused
with micro-batches, which would renumber the rows; positions the step computes itself,
and indices into tables, are not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from meshshard import DataParallel
from meshshard.errors import MeshshardInputError
from meshshard.passes.batch_indexing import batch_positions
from meshshard.passes.trace import trace_step
from tests.conftest import assert_trees_close

NODES, FEATURES = 8, 4


def graph_batch(seed: int = 0) -> dict:
    """A graph of 8 nodes and 8 edges: as many edges as nodes, so every batch leaf has
    8 rows and the row-count check cannot tell the edges from examples."""
    rng = np.random.default_rng(seed)
    return {
        "nodes": rng.normal(size=(NODES, FEATURES)).astype(np.float32),
        "senders": rng.integers(0, NODES, NODES).astype(np.int32),
        "receivers": rng.integers(0, NODES, NODES).astype(np.int32),
        "y": rng.normal(size=(NODES, 1)).astype(np.float32),
    }


def params() -> dict:
    rng = np.random.default_rng(1)
    return {
        "w": rng.normal(size=(FEATURES, FEATURES)).astype(np.float32),
        "out": rng.normal(size=(FEATURES, 1)).astype(np.float32),
    }


def message_passing_step(p, batch):
    """One round of message passing (gather by senders, segment sum by receivers)."""

    def loss_fn(p):
        h = jnp.tanh(batch["nodes"] @ p["w"])
        messages = h[batch["senders"]]
        h = h + jax.ops.segment_sum(messages, batch["receivers"], num_segments=h.shape[0])
        return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss


def test_a_graph_batch_cut_into_micro_batches_is_refused_naming_both_edge_lists():
    """Before, two micro-batches renumbered the nodes from 0 and the step silently
    differed from jax.jit (the first bias's update by 70%)."""
    with pytest.raises(MeshshardInputError) as err:
        trace_step(
            message_passing_step, (params(), graph_batch()), batch_argnums=(1,), num_micro_batches=2
        )
    msg = str(err.value)
    assert "args[1]['senders'] at test_batch_indexing.py" in msg
    assert "args[1]['receivers'] at test_batch_indexing.py" in msg
    assert "num_micro_batches=1" in msg and "(batch, nodes, ...)" in msg


def test_a_graph_batch_runs_whole_and_equals_jit(threads_cluster):
    step = meshshard.parallelize(
        message_passing_step, method=DataParallel(mesh_shape=(1, 2), num_micro_batches=1)
    )
    want = jax.jit(message_passing_step)(params(), graph_batch())
    assert_trees_close(want, step(params(), graph_batch()))


def per_example_positions_loss(p, batch):
    """Indices the step computes from each micro-batch (``arange`` rows, an ``argsort``
    of the batch, an ``argmax`` over it) or that address a table of fixed size (an
    embedding, a histogram of labels): none addresses rows by numbers the data hold."""
    h = jnp.tanh(batch["x"] @ p["w"] + p["table"][batch["ids"]])
    logits = h @ p["cls"]
    picked = logits[jnp.arange(h.shape[0]), batch["labels"]]
    ordered = h[jnp.argsort(batch["length"])]
    first = h[jnp.argmax(batch["length"])]
    counts = jax.ops.segment_sum(jnp.ones_like(picked), batch["labels"], num_segments=3)
    return -jnp.mean(picked) + jnp.mean(ordered**2) + jnp.sum(first) + jnp.sum(counts)


def found_in(loss, p, batch, m: int = 2):
    """:func:`batch_positions` of ``loss``'s forward and backward, traced at the
    micro-batch and full-batch shape."""
    n = len(batch["y"])
    micro, full = (
        jax.make_jaxpr(jax.value_and_grad(loss))(p, {k: v[:rows] for k, v in batch.items()})
        for rows in (n // m, n)
    )
    flags = [False] * len(jax.tree.leaves(p)) + [True] * len(jax.tree.leaves(batch))
    wheres = [f"leaf{i}" for i in range(len(flags))]
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    wheres[len(jax.tree.leaves(p)) :] = paths
    return batch_positions(micro, full, flags, wheres)


def test_the_pass_names_each_edge_list_of_a_graph_batch():
    found = found_in(loss_of_graph, params(), graph_batch())
    assert [leaf for leaf, _ in found.rows] == ["['senders']", "['receivers']"]
    assert all("test_batch_indexing.py" in line for _, line in found.rows)
    assert found.keys == ()


def loss_of_graph(p, batch):
    h = jnp.tanh(batch["nodes"] @ p["w"])
    h = h + jax.ops.segment_sum(h[batch["senders"]], batch["receivers"], num_segments=len(h))
    return jnp.mean((h @ p["out"] - batch["y"]) ** 2)


def test_positions_computed_per_micro_batch_and_table_lookups_are_not_found():
    rng = np.random.default_rng(2)
    p = {
        "w": rng.normal(size=(4, 4)).astype(np.float32),
        "table": rng.normal(size=(10, 4)).astype(np.float32),
        "cls": rng.normal(size=(4, 3)).astype(np.float32),
    }
    batch = {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "ids": rng.integers(0, 10, 8).astype(np.int32),
        "labels": rng.integers(0, 3, 8).astype(np.int32),
        "length": rng.integers(1, 20, 8).astype(np.int32),
        "y": np.zeros((8, 1), np.float32),
    }
    assert not found_in(per_example_positions_loss, p, batch)
    with_edges = dict(batch, partner=rng.integers(0, 8, 8).astype(np.int32))

    def partner_loss(p, batch):  # and the check: a partner row per example is found
        h = jnp.tanh(batch["x"] @ p["w"])
        return per_example_positions_loss(p, batch) + jnp.mean(h[batch["partner"]])

    assert [leaf for leaf, _ in found_in(partner_loss, p, with_edges).rows] == ["['partner']"]


def padded_graphs_step(p, batch):
    """Graphs padded to a fixed size, one per example: edges index axis 1 (per graph)."""

    def one_graph(nodes, senders, receivers):
        h = jnp.tanh(nodes @ p["w"])
        return h + jax.ops.segment_sum(h[senders], receivers, num_segments=h.shape[0])

    def loss_fn(p):
        h = jax.vmap(one_graph)(batch["nodes"], batch["senders"], batch["receivers"])
        return jnp.mean((h.mean(axis=1) @ p["out"] - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss


def test_graphs_padded_per_example_run_in_micro_batches_and_equal_jit(threads_cluster):
    """The layout the refusal offers: each example's own rows, cut like any batch."""
    rng = np.random.default_rng(3)
    batch = {
        "nodes": rng.normal(size=(8, NODES, FEATURES)).astype(np.float32),
        "senders": rng.integers(0, NODES, (8, 6)).astype(np.int32),
        "receivers": rng.integers(0, NODES, (8, 6)).astype(np.int32),
        "y": rng.normal(size=(8, 1)).astype(np.float32),
    }
    step = meshshard.parallelize(
        padded_graphs_step, method=DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    )
    want = jax.jit(padded_graphs_step)(params(), batch)
    assert_trees_close(want, step(params(), batch))


def keyed_dropout_step(make_keys):
    """A step whose dropout draws one key per example, made by ``make_keys(key, n)``."""

    def step(state, batch):
        p, key = state
        key, sub = jax.random.split(key)

        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w"])
            keys = make_keys(sub, batch)
            keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.5, row.shape))(keys, h)
            return jnp.mean((jnp.where(keep, h, 0.0) @ p["out"] - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(p)
        return (jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), key), loss

    return step


def keys_by_row_number(key, batch):
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(len(batch["x"])))


def keys_by_split(key, batch):
    return jax.random.split(key, len(batch["x"]))


def keys_by_example_id(key, batch):
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(batch["id"])


def keyed_case():
    rng = np.random.default_rng(4)
    batch = {
        "x": rng.normal(size=(8, FEATURES)).astype(np.float32),
        "y": rng.normal(size=(8, 1)).astype(np.float32),
        "id": np.arange(100, 108, dtype=np.int32),
    }
    return (params(), jax.random.key(0)), [batch, dict(batch, x=batch["x"] + 1)]


def test_keys_made_from_row_numbers_are_refused_with_micro_batches(threads_cluster):
    """Before, each micro-batch folded in rows 0..3 again and drew the first rows' masks:
    the weights differed from jax.jit's by 2% with no error."""
    state, batches = keyed_case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    step = meshshard.parallelize(keyed_dropout_step(keys_by_row_number), method=method)
    with pytest.raises(MeshshardInputError) as err:
        step(state, batches[0])
    msg = str(err.value)
    assert "random key per example from its row number (test_batch_indexing.py" in msg
    assert "jax.random.split(key, batch)" in msg


@pytest.mark.parametrize("make_keys", [keys_by_split, keys_by_example_id])
def test_keys_split_per_row_or_from_example_ids_equal_jit_in_micro_batches(
    threads_cluster, make_keys
):
    from tests.random_parity import check_step_parity

    state, batches = keyed_case()
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    check_step_parity(keyed_dropout_step(make_keys), method, state, batches)


def test_a_table_in_the_batch_with_as_many_rows_as_the_batch_is_named():
    """Class weights of 8 classes in a batch of 8: cut into micro-batches they would be
    looked up by label in the wrong halves; the refusal says where the table belongs."""
    rng = np.random.default_rng(8)
    p = {"w": rng.normal(size=(4, 8)).astype(np.float32)}
    batch = {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "labels": rng.integers(0, 8, 8).astype(np.int32),
        "class_weights": rng.uniform(size=8).astype(np.float32),
    }

    def weighted_loss(p, batch):
        logp = jax.nn.log_softmax(batch["x"] @ p["w"])
        picked = jnp.take_along_axis(logp, batch["labels"][:, None], axis=1)[:, 0]
        return -jnp.mean(batch["class_weights"][batch["labels"]] * picked)

    def step(p, batch):
        return meshshard.value_and_grad(weighted_loss)(p, batch)

    with pytest.raises(MeshshardInputError) as err:
        trace_step(step, (p, batch), batch_argnums=(1,), num_micro_batches=2)
    assert "args[1]['labels'] at test_batch_indexing.py" in str(err.value)
    assert "belongs in a non-batch argument" in str(err.value)
