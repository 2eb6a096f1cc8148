"""Golden plan text of every strategy on small versions of the paper's cases.

Regenerate with ``pytest tests/test_resharding_golden.py --update-golden`` and
read the diff: it is the plan a person would review.
"""

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import STRATEGIES, plan_resharding
from meshshard.tiles import resharding_problem
from tests.golden import check_golden

P38 = ClusterSpec.preset("aws-p3.8xlarge")

CASES = {
    # name: (src mesh, src spec, dst mesh, dst spec, shape)
    "case2_replicated_to_host": ((2, 4), (), (2, 4), ("host",), (16, 4)),
    "case6_two_to_three_hosts": ((2, 4), ("host",), (3, 4), ("host",), (12, 4, 2)),
    "case7_one_host_to_two": ((1, 4), ("device",), (2, 4), (), (8, 1 << 18)),
    "one_to_three_devices": ((1, 1), (), (1, 3), (), (8,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plans(name):
    ss, sp, ds, dp, shape = CASES[name]
    src = MeshSpec(0, ss, tuple(range(ss[0])))
    dst = MeshSpec(1, ds, tuple(range(ss[0], ss[0] + ds[0])))
    problem = resharding_problem(shape, "int32", src, sp, dst, dp)
    plans = [str(plan_resharding(problem, s, P38, simulate=False)) for s in STRATEGIES]
    check_golden(f"resharding_{name}.txt", str(problem) + "\n\n" + "\n\n".join(plans) + "\n")
