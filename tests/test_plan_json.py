"""Plan JSON decoded generically from the dataclass field types; errors name the field."""

import json

import pytest

from meshshard import ClusterSpec, PipeshardParallel
from meshshard.passes.emit import transfer_only_plan
from meshshard.plan import MeshSpec, Message, Plan, TensorSpec, TransferSpec
from meshshard.plan_json import PlanFormatError, decode, encode
from meshshard.refs import BufferRef, LeafKind, OutputSource, ProgramRef, TaskKind
from meshshard.sim.synthetic import synthetic_pipeline
from tests.test_plan import mlp_plan


@pytest.fixture(scope="module")
def plan():
    return mlp_plan(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))


def _transfer_plan():
    meshes = (MeshSpec(0, (1, 2), (0,)), MeshSpec(1, (2, 1), (1, 2)))
    msg = Message(0, 1, ((0, 4), (0, 8)), 128, group=(0, 1, 2), dst_devices=((0,), (0,)))
    t = TransferSpec("t0", TensorSpec(0, "x", (4, 8), "float32"), (), 0, 1, None, None, (msg,))
    return transfer_only_plan(t, meshes, ClusterSpec("json", 3, 2))


def test_real_plans_round_trip(plan):
    for p in (plan, synthetic_pipeline(3, 4), _transfer_plan()):
        assert Plan.from_json(p.to_json()) == p
        assert Plan.from_json(p.to_json(indent=1)).to_json() == p.to_json()


def test_typed_fields_travel_as_their_tokens(plan):
    doc = json.loads(plan.to_json())
    assert doc["programs"][0]["name"] == "s0.F" and doc["buffers"][0]["name"] == "X0"
    assert doc["inputs"][1]["kind"] in ("batch", "state", "unused")
    back = Plan.from_json(plan.to_json())
    assert back.programs[0].name == ProgramRef.parse("s0.F")
    assert isinstance(back.buffers[0].name, BufferRef)
    assert isinstance(back.schedule.ticks[0][0].kind, TaskKind)
    assert {type(i.kind) for i in back.inputs} == {LeafKind}
    assert {type(o.source) for o in back.outputs} == {OutputSource}


def _broken(plan, edit):
    doc = json.loads(plan.to_json())
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["transfers"][0]["messages"][0].update(nbytes="x"),
            r"^transfers\[0\]\.messages\[0\]\.nbytes: expected int, got 'x'$",
        ),
        (
            lambda d: d["meshes"][1].update(shape=[1]),
            r"^meshes\[1\]\.shape: expected a list of 2, got \[1\]$",
        ),
        (
            lambda d: d["inputs"][0].update(kind="weights"),
            r"^inputs\[0\]\.kind: expected one of 'batch', 'state', 'unused', got 'weights'$",
        ),
        (
            lambda d: d["programs"][2].update(inputs=["P0", "Q1"]),
            r"^programs\[2\]\.inputs\[1\]: bad BufferRef 'Q1': .*kind must be one of",
        ),
        (
            lambda d: d["streams"][1]["instructions"].__setitem__(0, "JUMP w3"),
            r"^streams\[1\]\.instructions\[0\]: bad Instruction 'JUMP w3'",
        ),
        (lambda d: d["schedule"].pop("ticks"), r"^schedule\.ticks: missing$"),
        (lambda d: d.update(colour="red"), r"^<document>: unknown field 'colour' of Plan$"),
        (
            lambda d: d["outputs"][0].update(literal=[1]),
            r"^outputs\[0\]\.literal: expected float \| int \| bool \| NoneType, got \[1\]$",
        ),
        (
            lambda d: d["transfers"][0].update(sim_time_s=True),
            r"^transfers\[0\]\.sim_time_s: expected float \| NoneType, got True$",
        ),
    ],
)
def test_malformed_documents_name_the_field(plan, edit, message):
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_json(_broken(plan, edit))


def test_not_json_at_all():
    with pytest.raises(PlanFormatError, match="plan JSON does not parse"):
        Plan.from_json("{not json")
    with pytest.raises(ValueError, match=r"^<document>: expected a Plan object, got \[\]$"):
        Plan.from_json("[]")


def test_decode_walks_nested_types():
    msg = Message(0, 2, ((0, 1), (2, 3)), 8, group=(0, 1, 2), dst_devices=((1,), (0, 1)))
    assert decode(Message, encode(msg)) == msg
    assert decode(tuple[int, ...], [1, 2]) == (1, 2)
    assert decode(int | None, None) is None
    assert decode(None | str | tuple[str, ...], ["host", "device"]) == ("host", "device")
