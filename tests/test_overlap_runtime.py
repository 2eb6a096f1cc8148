"""The overlapping runtime: a RUN waits only for its own inputs, communication is issued
in priority order, and results stay equal to single-device JAX."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from meshshard import PipeshardParallel
from meshshard.instructions import Recv, Run, Send, Wait, WorkerStream
from meshshard.plan import MeshSpec, Message
from meshshard.runtime import interpreter, worker
from meshshard.runtime.overlap import CommQueue, Lazy
from meshshard.runtime.transfer_run import TileBlocks, expected_tiles, source_tiles
from meshshard.runtime.transport import QueueTransport
from tests.parity import check_parity
from tests.test_transport import transfer_plan

# --- the comm queue on its own -------------------------------------------------------


def held_queue():
    """A queue whose thread is busy on a first op until the returned event is set."""
    q = CommQueue("test")
    release = threading.Event()
    q.submit(100, release.wait)
    time.sleep(0.05)  # the thread has taken the first op and blocks in it
    return q, release


def test_comm_queue_issues_by_priority_then_submission_order():
    q, release = held_queue()
    prios = [0, 3, 1, 3, 2, 0]
    futs = [q.submit(p, lambda p=p: p) for p in prios]
    release.set()
    assert [f.result() for f in futs] == prios
    q.close()
    # submission numbers: 0 is the holding op, then prios[k] is number k + 1
    assert q.issued == [0, 2, 4, 5, 3, 1, 6]


def test_comm_queue_keeps_one_channels_order_whatever_the_priorities():
    q, release = held_queue()
    order = []
    q.submit(0, lambda: order.append("a0"), channel="a")
    q.submit(9, lambda: order.append("a1"), channel="a")
    q.submit(5, lambda: order.append("b0"), channel="b")
    q.submit(1, lambda: order.append("x"))
    done = q.submit(-1, lambda: order.append("end"))
    release.set()
    done.result()
    q.close()
    # b0 (5) first; a1 (9) must follow a0 (0), which outranks only "end"
    assert order == ["b0", "x", "a0", "a1", "end"]


def test_lazy_runs_once_and_hands_errors_to_every_waiter():
    lz = Lazy(lambda: 1 / 0)
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            lz.get()


def test_lazy_hands_one_value_to_every_waiting_thread():
    """Threads that wait while another computes the value all get it, once computed;
    ``done`` flips only then."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def compute():
        calls.append(1)
        started.set()
        release.wait(10)
        return 7

    lz = Lazy(compute)
    runner = threading.Thread(target=lz.run)
    runner.start()
    started.wait(10)
    got = []
    waiters = [threading.Thread(target=lambda: got.append(lz.get())) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    assert not lz.done and got == []  # all four wait for the runner
    release.set()
    for t in [runner, *waiters]:
        t.join(10)
    assert got == [7] * 4 and calls == [1] and lz.done and lz.result() == 7


# --- priority order through the interpreter ---------------------------------------------


class RecordingTransport:
    """An in-memory transport that records issue order; its first send is slow to issue
    (it blocks 0.3 s), so the sends behind it queue and their order is the runtime's."""

    def __init__(self, inner):
        self.inner, self.rank, self.order = inner, inner.rank, []

    def isend(self, data, peer, tag):
        if not self.order:
            time.sleep(0.3)
        self.order.append(tag)
        return self.inner.isend(data, peer, tag)

    def irecv(self, nbytes, peer, tag):
        return self.inner.irecv(nbytes, peer, tag)


def test_sends_are_issued_in_priority_order_and_bytes_arrive():
    rows = 5
    src, dst = MeshSpec(0, (1, 1), (0,)), MeshSpec(1, (1, 1), (1,))
    msgs = tuple(Message(0, 1, ((r, r + 1), (0, 3)), 12, src_device=0) for r in range(rows))
    plan = transfer_plan((rows, 3), src, (), dst, (), msgs)
    prio = {0: 9, 1: 1, 2: 7, 3: 7, 4: 3}  # message -> priority
    sender = plan.streams[0]
    sender = WorkerStream(
        0,
        tuple(
            dataclasses.replace(i, priority=prio[i.message]) if isinstance(i, Send) else i
            for i in sender.instructions
        ),
    )
    assert "SEND t0@0 #2 -> w1 !7" in sender.tokens()
    full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    qs = QueueTransport.group([0, 1])
    rec = RecordingTransport(qs[0])
    interp = interpreter.StreamInterpreter(
        sender, plan, {}, None, rec, blocks=TileBlocks(plan, 0), overlap=True
    )
    buf = plan.transfers[0].name.buffer(0)
    interp.run({buf: (source_tiles(full, plan, 0),)}, load=None)
    tag_of = {interp.tag(plan.transfers[0].name, 0, m): m for m in range(rows)}
    # stream order would be 0 1 2 3 4; the 0.3 s first send lets the rest queue
    assert [tag_of[t] for t in rec.order] == [0, 2, 3, 4, 1]
    receiver = interpreter.StreamInterpreter(
        plan.streams[1], plan, {}, None, qs[1], blocks=TileBlocks(plan, 1)
    )
    got = receiver.run({}, load=None)[buf][0]
    for d, (idx, tile) in expected_tiles(full, plan, 1).items():
        assert got[d][0] == idx
        np.testing.assert_array_equal(got[d][1], tile)


# --- a RUN is not held up by a transfer it does not read --------------------------------


class SlowFirstSend:
    """Worker 1's transport: its first message of a step (the gradient of micro-batch
    0) is delivered 0.8 s late, as if on a slow link; every delivery time is logged."""

    def __init__(self, inner, log):
        self.inner, self.rank, self.log = inner, inner.rank, log
        self.slow_tag = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def isend(self, data, peer, tag):
        if self.slow_tag is None:
            self.slow_tag = tag  # the same message of every step is slow
        if tag != self.slow_tag:
            return self.inner.isend(data, peer, tag)

        def deliver():
            self.inner.isend(data, peer, tag)
            self.log.append(("delivered", time.perf_counter()))

        timer = threading.Timer(0.8, deliver)
        timer.start()
        return type("Slow", (), {"wait": lambda self_: timer.join()})()


def hoist_first_recv(stream: WorkerStream) -> WorkerStream:
    """Move worker 0's first RECV/WAIT (the gradient of micro-batch 0) before its
    forward of micro-batch 1, which does not read it."""
    ins = list(stream.instructions)
    recv = next(i for i in ins if isinstance(i, Recv))
    wait = next(i for i in ins if isinstance(i, Wait) and i.buffer == recv.buffer)
    ins.remove(recv)
    ins.remove(wait)
    at = next(
        k
        for k, i in enumerate(ins)
        if isinstance(i, Run) and str(i.program) == "s0.F" and i.mb == 1
    )
    return WorkerStream(stream.worker, tuple(ins[:at] + [recv, wait] + ins[at:]))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_a_run_does_not_wait_for_an_unrelated_transfer(threads_cluster, monkeypatch, overlap):
    log = []
    real = interpreter.StreamInterpreter

    def timed(prog, w):
        def call(groups):
            log.append(("run", w, str(prog.name), time.perf_counter()))
            return prog(groups)

        return call

    def make(stream, plan, programs, mesh, transport, blocks=None):
        if stream.worker == 0:
            stream = hoist_first_recv(stream)
            programs = {k: timed(p, 0) for k, p in programs.items()}
        if stream.worker == 1:
            transport = SlowFirstSend(transport, log)
        return real(stream, plan, programs, mesh, transport, blocks, overlap=overlap)

    monkeypatch.setattr(worker, "StreamInterpreter", make)
    monkeypatch.setenv("MESHSHARD_TIMELINE", "1")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    step = check_parity("mlp", method, steps=2)  # values unchanged by the moved WAIT
    # the recorded timelines: one compute span per RUN, every message sent arrived,
    # and the slow one was in flight for its 0.8 s
    timelines = step.executable.backend.runtime_options()
    for s in step.plan.streams:
        runs = [i for i in s.instructions if isinstance(i, Run)]
        assert len(timelines[s.worker].runs) == len(runs)
    t0, t1 = timelines[0], timelines[1]
    assert set(t1.sent) == set(t0.arrived) and set(t0.sent) == set(t1.arrived)
    # w1's first message (micro-batch 0's gradient) is the slow one; under load a later
    # message may also be stamped late (its WAIT runs after w0's backward), so pick it
    # by its micro-batch, not by the longest flight
    (slow,) = [k for k in t1.sent if k[1] == 0]
    assert t0.arrived[slow] - t1.sent[slow] >= 0.8e9
    # the last step: when did w0 dispatch its forward of micro-batch 1, and when did
    # the slow gradient arrive?
    delivered = [e[1] for e in log if e[0] == "delivered"][-1]
    forwards = [e[3] for e in log if e[0] == "run" and e[2] == "s0.F"]
    f1 = forwards[-1]
    if overlap:
        assert f1 < delivered - 0.5  # dispatched at once, long before the gradient came
    else:
        assert f1 > delivered  # the plain interpreter blocked at the WAIT
