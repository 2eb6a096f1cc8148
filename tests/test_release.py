"""The releaser thread and interpreter exit: a cleanup call that is dropping device arrays
when the program ends must not abort the process (it did: exit code 134)."""

import subprocess
import sys
import textwrap

import pytest

#: A program whose last act queues a cleanup that drops 2,000 device arrays over about a
#: second, and exits once that cleanup has started: JAX's exit hook frees the backends
#: while the releaser thread still drops arrays, unless the releaser is closed first.
EXIT_DURING_CLEANUP = textwrap.dedent(
    """
    import threading, time
    import jax.numpy as jnp
    from meshshard.runtime.release import RELEASER

    box = [jnp.ones((1000,)) + i for i in range(2000)]
    started = threading.Event()

    def drop_slowly():
        started.set()
        while box:
            box.pop()
            time.sleep(0.0005)

    RELEASER.call(drop_slowly)
    started.wait(10)
    print("exiting", flush=True)
    """
)


def assert_exits_cleanly(
    script: str, expect: str, runs: int, cwd: str | None = None, quiet: bool = False
) -> None:
    """Run ``script`` in a fresh interpreter ``runs`` times: exit code 0, output ``expect``
    (and with ``quiet``, no traceback or ignored exception on stderr)."""
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == expect
        if quiet:
            assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
            assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.fast
def test_exit_while_a_cleanup_drops_device_arrays_does_not_abort():
    assert_exits_cleanly(EXIT_DURING_CLEANUP, "exiting", runs=2)


@pytest.mark.fast
def test_closed_releaser_drops_later_calls_and_flush_returns():
    from meshshard.runtime.release import Releaser

    rel = Releaser()
    done = []
    rel.call(lambda: done.append(1))
    rel.flush()
    rel.close()
    rel.call(lambda: done.append(2))
    rel.flush()  # returns at once: nothing will run
    assert done == [1]


@pytest.mark.fast
def test_close_drops_waiting_delayed_calls_on_the_closing_thread():
    # A delayed call (the executables' batched frees, 0.1 s) still waiting at exit held
    # its step; the releaser thread dropped it once its deadline passed, after JAX's exit
    # hook, and the process aborted in about one run of three.  close() drops it itself.
    import threading
    import time
    import weakref

    from meshshard.runtime.release import Releaser

    dropped_on, called = [], []

    class Holder:
        def free(self):
            called.append(1)

        def __del__(self):
            dropped_on.append(threading.current_thread().name)

    rel = Releaser()
    holder = Holder()
    alive = weakref.ref(holder)
    rel.call_later(0.2, holder.free)
    del holder
    time.sleep(0.05)  # the thread has taken it off the queue and waits for its deadline
    rel.close()
    assert alive() is None and dropped_on == [threading.current_thread().name]
    time.sleep(0.3)
    assert called == []


#: A script that keeps a data-parallel replicated step (its comm and prefetch threads
#: alive) to its end.  It exited with 134 (``terminate called ...``) in about three runs
#: of four until the helper threads were stopped before JAX's exit hook.
EXIT_WITH_LIVE_STEP = textwrap.dedent(
    """
    import os
    # 8 devices; and the test session's fast-compile flags (conftest.py), which the
    # exit path does not depend on: the first run compiled 20 s with XLA's defaults
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    import meshshard
    from examples import mlp
    from meshshard import PipeshardParallel
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    batch = mlp.make_batch(batch_size=16)
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, data_parallel=2)
    with use_cluster(ThreadsCluster(4, 2)):
        step = meshshard.parallelize(mlp.train_step, method=method)
        state, loss = step(mlp.make_state(mlp.MLP(num_layers=4), batch["x"]), batch)
        print("loss", float(loss) > 0, flush=True)
    """
)


@pytest.mark.slow
def test_exit_with_a_live_replicated_step_does_not_abort():
    root = __file__.rsplit("/tests/", 1)[0]
    assert_exits_cleanly(EXIT_WITH_LIVE_STEP, "loss True", runs=3, cwd=root)


#: A script whose step, called at two batch sizes (two executables), outlives its closed
#: cluster to the end of the program: the executables' finalizers run while the
#: interpreter clears module globals.  It printed ``Exception ignored in: <function
#: Executable.__del__>`` and an AttributeError on every run before the releaser was held
#: by the class.
EXIT_WITH_STEPS_ALIVE = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    import numpy as np
    import meshshard
    from examples import mlp
    from meshshard import PipeshardParallel
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    with use_cluster(ThreadsCluster(4, 2)):
        step = meshshard.parallelize(
            mlp.train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 2)
        )
        step(state, batch)
        step(state, {k: np.concatenate([v, v]) for k, v in batch.items()})
    print("stepped", flush=True)
    """
)


@pytest.mark.slow
def test_steps_alive_at_exit_are_finalized_quietly():
    root = __file__.rsplit("/tests/", 1)[0]
    assert_exits_cleanly(EXIT_WITH_STEPS_ALIVE, "stepped", runs=1, cwd=root, quiet=True)


#: A script that makes a threads cluster with ``use_cluster`` and never closes it, its
#: last pipelined (2BW) step still in flight: the step is held until the exit hooks have
#: begun (then 20 ms more), so its worker threads run XLA programs while the interpreter
#: exits unless something waits for them.  A hook registered first (run last) says how
#: the step ended.  Before the cluster closed itself at exit: "running", and exit code
#: 134 (``terminate called after throwing an instance of ''``) in 5 runs of 20.
EXIT_WITH_UNCLOSED_THREADS_CLUSTER = textwrap.dedent(
    """
    import atexit, os, threading, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    handles = []

    def report():
        h = handles[0]
        how = "running" if h.running else "failed" if h.errors else "finished"
        print("in flight at exit:", how, *h.errors.values(), flush=True)

    atexit.register(report)  # the last exit hook
    import meshshard
    from examples import mlp
    from meshshard import PipeshardParallel
    from meshshard.runtime import interpreter
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    exiting, ready, hold = threading.Event(), threading.Semaphore(0), []
    step_init = interpreter._Step.__init__

    def held_until_exit(self, *args, **kwargs):
        step_init(self, *args, **kwargs)
        if self.seq is not None and hold:
            ready.release()
            exiting.wait(60)
            time.sleep(0.02)

    interpreter._Step.__init__ = held_until_exit
    batch = mlp.make_batch(batch_size=8)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    with use_cluster(ThreadsCluster(4, 2)):
        step = meshshard.parallelize(mlp.train_step, method=method)
        state, _ = step(mlp.make_state(mlp.MLP(num_layers=4), batch["x"]), batch)
        state, _ = step(state, batch)
        step.executable.settle()
        hold.append(True)
        state, _ = step(state, batch)  # pipelined: in flight until the exit hooks begin
        handles.append(step.executable._inflight[-1].handle)
        for _ in range(2):
            ready.acquire(timeout=60)
    atexit.register(exiting.set)  # the first exit hook
    print("stepped", flush=True)
    """
)


@pytest.mark.slow
def test_exit_with_an_unclosed_threads_cluster_waits_for_its_step_and_does_not_abort():
    root = __file__.rsplit("/tests/", 1)[0]
    assert_exits_cleanly(
        EXIT_WITH_UNCLOSED_THREADS_CLUSTER,
        "stepped\nin flight at exit: finished",
        runs=3,
        cwd=root,
    )


@pytest.mark.fast
def test_a_threads_cluster_closes_once_and_is_forgotten_by_the_exit_hook():
    from meshshard.runtime import cluster as cluster_mod

    cl = cluster_mod.ThreadsCluster(1, 1)
    assert cl in cluster_mod._OPEN_THREADS
    cl.stores[0] = {1: "kept"}
    cl.close()
    assert cl.closed and cl not in cluster_mod._OPEN_THREADS and cl.stores[0] == {}
    cl.stores[0][2] = "after"
    cl.close()  # a second close (as at exit) does nothing
    assert cl.stores[0] == {2: "after"}
