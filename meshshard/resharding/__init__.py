"""Cross-mesh resharding planners: many-to-many multicast as broadcasts, load balanced.

Pure planning (no Ray): from a :class:`~meshshard.tiles.ReshardingProblem` and a
described cluster to the messages of a :class:`~meshshard.plan.TransferSpec`.

- ``plan_resharding(problem, strategy, cluster)`` -> :class:`ReshardingPlan`;
- ``lower_bound(problem, cluster)``: seconds no plan can beat (NIC ingress/egress);
- ``simulate_resharding(problem, messages, cluster)``: seconds on the simulator;
- ``check_messages``: the exactness contract (every destination tile covered once).

One module per job: ``blocks`` (block arithmetic, message building), ``coverage``
(the contract), ``bound`` (NIC and tight bounds), ``hops`` (the hop bound for small
multicasts to more hosts than hold the data), ``relays`` (the relay bound: a host
reached through a relay pays a second hop, or the holders send more), ``oneholder``
(its term for one source host that every destination host needs all of), ``lasthop``
and ``cleanlast`` (the hop a message that lands on one device still owes),
``sharedroot`` (that hop where a host's big share could skip it but a source host two
hosts need serves one of them late),
``baselines`` (the paper's send/recv, local all-gather, broadcast without and with
size balancing), ``search`` (the paper's bounded search), ``rounds`` (the LP over
NIC-disjoint rounds), ``realize`` (rounds to messages), ``whole`` (whole-slice
schedules), ``balance`` (a sender's last slice shared with another holder),
``broadcast`` (ours: picks among those), ``estimate`` (fast makespan estimate),
``simulate``, ``result``, ``planner``.
This module only re-exports.
"""

from meshshard.resharding.bound import LowerBound, lower_bound, lower_bound_terms
from meshshard.resharding.coverage import check_messages
from meshshard.resharding.planner import STRATEGIES, plan_resharding
from meshshard.resharding.result import LocalGather, ReshardingPlan
from meshshard.resharding.simulate import simulate_resharding

__all__ = [
    "STRATEGIES",
    "LocalGather",
    "LowerBound",
    "ReshardingPlan",
    "check_messages",
    "lower_bound",
    "lower_bound_terms",
    "plan_resharding",
    "simulate_resharding",
]
