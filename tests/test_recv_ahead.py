"""Receives posted ahead of their RECV (``runtime/recv_ahead.py``): where each is
posted, that the interpreter posts it there, that no peer has more than one receive
posted beyond what its stream holds, and that results do not change."""

import threading
from collections import Counter

import pytest

from meshshard import PipeshardParallel
from meshshard.instructions import Recv, Run, Wait
from meshshard.refs import BufferRef, ProgramRef
from meshshard.runtime import interpreter
from meshshard.runtime.recv_ahead import receives_ahead
from tests.parity import check_parity


def recv(buffer: str, peer: int, message: int = 0) -> Recv:
    ref = BufferRef.parse(buffer)
    return Recv(buffer=ref, transfer=ref.transfer, message=message, peer=peer)


def wait(buffer: str) -> Wait:
    return Wait(buffer=BufferRef.parse(buffer))


def run(*inputs: str) -> Run:
    refs = tuple(BufferRef.parse(b) for b in inputs)
    return Run(program=ProgramRef.parse("s0.B"), mb=refs[0].mb, inputs=refs, outputs=())


def test_each_peers_next_receive_is_posted_at_the_wait_of_its_previous_one():
    stream = [
        recv("t1@0", 1), wait("t1@0"), run("t1@0"),  # 0 1 2
        recv("t2@0", 2), wait("t2@0"), run("t2@0"),  # 3 4 5
        recv("t1@1", 1), wait("t1@1"), run("t1@1"),  # 6 7 8
        recv("t2@1", 2), wait("t2@1"), run("t2@1"),  # 9 10 11
        recv("t1@2", 1), wait("t1@2"), run("t1@2"),  # 12 13 14
    ]  # fmt: skip
    # each peer's first receive at the start; then at the WAIT of that peer's previous
    assert receives_ahead(stream) == {0: (3,), 1: (6,), 4: (9,), 7: (12,)}


def test_a_receive_already_posted_before_the_previous_wait_stays_where_it_is():
    stream = [recv("t1@0", 1), recv("t1@1", 1), wait("t1@0"), wait("t1@1"), run("t1@0", "t1@1")]
    assert receives_ahead(stream) == {}


def test_every_message_of_a_buffer_is_posted_ahead_with_its_peer():
    stream = [
        recv("t1@0", 1, 0), recv("t1@0", 2, 1), wait("t1@0"), run("t1@0"),  # 0 1 2 3
        recv("t1@1", 1, 0), recv("t1@1", 2, 1), wait("t1@1"), run("t1@1"),  # 4 5 6 7
    ]  # fmt: skip
    # peer 2's first receive at the start; both next ones at the buffer's WAIT
    assert receives_ahead(stream) == {0: (1,), 2: (4, 5)}


def _outstanding(stream, ahead: dict) -> Counter:
    """The most receives each peer has posted and not yet waited for, along ``stream``
    with the receives posted at ``ahead``'s positions (and the rest where they stand)."""
    early = {j for js in ahead.values() for j in js}
    posted, most = Counter(), Counter()
    waiting: dict = {}  # buffer -> peers of its posted receives
    for i, ins in enumerate(stream):
        for j in (*ahead.get(i, ()), *(() if i in early else (i,))):
            if type(stream[j]) is Recv:
                posted[stream[j].peer] += 1
                waiting.setdefault(stream[j].buffer, []).append(stream[j].peer)
                most[stream[j].peer] = max(most[stream[j].peer], posted[stream[j].peer])
        if type(ins) is Wait:
            for peer in waiting.pop(ins.buffer, ()):
                posted[peer] -= 1
    return most


@pytest.mark.parametrize(
    "schedule,stages",
    [("gpipe", 2), ("1f1b", 2), ("eager_1f1b", 4), ("zb_h1", 4), ("interleaved_1f1b", 2)],
)
def test_a_peer_has_at_most_one_more_receive_posted_than_its_stream_holds(
    threads_cluster, schedule, stages
):
    kw = {"virtual_stages": 2} if schedule == "interleaved_1f1b" else {}
    method = PipeshardParallel(
        num_micro_batches=4, stages=[(1, 1)] * stages, schedule=schedule, **kw
    )
    step = check_parity("mlp", method, steps=1)
    moved = 0
    for s in step.plan.streams:
        stream = s.instructions
        ahead = receives_ahead(stream)
        moved += sum(map(len, ahead.values()))
        as_written, posted_ahead = _outstanding(stream, {}), _outstanding(stream, ahead)
        for peer, n in posted_ahead.items():
            assert n <= as_written[peer] + 1, (s.worker, peer, n, as_written[peer])
        for p, js in ahead.items():
            assert all(p < j for j in js)
    assert moved > 0  # some receives are posted early in every one of these schedules


def test_the_interpreter_posts_each_receive_where_the_map_says(threads_cluster, monkeypatch):
    """In a 1F1B step on the threads backend, each RECV's receive is posted while the
    instruction at its planned position is about to run, and results stay equal."""
    events, mine = [], threading.local()
    real_do, real_recv = interpreter._Step.do, interpreter._Step.recv

    def do(self, i, ins):
        mine.at = i
        events.append((self.interp.worker, "do", i))
        return real_do(self, i, ins)

    def post(self, ins, at=None):
        own = at if at is not None else mine.at
        events.append((self.interp.worker, "recv", own))
        return real_recv(self, ins, at)

    monkeypatch.setattr(interpreter._Step, "do", do)
    monkeypatch.setattr(interpreter._Step, "recv", post)
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, schedule="1f1b")
    step = check_parity("mlp", method, steps=1)
    for s in step.plan.streams:
        ahead = receives_ahead(s.instructions)
        mine_events = [(kind, i) for w, kind, i in events if w == s.worker]
        for p, js in ahead.items():
            before_p = mine_events.index(("do", p))
            for j in js:  # posted after the instruction before p ran, before p runs
                at = mine_events.index(("recv", j))
                assert at < before_p and (p == 0 or mine_events.index(("do", p - 1)) < at)
        posted = [i for kind, i in mine_events if kind == "recv"]
        recvs = [i for i, ins in enumerate(s.instructions) if type(ins) is Recv]
        assert sorted(posted) == recvs  # every receive posted once


def test_results_are_the_same_with_receives_posted_where_they_stand(threads_cluster):
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 2, schedule="1f1b")
    step = check_parity("mlp", method, steps=1)
    step.executable.backend.runtime_options(recv_ahead=False)
    check_parity("mlp", method, steps=2)
