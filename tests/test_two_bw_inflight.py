"""A pipelined 2BW step still in flight when its helpers stop, when the cluster closes,
or when a message is lost: it finishes, or it fails with an error that says why; it
never waits for good.

The stall these tests pin down: at interpreter exit, weakref's exit hook (registered
with the interpreters' finalizers, after ``meshshard.init`` registered the shutdown, so
run before it) stopped the comm threads of the step in flight; the step's next sends
were queued on a thread that had ended, so both of its workers waited in their
receives (and the shutdown waited out its 30 s). Injected waits make each case happen
on every run, whatever the machine's load.
"""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

import meshshard
from examples import mlp
from meshshard import MeshshardRuntimeError, PipeshardParallel
from meshshard.runtime import cluster as cluster_mod
from meshshard.runtime import interpreter
from meshshard.runtime.overlap import CommQueue
from meshshard.runtime.transport import QueueTransport, _Done

#: How long a test waits for a step that should end (seconds): far above the few
#: seconds it takes, far below the 300 s transfer timeout a stall would wait out.
BOUND_S = 60.0


def test_a_closed_comm_queue_refuses_new_ops():
    """An op queued after close would never be issued (the thread may have ended)."""
    q = CommQueue("closed")
    first = q.submit(0, lambda: "issued")
    q.close()
    assert first.result() == "issued"  # what it held before is still issued
    with pytest.raises(MeshshardRuntimeError, match="the comm thread closed was stopped"):
        q.submit(0, lambda: "never")


#: A script whose last 2BW step is in flight at exit, its workers holding their comm and
#: prefetch threads and paused until the exit hooks have begun (then 0.5 s more).  A hook
#: registered before ``meshshard.init`` runs after the shutdown and says how the step
#: ended.  Before the fix: "running" (the shutdown waited 30 s for a stalled step).
EXIT_WITH_STEP_IN_FLIGHT = textwrap.dedent(
    """
    import atexit, os, threading, time
    # 8 devices; and the test session's fast-compile flags (conftest.py), which the
    # exit path does not depend on: the first run compiled 20 s with XLA's defaults
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    import meshshard
    from examples import mlp
    from meshshard import PipeshardParallel
    from meshshard.runtime import interpreter

    exiting, ready, handles = threading.Event(), threading.Semaphore(0), []
    step_init = interpreter._Step.__init__

    def held_until_exit(self, *args, **kwargs):
        step_init(self, *args, **kwargs)  # the step holds its comm and prefetch threads
        if self.seq is not None:  # the pipelined step: on until the exit hooks began
            ready.release()
            exiting.wait(60)
            time.sleep(0.5)

    def report():
        h = handles[0]
        running = h.running
        how = "running" if running else "failed" if h.errors else "finished"
        print("in flight at exit:", how, *h.errors.values(), flush=True)

    interpreter._Step.__init__ = held_until_exit
    atexit.register(report)  # before init: runs after meshshard's shutdown
    meshshard.init(backend="threads")
    batch = mlp.make_batch(batch_size=8)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    step = meshshard.parallelize(mlp.train_step, method=method)
    state, _ = step(mlp.make_state(mlp.MLP(num_layers=4), batch["x"]), batch)
    state, _ = step(state, batch)  # pipelined: still running when the call returns
    handles.append(step.executable._inflight[-1].handle)
    for _ in range(2):
        ready.acquire(timeout=60)
    atexit.register(exiting.set)  # the first exit hook
    print("stepped", flush=True)
    """
)


@pytest.mark.slow
def test_exit_lets_the_step_in_flight_finish_with_its_comm_threads():
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_STEP_IN_FLIGHT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["stepped", "in flight at exit: finished"], proc.stdout


def steady_2bw(cluster):
    """A 2BW MLP step (S=2, M=2) past its first two calls (both plans compiled), settled;
    its executable, next state and batch."""
    batch = mlp.make_batch(batch_size=8)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    step = meshshard.parallelize(mlp.train_step, method=method)
    state, _ = step(mlp.make_state(mlp.MLP(num_layers=4), batch["x"]), batch)
    state, _ = step(state, batch)
    exe = step.executable
    exe.settle()
    assert exe.pipelined and exe.can_pipeline
    return step, exe, state, batch


def in_flight(step, exe, state, batch):
    """Call ``step`` once more; the handle of the step left in flight."""
    step(state, batch)
    return exe._inflight[-1].handle


def ended(handle, exe, bound_s: float = BOUND_S) -> bool:
    """Whether ``handle``'s threads end within ``bound_s`` (a stalled step is then given
    up on, so its threads do not wait out the transfer timeout)."""
    handle.join(bound_s)
    if handle.running:
        next(iter(exe.backend.transports.values())).abandon("the test gave up")
        return False
    return True


@pytest.mark.slow
def test_a_step_whose_comm_thread_stops_under_it_fails_at_once(threads_cluster, monkeypatch):
    """Stage 0's comm thread is stopped (as at exit, after the shutdown's wait) right
    after the pipelined step took it: its first send fails with an error naming the
    stopped thread, and stage 1 stops waiting for it (before: stage 1 waited out the
    300 s receive timeout, and stage 0's WAITALL waited for good)."""
    step, exe, state, batch = steady_2bw(threads_cluster)
    w0 = exe.plan.meshes[0].workers[0]
    step_init = interpreter._Step.__init__

    def stopped_under_it(self, *args, **kwargs):
        step_init(self, *args, **kwargs)
        if self.interp.worker == w0:
            self.comm.close()

    monkeypatch.setattr(interpreter._Step, "__init__", stopped_under_it)
    t0 = time.monotonic()
    handle = in_flight(step, exe, state, batch)
    assert ended(handle, exe), "the step stalled with its comm thread stopped"
    assert time.monotonic() - t0 < BOUND_S
    with pytest.raises(MeshshardRuntimeError, match=f"the comm thread w{w0}-comm was stopped"):
        exe.settle()


def lose_stage1_sends(monkeypatch, exe) -> threading.Event:
    """From now on stage 1's sends vanish; the event is set at the first lost one."""
    w1 = exe.plan.meshes[1].workers[0]
    isend, lost = QueueTransport.isend, threading.Event()

    def lossy(self, data, peer, tag):
        if self.rank == w1:
            lost.set()
            return _Done()  # sent to nobody
        return isend(self, data, peer, tag)

    monkeypatch.setattr(QueueTransport, "isend", lossy)
    return lost


@pytest.mark.slow
def test_a_lost_message_fails_the_step_after_the_transfer_timeout(threads_cluster, monkeypatch):
    step, exe, state, batch = steady_2bw(threads_cluster)
    for t in exe.backend.transports.values():
        monkeypatch.setattr(t, "timeout_s", 1.0)
    lose_stage1_sends(monkeypatch, exe)
    handle = in_flight(step, exe, state, batch)
    assert ended(handle, exe), "a lost message stalled the step past the transfer timeout"
    with pytest.raises(MeshshardRuntimeError, match=r"did not arrive in 1.0s"):
        exe.settle()


@pytest.mark.slow
def test_closing_the_cluster_gives_up_on_a_step_that_cannot_finish(threads_cluster, monkeypatch):
    """The shutdown (also the one at exit) gives up on a stalled step once it made no
    progress for CLOSE_WAIT_S: its receives fail at once, its threads end, the close
    returns (before: its threads waited out the 300 s transfer timeout)."""
    step, exe, state, batch = steady_2bw(threads_cluster)
    lost = lose_stage1_sends(monkeypatch, exe)
    monkeypatch.setattr(cluster_mod, "CLOSE_WAIT_S", 1.0)
    handle = in_flight(step, exe, state, batch)
    assert lost.wait(BOUND_S)
    t0 = time.monotonic()
    threads_cluster.close()
    assert time.monotonic() - t0 < BOUND_S
    assert ended(handle, exe, bound_s=0.0), "the close returned with the stalled step running"
    assert any("the cluster was shut down" in str(e) for e in handle.errors.values())


@pytest.mark.slow
def test_closing_the_cluster_waits_for_a_slow_step_that_gets_on(threads_cluster, monkeypatch):
    """Each instruction of the step in flight takes 0.2 s more, so it runs for several
    times CLOSE_WAIT_S, never that long without progress: the shutdown waits for it and
    it ends without an error (before: given up after CLOSE_WAIT_S in all; at exit
    that left threads inside XLA, which aborted the process under load)."""
    step, exe, state, batch = steady_2bw(threads_cluster)
    monkeypatch.setattr(cluster_mod, "CLOSE_WAIT_S", 1.5)
    do = interpreter._Step.do

    def slow_do(self, i, ins):
        time.sleep(0.2)
        return do(self, i, ins)

    monkeypatch.setattr(interpreter._Step, "do", slow_do)
    handle = in_flight(step, exe, state, batch)
    t0 = time.monotonic()
    threads_cluster.close()
    took = time.monotonic() - t0
    assert ended(handle, exe, bound_s=0.0), "the close returned with the step running"
    assert handle.errors == {}
    assert took > cluster_mod.CLOSE_WAIT_S  # it did wait past the idle limit


def slow_pipelined_steps(monkeypatch, seconds: float = 0.3) -> None:
    """Each pipelined step waits ``seconds`` before it runs, so a call right after the
    step returned finds it in flight."""
    from meshshard.runtime.worker import Worker

    run_step = Worker.run_step

    def slow(self, batch, state, base, free=(), seq=None, after=None):
        if seq is not None:
            time.sleep(seconds)
        return run_step(self, batch, state, base, free, seq, after)

    monkeypatch.setattr(Worker, "run_step", slow)


def test_another_step_reads_a_pipelined_result_once_it_is_stored(threads_cluster, monkeypatch):
    """An eval step on the state a 2BW step just returned, while that step still runs,
    waits for it: before, it read keys the workers had not stored yet and failed with
    "no longer holds array ..."."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    step, exe, state, batch = steady_2bw(threads_cluster)
    apply_fn = state.apply_fn

    def eval_loss(params, b):
        return jnp.mean((apply_fn({"params": params}, b["x"]) - b["y"]) ** 2)

    method = PipeshardParallel(num_micro_batches=1, stages=[(1, 2)] * 2)
    evaluate = meshshard.parallelize(eval_loss, method=method)
    evaluate(state.params, batch)  # compiled now, so the next call comes at once
    slow_pipelined_steps(monkeypatch)
    state, _ = step(state, batch)
    assert exe._inflight  # the step that writes ``state`` runs on
    got = evaluate(state.params, batch)
    want = jax.jit(eval_loss)(meshshard.fetch(state.params), batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_saving_a_state_a_pipelined_step_still_writes_waits_for_it(
    threads_cluster, monkeypatch, tmp_path
):
    """``meshshard.save`` right after a 2BW call writes the state that call returned:
    before, it failed ("array ... is no longer stored on this host") unless the user
    settled the step first."""
    import jax
    import numpy as np

    step, exe, state, batch = steady_2bw(threads_cluster)
    slow_pipelined_steps(monkeypatch)
    state, _ = step(state, batch)
    assert exe._inflight
    meshshard.save(str(tmp_path / "ck"), state)
    back = meshshard.restore(str(tmp_path / "ck"), like=state)
    for a, b in zip(
        jax.tree.leaves(meshshard.fetch(state.params)),
        jax.tree.leaves(meshshard.fetch(back.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
