"""The shared-root term (meshshard/resharding/sharedroot.py): valid against every
schedule of a small family where a host's big share could end without a hop but the
source host both hosts need serves one of them late; the best schedule takes the
bound (to 0.2%), and so does ``broadcast``'s plan."""

import dataclasses
import itertools
import sys

import pytest

from meshshard.plan import MeshSpec
from meshshard.resharding import plan_resharding, simulate_resharding
from meshshard.resharding.blocks import make_message
from meshshard.resharding.bound import MIN_CHUNK_BYTES
from meshshard.resharding.hops import hop_bound_terms
from meshshard.resharding.merge import merged
from meshshard.resharding.relays import relay_bound_terms
from meshshard.resharding.sharedroot import shared_root_terms
from meshshard.tiles import resharding_problem
from tests.bound_checks import assert_bound_met

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_resharding_cleanlast import SIX, _pairs  # noqa: E402

SRC = MeshSpec(0, (3, 1), (0, 1, 2))  # thirds of the rows, one per host
DST = MeshSpec(1, (2, 3), (3, 4))  # halves of the rows by host, thirds of the columns
GROUPS = (((0, 1, 2),), ((0, 1), (2,)), ((0, 2), (1,)), ((1, 2), (0,)), ((0,), (1,), (2,)))
"""Each way one root's message to a host may split over its three devices."""


def _problem(rows: int):
    return resharding_problem(
        (rows, 114), "float32", SRC, ("host", "device"), DST, ("host", "device")
    )


def _message(problem, i, root, chain, parts, chunk):
    """One host-level message from ``root`` through ``chain``: ``parts`` ``(need, host,
    device)``; ``chunk`` set where the message is over it (0: the cluster's)."""
    blocks = [
        make_message(
            n.index,
            problem.itemsize,
            next(ref for ref in n.holders if ref[0] == root),
            [(h, (d,) if h == host else ()) for h in chain],
        )
        for n, host, d in parts
    ]
    m = dataclasses.replace(merged(blocks), round=i)
    if chunk and m.nbytes > chunk:
        m = dataclasses.replace(m, chunk_bytes=chunk)
    return m


def _message_sets(problem):
    """Every set of direct messages (per root and host, its devices split any way) of
    at most five.  No chain: the two hosts share no slice, and every block of a chain
    goes to a device of each of its hosts."""
    pairs = sorted(_pairs(problem).items())
    for choice in itertools.product(GROUPS, repeat=len(pairs)):
        msgs = [
            (r, (h,), tuple((n, h, d) for d in g for n in per[d]))
            for ((r, h), per), groups in zip(pairs, choice, strict=True)
            for g in groups
        ]
        if len(msgs) <= 5:
            yield msgs


def _orders(msgs):
    """Every order of ``msgs`` (``(root, chain, parts)``), one per class of equal
    per-worker sequences: each worker's sequence chosen, kept where they fit one
    global order."""
    members = [{r, *chain} for r, chain, _ in msgs]
    workers = sorted(set().union(*members))
    per = {w: [i for i, m in enumerate(members) if w in m] for w in workers}
    for seqs in itertools.product(*(itertools.permutations(per[w]) for w in workers)):
        heads = {w: list(s) for w, s in zip(workers, seqs, strict=True)}
        order: list[int] = []
        while len(order) < len(msgs):
            ready = [
                i
                for i, m in enumerate(members)
                if i not in order and all(heads[w][:1] == [i] for w in m)
            ]
            if not ready:
                break  # the sequences wait on each other: no such schedule
            order.append(ready[0])
            for w in members[ready[0]]:
                heads[w].pop(0)
        if len(order) == len(msgs):
            yield [msgs[i] for i in order]


def _times(problem):
    """Simulated seconds of every schedule of :func:`_message_sets` in every order, each
    with the cluster's chunk and with 32 KiB chunks."""
    out = []
    for msgs in _message_sets(problem):
        for order in _orders(msgs):
            for chunk in (0, MIN_CHUNK_BYTES):
                built = [
                    _message(problem, i, r, chain, parts, chunk)
                    for i, (r, chain, parts) in enumerate(order)
                ]
                out.append(simulate_resharding(problem, built, SIX))
    return out


@pytest.mark.parametrize("rows", [228, 300])
def test_shared_root_every_schedule_is_above_and_the_best_meets_it(rows):
    """Three holders of a third of the rows, two hosts x 3 devices that each need a
    half (a column third per device): the middle holder alone holds a sixth for each
    host (one chunk or less), the outer ones a third (over a chunk at 228 rows).  Every
    message set (direct, devices split any way, up to five messages) in every order, both chunk
    sizes: none below the bound, the best takes it (to 0.2%), and so does
    ``broadcast``'s plan; the ingress term alone is a hop lower (no host lands whole)."""
    p = _problem(rows)
    terms = relay_bound_terms(p, SIX)
    ((term,),) = [shared_root_terms(p, SIX, hop_bound_terms(p, SIX))]
    assert terms.seconds == pytest.approx(term.seconds)
    ingress = max(t.seconds for t in terms.terms if t.resource == "w3 ingress")
    assert terms.seconds == pytest.approx(ingress + SIX.intra_latency)
    times = _times(p)
    assert len(times) >= 700
    assert_bound_met(times, terms.seconds, 1.002)
    plan = plan_resharding(p, "broadcast", SIX)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)


def test_no_term_where_the_shared_root_sends_over_a_chunk():
    """Where the middle holder's share of a host is over a chunk, its own message can
    end without a hop: no term."""
    p = _problem(456)
    assert shared_root_terms(p, SIX, hop_bound_terms(p, SIX)) == []
