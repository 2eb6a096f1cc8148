"""Host-level messages (several blocks in one message): the contract, the coverage check,
JSON, and real execution on threads (exact tiles, exact bytes)."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshshard.cluster import ClusterSpec
from meshshard.passes.emit import transfer_only_plan
from meshshard.plan import Block, MeshSpec, Message, TensorSpec, TransferSpec
from meshshard.plan_json import decode, encode
from meshshard.resharding import plan_resharding
from meshshard.resharding.blocks import volume
from meshshard.resharding.coverage import check_messages, destination_tiles
from meshshard.resharding.merge import host_messages
from meshshard.runtime.transfer_run import run_transfer_threads
from meshshard.tiles import resharding_problem
from tests.test_resharding_runtime import check_delivery, problems

CLUSTER = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=4)
PLAIN = ["send_recv", "broadcast_nolb", "broadcast_greedy"]  # plans without local gathers


def _problem(shape, src_shape, src_spec, dst_shape, dst_spec, dtype="int32"):
    src = MeshSpec(0, src_shape, tuple(range(src_shape[0])))
    dst = MeshSpec(1, dst_shape, tuple(range(src_shape[0], src_shape[0] + dst_shape[0])))
    return resharding_problem(shape, dtype, src, src_spec, dst, dst_spec)


def _merged(problem, strategy, per_round):
    msgs = plan_resharding(problem, strategy, CLUSTER, simulate=False).messages
    return msgs, host_messages(msgs, per_round=per_round)


def _plan(problem, msgs):
    t = TransferSpec(
        "t0",
        TensorSpec(0, "x", problem.shape, problem.dtype, problem.src_spec),
        problem.dst_spec,
        0,
        1,
        None,
        None,
        tuple(msgs),
        "broadcast",
    )
    return transfer_only_plan(t, (problem.src, problem.dst), CLUSTER)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(PLAIN), st.booleans())
def test_merged_messages_give_every_device_exactly_its_tile(case, strategy, per_round):
    """Merged, every destination device receives exactly its tile's bytes, the wire
    carries the same bytes, and fewer (or as many) messages carry them."""
    problem = _problem(*case)
    msgs, merged = _merged(problem, strategy, per_round)
    if merged is None:  # nothing shares a host pair: every message stands alone
        keys = [(m.round if per_round else 0, m.group or (m.src, m.dst)) for m in msgs]
        assert len(set(keys)) == len(keys)
        return
    assert len(merged) < len(msgs)
    assert check_messages(problem, merged, allow_gather=False) == ()
    got: dict = {}
    for m in merged:
        for b in m.parts:
            for h, devs in zip(m.receivers, b.dst_devices, strict=True):
                for d in devs:
                    got[(h, d)] = got.get((h, d), 0) + volume(b.index) * problem.itemsize
    expected = {dev: volume(t) * problem.itemsize for dev, t in destination_tiles(problem).items()}
    assert got == expected
    wire = sum(m.nbytes * len(m.receivers) for m in merged)
    assert wire == sum(m.nbytes * len(m.receivers) for m in msgs)


CASES = [
    ((64, 48, 8), (1, 4), ("device",), (2, 2), ()),
    ((48, 24), (1, 4), (("host", "device"),), (3, 1), ()),
    ((24, 36), (2, 3), (None, "device"), (1, 2), ()),
]


@pytest.mark.parametrize("strategy", PLAIN)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}{c[2]}->{c[3]}{c[4]}")
@pytest.mark.parametrize("dtype", ["int32", "float16"])
def test_merged_messages_execute_on_threads(case, strategy, dtype):
    """Host-level messages run for real: senders read several shards into one payload,
    receivers rebuild every device's tile from several blocks; bytes exact."""
    problem = _problem(*case, dtype=dtype)
    _, merged = _merged(problem, strategy, per_round=False)
    assert merged is not None and any(m.blocks for m in merged)
    plan = _plan(problem, merged)
    full = np.arange(int(np.prod(problem.shape))).astype(dtype).reshape(problem.shape)
    tiles, received = run_transfer_threads(plan, full)
    check_delivery(plan, tiles, received, full)


def test_host_level_message_round_trips_through_json():
    m = Message(
        0,
        1,
        ((0, 2),),
        16,
        (0, 1),
        0,
        ((0, 1),),
        blocks=(Block(((0, 2),), 0, ((0,),)), Block(((2, 4),), 1, ((1,),))),
    )
    import json

    assert decode(Message, json.loads(json.dumps(encode(m)))) == m


def test_host_level_message_header_must_match_its_blocks():
    problem = _problem((8,), (1, 2), ("device",), (1, 2), ())
    a = Message(0, 1, ((0, 4),), 16, (0, 1), 0, ((0, 1),))
    b = Message(0, 1, ((4, 8),), 16, (0, 1), 1, ((0, 1),))
    (m,) = host_messages([a, b], per_round=False)
    assert check_messages(problem, [m]) == ()
    bad = dataclasses.replace(m, dst_devices=((0,),))
    with pytest.raises(ValueError, match=re.escape("must be, per receiver, the devices")):
        check_messages(problem, [bad])
    bad = dataclasses.replace(m, nbytes=16)
    with pytest.raises(ValueError, match="nbytes 16 is not the size of its blocks"):
        check_messages(problem, [bad])
