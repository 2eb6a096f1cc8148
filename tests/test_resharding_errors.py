"""Bad input and broken plans get errors that name the value, the rule and the fix."""

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.plan import MeshSpec, Message
from meshshard.resharding import STRATEGIES, check_messages, plan_resharding
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge")
SRC, DST = MeshSpec(0, (1, 2), (0,)), MeshSpec(1, (3, 1), (1, 2, 3))


def test_non_divisible_dim_names_dim_and_axis_sizes():
    with pytest.raises(
        MeshshardInputError,
        match=r"dim 0 of size 10 cannot be split over mesh axes \('host',\) of total size 3",
    ):
        plan_resharding(
            resharding_problem((10, 4), "int32", SRC, (), DST, ("host",)), "broadcast", P38
        )
    with pytest.raises(
        MeshshardInputError,
        match=r"dim 1 of size 3 cannot be split over mesh axes \('device',\) of total size 2",
    ):
        resharding_problem((4, 3), "int32", SRC, (None, "device"), DST, ())


def test_unknown_strategy_lists_the_known_ones():
    p = resharding_problem((6,), "int32", SRC, (), DST, ("host",))
    with pytest.raises(
        MeshshardInputError, match=r"strategy 'bcast' is not known; choose one of \["
    ):
        plan_resharding(p, "bcast", P38)
    assert STRATEGIES[0] == "broadcast" and len(STRATEGIES) == 6


def test_meshes_sharing_hosts_are_refused():
    p = resharding_problem((6,), "int32", SRC, (), MeshSpec(1, (3, 1), (0, 1, 2)), ("host",))
    with pytest.raises(MeshshardInputError, match=r"share hosts \[0\]; .* disjoint hosts"):
        plan_resharding(p, "broadcast", P38)


@pytest.fixture
def problem():
    return resharding_problem((6,), "int32", SRC, ("device",), DST, ("host",))


def good(problem):
    """The broadcast plan's messages, the one of block [0:2] (to w1.0) first."""
    msgs = list(plan_resharding(problem, "broadcast", P38, simulate=False).messages)
    return sorted(msgs, key=lambda m: m.index != ((0, 2),))


@pytest.mark.parametrize(
    "change,pattern",
    [
        (dict(src_device=1), r"block \[0:2\] is not inside the tile \[3:6\] of its sender w0\.1"),
        (dict(src=5), r"sender w5\.0 is not a source device"),
        (dict(nbytes=7), r"nbytes 7 is not the size of its blocks"),
        (dict(dst_devices=((1,),)), r"receiver w1\.1 is not a destination device"),
        (dict(dst_devices=()), r"dst_devices \(\) must list devices for each receiver \(1,\)"),
        (dict(group=(1, 2)), r"group \(1, 2\) must be \(src, dst, \.\.\.\)"),
    ],
)
def test_check_messages_names_the_broken_message(problem, change, pattern):
    msgs = good(problem)
    first = msgs[0]
    assert first.index == ((0, 2),)
    msgs[0] = Message(**{**first.__dict__, **change})
    with pytest.raises(ValueError, match=pattern):
        check_messages(problem, msgs)


def test_check_messages_finds_gaps_and_overlaps(problem):
    msgs = good(problem)
    with pytest.raises(ValueError, match=r"w1\.0 gets 0 of the 2 elements of its tile \[0:2\]"):
        check_messages(problem, msgs[1:])
    with pytest.raises(ValueError, match=r"receives overlapping blocks \[0:2\] and \[0:2\]"):
        check_messages(problem, msgs + msgs[:1])
    partial = Message(0, 1, ((0, 1),), 4, dst_devices=((0,),))
    with pytest.raises(ValueError, match=r"w1\.0 gets 1 of the 2 elements"):
        check_messages(problem, [partial] + msgs[1:])
