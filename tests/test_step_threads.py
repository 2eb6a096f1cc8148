"""The in-process backend's kept step threads (runtime/step_threads.py) and the batched
conversion of by-value results (runtime/executable.as_results)."""

import threading
import time

import jax
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard.runtime.executable import as_result, as_results
from meshshard.runtime.step_threads import StepThreads

pytestmark = pytest.mark.fast


def test_calls_reuse_an_idle_thread():
    pool = StepThreads()
    seen = []
    for _ in range(5):
        pool.start(lambda: seen.append(threading.current_thread().name)).wait(5)
    assert len(seen) == 5 and len(set(seen)) == 1  # one thread served all five
    assert pool.idle == 1
    pool.close_idle()


def test_concurrent_calls_run_at_once():
    """Two pipelined steps on one worker run at once: a call never waits for a busy
    thread (each call here waits for the other's event)."""
    pool = StepThreads()
    a, b = threading.Event(), threading.Event()
    first = pool.start(lambda: (a.set(), b.wait(5)))
    second = pool.start(lambda: (b.set(), a.wait(5)))
    assert first.wait(5) and second.wait(5)
    assert a.is_set() and b.is_set()
    assert pool.idle == 2
    pool.close_idle()


def test_a_raising_call_sets_its_event_and_keeps_the_thread(caplog):
    pool = StepThreads()

    def boom():
        raise ValueError("boom")

    assert pool.start(boom).wait(5)
    assert "boom" in caplog.text
    got = []
    assert pool.start(lambda: got.append(1)).wait(5)
    assert got == [1] and pool.idle == 1
    pool.close_idle()


def test_idle_threads_end():
    pool = StepThreads(idle_s=0.05)
    pool.start(lambda: None).wait(5)
    deadline = time.monotonic() + 5
    while pool.idle and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.idle == 0
    assert pool.start(lambda: None).wait(5)  # a new thread after the old one ended
    assert pool.idle == 1
    pool.close_idle()
    assert pool.idle == 0


def test_steps_of_the_threads_backend_reuse_their_threads(threads_cluster, monkeypatch):
    """Each step used to start one thread per worker; now the threads that ran the first
    step run the next ones too."""
    ran = _record_step_threads(monkeypatch)
    state, batch = _mlp_case()
    step = meshshard.parallelize(
        mlp.train_step,
        method=meshshard.PipeshardParallel(num_micro_batches=2, stages=((1, 2), (1, 2))),
        batch_argnums=(1,),
    )
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    first = set(ran)
    ran.clear()
    for _ in range(4):
        state, loss = step(state, batch)
    jax.block_until_ready(loss)
    assert len(first) == 2 and len(ran) == 8  # two workers, one call each per step
    assert set(ran) <= first


def _record_step_threads(monkeypatch) -> list:
    """The threads that run ``Worker.run_step`` from now on, one entry per call."""
    from meshshard.runtime.worker import Worker

    ran, run_step = [], Worker.run_step

    def recorded(self, *args, **kwargs):
        ran.append(threading.current_thread())
        return run_step(self, *args, **kwargs)

    monkeypatch.setattr(Worker, "run_step", recorded)
    return ran


def _mlp_case():
    """(state, batch) of a two-layer MLP."""
    batch = mlp.make_batch(batch_size=8)
    return mlp.make_state(mlp.MLP(num_layers=2), batch["x"]), batch


def _cases():
    return [
        (np.float32(1.5), True),  # a weakly typed float result (a Python-float loss)
        (np.array(3, np.int32), True),  # a step counter started from a Python int
        (np.array(True), True),
        (np.float32(2.0), False),
        (np.ones(3, np.float32), True),
        (np.array(1.0, np.float16), True),  # no Python scalar has this dtype
        (np.uint32(7), True),
        (np.array([1.0, 2.0], jax.numpy.bfloat16), False),
    ]


def test_as_results_is_as_result_of_each():
    cases = _cases()
    one_by_one = [as_result(v, w) for v, w in cases]
    at_once = as_results([v for v, _ in cases], [w for _, w in cases])
    assert len(at_once) == len(cases)
    for a, b in zip(one_by_one, at_once, strict=True):
        assert isinstance(b, jax.Array)
        assert (a.dtype, a.weak_type, a.shape, a.committed) == (
            b.dtype,
            b.weak_type,
            b.shape,
            b.committed,
        )
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert as_results([], []) == []


def test_closing_a_threads_cluster_ends_its_idle_step_threads(monkeypatch):
    """Per-step threads used to end with each step; kept ones must not outlive the
    cluster (no thread left behind by a closed cluster).  Checked on the threads that
    ran this cluster's steps: other tests' steps in this process may still hold theirs."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    ran = _record_step_threads(monkeypatch)
    state, batch = _mlp_case()
    with use_cluster(ThreadsCluster(4, 2)) as cluster:
        step = meshshard.parallelize(
            mlp.train_step, method=meshshard.DataParallel((1, 2)), batch_argnums=(1,)
        )
        for _ in range(2):
            state, loss = step(state, batch)
        jax.block_until_ready(loss)
    assert ran and all(t.name.startswith("meshshard-step-") for t in ran)
    cluster.close()  # as meshshard.shutdown() does
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in ran) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in ran)


def test_an_idle_thread_keeps_nothing_of_its_last_call():
    """A kept thread waiting for work held its last call's closure, and through it the
    step's workers and their stored arrays, until its next call: a released step's
    buffers stayed alive (the leak test saw 12 extra live buffers)."""
    import gc
    import weakref

    class Payload:
        pass

    pool = StepThreads()
    payload = Payload()
    gone = weakref.ref(payload)

    def call(held=payload):
        assert held is not None

    assert pool.start(call).wait(5)
    del payload, call
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None
    pool.close_idle()
