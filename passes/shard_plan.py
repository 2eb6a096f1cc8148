"""Pass: sharding specs for every mesh of a plan, by mode (``sharding=`` of a method).

- ``data_parallel``: the batch split over the whole mesh, the rest whole (the rule of
  :mod:`meshshard.passes.sharding`; no solver).
- ``auto``: the sharding ILP (:func:`meshshard.passes.shard_ilp.solve_stage`) over the
  equations of each mesh's programs (forward, backward and update), every value free.
- ``zero2``: as ``auto`` with the batch pinned data parallel, parameters whole and the
  optimizer state (state read only by the update) split over the mesh.
- ``zero3``: ``zero2`` with the parameters split as well.

A parameter and its updated value (input ``args[i].p``, output ``out[j].p`` of the same
shape) are tied to one spec, since the next step reads the value this step writes.
Values pinned with ``meshshard.shard`` keep their pin in every mode but
``data_parallel``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.jaxpr_util import is_literal, var_ids
from meshshard.passes.shard_accumulate import accumulable_eqns
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.shard_ilp import MARKER_PRIMITIVES, ShardingSolution, solve_stage
from meshshard.passes.shard_rules import ELEMENTWISE, is_elementwise_call, layouts, to_spec
from meshshard.passes.sharding import data_parallel_spec, micro_batch_sizes
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import MeshSpec, Spec
from meshshard.refs import Phase

__all__ = [
    "SHARDING_MODES",
    "ZERO_UNSPLIT",
    "MeshSharding",
    "infer_shardings",
    "tied_state",
    "zero_notes",
]

SHARDING_MODES = ("data_parallel", "auto", "zero2", "zero3")
TIME_LIMIT = 20.0


@dataclass(frozen=True)
class MeshSharding:
    """The solution of one mesh: its programs' equations and the solver's answer."""

    mesh: int
    eqns: tuple[int, ...]
    solution: ShardingSolution

    @property
    def specs(self) -> Mapping[int, Spec]:
        return self.solution.specs


_ARG_PREFIX = re.compile(r"^args\[\d+\]\.?")
_OUT_PREFIXES = (re.compile(r"^out\[\d+\]\.?"), re.compile(r"^out\.?"))


def _state_key(path: str) -> str:
    """A state input's path below its argument: ``args[0].params['w']`` -> ``params['w']``,
    ``args[0][1]['w']`` -> ``[1]['w']``."""
    return _ARG_PREFIX.sub("", path, count=1)


def _out_keys(path: str) -> tuple[str, ...]:
    """The paths an output may have below the state it returns: below ``out[j]`` (a step
    returning ``(state, loss)``) or below ``out`` (a step returning the state alone)."""
    return tuple(dict.fromkeys(p.sub("", path, count=1) for p in _OUT_PREFIXES))


def tied_state(traced: TracedStep) -> tuple[tuple[int, int], ...]:
    """(input var id, output var id) of each state leaf the step returns updated.

    An output ties to the one state input with its path below the argument, shape and
    dtype: a Flax ``TrainState``, a tuple ``(params, opt_state)`` or a dict alike.  A
    state leaf left untied may get another spec as an output than as an input, which a
    later step reading it back would reshard.
    """
    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    by_key: dict = {}
    for i, leaf in enumerate(traced.inputs):
        if not leaf.is_batch:
            by_key.setdefault((_state_key(leaf.path), leaf.shape, leaf.dtype), []).append(i)
    pairs = []
    for j, leaf in enumerate(traced.outputs):
        out = jaxpr.outvars[j]
        if is_literal(out) or out not in ids:
            continue
        for key in _out_keys(leaf.path):
            got = by_key.get((key, leaf.shape, leaf.dtype), [])
            if len(got) == 1:
                pairs.append((got[0], ids[out]))
                break
    return tuple(pairs)


def _split_spec(shape, lmesh: LogicalMesh) -> Spec:
    """The first layout splitting one dim over every axis of the mesh, else the most split."""
    best = max(layouts(shape, lmesh), key=lambda lay: sum(len(a) for a in lay), default=())
    return to_spec(best) if best else ()


def _read_by_gradients(traced: TracedStep, graph: StageGraph) -> set:
    """Vars read by a forward or backward program (the rest of the state is the update's).

    A step differentiated with ``jax.grad`` has no update program: there, a state leaf
    whose every use downstream is elementwise (Adam's ``mu`` and ``nu``: scaled, added
    to the gradient, divided into the update) is the update's too, where a parameter
    always reaches a contraction or a reduction (the loss)."""
    fwd = set()
    for p in graph.programs:
        if p.name.phase in (Phase.FORWARD, Phase.BACKWARD):
            fwd.update(v for i in p.eqns for v in traced.jaxpr.eqns[i].invars if not is_literal(v))
    if not any(p.name.phase is Phase.APPLY for p in graph.programs):
        fwd -= elementwise_only_inputs(traced.jaxpr)
    return fwd


def elementwise_only_inputs(jaxpr) -> set:
    """Input vars of ``jaxpr`` from which only elementwise equations lead to the outputs
    (no contraction, reduction, reshape or gather on any path): values combined with
    others position by position, as an optimizer's moment estimates are.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda w, m, x: (jnp.sum(x @ w), 0.9 * m + jnp.sum(x @ w))
    >>> j = jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((2,)), jnp.ones((3, 2))).jaxpr
    >>> [j.invars.index(v) for v in elementwise_only_inputs(j)]
    [1]
    """
    tainted = set()  # vars from which a non-elementwise equation is reached
    for eqn in reversed(jaxpr.eqns):
        keeps = eqn.primitive.name in ELEMENTWISE or is_elementwise_call(eqn)
        if eqn.primitive.name == "broadcast_in_dim":
            keeps = not eqn.invars[0].aval.shape  # a scalar spread position by position
        if not keeps or any(o in tainted for o in eqn.outvars):
            tainted.update(v for v in eqn.invars if not is_literal(v))
    return {v for v in jaxpr.invars if v not in tainted}


#: Plan notes that start so are also logged as a warning at compile time.
ZERO_UNSPLIT = "optimizer state not split"


def zero_notes(traced: TracedStep, graph: StageGraph, mode: str) -> list[str]:
    """A note when ``sharding="zero2"`` finds no state that only the update reads.

    ZeRO-2 splits the optimizer state, which it tells from the parameters by what the
    gradient programs read.  A step that differentiates with ``jax.grad`` has no
    marked gradients, so its update is not planned apart; there only state with
    elementwise uses alone counts as the update's (:func:`_read_by_gradients`).  When
    none does (LAMB's moments reach a norm) nothing is split (the numbers are
    unchanged), which a user asking for ZeRO-2 does not expect without being told.
    """
    if mode != "zero2":
        return []
    fwd = _read_by_gradients(traced, graph)
    read = {v for eqn in traced.jaxpr.eqns for v in eqn.invars if not is_literal(v)}
    state = [  # leaves the step only passes through (Adafactor's unused slots) split nothing
        v
        for v, info in zip(traced.jaxpr.invars, traced.inputs, strict=False)
        if not info.is_batch and not info.is_key and len(info.shape) > 0 and v in read
    ]
    if not state or any(v not in fwd for v in state):
        return []
    return [
        f"{ZERO_UNSPLIT} (sharding='zero2'): every state leaf is read by the gradient "
        "computation, so none is the update's own to split; differentiate with "
        "meshshard.grad or meshshard.value_and_grad (not jax.grad) so meshshard plans the "
        "update apart"
    ]


def _mode_pins(traced, graph, mesh, lmesh, mode, scope_inputs) -> dict[int, Spec]:
    if mode == "auto":
        return {}
    mbs = micro_batch_sizes(traced)
    fwd = _read_by_gradients(traced, graph)
    pins = {}
    for leaf, info in enumerate(traced.inputs):
        v = traced.jaxpr.invars[leaf]
        if leaf not in scope_inputs or info.is_key:
            continue
        if info.is_batch:  # at micro-batch shape, as the programs read it
            pins[leaf] = data_parallel_spec(tuple(v.aval.shape), True, mbs, mesh)
        elif v in fwd:
            pins[leaf] = _split_spec(info.shape, lmesh) if mode == "zero3" else ()
        else:
            pins[leaf] = _split_spec(info.shape, lmesh)
    return pins


def _data_parallel_seed(traced: TracedStep, mesh: MeshSpec, scope_inputs) -> dict[int, Spec]:
    """var id -> spec of every input leaf the mesh reads: the batch split over the whole
    mesh, the rest whole (where a heuristic plan starts when the ILP stops early)."""
    ids = var_ids(traced.jaxpr)
    mbs = micro_batch_sizes(traced)
    seed = {}
    for leaf, info in enumerate(traced.inputs):
        v = traced.jaxpr.invars[leaf]
        if ids[v] in scope_inputs and not info.is_key:
            micro = tuple(v.aval.shape)  # the batch at micro-batch shape
            seed[ids[v]] = data_parallel_spec(micro, True, mbs, mesh) if info.is_batch else ()
    return seed


def infer_shardings(
    traced: TracedStep,
    graph: StageGraph,
    meshes: tuple[MeshSpec, ...],
    cluster: ClusterSpec,
    mode: str,
) -> tuple[MeshSharding, ...]:
    """One :class:`MeshSharding` per mesh (none for ``data_parallel``)."""
    if mode == "data_parallel":
        return ()
    jaxpr = traced.jaxpr
    ids = var_ids(jaxpr)
    tied = tied_state(traced)
    markers = {i for i, e in enumerate(jaxpr.eqns) if e.primitive.name in MARKER_PRIMITIVES}
    out = []
    for mesh in meshes:
        eqns = {i for p in graph.programs if p.stage == mesh.id for i in p.eqns}
        if not eqns:
            continue
        eqns = tuple(sorted(eqns | markers))  # markers carry specs across programs
        lmesh = LogicalMesh.of_mesh(mesh, cluster)
        read = {ids[v] for i in eqns for v in jaxpr.eqns[i].invars if not is_literal(v)}
        pins = _mode_pins(traced, graph, mesh, lmesh, mode, read)
        seeds = (("data-parallel", _data_parallel_seed(traced, mesh, read)),)
        sol = solve_stage(
            jaxpr,
            lmesh,
            cluster,
            pins=pins,
            eqns=eqns,
            tied=tied,
            time_limit=TIME_LIMIT,
            seeds=seeds,
            amortize=accumulable_eqns(traced, graph, mesh),
        )
        out.append(MeshSharding(mesh.id, eqns, sol))
    return tuple(out)


def spec_lookup(shardings: tuple[MeshSharding, ...]) -> dict[int, Mapping[int, Spec]]:
    """mesh id -> (var id -> spec), for the buffer and transfer passes."""
    return {s.mesh: s.specs for s in shardings}


def program_constraints(
    traced: TracedStep, shardings: tuple[MeshSharding, ...], mesh: int, eqns
) -> tuple[tuple[int, Spec], ...]:
    """(var id, spec) of every value the program's equations compute, from its mesh's
    solution (the runtime pins them with ``with_sharding_constraint``)."""
    specs = spec_lookup(shardings).get(mesh)
    if not specs:
        return ()
    ids = var_ids(traced.jaxpr)
    out = []
    for i in eqns:
        for o in traced.jaxpr.eqns[i].outvars:
            vid = ids.get(o)
            if vid is not None and vid in specs and hasattr(o.aval, "shape"):
                out.append((vid, specs[vid]))
    return tuple(out)


def program_operand_constraints(
    shardings: tuple[MeshSharding, ...], mesh: int, eqns
) -> tuple[tuple[int, int, Spec], ...]:
    """(equation, operand position, spec) of the operands the mesh's solution reshards
    before the program's equations read them (the runtime pins them there)."""
    sol = next((s.solution for s in shardings if s.mesh == mesh), None)
    if sol is None:
        return ()
    keep = set(eqns)
    return tuple(c for c in sol.operand_specs if c[0] in keep)


def _fmt_comm(comms) -> str:
    if not comms:
        return "no collectives"
    by: dict = {}
    for c in comms:
        key = (c.kind, c.axes)
        n, b = by.get(key, (0, 0.0))
        by[key] = (n + 1, b + c.nbytes)
    return ", ".join(
        f"{k}[{','.join(a)}] x{n} {b / 1024:.1f} KiB" for (k, a), (n, b) in sorted(by.items())
    )


def sharding_notes(shardings: tuple[MeshSharding, ...], programs) -> list[str]:
    """Plan notes: each mesh's ILP summary and each program's predicted collectives."""
    out = []
    for s in shardings:
        out.append(f"mesh{s.mesh} {s.solution.summary()}")
        out += [f"mesh{s.mesh} {n}" for n in s.solution.notes]
        for p in programs:
            if p.mesh == s.mesh:
                comms = s.solution.comms_of(p.eqns)
                out.append(f"{p.name} predicted comm: {_fmt_comm(comms)}")
    return out
