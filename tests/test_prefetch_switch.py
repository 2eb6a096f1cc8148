"""The prefetch switch (``StreamInterpreter(prefetch=)``, ``MESHSHARD_PREFETCH``): off
(the default) the reading ``RUN`` completes each received message itself, on it a
thread completes them ahead; results are the same either way, and a recording step
completes messages on the prefetch thread even with the switch off."""

import jax
import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.instructions import Wait
from meshshard.runtime import interpreter
from meshshard.runtime.overlap import Lazy, Prefetcher
from tests.conftest import assert_trees_close
from tests.parity import check_parity

METHOD = dict(num_micro_batches=4, stages=[(1, 1)] * 2, schedule="1f1b")


@pytest.fixture
def handed(monkeypatch):
    """Count the receives handed to the interpreters' prefetch threads."""
    counts = {"added": 0}
    real_add = Prefetcher.add

    def add(self, lazy):
        if type(lazy) is Lazy and self._thread.name.endswith("-recv"):
            counts["added"] += 1
        return real_add(self, lazy)

    monkeypatch.setattr(Prefetcher, "add", add)
    return counts


def _waits(step) -> int:
    return sum(type(i) is Wait for s in step.plan.streams for i in s.instructions)


def test_by_default_each_received_message_is_left_to_its_reader(threads_cluster, handed):
    step = check_parity("mlp", PipeshardParallel(**METHOD), steps=2)
    assert _waits(step) > 0 and handed["added"] == 0


def _steps_equal_reference(step, states=None, steps: int = 1, first_seed: int = 0):
    """``steps`` steps of ``step`` from ``states`` (reference, meshshard; default: a fresh
    state) equal the same steps of single-device ``jax.jit``; returns both states."""
    if states is None:
        batch = mlp.make_batch(batch_size=16)
        states = (mlp.make_state(mlp.MLP(num_layers=4), batch["x"]),) * 2
    ref, got = states
    for i in range(first_seed, first_seed + steps):
        b = mlp.make_batch(seed=i, batch_size=16)
        ref, ref_loss = jax.jit(mlp.train_step)(ref, b)
        got, got_loss = step(got, b)
        assert_trees_close(ref.params, got.params)
        assert_trees_close(ref_loss, got_loss)
    return ref, got


def test_prefetch_on_hands_each_message_to_the_thread_and_results_stay(threads_cluster, handed):
    step = meshshard.parallelize(mlp.train_step, method=PipeshardParallel(**METHOD))
    states = _steps_equal_reference(step)  # compiles; not prefetched (the default)
    assert handed["added"] == 0
    step.executable.backend.runtime_options(prefetch=True)
    _steps_equal_reference(step, states, steps=2, first_seed=1)
    assert handed["added"] == 2 * _waits(step)


def test_a_recording_step_prefetches_even_with_the_switch_off(threads_cluster, handed):
    step = meshshard.parallelize(mlp.train_step, method=PipeshardParallel(**METHOD))
    states = _steps_equal_reference(step)
    step.executable.backend.runtime_options(prefetch=False, timeline=True)
    handed["added"] = 0
    _steps_equal_reference(step, states, first_seed=1)
    assert handed["added"] == _waits(step)


def test_environment_switch(monkeypatch):
    monkeypatch.delenv("MESHSHARD_PREFETCH", raising=False)
    assert interpreter.default_prefetch() is False
    monkeypatch.setenv("MESHSHARD_PREFETCH", "1")
    assert interpreter.default_prefetch() is True
    monkeypatch.setenv("MESHSHARD_PREFETCH", "0")
    assert interpreter.default_prefetch() is False
