"""Instruction tokens print compactly and parse back exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshshard.instructions import (
    Collective,
    Free,
    Load,
    Recv,
    Run,
    Send,
    Wait,
    WaitAll,
    WorkerStream,
    Zeros,
    parse_instruction,
)

buffers = st.from_regex(r"[A-Za-z][A-Za-z0-9.]{0,6}(@[0-9]{1,3})?", fullmatch=True)
mb_buffers = st.from_regex(r"[A-Za-z][A-Za-z0-9]{0,6}@[0-9]{1,3}", fullmatch=True)
t_buffers = st.from_regex(r"t[0-9]{1,3}@[0-9]{1,3}", fullmatch=True)
prio = st.integers(-5, 50)
small = st.integers(0, 999)

instructions = st.one_of(
    st.builds(lambda b, p: Load(buffer=b, mb=int(b.split("@")[1]), priority=p), mb_buffers, prio),
    st.builds(lambda b, p: Zeros(buffer=b, priority=p), buffers, prio),
    st.builds(
        lambda prog, mb, i, o, p: Run(
            program=prog, mb=mb, inputs=tuple(i), outputs=tuple(o), priority=p
        ),
        st.from_regex(r"[sm][0-9]\.(F|B|apply)", fullmatch=True),
        st.none() | small,
        st.lists(buffers, max_size=5),
        st.lists(buffers, max_size=5),
        prio,
    ),
    st.builds(
        lambda b, m, w, p: Send(buffer=b, transfer=b.split("@")[0], message=m, peer=w, priority=p),
        t_buffers,
        small,
        small,
        prio,
    ),
    st.builds(
        lambda b, m, w, p: Recv(buffer=b, transfer=b.split("@")[0], message=m, peer=w, priority=p),
        t_buffers,
        small,
        small,
        prio,
    ),
    st.builds(
        lambda b, m, g, p: Collective(
            kind="broadcast",
            buffer=b,
            transfer=b.split("@")[0],
            message=m,
            group=tuple(g),
            root=g[0],
            priority=p,
        ),
        t_buffers,
        small,
        st.lists(small, min_size=1, max_size=6, unique=True),
        prio,
    ),
    st.builds(lambda b, p: Wait(buffer=b, priority=p), buffers, prio),
    st.builds(lambda p: WaitAll(priority=p), prio),
    st.builds(lambda b, p: Free(buffer=b, priority=p), buffers, prio),
)


@given(instructions)
def test_token_round_trip(ins):
    assert parse_instruction(str(ins)) == ins


@given(st.lists(instructions, max_size=20), small)
def test_stream_round_trip(items, worker):
    stream = WorkerStream(worker, tuple(items))
    assert WorkerStream.parse(worker, stream.tokens()) == stream
    for line, ins in zip(str(stream).splitlines(), items, strict=True):
        assert parse_instruction(line) == ins  # the "w3: " prefix is accepted


def test_examples_print_as_documented():
    assert str(Run(program="s1.F", mb=2, inputs=("P1", "t0@2"), outputs=("R1@2", "t1@2"))) == (
        "RUN s1.F mb2 (P1 t0@2) -> (R1@2 t1@2)"
    )
    assert (
        str(Send(buffer="t7@0", transfer="t7", message=1, peer=4, priority=3))
        == "SEND t7@0 #1 -> w4 !3"
    )
    assert str(
        Collective(
            kind="broadcast", buffer="t2@1", transfer="t2", message=0, group=(0, 2, 3), root=0
        )
    ) == ("COLL broadcast t2@1 #0 [w0,w2,w3] root=w0")


def test_reads_and_writes_are_explicit():
    run = Run(program="s0.B", mb=1, inputs=("P0", "R0@1"), outputs=("A0",))
    assert run.reads == ("P0", "R0@1") and run.writes == ("A0",)
    assert Recv(buffer="t1@0", transfer="t1", message=0, peer=2).writes == ("t1@0",)
    assert Send(buffer="t1@0", transfer="t1", message=0, peer=2).reads == ("t1@0",)


@pytest.mark.parametrize("token", ["JUMP w3", "RUN s0.F mb1 (a) ->", "SEND t1@0 -> w2", "LOAD X0"])
def test_bad_tokens_are_rejected(token):
    with pytest.raises(ValueError, match="cannot parse|per-micro-batch"):
        parse_instruction(token)


def test_collective_root_must_be_in_group():
    with pytest.raises(ValueError, match="root w9 is not in its group"):
        Collective(kind="broadcast", buffer="t0@0", transfer="t0", message=0, group=(0, 1), root=9)
