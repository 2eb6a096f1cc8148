"""``broadcast``: our planner.  Every holder, cut slices, NIC-disjoint rounds.

Compared with the paper's broadcast planners (``broadcast_nolb/greedy/search``):

- **every replica counts**: a slice held by several source hosts can be sent by any of
  them, and one slice can be cut into sub-blocks sent by different holders, so the
  egress spreads over all holders exactly as the lower bound allows;
- **pooled flows**: slices with the same holder hosts and receiving hosts are pooled
  into one flow; the messages of one flow in one round run back to back between the
  same hosts.  (Two slices never merge into one message: a slice is the whole overlap
  of one source tile and one destination tile, so no larger block is held by one
  device and needed whole by every receiver.)
- **rounds**: flows are scheduled as rounds of host-disjoint transfers whose lengths
  come from a linear program (:mod:`~meshshard.resharding.rounds`), so no NIC waits
  in another's queue; a flow reaches its receivers in one chain broadcast (each host
  boundary crossed once, fan-out over the fabric) or receiver by receiver from
  different senders when that packs better;
- **order and granularity by estimate**: several realisations of the rounds
  (:mod:`~meshshard.resharding.realize`) and whole-slice schedules for latency-bound
  arrays (:mod:`~meshshard.resharding.whole`), each also with its busiest sender's
  last slice shared (:mod:`~meshshard.resharding.balance`), are compared with the makespan
  estimate of :mod:`~meshshard.resharding.estimate`; the fastest is the plan.

Messages go to every device that needs the block (``dst_devices``), or, where that
is faster, to one device per host followed by a local all-gather on the host
(:mod:`~meshshard.resharding.gather`); a single receiving device gets a
point-to-point message.  Broadcasts through several hops move in NCCL-like sub-MiB
chunks where that shortens the chain (:mod:`~meshshard.resharding.chunks`).
"""

from __future__ import annotations

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.balance import balanced
from meshshard.resharding.baselines import Planned
from meshshard.resharding.chunks import with_chunks
from meshshard.resharding.coverage import check_messages
from meshshard.resharding.estimate import estimate_makespan
from meshshard.resharding.gather import gathered
from meshshard.resharding.merge import host_messages
from meshshard.resharding.realize import overhead, pool_flows, realize_rounds
from meshshard.resharding.rounds import schedule_rounds
from meshshard.resharding.whole import GROUPINGS, dispatch_slices, searched_slices
from meshshard.tiles import ReshardingProblem

__all__ = ["broadcast"]

_DISPATCH_MAX_SLICES = 256  # the dispatcher is quadratic; beyond this the LP plans alone
_SEARCH_MAX_SLICES = 32  # a small search over whole slices; beyond this it rarely finishes


def broadcast(problem: ReshardingProblem, cluster: ClusterSpec) -> Planned:
    """Our plan: pooled flows, every holder, cut slices, LP rounds (module docstring).

    Candidates: the round LP with and without the per-message overheads of
    :func:`~meshshard.resharding.realize.overhead` (they matter for small slices and
    long chains), each realised in both round orders with slices cut to the LP's
    shares or rounded to whole slices; whole slices dispatched to all receiving hosts
    at once, per host, or in chains of two, each slice on its own or each flow's slices
    together; whole slices by a small bounded search.
    The estimate of :mod:`~meshshard.resharding.estimate` picks one (the first of
    equals, so the choice is deterministic).
    """
    pools = pool_flows(problem)
    if not pools:
        return (), ()
    flows = [flow for flow, _ in pools]
    charged = schedule_rounds(flows, lambda r: overhead(r, pools[r.flow][1], problem, cluster))
    candidates: list[tuple[str, list[Message]]] = []
    for name, sched in (("LP", charged), ("LP without overheads", schedule_rounds(flows))):
        rounds = list(sched.rounds)
        for order, rev in ((rounds, ""), (rounds[::-1], ", reversed")):
            for whole in (False, True):
                desc = f"{name} rounds{rev}" + (", whole slices" if whole else "")
                candidates.append((desc, realize_rounds(order, pools, problem, whole)))
    widest = max(len({h for h, _ in n.receivers}) for n in problem.needs)
    for grouping in GROUPINGS if len(problem.needs) <= _DISPATCH_MAX_SLICES else ():
        if grouping == "in chains of two hosts" and widest < 3:
            continue  # the same as one chain
        candidates.append(
            (f"whole slices dispatched {grouping}", dispatch_slices(problem, cluster, grouping))
        )
        if len(pools) < len(problem.needs):  # some flow has several slices: move it whole
            msgs = dispatch_slices(problem, cluster, grouping, pooled=True)
            candidates.append((f"whole flows dispatched {grouping}", msgs))
    if len(problem.needs) <= _SEARCH_MAX_SLICES:
        candidates.append(("whole slices by bounded search", searched_slices(problem, cluster)))
    for desc, msgs in list(candidates):
        shared = balanced(problem, msgs, cluster)
        if shared is not None:
            candidates.append((f"{desc}, the busiest sender's last slice shared", shared))
    desc, msgs = _choose(candidates, problem, cluster)
    rounds_used = 1 + max((m.round for m in msgs), default=-1)
    return tuple(msgs), (f"{len(pools)} flows in {rounds_used} rounds: {desc}",)


def _choose(
    candidates: list[tuple[str, list[Message]]], problem: ReshardingProblem, cluster: ClusterSpec
) -> tuple[str, list[Message]]:
    """The candidate the estimate finds fastest (the first of equals), each tried as is
    and, where hosts have several receiving devices, as broadcast + local gather, and
    each of those whose messages carry whole slices with its slices merged into
    host-level messages (:func:`~meshshard.resharding.merge.host_messages`, per round
    and across rounds); every
    broadcast in the chunk :func:`~meshshard.resharding.chunks.with_chunks` picks."""
    best: tuple[float, int, str, list[Message]] | None = None
    whole = {n.index for n in problem.needs}
    k = 0
    for desc, msgs in candidates:
        variants = [(desc, msgs, False)]
        local = gathered(msgs)
        if local is not None:
            variants.append((desc + ", then gathered on each host", local, True))
        for name, variant, gather in list(variants):
            if not all(m.index in whole for m in variant):
                continue  # cut slices stay apart: merged pieces would beat the tight bound's
                # whole-slice multicast model (one holder per piece, in parallel)
            for per_round, how in ((True, "each round's"), (False, "all")):
                host = host_messages(variant, per_round=per_round)
                if host is not None:
                    variants.append((f"{name}, {how} slices per host pair merged", host, gather))
        for name, variant, gather in variants:
            chunked = with_chunks(variant, cluster)
            gathers = check_messages(problem, chunked) if gather else ()
            key = round(estimate_makespan(chunked, cluster, gathers), 12)
            if best is None or (key, k) < best[:2]:
                best = (key, k, name, chunked)
            k += 1
    assert best is not None
    return best[2], best[3]
