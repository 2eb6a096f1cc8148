"""Plans as files: malformed documents and edited headers are refused with the field named."""

import json
import re
from dataclasses import replace

import pytest

from meshshard import ClusterSpec, PipeshardParallel, Plan
from meshshard.cli import main
from meshshard.plan import MeshSpec
from meshshard.plan_checks import PlanFormatError, PlanVerifyError, header_problems
from meshshard.sim import simulate
from meshshard.sim.synthetic import synthetic_pipeline
from meshshard.verify import verify
from tests.test_plan import mlp_plan


@pytest.fixture(scope="module")
def plan():
    return mlp_plan(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))


def edited(plan, **fields) -> str:
    doc = json.loads(plan.to_json())
    doc.update(fields)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("[]", r"^<document>: expected a Plan object, got \[\]$"),
        ("{}", r"plan JSON lacks field\(s\) method, cluster, num_micro_batches"),
        ("3", r"^<document>: expected a Plan object, got 3$"),
        ("{not json", r"plan JSON does not parse: .*line 1 column 2"),
    ],
)
def test_from_json_rejects_documents_that_are_not_plans(text, pattern):
    with pytest.raises(PlanFormatError, match=pattern):
        Plan.from_json(text)


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("num_micro_batches", "2", r"^num_micro_batches: expected int, got '2'"),
        ("num_micro_batches", True, r"^num_micro_batches: expected int, got True"),
        ("meshes", {}, r"^meshes: expected a list, got \{\}"),
        ("fingerprint", None, r"^fingerprint: expected str, got None"),
        ("schedule", [], r"^schedule: expected a Schedule object, got \[\]"),
    ],
)
def test_from_json_names_a_field_of_the_wrong_type(plan, field, value, pattern):
    with pytest.raises(PlanFormatError, match=pattern):
        Plan.from_json(edited(plan, **{field: value}))


def test_from_json_rejects_a_missing_field(plan):
    doc = json.loads(plan.to_json())
    del doc["streams"]
    with pytest.raises(PlanFormatError, match=r"lacks field\(s\) streams;"):
        Plan.from_json(json.dumps(doc))


def test_verify_catches_an_edited_micro_batch_count(plan):
    broken = Plan.from_json(edited(plan, num_micro_batches=4))
    problems = verify(broken)
    assert "num_micro_batches is 4 but the schedule '1f1b' runs 2" in problems
    fewer = Plan.from_json(edited(plan, num_micro_batches=1))
    assert any(
        re.fullmatch(r"w\d: the stream uses micro-batch 1 but num_micro_batches is 1", p)
        for p in verify(fewer)
    )


def test_verify_catches_an_edited_fingerprint(plan):
    broken = Plan.from_json(edited(plan, fingerprint="edited"))
    assert any(p.startswith("fingerprint 'edited' is not a traced") for p in verify(broken))
    assert header_problems(plan) == []


def test_verify_checks_meshes_against_the_cluster(plan):
    wide = replace(plan, meshes=(MeshSpec(0, (1, 4), (0,)), *plan.meshes[1:]))
    assert (
        "mesh0: shape (1, 4) uses 4 devices per host but its header's cluster has devices_per_host=2"
        in verify(wide)
    )
    far = replace(plan, meshes=(MeshSpec(0, (1, 2), (7,)), *plan.meshes[1:]))
    assert any(
        "mesh0: hosts [7] are outside its header's cluster (num_hosts=4" in p for p in verify(far)
    )
    two = replace(plan, meshes=(MeshSpec(0, (2, 2), (0,)), *plan.meshes[1:]))
    assert "mesh0: shape (2, 2) needs 2 distinct hosts, lists [0]" in verify(two)
    small = ClusterSpec("one-device", 4, 1)
    assert any(
        "uses 2 devices per host but cluster 'one-device' has devices_per_host=1" in p
        for p in verify(plan, small)
    )


def test_simulator_refuses_an_edited_header():
    plan = synthetic_pipeline(2, 4)
    with pytest.raises(PlanVerifyError, match=r"cannot simulate plan .*num_micro_batches is 3"):
        simulate(replace(plan, num_micro_batches=3))


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("[]", r"expected a Plan object, got \[\]"),
        ("{}", r"lacks field\(s\) method"),
        ("{oops", r"does not parse"),
    ],
)
def test_cli_rejects_malformed_plan_files_with_one_line(tmp_path, capsys, text, pattern):
    path = tmp_path / "plan.json"
    path.write_text(text)
    rc = main(["simulate", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("meshshard simulate: error: ")
    assert re.search(pattern, err) and "Traceback" not in err


def test_cli_rejects_an_edited_plan(tmp_path, capsys):
    plan = synthetic_pipeline(2, 4)
    path = tmp_path / "plan.json"
    path.write_text(edited(plan, num_micro_batches=7))
    rc = main(["simulate", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "num_micro_batches is 7 but the schedule" in err
