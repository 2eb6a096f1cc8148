"""The clean-last terms (meshshard/resharding/cleanlast.py): valid against every
schedule of two small families where not every root, or not every host, can end with
a message for one device, the best schedule takes the bound, and so does
``broadcast``'s plan."""

import dataclasses
import itertools
import sys

import pytest

from meshshard.plan import MeshSpec
from meshshard.resharding import plan_resharding, simulate_resharding
from meshshard.resharding.blocks import make_message
from meshshard.resharding.merge import merged
from meshshard.resharding.relays import relay_bound_terms
from meshshard.tiles import resharding_problem

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_resharding_relays import CLUSTER  # noqa: E402

from tests.bound_checks import assert_bound_met

SIX = dataclasses.replace(CLUSTER, num_hosts=6)


def _pairs(problem):
    """``{(root, host): {device: [needs]}}``: what each holder sends each host."""
    out = {}
    for need in problem.needs:
        ((r, _),) = {(h, 0) for h, _ in need.holders}
        for h, d in need.receivers:
            out.setdefault((r, h), {}).setdefault(d, []).append(need)
    return out


def _message(i, root, host, parts):
    """One host-level message from ``root`` to ``host``: ``parts`` ``(need, device)``."""
    blocks = [
        make_message(n.index, 1, next(ref for ref in n.holders if ref[0] == root), [(host, (d,))])
        for n, d in parts
    ]
    return dataclasses.replace(merged(blocks), round=i)


def _deliveries(problem, split_all):
    """Every message set: per ``(root, host)`` one message for all its devices, or
    (where ``split_all`` or for one device anyway) one per device."""
    pairs = _pairs(problem)
    options = []
    for (r, h), per in sorted(pairs.items()):
        whole = [(r, h, tuple((n, d) for d, ns in sorted(per.items()) for n in ns))]
        apart = [(r, h, tuple((n, d) for n in ns)) for d, ns in sorted(per.items())]
        options.append([whole] + ([apart] if split_all and len(per) > 1 else []))
    for choice in itertools.product(*options):
        yield [m for ms in choice for m in ms]


def _orders(msgs, workers):
    """Every order of ``msgs`` (``(root, host, parts)``), one per class of equal
    per-worker sequences: each worker's sequence chosen, kept where they fit one
    global order (built by repeatedly taking a message first for all its workers)."""
    per = {w: [i for i, (r, h, _) in enumerate(msgs) if w in (r, h)] for w in workers}
    for seqs in itertools.product(*(itertools.permutations(per[w]) for w in workers)):
        heads = dict(zip(workers, (list(s) for s in seqs), strict=True))
        order = []
        while len(order) < len(msgs):
            ready = [
                i
                for i, (r, h, _) in enumerate(msgs)
                if i not in order and heads[r][:1] == [i] and heads[h][:1] == [i]
            ]
            if not ready:
                break  # the sequences wait on each other: no such schedule
            order.append(ready[0])
            r, h, _ = msgs[ready[0]]
            heads[r].pop(0)
            heads[h].pop(0)
        if len(order) == len(msgs):
            yield [msgs[i] for i in order]


def _times(problem, cluster, split_all, symmetric=False):
    """Simulated seconds of every schedule of direct messages; where ``symmetric``
    (the destination hosts need the same data), one per class under renaming them."""
    hosts = sorted({h for n in problem.needs for h, _ in n.receivers})
    roots = sorted({h for n in problem.needs for h, _ in n.holders})
    perms = itertools.permutations(hosts) if symmetric else [hosts]
    renames = [dict(zip(hosts, perm, strict=True)) for perm in perms]
    seen = set()
    out = []
    for msgs in _deliveries(problem, split_all):
        for order in _orders(msgs, roots + hosts):
            key = min(_per_worker(order, rename, roots + hosts) for rename in renames)
            if key in seen:
                continue
            seen.add(key)
            built = [_message(i, r, h, parts) for i, (r, h, parts) in enumerate(order)]
            out.append(simulate_resharding(problem, built, cluster))
    return out


def _per_worker(order, rename, workers):
    """Each worker's sequence of ``(root, host, devices)`` once hosts are renamed."""
    named = [(r, rename[h], tuple(d for _, d in parts)) for r, h, parts in order]
    return tuple(tuple(m for m in named if w in m[:2]) for w in workers)


@pytest.mark.parametrize("nbytes", [12000, 37896])
def test_roots_end_clean_every_schedule_is_above_and_the_best_meets_it(nbytes):
    """Two holders of different halves (a quarter per device), three hosts x 2 devices
    (a sixth each): the middle host needs one device's data from each holder, so each
    holder could end with a message for one device, but not both.  Every message set
    (a message per holder and host, or per device) in every order: none below the
    bound, the best takes it (to 0.3%), and so does ``broadcast``'s plan; the egress
    term alone is a fabric latency lower."""
    p = resharding_problem(
        (nbytes,),
        "int8",
        MeshSpec(0, (2, 2), (0, 1)),
        (("host", "device"),),
        MeshSpec(1, (3, 2), (2, 3, 4)),
        (("host", "device"),),
    )
    terms = relay_bound_terms(p, CLUSTER)
    assert terms.binding.resource == "roots end clean"
    egress = max(t.seconds for t in terms.terms if t.resource == "w0 egress")
    assert terms.seconds == pytest.approx(egress + CLUSTER.intra_latency)
    times = _times(p, CLUSTER, split_all=True)
    assert len(times) >= 100
    assert_bound_met(times, terms.seconds, 1.003)
    plan = plan_resharding(p, "broadcast", CLUSTER)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)


@pytest.mark.slow
def test_hosts_end_clean_every_direct_schedule_is_above_and_the_best_meets_it():
    """Three holders of a third each, three hosts x 2 devices (a half each): each host
    needs all three; the first and last holders' data is for one device, so a host can
    end clean only with a message from one of those two, and only two hosts can.  Every
    schedule of one direct message per holder and host, every per-worker order: none
    below the bound (the ingress term plus a fabric latency), the best takes it (to
    0.3%), and so does ``broadcast``'s plan.  3,194 schedules up to renaming the
    hosts, about 20 s."""
    p = resharding_problem(
        (7200,),
        "int8",
        MeshSpec(0, (3, 1), (0, 1, 2)),
        ("host",),
        MeshSpec(1, (3, 2), (3, 4, 5)),
        ("device",),
    )
    terms = relay_bound_terms(p, SIX)
    assert terms.binding.resource == "hosts end clean"
    ingress = max(t.seconds for t in terms.terms if t.resource == "w3 ingress")
    assert terms.seconds == pytest.approx(ingress + SIX.intra_latency)
    times = _times(p, SIX, split_all=False, symmetric=True)
    assert len(times) >= 3000
    assert_bound_met(times, terms.seconds, 1.003)
    plan = plan_resharding(p, "broadcast", SIX)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)
