"""The last-hop terms (meshshard/resharding/lasthop.py): valid against every schedule of
small families whose hosts' messages land whole on one of two devices (one holder's
egress and its "no chain through all", several holders all direct, a host's ingress);
the best schedule takes the bound (or, all direct, half a hop more), and so does
``broadcast``'s plan."""

import dataclasses
import itertools
import sys

import pytest

from meshshard.plan import MeshSpec
from meshshard.resharding import plan_resharding, simulate_resharding
from meshshard.resharding.blocks import make_message
from meshshard.resharding.bound import tight_bound_terms
from meshshard.resharding.lasthop import last_hop
from meshshard.resharding.merge import merged
from meshshard.resharding.relays import relay_bound, relay_bound_terms
from meshshard.tiles import resharding_problem

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_resharding_relays import CLUSTER, HOSTS, schedules  # noqa: E402

from tests.bound_checks import assert_bound_met

SRC = MeshSpec(0, (1, 2), (0,))  # one holder, the halves on its two devices
DST = MeshSpec(1, (3, 2), HOSTS)  # three hosts x 2 devices


def _last_hop(problem):
    """:func:`last_hop` with the tight bound's terms."""
    return last_hop(problem, CLUSTER, tight_bound_terms(problem, CLUSTER))


def _message(problem, i, chain, parts):
    """One host-level message from the holder through ``chain`` carrying ``parts``
    (``(need, devices per host)``), in round ``i``."""
    msgs = []
    for need, devices in parts:
        src = next(iter(need.holders))
        msgs.append(make_message(need.index, 1, src, [(h, devices[h]) for h in chain]))
    return dataclasses.replace(merged(msgs), round=i)


def _sharded_times(problem):
    """Every schedule where each destination host takes its third of the array in one
    message to both devices or in one message per device, in every order of the
    holder's messages (each host's own messages come from the holder only, so the
    holder's order is the whole schedule)."""
    per_device = {}
    for need in problem.needs:
        ((h, d),) = need.receivers
        per_device.setdefault((h, d), []).append(need)
    out = []
    for split in itertools.product((False, True), repeat=len(HOSTS)):
        deliveries = []
        for h, apart in zip(HOSTS, split, strict=True):
            groups = [(0,), (1,)] if apart else [(0, 1)]
            for devs in groups:
                parts = [(n, {h: (d,)}) for d in devs for n in per_device[(h, d)]]
                deliveries.append(((h,), parts))
        for order in itertools.permutations(deliveries):
            msgs = [_message(problem, i, c, parts) for i, (c, parts) in enumerate(order)]
            out.append(simulate_resharding(problem, msgs, CLUSTER))
    return out


@pytest.mark.parametrize("nbytes", [11400, 30000])
def test_egress_plus_last_hop_every_schedule_is_above_and_the_best_meets_it(nbytes):
    """One holder, three hosts that each need a different third (a sixth per device,
    at most one chunk per host): one message per host, or one per device, in every
    order (1,158 schedules).  None is below the bound, the best takes it (three
    messages, the last fanned out), and so does ``broadcast``'s plan; the egress term
    alone is one fabric latency lower."""
    p = resharding_problem((nbytes,), "int8", SRC, ("device",), DST, (("host", "device"),))
    assert _last_hop(p) == CLUSTER.intra_latency
    terms = relay_bound_terms(p, CLUSTER)
    last = next(t for t in terms.terms if t.resource == "w0 egress + last hop")
    assert last.seconds == terms.seconds  # the relay term's all-direct split ties
    times = _sharded_times(p)
    assert len(times) == 1158
    assert_bound_met(times, terms.seconds, 1.001)
    plan = plan_resharding(p, "broadcast", CLUSTER)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)


def _replicated_messages(problem, order, mode):
    """The runtime's messages for one schedule of ``schedules`` where every device
    needs the whole array: ``mode`` ``"both"`` sends the halves to both devices of each
    host, ``"gather"`` to device 0 only (a local all-gather fills device 1), and
    ``"devices"`` reads the pieces as devices: ``head`` is the whole array for device
    0, ``tail`` for device 1, ``whole`` for both."""
    head, tail = sorted(problem.needs, key=lambda n: n.index)
    out = []
    for i, (_, chain, piece) in enumerate(order):
        if mode == "devices":
            devs = {"head": (0,), "tail": (1,), "whole": (0, 1)}[piece]
            needs = (head, tail)
        else:
            devs = (0, 1) if mode == "both" else (0,)
            needs = {"head": (head,), "tail": (tail,), "whole": (head, tail)}[piece]
        out.append(_message(problem, i, chain, [(n, dict.fromkeys(chain, devs)) for n in needs]))
    return out


def _replicated_times(problem, mode):
    """Simulated seconds of every schedule of ``schedules`` (one holder, up to 6
    messages, every order up to renaming hosts) in ``mode``."""
    out = []
    for order in schedules(True, 6, roots=(0,)):
        out.append(
            simulate_resharding(problem, _replicated_messages(problem, order, mode), CLUSTER)
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nbytes", [4096, 21712])
def test_one_holder_no_chain_plus_last_hop_every_schedule_is_above_and_the_best_meets_it(nbytes):
    """One holder, three hosts x 2 devices that each need the whole array (at most one
    chunk): every schedule of the one-holder family (halves or the whole, chains of
    every shape, every order) with both devices in each message, with device 0 only
    and a local all-gather, or with the whole array to each device in its own message.
    None is below the bound (the one-holder term's case B plus a fabric latency), the
    best takes it to 0.3% (the fabric hop's bytes), and so does ``broadcast``'s plan.
    About 10 s each."""
    p = resharding_problem((nbytes,), "int8", SRC, ("device",), DST, (None,))
    terms = relay_bound_terms(p, CLUSTER)
    bound = terms.seconds
    times = [t for mode in ("both", "gather", "devices") for t in _replicated_times(p, mode)]
    assert len(times) >= 3000
    assert_bound_met(times, bound, 1.003)  # the hop also moves the bytes, 0.2 us at 21 KB
    assert bound > relay_bound(
        resharding_problem(
            (nbytes,), "int8", SRC, ("device",), MeshSpec(1, (3, 1), HOSTS), (None,)
        ),
        CLUSTER,
    )
    plan = plan_resharding(p, "broadcast", CLUSTER)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)


def test_outside_the_family_no_hop():
    """Several holders, a host over one chunk, or a host with one receiving device: no
    last hop."""
    two = MeshSpec(0, (2, 1), (0, 1))
    assert _last_hop(resharding_problem((4096,), "int8", two, ("host",), DST, (None,))) == 0
    big = resharding_problem((1 << 16,), "int8", SRC, ("device",), DST, (None,))
    assert _last_hop(big) == 0
    one = resharding_problem((4096,), "int8", SRC, ("device",), MeshSpec(1, (3, 1), HOSTS), (None,))
    assert _last_hop(one) == 0


TWO = MeshSpec(0, (2, 1), (0, 1))  # two holders, each with the whole array


def _two_holder_schedules(problem):
    """Every schedule where each destination host takes its third in one message to
    both devices or one message per device, each message from either holder, in
    every order; one per class of equal per-worker sequences up to swapping the
    holders."""
    per_device = {}
    for need in problem.needs:
        ((h, d),) = need.receivers
        per_device.setdefault((h, d), []).append(need)
    seen = set()
    for split in itertools.product((False, True), repeat=len(HOSTS)):
        deliveries = [
            (h, devs)
            for h, apart in zip(HOSTS, split, strict=True)
            for devs in ([(0,), (1,)] if apart else [(0, 1)])
        ]
        for roots in itertools.product((0, 1), repeat=len(deliveries)):
            msgs = [(r, h, devs) for r, (h, devs) in zip(roots, deliveries, strict=True)]
            for order in itertools.permutations(msgs):
                key = min(
                    tuple(
                        tuple((swap[r], h, d) for r, h, d in order if w in (swap[r], h))
                        for w in (0, 1, *HOSTS)
                    )
                    for swap in ({0: 0, 1: 1}, {0: 1, 1: 0})
                )
                if key not in seen:
                    seen.add(key)
                    yield [
                        (r, (h,), [(n, {h: (d,)}) for d in devs for n in per_device[(h, d)]])
                        for r, h, devs in order
                    ]


def _two_holder_message(problem, i, root, chain, parts):
    """:func:`_message` from holder ``root``'s copy of each block."""
    msgs = []
    for need, devices in parts:
        src = next(ref for ref in need.holders if ref[0] == root)
        msgs.append(make_message(need.index, 1, src, [(h, devices[h]) for h in chain]))
    return dataclasses.replace(merged(msgs), round=i)


@pytest.mark.slow
@pytest.mark.parametrize("nbytes", [9000])
def test_two_holders_all_direct_plus_half_a_hop_every_schedule_is_above(nbytes):
    """Two holders of the whole array, three hosts x 2 devices that each need a
    different third (no slice shared, so no host can relay): every schedule of one
    message per host or one per device, each from either holder, in every order.
    None is below the bound (the relay term's all-direct split: four messages, plus
    half a fabric latency, the least the holders' last messages leave), the best is
    within 4% of it (one holder's last message fans out: a whole latency), and
    ``broadcast``'s plan takes the best.  About 20 s.  (It held at 30,000 bytes too, a
    second case until the suite was trimmed.)"""
    p = resharding_problem((nbytes,), "int8", TWO, (None,), DST, (("host", "device"),))
    terms = relay_bound_terms(p, CLUSTER)
    assert "all direct" in str(terms) and "then a hop" in str(terms)
    times = [
        simulate_resharding(
            p,
            [_two_holder_message(p, i, r, c, parts) for i, (r, c, parts) in enumerate(order)],
            CLUSTER,
        )
        for order in _two_holder_schedules(p)
    ]
    assert len(times) >= 1000
    assert_bound_met(times, terms.seconds, 1.04)
    assert min(times) > terms.seconds + CLUSTER.intra_latency / 2 * 0.99  # the gap is half a hop
    plan = plan_resharding(p, "broadcast", CLUSTER)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)


ONE = MeshSpec(1, (1, 2), (2,))  # one destination host x 2 devices


def _ingress_sets(problem):
    """Every message set that brings one destination host its data from two holders
    of different halves: per holder one message (a block per slice for all its
    devices, or a block per slice and device), one message per device, or one
    message to a single device (a local all-gather fills the other)."""
    per_root = {}
    for need in problem.needs:
        ((r, _),) = {(h, 0) for h, _ in need.holders}
        per_root.setdefault(r, []).append(need)
    options = {}
    for r, needs in per_root.items():
        pairs = [(n, d) for n in needs for _, d in n.receivers]
        options[r] = [
            [[(n, (d,)) for n, d in pairs]],  # a block per slice and device
            [[(n, tuple(d for _, d in n.receivers)) for n in needs]],  # a block per slice
            [[(n, (d,)) for n, dd in pairs if dd == d] for d in (0, 1)],  # one per device
            [[(n, (0,)) for n in needs]],  # device 0 only
        ]
    for choice in itertools.product(*options.values()):
        msgs = [(r, parts) for r, sets in zip(options, choice, strict=True) for parts in sets]
        yield [(r, parts) for r, parts in msgs if parts]


def _ingress_times(problem):
    """Simulated seconds of every set of :func:`_ingress_sets` in every order (those
    that reshard exactly)."""
    out = []
    for msgs in _ingress_sets(problem):
        for order in itertools.permutations(msgs):
            built = []
            for i, (_, parts) in enumerate(order):
                blocks = [
                    make_message(n.index, 1, next(iter(n.holders)), [(2, devs)])
                    for n, devs in parts
                ]
                built.append(dataclasses.replace(merged(blocks), round=i))
            try:
                out.append(simulate_resharding(problem, built, CLUSTER))
            except ValueError:
                continue  # a device left without its tile
    return out


@pytest.mark.parametrize(
    ("shape", "src_spec", "dst_spec"),
    [((48000,), ("host",), (None,)), ((2, 18000), ("host", None), (None, "device"))],
    ids=["replicated", "columns"],
)
def test_ingress_plus_last_hop_every_schedule_is_above_and_the_best_meets_it(
    shape, src_spec, dst_spec
):
    """Two holders of different halves, one host x 2 devices: each device needs all of
    it (48 KB, a copy per device would be 48 KB per message, over a chunk) or its own
    columns of both halves (36 KB).  Every message set (one per holder, a block per
    slice or per slice and device, one per device, or one to device 0 and a local
    all-gather), in every order: none is below the bound (the host's ingress plus a
    fabric latency), the best takes it to 0.3%, and so does ``broadcast``'s plan."""
    p = resharding_problem(shape, "int8", TWO, src_spec, ONE, dst_spec)
    terms = relay_bound_terms(p, CLUSTER)
    assert terms.binding.resource == "w2 ingress + last hop"
    times = _ingress_times(p)
    assert len(times) >= 20
    assert_bound_met(times, terms.seconds, 1.003)
    plan = plan_resharding(p, "broadcast", CLUSTER)
    assert plan.sim_time_s == pytest.approx(min(times), rel=1e-3)
