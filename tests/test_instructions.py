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
from meshshard.refs import (
    BufferKind,
    BufferRef,
    CollectiveKind,
    Phase,
    ProgramRef,
    TransferRef,
)

small = st.integers(0, 999)
slot = st.none() | st.integers(0, 9)
prio = st.integers(-5, 50)
kinds = st.sampled_from(list(BufferKind))
buffers = st.builds(BufferRef, kinds, small, slot | small, slot, slot)
mb_buffers = st.builds(BufferRef, kinds, small, small, slot, slot)
t_buffers = st.builds(lambda n, mb: BufferRef(BufferKind.TRANSFER, n, mb), small, small)
programs = st.one_of(
    st.builds(
        ProgramRef,
        st.sampled_from([Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT_GRAD]),
        small,
        slot,
    ),
    st.builds(ProgramRef, st.sampled_from([Phase.APPLY, Phase.GATHER]), small),
)

instructions = st.one_of(
    st.builds(lambda b, p: Load(buffer=b, mb=b.mb, priority=p), mb_buffers, prio),
    st.builds(lambda b, p: Zeros(buffer=b, priority=p), buffers, prio),
    st.builds(
        lambda prog, mb, i, o, p: Run(
            program=prog, mb=mb, inputs=tuple(i), outputs=tuple(o), priority=p
        ),
        programs,
        st.none() | small,
        st.lists(buffers, max_size=5),
        st.lists(buffers, max_size=5),
        prio,
    ),
    st.builds(
        lambda b, m, w, p: Send(buffer=b, transfer=b.transfer, message=m, peer=w, priority=p),
        t_buffers,
        small,
        small,
        prio,
    ),
    st.builds(
        lambda b, m, w, p: Recv(buffer=b, transfer=b.transfer, message=m, peer=w, priority=p),
        t_buffers,
        small,
        small,
        prio,
    ),
    st.builds(
        lambda b, m, g, k, p: Collective(
            kind=k,
            buffer=b,
            transfer=b.transfer,
            message=m,
            group=tuple(g),
            root=g[0],
            priority=p,
        ),
        t_buffers,
        small,
        st.lists(small, min_size=1, max_size=6, unique=True),
        st.sampled_from(list(CollectiveKind)),
        prio,
    ),
    st.builds(lambda b, p: Wait(buffer=b, priority=p), buffers, prio),
    st.builds(lambda p: WaitAll(priority=p), prio),
    st.builds(lambda b, p: Free(buffer=b, priority=p), buffers, prio),
)


@given(buffers)
def test_buffer_refs_round_trip(ref):
    assert BufferRef.parse(str(ref)) == ref
    assert ref.group.mb is None and ref.group.kind is ref.kind and ref.group.owner == ref.owner


@given(programs)
def test_program_refs_round_trip(ref):
    assert ProgramRef.parse(str(ref)) == ref


@given(small)
def test_transfer_refs_round_trip(n):
    ref = TransferRef(n)
    assert TransferRef.parse(str(ref)) == ref
    assert ref.buffer(3).transfer == ref and str(ref.buffer(3)) == f"t{n}@3"


@pytest.mark.parametrize("token", ["Q1", "P", "t1@", "s0.apply", "m0.F", "P1@x"])
def test_bad_reference_tokens_are_rejected(token):
    with pytest.raises(ValueError, match=r"cannot parse|kind must be one of"):
        (ProgramRef.parse if "." in token else BufferRef.parse)(token)


def test_typed_fields_not_names():
    ins = parse_instruction("RUN s1v2.B mb3 (P1 R1@3) -> (A1 t4@3)")
    assert ins.program == ProgramRef(Phase.BACKWARD, 1, virtual=2)
    assert [b.kind for b in ins.writes] == [BufferKind.ACCUMULATORS, BufferKind.TRANSFER]
    assert ins.writes[1].transfer == TransferRef(4) and ins.writes[1].mb == 3
    assert BufferRef.parse("P1v2~3@4") == BufferRef(BufferKind.PARAMS, 1, 4, virtual=2, version=3)


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
    assert tuple(map(str, run.reads)) == ("P0", "R0@1") and tuple(map(str, run.writes)) == ("A0",)
    t1 = BufferRef(BufferKind.TRANSFER, 1, 0)
    assert Recv(buffer="t1@0", transfer="t1", message=0, peer=2).writes == (t1,)
    assert Send(buffer="t1@0", transfer="t1", message=0, peer=2).reads == (t1,)


@pytest.mark.parametrize("token", ["JUMP w3", "RUN s0.F mb1 (a) ->", "SEND t1@0 -> w2", "LOAD X0"])
def test_bad_tokens_are_rejected(token):
    with pytest.raises(ValueError, match="cannot parse|per-micro-batch"):
        parse_instruction(token)


def test_collective_root_must_be_in_group():
    with pytest.raises(ValueError, match="root w9 is not in its group"):
        Collective(kind="broadcast", buffer="t0@0", transfer="t0", message=0, group=(0, 1), root=9)
