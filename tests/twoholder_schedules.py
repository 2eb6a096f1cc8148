"""Schedules of the two-holder family, cut halves included, for the resharding bound tests
and ``benchmarks/resharding_twoholder_cuts.py``.

Two source hosts (0 and 1), each holding its own half of an ``int8[2 U]`` array
(``P('host')`` on a ``(2, 1)`` mesh), and three destination hosts (2, 3, 4) that need
the whole array (replicated on a ``(3, 1)`` mesh): the family of the random
benchmark's "two-holder multi-chunk relay" misses.  A schedule is a tuple of ``(root,
chain, piece)`` in execution order; ``piece`` is ``"w"`` (the root's whole half) or
``"p1"`` / ``"p2"`` (its first ``cut`` and the rest).
"""

from __future__ import annotations

import dataclasses
import itertools

from meshshard.plan import MeshSpec, Message
from meshshard.resharding.blocks import make_message
from meshshard.resharding.bound import MIN_CHUNK_BYTES, smallest_chunk
from meshshard.tiles import ReshardingProblem, resharding_problem
from tests.test_resharding_hops import chains

SRC = MeshSpec(0, (2, 1), (0, 1))  # host 0 holds the first half, host 1 the second
ROOTS, HOSTS = (0, 1), (2, 3, 4)
RENAMES = [dict(zip(HOSTS, perm, strict=True)) for perm in itertools.permutations(HOSTS)]
"""Renamings of the destination hosts, which map the family to itself."""


def problem(u: int, devices: int = 1) -> ReshardingProblem:
    """Halves of ``u`` bytes; each destination host's ``devices`` need the whole array."""
    dst = MeshSpec(1, (3, devices), HOSTS)
    return resharding_problem((2 * u,), "int8", SRC, ("host",), dst, (None,))


def root_deliveries(root: int, cut: bool = True):
    """Every message set of one root: the hosts in ``whole`` take its half in one
    message (chains of every shape), the others (with ``cut``) its two pieces apart."""
    for k in range(len(HOSTS), -1 if cut else len(HOSTS) - 1, -1):
        for whole in itertools.combinations(HOSTS, k):
            rest = tuple(h for h in HOSTS if h not in whole)
            for w in chains(whole):
                ws = tuple((root, c, "w") for c in w)
                if not rest:
                    yield ws
                    continue
                for a, b in itertools.product(chains(rest), repeat=2):
                    ps = tuple((root, c, "p1") for c in a) + tuple((root, c, "p2") for c in b)
                    yield ws + ps


def message_sets(max_messages: int, cut: bool = True):
    """Every message set of both roots of at most ``max_messages``, one per class under
    renaming the destination hosts."""
    seen = set()
    per_root = {r: list(root_deliveries(r, cut)) for r in ROOTS}
    for a, b in itertools.product(per_root[0], per_root[1]):
        msgs = a + b
        if len(msgs) > max_messages:
            continue
        key = min(
            tuple(sorted((r, tuple(ren[h] for h in c), p) for r, c, p in msgs)) for ren in RENAMES
        )
        if key not in seen:
            seen.add(key)
            yield msgs


def orders(msgs):
    """``msgs`` in every order, one per class of equal per-worker sequences."""
    seen = set()
    for order in itertools.permutations(msgs):
        per = tuple(tuple(m for m in order if w == m[0] or w in m[1]) for w in ROOTS + HOSTS)
        if per not in seen:
            seen.add(per)
            yield order


def messages(p: ReshardingProblem, order, cut: float, chunk: int) -> list[Message]:
    """The runtime's messages for ``order``: a piece ``p1`` is the first ``cut`` of its
    root's half; a chain's message moves in ``chunk`` bytes where it is larger."""
    devices = tuple(range(p.dst.shape[1]))
    out = []
    for i, (root, chain, piece) in enumerate(order):
        need = next(n for n in p.needs if next(iter(n.holders))[0] == root)
        ((lo, hi),) = need.index
        mid = lo + round(cut * (hi - lo))
        index = {"w": ((lo, hi),), "p1": ((lo, mid),), "p2": ((mid, hi),)}[piece]
        m = make_message(index, 1, next(iter(need.holders)), [(h, devices) for h in chain])
        big = m.group and m.nbytes > chunk
        out.append(dataclasses.replace(m, round=i, chunk_bytes=chunk if big else 0))
    return out


def busiest(msgs, u: int, cut: float, chunk: int, lat: float, bw: float) -> float:
    """The busiest worker's least busy time over ``msgs`` in the bounds' execution model
    (an operation keeps its root ``>= alpha + b / B``, a host alone in it ``>= alpha + b
    / B``, a host at depth ``d`` of a longer chain ``>= max(d, 2) alpha + (b + (max(d,
    2) - 1) c) / B``): no order of ``msgs`` takes less."""
    busy: dict[int, float] = {}
    for root, chain, piece in msgs:
        b = {"w": u, "p1": round(cut * u), "p2": u - round(cut * u)}[piece]
        c = smallest_chunk(b) if chunk == MIN_CHUNK_BYTES else min(b, chunk)
        busy[root] = busy.get(root, 0.0) + lat + b / bw
        for d, h in enumerate(chain, 1):
            depth = max(d, 2) if len(chain) > 1 else 1
            busy[h] = busy.get(h, 0.0) + depth * lat + (b + (depth - 1) * c) / bw
    return max(busy.values())
