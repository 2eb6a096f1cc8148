"""The bounded search stops on a node budget: plans do not depend on the machine's speed."""

import re

import pytest

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import plan_resharding
from meshshard.resharding.search import NODE_BUDGET, Work, broadcast_search, search_schedule
from meshshard.tiles import resharding_problem

P38 = ClusterSpec.preset("aws-p3.8xlarge")
HD = ("host", "device")


def all_to_all():
    """The paper's case 4 at 64 KiB: 64 works, far too many for the search to finish."""
    src, dst = MeshSpec(0, (2, 4), (0, 1)), MeshSpec(1, (2, 4), (2, 3))
    return resharding_problem((64, 64, 4), "int32", src, (None, HD), dst, (HD,))


def hard_works(n=9):
    """Works whose bound (the busiest receiver) cannot be met, so nothing stops the search early."""
    return [Work((0, 1), (10 + i % 3,), 3 + (i * 7) % 5) for i in range(n)]


@pytest.mark.parametrize("budget", [1, 50, 1000, 20_000])
def test_the_budget_is_honoured(budget):
    works = hard_works()
    r = search_schedule(works, max_nodes=budget)
    assert r.nodes == max(budget, len(works) + 1)  # the first dive always completes
    assert not r.complete
    assert "cut off by the node budget" in str(r)


def test_a_larger_budget_never_finds_a_worse_schedule():
    works = hard_works()
    spans = [search_schedule(works, max_nodes=b).makespan for b in (10, 100, 1000, 10_000)]
    assert spans == sorted(spans, reverse=True)
    assert spans[-1] < spans[0]


def test_two_runs_give_identical_schedules_and_plans():
    works = hard_works()
    assert search_schedule(works, max_nodes=5000) == search_schedule(works, max_nodes=5000)
    p = all_to_all()
    first = broadcast_search(p, P38, max_nodes=3000)
    assert first == broadcast_search(p, P38, max_nodes=3000)
    assert re.fullmatch(
        r"search: makespan \d+ B after 3000 nodes \(cut off by the node budget\)", first[1][0]
    )
    a, b = (str(plan_resharding(p, "broadcast_search", P38, simulate=False)) for _ in range(2))
    assert a == b
    assert f"after {NODE_BUDGET} nodes (cut off by the node budget)" in a


def test_a_small_search_completes_within_the_budget():
    works = [Work((0,), (10,), 2), Work((0,), (11,), 1), Work((1,), (11,), 1), Work((1,), (12,), 2)]
    r = search_schedule(works, max_nodes=NODE_BUDGET)
    assert r.complete and r.makespan == 3 and r.nodes < 50


def test_a_bad_budget_names_the_argument():
    with pytest.raises(ValueError, match=r"max_nodes must be a positive int, got 0; pass e\.g\."):
        search_schedule(hard_works(), max_nodes=0)
