"""``plan_resharding``: run a strategy, check its messages, bound and simulate them.

Strategies live in a registry (one entry per name in :data:`STRATEGIES`), each a pure
function ``(problem, cluster) -> (messages, notes)``; adding one touches one entry.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.methods import RESHARDING_STRATEGIES
from meshshard.resharding.baselines import (
    Planned,
    broadcast_greedy,
    broadcast_nolb,
    local_allgather,
    send_recv,
)
from meshshard.resharding.bound import lower_bound, tight_bound
from meshshard.resharding.broadcast import broadcast
from meshshard.resharding.coverage import check_messages
from meshshard.resharding.result import ReshardingPlan
from meshshard.resharding.search import broadcast_search
from meshshard.resharding.simulate import simulate_resharding
from meshshard.tiles import ReshardingProblem

__all__ = ["STRATEGIES", "STRATEGY_RULES", "plan_resharding"]

STRATEGIES = RESHARDING_STRATEGIES
"""Strategy names: ``broadcast`` (ours) first, then the paper's baselines."""

Strategy = Callable[[ReshardingProblem, ClusterSpec], Planned]

STRATEGY_RULES: dict[str, Strategy] = {
    "broadcast": broadcast,
    "send_recv": send_recv,
    "local_allgather": local_allgather,
    "broadcast_nolb": broadcast_nolb,
    "broadcast_greedy": broadcast_greedy,
    "broadcast_search": broadcast_search,
}
assert set(STRATEGY_RULES) == set(STRATEGIES), "every strategy name needs a rule"


_GATHERING = ("local_allgather", "broadcast")  # strategies that may end in local all-gathers


def _check_input(problem: ReshardingProblem, strategy: str) -> None:
    if strategy not in STRATEGY_RULES:
        raise MeshshardInputError(
            f"resharding strategy {strategy!r} is not known; choose one of {list(STRATEGIES)}"
        )
    shared = sorted(set(problem.src.hosts) & set(problem.dst.hosts))
    if shared:
        raise MeshshardInputError(
            f"source mesh{problem.src.id} (hosts {list(problem.src.hosts)}) and destination "
            f"mesh{problem.dst.id} (hosts {list(problem.dst.hosts)}) share hosts {shared}; "
            "cross-mesh resharding plans meshes on disjoint hosts"
        )


def plan_resharding(
    problem: ReshardingProblem, strategy: str, cluster: ClusterSpec, *, simulate: bool = True
) -> ReshardingPlan:
    """Plan how ``problem``'s slices move with ``strategy`` on ``cluster``.

    The messages are checked to reshard exactly (every destination tile covered once);
    ``lower_bound_s`` is :func:`~meshshard.resharding.bound.lower_bound` (NIC) and
    ``tight_bound_s`` :func:`~meshshard.resharding.bound.tight_bound`; with
    ``simulate`` the plan is also run on the simulator (``sim_time_s``).

        >>> from meshshard.plan import MeshSpec
        >>> from meshshard.tiles import resharding_problem
        >>> p = resharding_problem((8, 1 << 20), "float32", MeshSpec(0, (1, 2), (0,)), ("device",),
        ...                        MeshSpec(1, (2, 1), (1, 2)), ())
        >>> r = plan_resharding(p, "broadcast", ClusterSpec.preset("aws-p3.8xlarge"))
        >>> print(r)
        reshard f32[8,1048576] 32.0 MiB: mesh0 (1, 2) P('device') -> mesh1 (2, 1) P()
          broadcast: 1 messages, 64.0 MiB over the network, lower bound 26.874 ms, tight bound 26.930 ms, simulated 27.323 ms (1.017x, 1.015x tight)
          #0 r0 bcast w0 -> w1.{0} w2.{0} .0[0:4,0:1048576]->{0}/{0} + .1[4:8,0:1048576]->{0}/{0} 32.0 MiB in 512.0 KiB chunks
          note: 1 flows in 1 rounds: LP rounds, each round's slices per host pair merged

    Both 16 MiB slices leave host 0 once, as one host-level message (the two devices'
    blocks back to back), and host 1 relays it to host 2 (a chain broadcast); the 1.7%
    over the NIC bound is the chain's pipeline fill, a 512 KiB chunk (1 MiB chunks
    would cost 6.5%).
    """
    _check_input(problem, strategy)
    start = time.perf_counter()
    messages, notes = STRATEGY_RULES[strategy](problem, cluster)
    planning = time.perf_counter() - start
    gathers = check_messages(problem, messages, allow_gather=strategy in _GATHERING)
    sim = simulate_resharding(problem, messages, cluster) if simulate else None
    return ReshardingPlan(
        problem=problem,
        strategy=strategy,
        messages=tuple(messages),
        lower_bound_s=lower_bound(problem, cluster),
        sim_time_s=sim,
        planning_s=planning,
        gathers=gathers,
        notes=tuple(notes),
        tight_bound_s=tight_bound(problem, cluster),
    )
