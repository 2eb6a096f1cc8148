"""IR invariants checked after every pass when ``MESHSHARD_CHECKS=1`` (on in the tests).

Like JAX's ``check_jaxpr`` in debug mode: a pass that breaks an invariant is named at
once, not found three passes later through a symptom.  :func:`state_problems` checks
every part of a :class:`~meshshard.passes.state.CompileState` decided so far; the
streams (as soon as they exist) go through :func:`meshshard.verify.verify`.
"""

from __future__ import annotations

import os

from meshshard.long_work import phase
from meshshard.passes.schedule_verify import problems_with_grid, stream_problems
from meshshard.passes.state import CompileState, Pass, PassCheckError
from meshshard.plan import Plan, Schedule
from meshshard.refs import BufferKind, TransferRef
from meshshard.verify import verify

__all__ = ["checks_enabled", "state_problems", "run_passes"]


def checks_enabled() -> bool:
    """True when ``MESHSHARD_CHECKS=1`` asks for checks after every pass."""
    return os.environ.get("MESHSHARD_CHECKS", "") == "1"


def run_passes(state: CompileState, passes: tuple[Pass, ...], check: bool | None = None):
    """Run ``passes`` in order; with checks on, raise :class:`PassCheckError` naming the
    first pass after which :func:`state_problems` finds anything."""
    check = checks_enabled() if check is None else check
    for p in passes:
        phase(f"planning: {p.name}")
        state = p.run(state)
        if check:
            problems = state_problems(state)
            if problems:
                shown = "\n  ".join(problems[:10])
                more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
                raise PassCheckError(
                    f"after pass {p.name!r}: {len(problems)} IR invariant(s) broken:\n  "
                    f"{shown}{more}"
                )
    return state


def state_problems(state: CompileState) -> list[str]:
    """Every invariant violation of the parts of ``state`` decided so far."""
    problems = _slicing_problems(state) + _mesh_problems(state) + _graph_problems(state)
    problems += _buffer_problems(state) + _transfer_problems(state)
    if state.schedule is not None:
        problems += problems_with_grid(state.schedule)
    if state.plan is not None:
        problems += verify(state.plan) + stream_problems(state.plan)
    elif state.streams is not None:
        plan = _provisional_plan(state)
        problems += verify(plan) + stream_problems(plan)
    return problems


def _slicing_problems(state: CompileState) -> list[str]:
    s = state.slicing
    if s is None:
        return []
    n = len(state.traced.jaxpr.eqns)
    if len(s.layer) != n or len(s.phase) != n:
        return [f"slicing covers {len(s.layer)}/{len(s.phase)} of {n} equations"]
    return []


def _interleaved(method) -> bool:
    """Whether ``method`` (or the step a FollowParallel follows) has virtual stages."""
    if getattr(method, "virtual_stages", 1) > 1:
        return True
    step = getattr(method, "step", None)
    plan = getattr(step, "plan", None)
    return plan is not None and plan.schedule.virtual_stages > 1


def _mesh_problems(state: CompileState) -> list[str]:
    if state.meshes is None:
        return []
    problems = []
    seen: set[int] = set()
    views = set()  # interleaved 1F1B: a logical mesh may be an exact view of an earlier one
    for i, m in enumerate(state.meshes):
        if m.id != i:
            problems.append(f"mesh{m.id} sits at position {i}")
        if (m.hosts, m.shape, m.view) in views and _interleaved(state.method):
            continue
        views.add((m.hosts, m.shape, m.view))
        if set(m.hosts) & seen:
            problems.append(f"mesh{m.id} shares hosts {sorted(set(m.hosts) & seen)}")
        seen |= set(m.hosts)
        if max(m.hosts, default=-1) >= state.cluster.num_hosts:
            problems.append(f"mesh{m.id} uses hosts {m.hosts} beyond the cluster's")
    if state.layer_groups is not None and len(state.layer_groups) != len(state.meshes):
        problems.append(f"{len(state.layer_groups)} stages but {len(state.meshes)} meshes")
    return problems


def _graph_problems(state: CompileState) -> list[str]:
    g = state.graph
    if g is None:
        return []
    problems = []
    groups = {grp.ref: grp.vars for grp in g.groups}
    programs = {p.name for p in g.programs}
    for p in g.programs:
        for grp in p.inputs + p.outputs:
            if grp.ref.kind is BufferKind.TRANSFER:
                k = grp.ref.owner
                if k >= len(g.edges) or grp.vars != (g.edges[k].var,):
                    problems.append(f"{p.name} uses {grp.ref}, which is not edge {k}'s value")
            elif grp.ref.kind is BufferKind.REDUCTION:
                k = grp.ref.owner
                if k >= len(g.reductions) or grp.vars != (g.reductions[k].var,):
                    problems.append(f"{p.name} uses {grp.ref}, which is not all-reduce {k}'s")
            elif groups.get(grp.ref) != grp.vars:
                problems.append(f"{p.name} uses {grp.ref} unlike the graph's group")
    for k, e in enumerate(g.edges):
        if e.producer not in programs or e.consumer not in programs:
            problems.append(f"edge {k} joins unknown programs {e.producer} -> {e.consumer}")
        elif e.producer.owner == e.consumer.owner:
            problems.append(f"edge {k} stays inside stage {e.producer.owner}")
    for ref in groups:
        if ref.owner >= g.num_stages:
            problems.append(f"group {ref} belongs to stage/mesh {ref.owner} of {g.num_stages}")
    return problems


def _buffer_problems(state: CompileState) -> list[str]:
    if state.buffers is None or state.graph is None:
        return []
    problems = []
    specs = {b.name: b for b in state.buffers}
    if len(specs) != len(state.buffers):
        problems.append("two buffer specs share a name")
    for grp in state.graph.groups:
        spec = specs.get(grp.ref)
        if grp.vars and spec is None:
            problems.append(f"group {grp.ref} has no buffer spec")
        elif spec is not None:
            if tuple(t.var for t in spec.tensors) != grp.vars:
                problems.append(f"buffer {grp.ref} holds other values than its group")
            if spec.per_micro_batch != grp.ref.kind.per_micro_batch:
                problems.append(f"buffer {grp.ref}: per_micro_batch disagrees with its kind")
    return problems


def _transfer_problems(state: CompileState) -> list[str]:
    if state.transfers is None or state.graph is None or state.meshes is None:
        return []
    edges = state.graph.edges
    if len(state.transfers) != len(edges):
        return [f"{len(state.transfers)} transfers for {len(edges)} cross-stage edges"]
    problems = []
    for k, (t, e) in enumerate(zip(state.transfers, edges, strict=True)):
        if t.name != TransferRef(k) or (t.producer, t.consumer) != (e.producer, e.consumer):
            problems.append(f"transfer {t.name} does not carry edge {k}")
        if t.src_mesh != state.meshes[e.producer.owner].id:
            problems.append(f"transfer {t.name} leaves mesh{t.src_mesh}, not its producer's")
        if any(m.nbytes <= 0 for m in t.messages):
            problems.append(f"transfer {t.name} has an empty message")
    return problems


def _provisional_plan(state: CompileState) -> Plan:
    """A plan of the streams alone (for :func:`verify` before the plan is assembled)."""
    return Plan(
        method=repr(state.method),
        cluster=state.cluster,
        # a data-parallel replica's schedule runs its share of the micro-batches
        num_micro_batches=(state.schedule or state.traced).num_micro_batches,
        fingerprint=state.traced.fingerprint,
        meshes=state.meshes or (),
        stages=(),
        programs=(),
        buffers=state.buffers or (),
        transfers=state.transfers or (),
        schedule=state.schedule or Schedule("none", 0, 0, ()),
        streams=state.streams or (),
        inputs=(),
        outputs=(),
    )
