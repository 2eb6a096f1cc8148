"""Buffer, program and transfer references are interned: equal ones are one object
(their equality is identity), however they were made, from any thread."""

import copy
import dataclasses
import pickle
import sys
import threading

import pytest

from meshshard.refs import BufferKind, BufferRef, Phase, ProgramRef, TransferRef

pytestmark = pytest.mark.fast


def test_every_way_of_making_a_reference_gives_the_one_object():
    b = BufferRef(BufferKind.PARAMS, 1, 2)
    assert BufferRef.parse("P1@2") is b
    assert BufferRef(kind=BufferKind.PARAMS, owner=1, mb=2) is b
    assert pickle.loads(pickle.dumps(b)) is b
    assert copy.deepcopy(b) is b
    assert dataclasses.replace(BufferRef(BufferKind.PARAMS, 1, 3), mb=2) is b
    r = BufferRef(BufferKind.RESIDUALS, 1, 2)
    assert BufferRef(BufferKind.RESIDUALS, 1).at(2) is r and r.group is BufferRef.parse("R1")
    assert ProgramRef.parse("s0.F") is ProgramRef(Phase.FORWARD, 0)
    assert TransferRef.parse("t3") is TransferRef(3) and TransferRef(3).buffer(1) is (
        BufferRef.parse("t3@1")
    )
    assert {b: 1}[BufferRef.parse("P1@2")] == 1


def test_values_of_other_types_are_other_references():
    b = BufferRef(BufferKind.PARAMS, 1, 1)
    assert BufferRef(BufferKind.PARAMS, 1, 1.0) is not b
    assert BufferRef(BufferKind.PARAMS, 1, True) is not b
    assert b != BufferRef(BufferKind.PARAMS, 1, 2) and b != "P1@1"


def test_threads_making_the_same_references_at_once_get_one_object():
    made: list[list] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [
            threading.Thread(
                target=lambda: made.append(
                    [BufferRef(BufferKind.RESIDUALS, 10**6 + i, 5) for i in range(5000)]
                )
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(a is b for other in made[1:] for a, b in zip(made[0], other, strict=True))
