"""A worker that fails on the in-process backend abandons the step: its peers stop
waiting for the messages it owes (they waited out a 300 s receive timeout before), and
the next step runs on clean queues."""

import jax
import pytest

import meshshard
from examples import mlp
from meshshard import MeshshardRuntimeError, PipeshardParallel
from tests.conftest import assert_trees_close


@pytest.mark.slow
def test_a_failed_worker_abandons_the_step_and_the_next_step_runs(threads_cluster):
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    got, _ = step(state, batch)
    ref, _ = jax.jit(mlp.train_step)(state, batch)
    backend = step.executable.backend
    for t in backend.transports.values():
        t.timeout_s = 3600.0  # only abandoning can end the wait within this test's life
    first = backend.workers[0]
    real = first.run_step

    def fail(*args, **kwargs):
        raise ValueError("injected failure")

    first.run_step = fail
    with pytest.raises(MeshshardRuntimeError) as info:
        step(got, batch)
    text = str(info.value)
    assert "injected failure" in text
    assert "w1 stopped waiting for message from w0" in text and "w0 failed (ValueError)" in text
    first.run_step = real
    got, loss = step(got, batch)  # the abandoned step's messages do not leak into this one
    ref, ref_loss = jax.jit(mlp.train_step)(ref, batch)
    assert_trees_close(ref.params, got.params)
    assert_trees_close(ref_loss, loss)
