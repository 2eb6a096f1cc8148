"""2BW without flushes at run time: step k+1's forwards run while step k drains.

Stage 1's sends are slowed (each by 0.15 s on its comm thread), so on stage 0 step k's
backwards wait for their gradients; with the pipelined runtime step k+1's forwards are
dispatched during that wait, with ``MESHSHARD_2BW_PIPELINE=0`` only after step k ended.
The numbers are checked against the plain-JAX 2BW rule in tests/test_schedule_parity.py
(and on Ray in tests/test_schedules_ray.py), both through the pipelined runtime.
"""

import time

import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.instructions import Run
from meshshard.runtime.transport import QueueTransport
from tests.conftest import assert_trees_close
from tests.two_bw_reference import reference_2bw

pytestmark = pytest.mark.slow


def stage0_steps(monkeypatch, pipelined: bool, steps: int = 4):
    """Run 2BW S=2 M=2 with slow stage-1 sends; per step on stage 0's worker: (first
    forward dispatch, last backward dispatch) in ns, and the losses."""
    monkeypatch.setenv("MESHSHARD_2BW_PIPELINE", "1" if pipelined else "0")
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(steps)]
    state = mlp.make_state(model, batches[0]["x"], learning_rate=0.05)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    step = meshshard.parallelize(mlp.train_step, method=method)
    state, _ = step(state, batches[0])  # the first call: the plan without the stash
    state, _ = step(state, batches[1])  # compiles the steady plan
    exe = step.executable
    exe.settle()
    exe.backend.runtime_options(timeline=True)
    slow = exe.plan.meshes[1].workers[0]
    isend = QueueTransport.isend

    def slow_isend(self, data, peer, tag):
        if self.rank == slow:
            time.sleep(0.15)
        return isend(self, data, peer, tag)

    monkeypatch.setattr(QueueTransport, "isend", slow_isend)
    losses = []
    for batch in batches[2:]:
        state, loss = step(state, batch)
        losses.append(loss)
    exe.settle()
    w0 = exe.backend.workers[exe.plan.meshes[0].workers[0]]
    code = w0.interp.stream.instructions
    spans = []
    for _, tl in list(w0.interp.timelines)[-(steps - 2) :]:
        runs = {str(code[i].program): t0 for i, t0, _ in tl.runs if type(code[i]) is Run}
        fwd = min(t for p, t in runs.items() if p.endswith(".F"))
        bwd = max(t for p, t in runs.items() if p.endswith(".B"))
        spans.append((fwd, bwd))
    return spans, [float(x) for x in losses], (state, batches)


@pytest.mark.parametrize("pipelined", [True, False])
def test_2bw_next_step_forwards_run_while_the_last_backwards_drain(
    threads_cluster, monkeypatch, pipelined
):
    spans, losses, (state, batches) = stage0_steps(monkeypatch, pipelined)
    (_, k_last_b), (k1_first_f, _) = spans
    if pipelined:
        assert k1_first_f < k_last_b  # no flush: step k+1 started before step k drained
    else:
        assert k1_first_f > k_last_b  # flushed: one step after the other
    # and the numbers are the 2BW rule's, step for step, either way
    model = mlp.MLP(num_layers=4)
    want = reference_2bw(mlp.make_state(model, batches[0]["x"], learning_rate=0.05), batches, 2)
    np.testing.assert_allclose(losses, [float(w[1]) for w in want[2:]], rtol=1e-5)
    assert_trees_close(want[-1][0].params, state.params)


def test_start_order_waits_for_the_step_in_flight_whatever_the_arrival_order():
    """A threaded actor may run step 1's call before step 0's: step 1 then waits for
    step 0 to start, and step 0 starting late never moves the order backwards."""
    import threading

    from meshshard.runtime.worker import StartOrder

    order, log = StartOrder(threading.Condition()), []

    def step(seq, after):
        order.wait(after, timeout_s=10)
        log.append(seq)
        order.started(seq)

    one = threading.Thread(target=step, args=(1, 0))
    one.start()
    time.sleep(0.2)
    assert log == []  # step 1 arrived first and waits
    step(0, None)
    one.join(10)
    step(2, 1)  # would wait forever if step 0's late start had reset the order to 0
    assert log == [0, 1, 2] and order.last == 2
    with pytest.raises(meshshard.MeshshardRuntimeError, match="never arrived"):
        StartOrder(threading.Condition()).wait(5, timeout_s=0.1)


def test_2bw_steps_whose_calls_arrive_out_of_order_still_match_the_rule(
    threads_cluster, monkeypatch
):
    """Each pipelined step's call reaches stage 1's worker late (as a threaded Ray actor
    may run two calls in either order): the steps still run, step for step equal to
    the 2BW rule."""
    from meshshard.runtime.worker import Worker

    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(5)]
    state = mlp.make_state(model, batches[0]["x"], learning_rate=0.05)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    step = meshshard.parallelize(mlp.train_step, method=method)
    run_step = Worker.run_step

    def late_even_steps(self, *args):
        seq = args[4] if len(args) > 4 else None
        if seq is not None and seq % 2 == 0 and self.worker == 1:
            time.sleep(0.3)  # the next step's call gets here first
        return run_step(self, *args)

    monkeypatch.setattr(Worker, "run_step", late_even_steps)
    got, losses = state, []
    for batch in batches:
        got, loss = step(got, batch)
        losses.append(loss)
    want = reference_2bw(state, batches, 2)
    np.testing.assert_allclose([float(x) for x in losses], [float(w[1]) for w in want], rtol=1e-5)
    assert_trees_close(want[-1][0].params, got.params)
