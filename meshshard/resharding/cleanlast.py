"""Who may end clean: the last hop (:mod:`~meshshard.resharding.lasthop`) per root and per host.

The last-hop terms charge a hop after a root's or a host's last message unless that
message is *clean* (for one device of one host, and no local all-gather follows
there), and they hold only where no message can be clean for free.  Often one can, but
not for everyone at once: two holders of different halves and a host that needs one
device's data from each (``int8[37896] (2, 4) P(('host', 'device')) -> (3, 2)
P(('host', 'device'))``): each holder can end with its one-device message to that host,
but the two run one after the other there, so one holder ends with a message that
hops (80.2 us, not the 75.2 us of the egress term).

**The argument** (:mod:`~meshshard.resharding.lasthop`'s model and notation, ``hop =
min(alpha, intra_latency)``; a message to one host ends for its root when the host has
its last byte: the latency comes before the first chunk).  Take *agents* with a bound
``E_a`` on their busy time and a last message each:

- *roots* (a source host's egress term, ``E_r = k alpha + n / B``): if ``r``'s last
  message ``O`` is not clean it hops, provided it lands whole (every host's share of
  ``r``'s slices as in :func:`~meshshard.resharding.lasthop.landing`): the plan ends
  ``>= E_r + hop``.  If ``O`` is clean, for one device of ``h``, and the slices only
  ``r`` holds that ``h`` needs are for two devices or more, ``r`` sends ``h`` another
  message: ``>= E_r + alpha``.  So ``r`` ends clean for free only into a host of
  ``F_r``: hosts that need a slice ``r`` holds and whose slices only ``r`` holds are for
  one device at most.  Two clean last messages into one host run one after the other
  there: the plan ends ``>= min(E_a, E_b) + alpha``.
- *hosts* (a destination host's ingress term, ``E_h = k_h alpha + I_h / B``): if its
  last message is not clean it hops (messages that land whole), ``>= E_h + hop``; if
  ``h`` forwards, is at depth 2 or takes ``k_h + 1`` messages, ``>= E_h + alpha``.
  Otherwise its ``k_h`` messages come one from each root of a smallest cover, and the
  last one, from ``r``, carries every slice only ``r`` holds in it, all for one device:
  ``r`` is in ``F_h``.  Two hosts whose clean last messages come from one root: that
  root sends them one after the other, so the plan ends ``>= min(E_a, E_b) + alpha``.

So in every plan the agents that end clean (for free, and without two sharing a
partner, which costs ``alpha >= hop`` over the smaller one ending with a hop) are a set
``S`` matched to distinct partners, and the plan ends ``>= max(max_{a in S} E_a,
max_{a not in S} E_a + hop_a)`` (``hop_a = 0`` where ``a``'s messages need not land
whole).  The term is the least of that over every matchable ``S``.

    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.plan import MeshSpec
    >>> from meshshard.tiles import resharding_problem
    >>> from meshshard.resharding.relays import relay_bound_terms
    >>> p = resharding_problem((37896,), "int8", MeshSpec(0, (2, 4), (0, 1)),
    ...                        (("host", "device"),), MeshSpec(1, (3, 2), (2, 3, 4)),
    ...                        (("host", "device"),))
    >>> print(relay_bound_terms(p, ClusterSpec.preset("aws-p3.8xlarge")))
    relay bound 80.158 us: roots end clean, 1 of 2 can end without a hop
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.resharding.bound import (
    BoundTerm,
    LowerBound,
)
from meshshard.resharding.lasthop import HostSlices
from meshshard.tiles import ReshardingProblem

__all__ = ["clean_last_terms"]

_MAX_AGENTS = 10  # subsets of agents tried: 2 ** agents
_MAX_SOURCE_HOSTS = 8  # smallest covers tried per host


@dataclass(frozen=True)
class _Agent:
    """A root or a host: its bound ``seconds``, the hop it owes unless clean, and the
    partners it can end clean with."""

    seconds: float
    hop: float
    partners: frozenset[int]


def _best(agents: Sequence[_Agent]) -> tuple[float, int]:
    """The least over matchable sets ``S`` (module docstring) and the size of the
    largest ``S`` that gives it."""
    best, size = float("inf"), 0
    for mask in itertools.product((False, True), repeat=len(agents)):
        clean = [a for a, m in zip(agents, mask, strict=True) if m]
        if not _matchable([a.partners for a in clean]):
            continue
        seconds = max(
            [a.seconds for a in clean]
            + [a.seconds + a.hop for a, m in zip(agents, mask, strict=True) if not m]
        )
        if (seconds, -len(clean)) < (best, -size):
            best, size = seconds, len(clean)
    return best, size


def _matchable(partners: list[frozenset[int]]) -> bool:
    """Whether each set can get a distinct member (augmenting paths)."""
    owner: dict[int, int] = {}

    def take(i: int, seen: set[int]) -> bool:
        for p in partners[i]:
            if p in seen:
                continue
            seen.add(p)
            if p not in owner or take(owner[p], seen):
                owner[p] = i
                return True
        return False

    return all(take(i, set()) for i in range(len(partners)))


def _roots(slices: HostSlices, tight: LowerBound, hop: float) -> list[_Agent]:
    """One agent per source host with an egress term of its own."""
    extra = hop * tight.bandwidth
    out = []
    for t in tight.terms:
        if t.side != "egress" or len(t.members) != 1 or t.detail:
            continue
        (r,) = t.members
        hosts = [h for h, s in slices.per_host.items() if any(r in hs for hs, _, _ in s)]
        whole = all(slices.lands_whole(r, h, extra) for h in hosts)
        partners = frozenset(
            h
            for h in hosts
            if len({d for hs, ds, _ in slices.per_host[h] if hs == {r} for d in ds}) <= 1
        )
        out.append(_Agent(t.seconds, hop if whole else 0.0, partners))
    return out


def _clean_roots(slices, k: int, hosts: tuple[int, ...]) -> frozenset[int]:
    """Roots ``r`` of a smallest cover whose slices only ``r`` holds in it are all for
    one device (``slices``: one host's ``(holders, devices, bytes)``)."""
    out = set()
    for cover in itertools.combinations(hosts, k):
        if not all(hs & set(cover) for hs, _, _ in slices):
            continue
        for r in cover:
            mine = {ds for hs, ds, _ in slices if hs & set(cover) == {r}}
            if len(mine) == 1 and len(next(iter(mine))) == 1:
                out.add(r)
    return frozenset(out)


def _hosts(
    problem: ReshardingProblem, slices: HostSlices, tight: LowerBound, hop: float
) -> list[_Agent]:
    """One agent per destination host with an ingress term."""
    extra = hop * tight.bandwidth
    out = []
    for t in tight.terms:
        if t.side != "ingress" or t.detail:
            continue
        h = t.members[0]
        mine = slices.per_host[h]
        roots = {r for hs, _, _ in mine for r in hs}
        whole = all(slices.lands_whole(r, h, extra) for r in roots)
        partners = _clean_roots(mine, t.slices, problem.src.hosts)
        out.append(_Agent(t.seconds, hop if whole else 0.0, partners))
    return out


def clean_last_terms(
    problem: ReshardingProblem, cluster: ClusterSpec, tight: LowerBound
) -> list[BoundTerm]:
    """The roots' and the hosts' terms (module docstring) from ``tight``'s egress and
    ingress terms; none where there are too many agents or source hosts to try."""
    if len(problem.src.hosts) > _MAX_SOURCE_HOSTS:
        return []
    hop = float(min(cluster.nic_latency, cluster.intra_latency))
    slices = HostSlices.of(problem)
    out = []
    for name, agents in (
        ("roots", _roots(slices, tight, hop)),
        ("hosts", _hosts(problem, slices, tight, hop)),
    ):
        if not agents or len(agents) > _MAX_AGENTS or not any(a.hop for a in agents):
            continue
        seconds, size = _best(agents)
        detail = f"{size} of {len(agents)} can end without a hop"
        out.append(BoundTerm(f"{name} end clean", 0, 0, len(agents), seconds, detail))
    return out
