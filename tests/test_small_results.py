"""Small results come back by value as ``jax.Array``s and stay stored on their workers
for one step: passed back as state, they are read in place instead of sent again."""

import jax
import numpy as np

import meshshard
from examples import mlp
from meshshard import DataParallel
from meshshard.runtime import executable
from meshshard.runtime.worker import StoreKey, Worker
from tests.conftest import assert_trees_close


def _case():
    batch = mlp.make_batch(batch_size=16)
    return mlp.make_state(mlp.MLP(num_layers=3), batch["x"]), batch


def _small_leaves(state) -> int:
    return sum(np.asarray(x).nbytes <= 64 for x in jax.tree.leaves(state))


def test_small_state_results_are_read_in_place(threads_cluster, monkeypatch):
    state, batch = _case()
    assert _small_leaves(state) >= 8  # the biases (16 floats) and Adam's counts
    step = meshshard.parallelize(mlp.train_step, method=DataParallel((1, 2)))
    sent: list = []
    read = Worker._state_array

    def counting(self, value, tensor):
        sent.append(not isinstance(value, StoreKey))
        return read(self, value, tensor)

    monkeypatch.setattr(Worker, "_state_array", counting)
    got, ref = step(state, batch), jax.jit(mlp.train_step)(state, batch)
    assert sum(sent) == len(jax.tree.leaves(state))  # the first step: all from the host
    small = [x for x in jax.tree.leaves(got[0]) if isinstance(x, jax.Array)]
    assert len(small) >= 8  # by value, as jax.jit returns them
    for _ in range(3):
        sent.clear()
        got, ref = step(got[0], batch), jax.jit(mlp.train_step)(ref[0], batch)
        assert sent and not any(sent)  # every state array read where the last step left it
        assert_trees_close(ref, got)


def test_the_stored_copies_are_bounded_and_freed_with_the_step(threads_cluster):
    state, batch = _case()
    step = meshshard.parallelize(mlp.train_step, method=DataParallel((1, 2)))
    for _ in range(3):
        state, loss = step(state, batch)
    twins = len(executable._TWINS)
    for _ in range(10):
        state, loss = step(state, batch)
    assert len(executable._TWINS) == twins  # one step's worth, not one per step
    exe = step.executable
    kept = [stored for _, stored in exe._twin_steps[-1]]
    assert kept and not any(t.deleted for t in kept)
    step.release()  # a released step drops its stored copies; the values stay
    assert all(t.deleted for t in kept) and not exe._twin_steps
    alive = [stored() for _, stored in executable._TWINS.values()]
    assert not any(a is t for a in alive for t in kept)
    assert float(loss) == float(np.asarray(loss))  # the by-value result itself is kept
