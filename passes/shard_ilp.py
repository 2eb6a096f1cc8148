"""Pass: sharding inference for one stage, as an integer linear program (Alpa's intra-op ILP).

:func:`solve_stage` takes a stage's jaxpr and its logical mesh and chooses a layout for
every value: each jaxpr input (parameters, optimizer state, batch) and each equation gets
one strategy from the rule table (:mod:`meshshard.passes.shard_rules`); an operand that
arrives in another layout than its consumer's strategy needs pays a resharding edge.
Elementwise equations with one array operand (and pipeline markers, and
``meshshard.shard`` pins) *follow* their operand: they share its decision variable,
which keeps a GPT block at a few hundred ILP nodes.  A pin fixes its group's variable;
a second pin of another layout on the same group gets a node of its own, read through
a resharding edge, so every pin holds.

Objective (seconds): per strategy, compute divided by its split plus its collectives
(alpha-beta per mesh axis, :mod:`meshshard.passes.shard_costs`); per edge, the
resharding collectives.  XLA's all-reduce combiner merges independent all-reduces of one
replica group into one collective, so the all-reduces of equations no later
all-reducing equation depends on (:func:`_combinable`: the data-parallel gradients,
which feed only the elementwise update) pay their bandwidth per strategy and their
latency once per (mesh axes, reduction, dtype) group: one variable ``y >= x`` of every
strategy that joins the group, priced at the group's alpha.  Constraint: at up to 16
points of the program (those with the most live bytes when everything is replicated)
the bytes one device holds of every live value (inputs live throughout) fit
``memory_budget``.  HiGHS
(``scipy.optimize.milp``) solves it with a time limit; its gap is reported.  When it
stops before optimality, the plan kept is the cheapest of its incumbent, a greedy pass,
seeded greedy passes and, on a mesh of two split axes, HiGHS's plans for each axis
alone and for both as one (far smaller problems), each mapped onto the mesh and
improved by local search; the solution says which it kept.

    >>> import jax, jax.numpy as jnp
    >>> from meshshard.cluster import ClusterSpec
    >>> from meshshard.passes.shard_costs import LogicalMesh
    >>> cluster = ClusterSpec()
    >>> mesh = LogicalMesh.of((1, 2), cluster)
    >>> closed = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((64, 8)), jnp.ones((8, 8)))
    >>> sol = solve_stage(closed, mesh, cluster)
    >>> sol.specs[0], sol.specs[1]  # the batch splits, the small weight stays whole
    (('device',), ())
    >>> sol.fallback, sol.status
    (False, 'optimal')
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import contraction_flops, is_dropvar, is_literal, itemsize, var_ids
from meshshard.passes.shard_costs import REDUCE_KINDS, Comm, LogicalMesh
from meshshard.passes.shard_loops import loop_flops
from meshshard.passes.shard_rules import (
    ELEMENTWISE,
    Layout,
    Strategy,
    from_spec,
    layouts,
    local_bytes,
    reshard_comms,
    strategies,
    to_spec,
)
from meshshard.plan import Spec, spec_str

__all__ = [
    "ShardingSolution",
    "StageCost",
    "solve_stage",
    "estimate_stage_cost",
    "ALIAS_PRIMITIVES",
    "MARKER_PRIMITIVES",
]

#: Markers and sharding pins: identities that carry specs across a step's programs.
MARKER_PRIMITIVES = frozenset({"pipeline_boundary", "meshshard_shard"})
#: Identity primitives whose outputs are their operands: the markers, and the barrier a
#: rematerialized layer's recompute starts with (``passes/inline_remat.py``).
ALIAS_PRIMITIVES = MARKER_PRIMITIVES | {"optimization_barrier"}
#: Primitives that make, split or convert PRNG keys: a few words each (``nn.RNN`` splits
#: a key for its carry), whose replicated runs are not worth a plan note.
KEY_PLUMBING = frozenset(
    {"random_seed", "random_split", "random_fold_in", "random_wrap", "random_unwrap"}
)
MEMORY_POINTS = 16
#: Inputs held sharded save memory: between plans of equal time, the one holding fewer
#: input bytes per device wins (priced at this fraction of reading them once).
TIE_BREAK = 1e-3


@dataclass(frozen=True)
class ShardingSolution:
    """The layouts chosen for one stage and what the solver says about them.

    ``specs``: var id (``var_ids`` of the jaxpr) -> spec of every value in scope.
    ``comms``: (equation index, predicted collective) pairs: each strategy's own
    collectives and the resharding of its operands, at the consuming equation.
    ``objective``: predicted seconds (compute + communication) of one run.
    ``ilp_size``: (nodes, variables, constraints).  ``gap``: HiGHS's relative MIP gap
    (0 when optimal; against the solver's lower bound when a heuristic plan was kept).
    ``fallback``: a heuristic plan (greedy, seeded greedy, with local search) replaced
    the solver's, which found none, or a worse one, in time; ``status`` says which.
    ``memory``: predicted peak bytes per device (at the sampled points).
    ``comm_seconds``: the communication part of ``objective`` (combinable all-reduces
    paying their latency once per combiner group, as the objective does).  Exact for a
    solve without ``amortize``; with it (``passes/shard_plan.py``) the collectives count
    once each while the objective weights the amortized reduces, so the two differ.
    """

    specs: Mapping[int, Spec]
    objective: float
    comms: tuple[tuple[int, Comm], ...]
    ilp_size: tuple[int, int, int]
    solve_time: float
    gap: float
    fallback: bool
    status: str
    memory: float = 0.0
    mesh: str = ""
    notes: tuple[str, ...] = field(default=())
    comm_seconds: float = 0.0
    #: (equation index, operand position, spec): an operand the chosen strategy reads in
    #: another layout than its producer's, resharded just before that equation
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()

    def comms_of(self, eqns: Sequence[int]) -> tuple[Comm, ...]:
        """Predicted collectives of a program made of equations ``eqns``: a value that
        several equations need in the same new layout is resharded once (XLA reuses it)."""
        keep = set(eqns)
        seen, out = set(), []
        for e, c in self.comms:
            key = (c.var, c.kind, c.axes, c.nbytes)
            if e in keep and (c.var < 0 or key not in seen):
                seen.add(key)
                out.append(c)
        return tuple(out)

    def summary(self) -> str:
        """One line: ILP size, objective, solve time, gap, and the fallback when taken."""
        nodes, nvars, ncons = self.ilp_size
        gap = "unknown (no bound)" if math.isnan(self.gap) else f"{self.gap:.2%}"
        return (
            f"sharding ILP on {self.mesh}: {nodes} nodes, {nvars} variables, {ncons} constraints; "
            f"objective {self.objective * 1e3:.4g} ms, solved in {self.solve_time:.2f} s, "
            f"gap {gap}, {self.status}; peak {self.memory / 2**20:.1f} MiB/device"
        )


@dataclass(frozen=True)
class StageCost:
    """A cheap estimate of one stage on a mesh: seconds (compute, communication), peak
    bytes per device, and whether it fits the budget."""

    seconds: float
    compute: float
    comm: float
    memory: float
    fits: bool


@dataclass
class _Node:
    eqn: int  # -1 for a jaxpr input
    outs: tuple[int, ...]  # var ids
    strategies: list[Strategy]
    cost: np.ndarray = None  # seconds per strategy
    shapes: tuple = ()  # (shape, dtype) per output
    #: per strategy: the combiner groups its combinable all-reduces join (see _combinable)
    groups: list = None
    #: per strategy: latency seconds left out of ``cost`` (paid once per group instead)
    saved: np.ndarray = None


@dataclass
class _Edge:
    src: int
    src_out: int
    dst: int
    dst_in: int
    var: int
    matrix: np.ndarray  # seconds, [src strategy, dst strategy]


@dataclass
class _Problem:
    nodes: list[_Node]
    edges: list[_Edge]
    source: dict[int, tuple[int, int]]  # var id -> (node, output)
    mem_rows: list[np.ndarray]  # per point: bytes per (node, strategy), flattened
    notes: list[str]
    scope: tuple = ()  # (jaxpr, equation indices, var ids): to recompute memory rows
    ties: list[tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=list)
    #: combiner group (axes, reduction, dtype) -> seconds paid once when any member runs
    combine: dict = field(default_factory=dict)


def _flops(eqn) -> float:
    if eqn.primitive.name in ("scan", "cond"):  # a loop's body every step; a branch's
        return loop_flops(eqn)
    return contraction_flops(eqn) or 0.0


def _strategy_cost(eqn, s: Strategy, mesh: LogicalMesh) -> float:
    """Seconds of one equation under strategy ``s``: its FLOPs and the bytes it writes,
    each shared by the devices the strategy splits the work over, its operand reads
    (matmuls and convolutions) and its collectives."""
    out_bytes = sum(
        math.prod(o.aval.shape) * itemsize(o.aval.dtype)
        for o in eqn.outvars
        if hasattr(o.aval, "shape")
    )
    compute = _flops(eqn) / s.split / mesh.peak_flops
    memory = out_bytes / s.split / mesh.memory_bandwidth
    return compute + memory + _operand_reads(eqn, s, mesh) + mesh.comm_time(s.comms)


def _operand_reads(eqn, s: Strategy, mesh: LogicalMesh) -> float:
    """Seconds a matmul or convolution spends reading its operands, each device the part
    its layout holds (XLA fuses no producer into them).  Splitting a convolution's output
    features leaves every device reading the whole input, which splitting its batch does
    not: without this term the two tied, and a BatchNorm CNN planned on the output
    features ran 1.8x slower than data parallel (``benchmarks/conv_operand_reads.py``)."""
    if not _flops(eqn):
        return 0.0
    return (
        sum(
            local_bytes(v.aval.shape, v.aval.dtype, lay or (), mesh)
            for v, lay in zip(eqn.invars, s.ins, strict=True)
            if hasattr(v.aval, "shape")
        )
        / mesh.memory_bandwidth
    )


def _is_follower(eqn) -> bool:
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return False
    arrays = [v for v in eqn.invars if not is_literal(v) and v.aval.shape != ()]
    return len(arrays) == 1 and arrays[0].aval.shape == eqn.outvars[0].aval.shape


def _pin_layout(spec, shape, mesh: LogicalMesh, name: str) -> Layout:
    layout = from_spec(tuple(spec), len(shape))
    for d, axes in enumerate(layout):
        bad = [a for a in axes if a not in mesh.axes]
        if bad:
            raise MeshshardInputError(
                f"meshshard.shard pin {spec_str(tuple(spec))} on {name} (shape {shape}) names "
                f"axis {bad[0]!r}, which mesh {mesh} lacks; use axes of {mesh.axes}"
            )
        if axes and shape[d] % mesh.size(axes) != 0:
            fits = [spec_str(to_spec(lay)) for lay in layouts(shape, mesh)]
            raise MeshshardInputError(
                f"meshshard.shard pin {spec_str(tuple(spec))} on {name} (shape {shape}) splits "
                f"dim {d} of size {shape[d]} over {mesh.size(axes)} devices of mesh {mesh}, "
                f"which does not divide it; layouts that fit: {', '.join(fits)}"
            )
    return _live_axes(layout, mesh)


def _live_axes(layout: Layout, mesh: LogicalMesh) -> Layout:
    """``layout`` less its axes of size 1: they split nothing, and the layouts the rules
    enumerate leave them out."""
    return tuple(tuple(a for a in axes if mesh.size((a,)) > 1) for axes in layout)


def _pin_name(eqn, vid: int) -> str:
    """How an error names a pinned value: the pin's ``name=`` if given, and its id."""
    label = eqn.params.get("name")
    return f"{label!r} (%{vid})" if label else f"%{vid}"


def _devices_that_fit(need: float, budget: float, mesh: LogicalMesh) -> int:
    """The device count at which the most sharded plan would fit, were it all sharded."""
    n = mesh.size(mesh.axes)
    return max(n + 1, math.ceil(need * n / budget)) if budget > 0 else n + 1


def _scope(jaxpr, eqns: Sequence[int] | None):
    idx = list(range(len(jaxpr.eqns))) if eqns is None else sorted(eqns)
    defined = {v for i in idx for v in jaxpr.eqns[i].outvars}
    inputs, seen = [], set()
    for i in idx:
        for v in jaxpr.eqns[i].invars:
            if not is_literal(v) and v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
    if eqns is None:
        inputs = [v for v in (*jaxpr.invars, *jaxpr.constvars)] + [
            v for v in inputs if v not in set(jaxpr.invars) | set(jaxpr.constvars)
        ]
    return idx, inputs


def _input_node(v, vid: int, mesh: LogicalMesh) -> _Node:
    """A value the scope reads but does not compute: any layout, at no cost but a tie-break."""
    shape = tuple(v.aval.shape)
    strat = [Strategy(str(to_spec(lay)), (lay,), ()) for lay in layouts(shape, mesh)]
    held = [local_bytes(shape, v.aval.dtype, st.outs[0], mesh) for st in strat]
    tie = np.array(held) * TIE_BREAK / mesh.memory_bandwidth
    return _Node(-1, (vid,), strat, tie, ((shape, v.aval.dtype),))


def _pin_node(i: int, v, vid: int, lay: Layout) -> _Node:
    """A pinned value whose operand's group (the values that follow one variable) another
    pin already fixes to another layout: its own node, in the pinned layout only, read
    from its operand through a resharding edge."""
    return _Node(
        i,
        (vid,),
        [Strategy("pin", (lay,), (lay,))],
        np.zeros(1),
        ((tuple(v.aval.shape), v.aval.dtype),),
    )


#: Reductions an all-reduce applies per primitive (XLA combines only equal reductions).
_REDUCTION = {"reduce_max": "max", "reduce_min": "min", "reduce_prod": "mul"}


def _combinable(jaxpr, idx, strat: Mapping[int, list[Strategy]]) -> set[int]:
    """Equations whose all-reduces XLA's all-reduce combiner can merge into one per
    replica group: no equation of the scope downstream of their outputs may all-reduce
    (has a strategy with an all-reduce).  Their all-reduced values then feed only
    all-reduce-free work (elementwise updates, reshapes, the outputs), so no all-reduce
    of this set depends on another: they are independent, and XLA merges independent
    all-reduces of one replica group and reduction (the data-parallel gradients of the
    parameters: Adam's or SGD's update is elementwise)."""
    may_reduce = {i: any(c.kind == "all-reduce" for st in strat.get(i, ()) for c in st.comms)
                  for i in idx}  # fmt: skip
    tainted: set = set()  # vars some all-reducing equation depends on downstream
    out = set()
    for i in reversed(idx):
        eqn = jaxpr.eqns[i]
        after = any(o in tainted for o in eqn.outvars if not is_dropvar(o))
        if may_reduce[i] and not after:
            out.add(i)
        if may_reduce[i] or after:
            tainted.update(v for v in eqn.invars if not is_literal(v))
    return out


def _combine_groups(eqn, strat, cost, mesh: LogicalMesh, factor: float, combine: dict):
    """(per-strategy group keys, per-strategy latency left out of ``cost``) of a
    combinable equation; ``cost`` loses the latency of each combinable all-reduce (times
    ``factor``, its runs per step) and ``combine`` gains each group's once-paid latency."""
    red = _REDUCTION.get(eqn.primitive.name, "add")
    dtype = str(eqn.outvars[0].aval.dtype)
    groups, saved = [], np.zeros(len(strat))
    for j, s in enumerate(strat):
        keys = []
        for c in s.comms:
            lat = mesh.latency(c.kind, c.axes) if c.kind == "all-reduce" and c.nbytes > 0 else 0
            if lat <= 0:
                continue
            key = (c.axes, red, dtype)
            keys.append(key)
            saved[j] += factor * lat
            combine[key] = max(combine.get(key, 0.0), factor * lat)
        groups.append(tuple(dict.fromkeys(keys)))
    return groups, cost - saved, saved


def _keys(node: _Node, j: int) -> tuple:
    """The combiner groups strategy ``j`` of ``node`` joins."""
    return node.groups[j] if node.groups else ()


def _group_seconds(problem: _Problem, choice) -> float:
    """The once-paid latency of every combiner group some chosen strategy joins."""
    active = {k for n, j in zip(problem.nodes, choice, strict=True) for k in _keys(n, j)}
    return sum(problem.combine[k] for k in active)


def _joining(problem: _Problem, node: _Node, active) -> np.ndarray:
    """Per strategy of ``node``: the latency of the groups it would open (not ``active``)."""
    return np.array(
        [
            sum(problem.combine[k] for k in _keys(node, j) if k not in active)
            for j in range(len(node.strategies))
        ]
    )


def _amortized(cost: np.ndarray, strat, mesh: LogicalMesh, factor: float) -> np.ndarray:
    """Strategy costs with their reduces counted ``factor`` times (run once per step)."""
    out = cost.copy()
    for j, s in enumerate(strat):
        reduces = [c for c in s.comms if c.kind in REDUCE_KINDS]
        out[j] -= (1.0 - factor) * mesh.comm_time(reduces)
    return out


def _live_outputs(eqn, strat: list[Strategy]) -> list[Strategy]:
    """``strat`` with each strategy's output layouts for the equation's used outputs
    only: a node numbers its outputs without the dropped ones (``_``), and a loop with a
    dropped output before a used one (a scan's unused stacked values) otherwise read
    the dropped output's layout for the used one."""
    if not any(is_dropvar(o) for o in eqn.outvars):
        return strat
    live = [k for k, o in enumerate(eqn.outvars) if not is_dropvar(o)]
    return [
        replace(s, outs=tuple(s.outs[k] for k in live)) if len(s.outs) == len(eqn.outvars) else s
        for s in strat
    ]


def _build(jaxpr, mesh, eqns, pins, amortize: Mapping[int, float] | None = None) -> _Problem:
    ids = var_ids(jaxpr)
    idx, inputs = _scope(jaxpr, eqns)
    nodes: list[_Node] = []
    source: dict[int, tuple[int, int]] = {}
    pin_on: dict[tuple[int, int], Layout] = {}
    notes: list[str] = []
    for v in inputs:
        source[ids[v]] = (len(nodes), 0)
        nodes.append(_input_node(v, ids[v], mesh))
    edges: list[_Edge] = []
    strat_of = {
        i: _live_outputs(jaxpr.eqns[i], strategies(jaxpr.eqns[i], mesh))
        for i in idx
        if not (jaxpr.eqns[i].primitive.name in ALIAS_PRIMITIVES or _is_follower(jaxpr.eqns[i]))
    }
    combinable = _combinable(jaxpr, idx, strat_of)
    combine: dict = {}
    for i in idx:
        eqn = jaxpr.eqns[i]
        name = eqn.primitive.name
        if name in ALIAS_PRIMITIVES or _is_follower(eqn):
            pairs = (
                zip(eqn.invars, eqn.outvars, strict=True)
                if name in ALIAS_PRIMITIVES
                else [
                    (
                        next(v for v in eqn.invars if not is_literal(v) and v.aval.shape != ()),
                        eqn.outvars[0],
                    )
                ]
            )
            for a, o in pairs:
                if is_dropvar(o) or is_literal(a):
                    continue
                if ids[a] not in source:  # its operand comes from outside: a free input
                    source[ids[o]] = (len(nodes), 0)
                    nodes.append(_input_node(o, ids[o], mesh))
                    continue
                src = source[ids[a]]
                if name == "meshshard_shard":
                    lay = _pin_layout(
                        eqn.params["spec"], tuple(a.aval.shape), mesh, _pin_name(eqn, ids[o])
                    )
                    if pin_on.get(src, lay) != lay:  # its group is pinned otherwise already
                        source[ids[o]] = (len(nodes), 0)
                        nodes.append(_pin_node(i, o, ids[o], lay))
                        edges.append(_edge(nodes, *src, len(nodes) - 1, 0, ids[a], a, mesh))
                        continue
                    pin_on[src] = lay
                source[ids[o]] = src
            continue
        strat = strat_of[i]
        n = len(nodes)
        outs = tuple(ids[o] for o in eqn.outvars if not is_dropvar(o))
        shapes = tuple(
            (tuple(o.aval.shape), o.aval.dtype) for o in eqn.outvars if not is_dropvar(o)
        )
        if (
            strat[0].name == "replicated"
            and name != "iota"
            and name not in KEY_PLUMBING
            and any(len(layouts(shape, mesh)) > 1 for shape, _ in shapes)
        ):  # a scalar (a PRNG key's seed) has nothing to split: not worth a note
            notes.append(f"{name} runs replicated (no sharding rule)")
        cost = np.array([_strategy_cost(eqn, s, mesh) for s in strat])
        factor = amortize.get(i, 1.0) if amortize else 1.0
        if factor != 1.0:
            cost = _amortized(cost, strat, mesh, factor)
        groups, saved = [()] * len(strat), np.zeros(len(strat))
        if i in combinable:
            groups, cost, saved = _combine_groups(eqn, strat, cost, mesh, factor, combine)
        nodes.append(_Node(i, outs, strat, cost, shapes, groups, saved))
        k = 0
        for o in eqn.outvars:
            if not is_dropvar(o):
                source[ids[o]] = (n, k)
                k += 1
        for pos, v in enumerate(eqn.invars):
            if is_literal(v) or ids.get(v) not in source:
                continue
            p, po = source[ids[v]]
            edges.append(_edge(nodes, p, po, n, pos, ids[v], v, mesh))
    for (p, po), lay in pin_on.items():
        keep = [s for s in nodes[p].strategies if s.outs[po] == lay]
        if not keep:
            raise MeshshardInputError(
                f"meshshard.shard pin {spec_str(to_spec(lay))} on %{nodes[p].outs[po]} cannot be "
                f"produced by its equation on mesh {mesh}; pin a layout of its operand instead"
            )
        _restrict(nodes, edges, p, keep, mesh)
    problem = _Problem(nodes, edges, source, [], notes, (jaxpr, idx, ids), combine=combine)
    _refresh_memory(problem, mesh)
    return problem


def _refresh_memory(problem: _Problem, mesh: LogicalMesh) -> None:
    jaxpr, idx, ids = problem.scope
    problem.mem_rows = _memory_rows(jaxpr, idx, problem.nodes, problem.source, ids, mesh)


def _restrict(nodes, edges, p, keep, mesh) -> None:
    node = nodes[p]
    pos = [node.strategies.index(s) for s in keep]
    node.strategies = keep
    node.cost = node.cost[pos]
    if node.groups is not None:
        node.groups = [node.groups[j] for j in pos]
        node.saved = node.saved[pos]
    for e in edges:
        if e.src == p:
            e.matrix = e.matrix[pos, :]
        if e.dst == p:
            e.matrix = e.matrix[:, pos]


def _edge(nodes, p, po, n, pos, vid, v, mesh) -> _Edge:
    shape, dtype = tuple(v.aval.shape), v.aval.dtype
    src = [s.outs[po] for s in nodes[p].strategies]
    dst = [s.ins[pos] for s in nodes[n].strategies]
    cache: dict = {}
    m = np.zeros((len(src), len(dst)))
    for a, la in enumerate(src):
        for b, lb in enumerate(dst):
            if lb is None or la == lb:
                continue
            key = (la, lb)
            if key not in cache:
                cache[key] = mesh.comm_time(reshard_comms(shape, dtype, la, lb, mesh))
            m[a, b] = cache[key]
    return _Edge(p, po, n, pos, vid, m)


def _memory_rows(jaxpr, idx, nodes, source, ids, mesh) -> list[np.ndarray]:
    """Bytes per (node, strategy) live at the points with the most replicated bytes."""
    offsets = np.cumsum([0] + [len(n.strategies) for n in nodes])
    end = len(idx)
    last = {}  # (node, out) -> last position used
    first = {}
    for t, i in enumerate(idx):
        for v in jaxpr.eqns[i].invars:
            if not is_literal(v) and ids.get(v) in source:
                last[source[ids[v]]] = t
    for n, node in enumerate(nodes):
        for k in range(len(node.outs)):
            first[(n, k)] = -1 if node.eqn < 0 else idx.index(node.eqn)
            if node.eqn < 0:
                last[(n, k)] = end  # inputs (parameters, state) stay resident
    for v in jaxpr.outvars:
        if not is_literal(v) and ids.get(v) in source:
            last[source[ids[v]]] = end
    full = {
        key: math.prod(nodes[key[0]].shapes[key[1]][0]) * itemsize(nodes[key[0]].shapes[key[1]][1])
        for key in first
    }
    live_at = np.zeros(end + 1)
    for key, f in first.items():
        live_at[max(f, 0) : last.get(key, f) + 1] += full[key]
    points = np.argsort(-live_at, kind="stable")[:MEMORY_POINTS]
    rows = []
    for t in points:
        row = np.zeros(offsets[-1])
        for key, f in first.items():
            if max(f, 0) <= t <= last.get(key, f):
                n, k = key
                shape, dtype = nodes[n].shapes[k]
                for j, s in enumerate(nodes[n].strategies):
                    row[offsets[n] + j] += local_bytes(shape, dtype, s.outs[k], mesh)
        rows.append(row)
    return rows


def _min_memory(problem: _Problem) -> float:
    offsets = np.cumsum([0] + [len(n.strategies) for n in problem.nodes])
    worst = 0.0
    for row in problem.mem_rows:
        worst = max(
            worst,
            sum(row[offsets[i] : offsets[i + 1]].min() for i in range(len(problem.nodes))),
        )
    return worst


def _groups(layouts_of: list) -> tuple[list, np.ndarray]:
    """Distinct layouts and, per strategy, the index of its layout."""
    distinct: list = []
    which = np.zeros(len(layouts_of), dtype=int)
    for j, lay in enumerate(layouts_of):
        if lay not in distinct:
            distinct.append(lay)
        which[j] = distinct.index(lay)
    return distinct, which


def _milp(problem: _Problem, budget: float | None, time_limit: float, gap: float):
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    nodes = problem.nodes
    offsets = np.cumsum([0] + [len(n.strategies) for n in nodes])
    nx = int(offsets[-1])
    c = np.concatenate([n.cost for n in nodes]).astype(float)
    rows, cols, vals, lb, ub = [], [], [], [], []
    extra_c: list[float] = []

    def row(entries, lo, hi):
        r = len(lb)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lb.append(lo)
        ub.append(hi)

    for n in range(len(nodes)):
        row([(offsets[n] + j, 1.0) for j in range(len(nodes[n].strategies))], 1.0, 1.0)
    for e in problem.edges:
        _, ga = _groups([s.outs[e.src_out] for s in nodes[e.src].strategies])
        _, gb = _groups([s.ins[e.dst_in] for s in nodes[e.dst].strategies])
        na, nb = ga.max() + 1, gb.max() + 1
        red = np.zeros((na, nb))
        for a in range(na):
            for b in range(nb):
                red[a, b] = e.matrix[np.argmax(ga == a), np.argmax(gb == b)]
        if not red.any():
            continue
        if na == 1 or nb == 1:  # one side fixed: the cost is the other side's
            if na == 1:
                c[offsets[e.dst] : offsets[e.dst + 1]] += red[0, gb]
            else:
                c[offsets[e.src] : offsets[e.src + 1]] += red[ga, 0]
            continue
        base = nx + len(extra_c)
        extra_c.extend(red.ravel())
        for a in range(na):
            ent = [(base + a * nb + b, 1.0) for b in range(nb)]
            ent += [(offsets[e.src] + j, -1.0) for j in np.flatnonzero(ga == a)]
            row(ent, 0.0, 0.0)
        for b in range(nb):
            ent = [(base + a * nb + b, 1.0) for a in range(na)]
            ent += [(offsets[e.dst] + j, -1.0) for j in np.flatnonzero(gb == b)]
            row(ent, 0.0, 0.0)
    for (n1, k1), (n2, k2) in problem.ties:
        lays1 = [st.outs[k1] for st in nodes[n1].strategies]
        lays2 = [st.outs[k2] for st in nodes[n2].strategies]
        for lay in dict.fromkeys(lays1 + lays2):  # in a fixed order: HiGHS breaks ties by it
            ent = [(offsets[n1] + j, 1.0) for j, x in enumerate(lays1) if x == lay]
            ent += [(offsets[n2] + j, -1.0) for j, x in enumerate(lays2) if x == lay]
            row(ent, 0.0, 0.0)
    for key, seconds in problem.combine.items():  # y_key >= x of every member strategy
        y = nx + len(extra_c)
        extra_c.append(seconds)
        for n, node in enumerate(nodes):
            members = [j for j in range(len(node.strategies)) if key in _keys(node, j)]
            if members:  # one strategy per node: their sum is 0 or 1
                row([(offsets[n] + j, 1.0) for j in members] + [(y, -1.0)], -np.inf, 0.0)
    if budget is not None:
        for mem in problem.mem_rows:
            row([(j, float(v)) for j, v in enumerate(mem) if v], -np.inf, float(budget))
    nvar = nx + len(extra_c)
    cost = np.concatenate([c, np.asarray(extra_c, float)])
    a = coo_matrix((vals, (rows, cols)), shape=(len(lb), nvar)).tocsr()
    integrality = np.concatenate([np.ones(nx), np.zeros(len(extra_c))])
    res = milp(
        cost,
        integrality=integrality,
        bounds=(0, 1),
        constraints=[LinearConstraint(a, lb, ub)],
        options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False},
    )
    size = (len(nodes), nvar, len(lb))
    if res.x is None:
        return None, size, res
    x = res.x[:nx]
    choice = [int(np.argmax(x[offsets[n] : offsets[n + 1]])) for n in range(len(nodes))]
    return choice, size, res


def _adjacency(problem: _Problem) -> tuple[dict[int, list[_Edge]], dict[int, list[_Edge]]]:
    """(node -> edges into it, node -> edges out of it)."""
    into: dict[int, list[_Edge]] = {}
    out_of: dict[int, list[_Edge]] = {}
    for e in problem.edges:
        into.setdefault(e.dst, []).append(e)
        out_of.setdefault(e.src, []).append(e)
    return into, out_of


def _greedy(problem: _Problem, preset: Mapping[int, int] | None = None) -> list[int]:
    """Equations in order, each the cheapest strategy given its operands' choices (an
    undecided jaxpr input costs its best case); then each input the layout its
    consumers' choices read most cheaply.  ``preset``: node -> strategy fixed first."""
    nodes = problem.nodes
    choice: list[int | None] = [None] * len(nodes)
    for n, j in (preset or {}).items():
        choice[n] = j
    into, out_of = _adjacency(problem)
    active = {k for n, j in enumerate(choice) if j is not None for k in _keys(nodes[n], j)}
    for n, node in enumerate(nodes):
        if node.eqn < 0 or choice[n] is not None:
            continue
        total = node.cost + _joining(problem, node, active)
        for e in into.get(n, []):
            src = choice[e.src]
            total += e.matrix.min(axis=0) if src is None else e.matrix[src]
        choice[n] = int(np.argmin(total))
        active.update(_keys(node, choice[n]))
    for n, node in enumerate(nodes):
        if choice[n] is None:
            total = node.cost.copy()
            for e in out_of.get(n, []):
                total += e.matrix[:, choice[e.dst]]
            choice[n] = int(np.argmin(total))
    for (n1, k1), (n2, k2) in problem.ties:  # the later side follows the earlier one
        want = nodes[n1].strategies[choice[n1]].outs[k1]
        ok = [j for j, s in enumerate(nodes[n2].strategies) if s.outs[k2] == want]
        if ok:
            choice[n2] = min(ok, key=lambda j: nodes[n2].cost[j])
    return choice


def _improve(problem: _Problem, choice: list[int], rounds: int = 4) -> list[int]:
    """Local search: each node in turn takes its cheapest strategy given its neighbours'
    choices (nodes tied to another keep theirs), until nothing changes."""
    nodes = problem.nodes
    into, out_of = _adjacency(problem)
    tied = {n for pair in problem.ties for n, _ in pair}
    choice = list(choice)
    members: dict = {}  # combiner group -> how many nodes' choices join it
    for n, j in enumerate(choice):
        for k in _keys(nodes[n], j):
            members[k] = members.get(k, 0) + 1
    for _ in range(rounds):
        changed = False
        for n, node in enumerate(nodes):
            if n in tied or len(node.strategies) == 1:
                continue
            mine = _keys(node, choice[n])
            active = {k for k, m in members.items() if m > (k in mine)}
            total = node.cost + _joining(problem, node, active)
            for e in into.get(n, []):
                total += e.matrix[choice[e.src]]
            for e in out_of.get(n, []):
                total += e.matrix[:, choice[e.dst]]
            best = int(np.argmin(total))
            if total[best] < total[choice[n]] - 1e-15:
                for k in mine:
                    members[k] -= 1
                for k in _keys(node, best):
                    members[k] = members.get(k, 0) + 1
                choice[n], changed = best, True
        if not changed:
            break
    return choice


def _seed_preset(problem: _Problem, seed: Mapping[int, Spec], mesh: LogicalMesh) -> dict:
    """node -> strategy of the jaxpr inputs a seed gives a layout (var id -> spec)."""
    preset = {}
    for vid, spec in seed.items():
        if vid not in problem.source:
            continue
        n, k = problem.source[vid]
        node = problem.nodes[n]
        if node.eqn >= 0:
            continue
        lay = _live_axes(from_spec(tuple(spec), len(node.shapes[k][0])), mesh)
        fits = [j for j, st in enumerate(node.strategies) if st.outs[k] == lay]
        if fits:
            preset[n] = fits[0]
    return preset


#: Seconds HiGHS has at least for each one-axis problem (:func:`_one_axis_plans`).
ONE_AXIS_MIN_SECONDS = 1.0
#: Name of the one axis of a mesh whose split axes are taken together (:func:`_one_axis_meshes`).
_FLAT = "flat"


def _one_axis_meshes(mesh: LogicalMesh) -> list[tuple[str, LogicalMesh, Callable]]:
    """(label, mesh with one split axis, map of its layouts onto ``mesh``'s) for a mesh
    of several split axes: each axis alone (the others size 1) and all of them as one
    axis.  Their problems are far smaller (a BERT block on 2 x 2: 13k variables, not
    174k), so HiGHS solves them where it stops early on the whole mesh, and each of
    their plans is a plan of ``mesh``: candidates that bound the answer by the best
    plan that splits over one axis, or over all devices as one."""
    axes = tuple(a for a, n in zip(mesh.axes, mesh.shape, strict=True) if n > 1)
    if len(axes) < 2:
        return []
    out = []
    for a in axes:
        shape = tuple(s if ax == a else 1 for ax, s in zip(mesh.axes, mesh.shape, strict=True))
        out.append((f"{a}-axis", replace(mesh, shape=shape), lambda lay: lay))
    pos = [mesh.axes.index(a) for a in axes]
    flat = replace(
        mesh,
        axes=(_FLAT,),
        shape=(mesh.size(axes),),
        alpha=(max(mesh.alpha[i] for i in pos),),
        beta=(max(mesh.beta[i] for i in pos),),
    )
    out.append(("all-axes", flat, lambda lay: tuple(axes if _FLAT in d else d for d in lay)))
    return out


def _translated(problem: _Problem, sub: _Problem, sub_choice, to_mesh: Callable) -> dict:
    """node -> strategy of ``problem`` that a plan of the same jaxpr on a one-axis mesh
    chose (its layouts mapped by ``to_mesh``); nodes with no such strategy are left out."""
    index = {(n.eqn, n.outs): k for k, n in enumerate(problem.nodes)}
    preset = {}
    for node, j in zip(sub.nodes, sub_choice, strict=True):
        k = index.get((node.eqn, node.outs))
        if k is None:
            continue
        s = node.strategies[j]
        outs = tuple(to_mesh(lay) for lay in s.outs)
        ins = tuple(None if lay is None else to_mesh(lay) for lay in s.ins)
        target = problem.nodes[k].strategies
        fits = [i for i, t in enumerate(target) if t.outs == outs and t.ins == ins]
        fits = fits or [i for i, t in enumerate(target) if t.outs == outs]
        if fits:
            preset[k] = min(fits, key=lambda i: problem.nodes[k].cost[i])
    return preset


def _one_axis_plans(problem, jaxpr, mesh, eqns, amortize, tied, time_limit, gap) -> list:
    """(label, preset) of the plans HiGHS finds on each of :func:`_one_axis_meshes`
    (pins given to ``solve_stage`` left out: the whole mesh's pinned nodes have one
    strategy each; a mesh that a ``meshshard.shard`` pin inside the step cannot be
    placed on is skipped)."""
    out = []
    for label, small, to_mesh in _one_axis_meshes(mesh):
        try:
            sub = _build(jaxpr, small, eqns, {}, amortize)
        except MeshshardInputError:  # a pin in the step names an axis this mesh lacks
            continue
        sub.ties = _ties(sub, tied)
        choice, _, _ = _milp(sub, None, time_limit, gap)
        if choice is None:
            choice = _improve(sub, _greedy(sub))
        out.append((label, _translated(problem, sub, choice, to_mesh)))
    return out


def _best_candidate(
    problem, mesh, budget, ilp_choice, seeds, plans=()
) -> tuple[list[int], str, float]:
    """(choice, label, objective): the cheapest of the ILP's incumbent, the greedy plan,
    each seeded greedy plan and each one-axis plan (all after local search) that fits
    ``budget`` and keeps every tie."""
    cands = [] if ilp_choice is None else [("the ILP's incumbent", list(ilp_choice))]
    cands.append(("greedy + local search", _improve(problem, _greedy(problem))))
    for label, seed in seeds:
        preset = _seed_preset(problem, seed, mesh)
        cands.append((f"{label} seed + local search", _improve(problem, _greedy(problem, preset))))
    for label, preset in plans:
        cands.append((f"{label} plan + local search", _improve(problem, _greedy(problem, preset))))
    best = None
    for label, choice in cands:
        objective, _, memory = _evaluate(problem, choice, mesh)
        broken = any(
            problem.nodes[a].strategies[choice[a]].outs[ka]
            != problem.nodes[b].strategies[choice[b]].outs[kb]
            for (a, ka), (b, kb) in problem.ties
        )
        if broken or (budget is not None and memory > budget):
            continue
        if best is None or objective < best[0] - 1e-12:
            best = (objective, choice, label)
    if best is None:  # nothing fits: the first candidate, as before
        return cands[0][1], cands[0][0], _evaluate(problem, cands[0][1], mesh)[0]
    return best[1], best[2], best[0]


def _evaluate(problem: _Problem, choice, mesh: LogicalMesh):
    """(objective seconds, per-equation comms, peak bytes) of a choice."""
    nodes = problem.nodes
    objective = sum(float(n.cost[j]) for n, j in zip(nodes, choice, strict=True))
    objective += _group_seconds(problem, choice)
    comms: list[tuple[int, Comm]] = []
    for n, j in zip(nodes, choice, strict=True):
        for cm in n.strategies[j].comms:
            comms.append((n.eqn, Comm(cm.kind, cm.axes, cm.nbytes, n.outs[0] if n.outs else -1)))
    for e in problem.edges:
        objective += float(e.matrix[choice[e.src], choice[e.dst]])
        src = nodes[e.src].strategies[choice[e.src]].outs[e.src_out]
        dst = nodes[e.dst].strategies[choice[e.dst]].ins[e.dst_in]
        if dst is None or src == dst:
            continue
        shape, dtype = nodes[e.src].shapes[e.src_out]
        for cm in reshard_comms(shape, dtype, src, dst, mesh):
            comms.append((nodes[e.dst].eqn, Comm(cm.kind, cm.axes, cm.nbytes, e.var)))
    offsets = np.cumsum([0] + [len(n.strategies) for n in nodes])
    x = np.zeros(offsets[-1])
    x[offsets[:-1] + np.asarray(choice, dtype=int)] = 1.0
    memory = max((float(r @ x) for r in problem.mem_rows), default=0.0)
    return objective, tuple(comms), memory


def _jaxpr(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


def solve_stage(
    jaxpr,
    mesh: LogicalMesh,
    cluster: ClusterSpec | None = None,
    memory_budget: float | None = None,
    pins: Mapping[int, Spec] | None = None,
    *,
    eqns: Sequence[int] | None = None,
    tied: Sequence[tuple[int, int]] = (),
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-3,
    seeds: Sequence[tuple[str, Mapping[int, Spec]]] = (),
    amortize: Mapping[int, float] | None = None,
) -> ShardingSolution:
    """Choose a spec for every value of ``jaxpr`` (or of its equations ``eqns``) on ``mesh``.

    ``memory_budget``: bytes per device (default: ``cluster.device_memory``, none without
    a cluster).  ``pins``: var id -> spec the solution must give that value (as
    ``meshshard.shard`` does inside the step).  ``tied``: pairs of var ids that must get
    the same spec (a parameter and its updated value, which the next step reads).
    ``seeds``: (label, var id -> spec of jaxpr inputs) starting points (data parallel)
    for the heuristic plans that replace the ILP's answer when HiGHS stops before
    optimality with a worse one.  ``amortize``: equation index -> how many times per run
    its reduces count (``1 / M`` for gradient contributions accumulated locally).
    Raises :class:`MeshshardInputError` when no plan fits the budget or a pin does not
    divide its value.
    """
    jaxpr = _jaxpr(jaxpr)
    problem = _build(jaxpr, mesh, eqns, {}, amortize)
    _apply_pins(problem, pins or {}, jaxpr, mesh)
    problem.ties = _ties(problem, tied)
    if memory_budget is None and cluster is not None:
        memory_budget = cluster.device_memory
    need = _min_memory(problem)
    if memory_budget is not None and need > memory_budget:
        raise MeshshardInputError(
            f"memory_budget={memory_budget / 2**20:.1f} MiB per device: no sharding of this "
            f"stage on mesh {mesh} fits; the most sharded plan needs {need / 2**20:.1f} MiB "
            f"per device. What would fit: a budget of at least {need / 2**20:.1f} MiB "
            f"(ClusterSpec(device_memory=...)), or a larger mesh for this stage (at least "
            f"{_devices_that_fit(need, memory_budget, mesh)} devices, were all of it sharded)"
        )
    t0 = time.perf_counter()
    choice, size, res = _milp(problem, memory_budget, time_limit, mip_rel_gap)
    elapsed = time.perf_counter() - t0
    if choice is not None and res.status == 0:
        status, fallback = "optimal", False
        gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    else:  # stopped early (or no plan): keep the best of the incumbent and heuristics
        sub_limit = max(time_limit / 4, ONE_AXIS_MIN_SECONDS)
        plans = _one_axis_plans(problem, jaxpr, mesh, eqns, amortize, tied, sub_limit, mip_rel_gap)
        choice, label, objective = _best_candidate(
            problem, mesh, memory_budget, choice, seeds, plans
        )
        fallback = label != "the ILP's incumbent"
        status = f"stopped: {res.message}; kept {label}"
        gap = _gap(objective, getattr(res, "mip_dual_bound", None))
        elapsed = time.perf_counter() - t0  # the one-axis solves too
    return _solution(problem, choice, mesh, size, elapsed, gap, fallback, status)


def _ties(problem: _Problem, tied) -> list:
    """The (node, output) pairs of the var id pairs ``tied`` that can hold: both sides
    in separate nodes, sharing a layout.  A pin can rule that out (a state pinned one
    way in and another way out): the pin holds, the tie is dropped, and the next step
    reads the value resharded, where the tie made the ILP infeasible."""
    out = []
    for a, b in tied:
        if a not in problem.source or b not in problem.source:
            continue
        (n1, k1), (n2, k2) = problem.source[a], problem.source[b]
        if (n1, k1) == (n2, k2):
            continue
        lays1 = {s.outs[k1] for s in problem.nodes[n1].strategies}
        if any(s.outs[k2] in lays1 for s in problem.nodes[n2].strategies):
            out.append(((n1, k1), (n2, k2)))
    return out


def _gap(objective: float, bound) -> float:
    """Relative gap of ``objective`` to the solver's lower bound (nan: no bound)."""
    if bound is None or not np.isfinite(bound) or objective <= 0:
        return float("nan")
    return max(0.0, (objective - float(bound)) / objective)


def _comm_seconds(problem: _Problem, choice, comms, mesh: LogicalMesh) -> float:
    """Seconds of ``comms`` as the objective prices them: combinable all-reduces pay
    their latency once per combiner group."""
    saved = sum(float(n.saved[j]) for n, j in zip(problem.nodes, choice, strict=True) if n.groups)
    return mesh.comm_time(c for _, c in comms) - saved + _group_seconds(problem, choice)


def _solution(problem, choice, mesh, size, elapsed, gap, fallback, status) -> ShardingSolution:
    objective, comms, memory = _evaluate(problem, choice, mesh)
    comm = _comm_seconds(problem, choice, comms, mesh)
    specs = {
        v: to_spec(problem.nodes[n].strategies[choice[n]].outs[k])
        for v, (n, k) in problem.source.items()
    }
    notes = tuple(sorted(set(problem.notes)))
    return ShardingSolution(
        specs, objective, comms, size, elapsed, gap, fallback, status, memory, str(mesh), notes,
        comm, _operand_specs(problem, choice),
    )  # fmt: skip


def _operand_specs(problem: _Problem, choice) -> tuple[tuple[int, int, Spec], ...]:
    """(equation, operand position, spec) of every resharding edge of ``choice``: where
    the plan prices a reshard of an operand, the program pins it there, so XLA reshards
    that operand (it may otherwise keep the operand and reshard the result instead)."""
    nodes, out = problem.nodes, []
    for e in problem.edges:
        src = nodes[e.src].strategies[choice[e.src]].outs[e.src_out]
        dst = nodes[e.dst].strategies[choice[e.dst]].ins[e.dst_in]
        if dst is not None and src != dst and nodes[e.dst].eqn >= 0:
            out.append((nodes[e.dst].eqn, e.dst_in, to_spec(dst)))
    return tuple(sorted(set(out)))


def _apply_pins(problem: _Problem, pins: Mapping[int, Spec], jaxpr, mesh) -> None:
    by_id = {i: v for v, i in var_ids(jaxpr).items()}
    for vid, spec in pins.items():
        if vid not in problem.source:
            raise MeshshardInputError(
                f"pins: value %{vid} is not computed or read by this stage; pin a value of it"
            )
        n, k = problem.source[vid]
        shape = tuple(by_id[vid].aval.shape)
        lay = _pin_layout(spec, shape, mesh, f"%{vid}")
        keep = [s for s in problem.nodes[n].strategies if s.outs[k] == lay]
        if not keep:
            raise MeshshardInputError(
                f"pins: %{vid} cannot be produced as {spec_str(tuple(spec))} on mesh {mesh}"
            )
        _restrict(problem.nodes, problem.edges, n, keep, mesh)
    if pins:
        _refresh_memory(problem, mesh)


def estimate_stage_cost(
    jaxpr,
    mesh: LogicalMesh,
    cluster: ClusterSpec | None = None,
    memory_budget: float | None = None,
    *,
    eqns: Sequence[int] | None = None,
) -> StageCost:
    """A cheap stage cost for searches over many (stage, mesh) pairs: the greedy plan's
    predicted seconds (compute and communication apart) and peak bytes, no ILP."""
    jaxpr = _jaxpr(jaxpr)
    problem = _build(jaxpr, mesh, eqns, {})
    choice = _greedy(problem)
    objective, comms, memory = _evaluate(problem, choice, mesh)
    comm = _comm_seconds(problem, choice, comms, mesh)
    if memory_budget is None and cluster is not None:
        memory_budget = cluster.device_memory
    fits = memory_budget is None or memory <= memory_budget
    return StageCost(objective, objective - comm, comm, memory, fits)
