"""The numbering the driver and the workers share for step calls (runtime/step_wire.py)."""

import jax
import pytest

import meshshard
from examples import mlp
from meshshard.errors import MeshshardInputError
from meshshard.runtime.step_wire import KeyCounter, StepLayout


def _plan():
    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    return meshshard.parallelize(mlp.train_step, method=method).lower(state, batch), state


def test_every_leaf_reaches_the_workers_of_its_meshes_once(threads_cluster):
    plan, state = _plan()
    layout = StepLayout.of_plan(plan)
    workers_of = {m.id: set(m.workers) for m in plan.meshes}
    for spec in plan.inputs:
        want = set().union(*(workers_of[plan.buffer(g).mesh] for g, _ in spec.slots))
        field = "batch_leaves" if spec.kind.value == "batch" else "state_leaves"
        have = {w for w, lay in layout.workers.items() if spec.leaf in getattr(lay, field)}
        assert have == (want if spec.kind.value != "unused" else set()), spec
    for lay in layout.workers.values():
        assert len(set(lay.state_leaves)) == len(lay.state_leaves)
    assert sum(len(lay.state_leaves) for lay in layout.workers.values()) >= len(
        jax.tree.leaves(state)
    )


def test_each_output_slot_has_its_own_key_offset(threads_cluster):
    plan, _ = _plan()
    layout = StepLayout.of_plan(plan)
    slots = {(g, i) for o in plan.outputs for g, i in o.slots}
    offsets = {}
    for lay in layout.workers.values():
        for g, i, off in lay.out_slots:
            assert offsets.setdefault((g, i), off) == off  # one offset on every holder
    assert set(offsets) == slots
    assert sorted(offsets.values()) == list(range(layout.num_keys))
    for o, out in zip(plan.outputs, layout.outputs, strict=True):
        assert (out is None) == (o.source.value != "buffer")


def test_key_blocks_never_overlap():
    keys = KeyCounter(10)
    a, b, c = keys.reserve(5), next(keys), keys.reserve(0)
    assert (a, b, c) == (10, 15, 16)
    assert keys.reserve(2) == 16


@pytest.mark.parametrize("donate", [(0,), (-2,)])
def test_donated_state_is_released_and_the_batch_is_kept(threads_cluster, donate):
    """``donate_argnums=(0,)``: once a step has the state it was given, that state's
    stored arrays are dropped (found from the flattened arguments by position); the
    batch argument and the step's new state stay usable, and training equals jax.jit.
    A negative position counts from the end, as in ``jax.jit`` (it was ignored)."""
    from meshshard.runtime.executable import RemoteArray
    from tests.conftest import assert_trees_close

    batches = [mlp.make_batch(8, seed=i) for i in range(3)]
    state = mlp.make_state(mlp.MLP(num_layers=4), batches[0]["x"])
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    step = meshshard.parallelize(mlp.train_step, method=method, donate_argnums=donate)
    ref, got = state, state
    kept = []
    for b in batches:
        ref, _ = jax.jit(mlp.train_step)(ref, b)
        new, _ = step(got, b)
        kept.append(got)
        got = new
    remote = lambda tree: [x for x in jax.tree.leaves(tree) if isinstance(x, RemoteArray)]  # noqa: E731
    assert not remote(kept[0])  # the host state it started from has nothing stored
    for donated in kept[1:]:
        assert remote(donated) and all(x.deleted for x in remote(donated))
    assert remote(got) and not any(x.deleted for x in remote(got))
    assert_trees_close(ref.params, got.params)


def test_a_donated_position_outside_the_call_is_refused_as_jit_refuses_it(threads_cluster):
    """It was ignored, so a typo left every state alive (twice the memory)."""
    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    method = meshshard.DataParallel(mesh_shape=(1, 2))
    step = meshshard.parallelize(mlp.train_step, method=method, donate_argnums=(2,))
    with pytest.raises(MeshshardInputError, match=r"donate_argnums names argument 2, but"):
        step(state, batch)
