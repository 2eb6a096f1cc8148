"""Stage costs from the sharding ILP: each layer's intra-op plan, memoised per signature.

:class:`IlpCost` answers the stage DP's question (``cost(lo, hi, submesh, (dp, tp))``,
:mod:`~meshshard.passes.stage_dp`) like :class:`~meshshard.passes.stage_cost.AnalyticCost`
but from the plan :func:`~meshshard.passes.shard_ilp.solve_stage` chooses for each layer's
forward equations (Alpa's intra-op pass run inside the inter-op DP):

* forward seconds: the ILP's objective (compute over each strategy's split, memory
  traffic, its collectives and resharding edges, alpha-beta per mesh axis); backward:
  twice the forward's compute and the forward's collectives again (each Megatron-style
  all-reduce of the forward has one in the backward);
* per step: each parameter's gradient all-reduced over the devices its chosen spec
  leaves it replicated on;
* per device: parameter state over the shards of its spec; saved activations (the
  values :func:`~meshshard.passes.stage_cost.layer_stats` counts) over theirs.

The ILP runs once per distinct *layer signature* (the layer's equations with their
shapes, dtypes and parameters, variables renamed by position) and ``tp``: on ``tp``
devices of one host (one mesh axis at the fabric's alpha-beta), where it may split the
batch, the weights or both.  A view ``(dp, tp)`` of a submesh runs that plan on ``1/dp``
of each micro-batch (compute, activation collectives and saved activations over ``dp``)
and all-reduces every gradient over the ``dp`` replicas once per step, hierarchically
across hosts.  Solving the two-axis ILP per view instead (Alpa's logical meshes) was
tried: for a GPT-1.3B layer it has ~17,000 variables against ~1,300, took 3-6 s per solve
on this machine and, under load, hit the time limit (greedy fallbacks), for plans that
differ from the composition only in which axis carries the batch.  A layer's plan is
costed alone: resharding between consecutive layers of one stage is left out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_literal, itemsize, var_ids
from meshshard.passes.layer_cluster import HEAVY
from meshshard.passes.meshes import logical_shapes
from meshshard.passes.shard_costs import LogicalMesh
from meshshard.passes.shard_ilp import solve_stage
from meshshard.passes.shard_rules import from_spec, shards
from meshshard.passes.stage_cost import (
    _NONLINEAR,
    AnalyticCost,
    CostOptions,
    LayerStats,
    StageCost,
    _param_derived,
)

__all__ = ["LayerPlanCost", "IlpCost", "layer_signature", "tp_mesh"]


@dataclass(frozen=True)
class LayerPlanCost:
    """One layer's costs under its ILP plan on one logical mesh (per device).

    ``grad_bytes``: (replicated axes, bytes) of the gradients to all-reduce once per step.
    """

    fwd_s: float
    comm_s: float
    grad_bytes: tuple[tuple[tuple[str, ...], float], ...]
    state_bytes: float
    act_bytes: float
    solve_s: float
    gap: float
    fallback: bool

    @property
    def seconds(self) -> float:
        """Forward and backward seconds of one micro-batch."""
        compute = self.fwd_s - self.comm_s
        return 3 * compute + 2 * self.comm_s


def layer_signature(jaxpr, eqns: Sequence[int], params: Collection) -> tuple:
    """A hashable key equal for layers with the same equations up to variable names:
    each operand is named by where it comes from (an earlier equation of the layer and
    output index, or the k-th outside input, marked when it is a parameter)."""
    where: dict = {}
    outside: dict = {}
    key = []
    for pos, i in enumerate(eqns):
        e = jaxpr.eqns[i]
        ins = []
        for v in e.invars:
            if is_literal(v):
                ins.append(("lit", str(v.aval), repr(v.val)))
            elif v in where:
                ins.append(where[v])
            else:
                ref = outside.setdefault(v, ("in", len(outside), v in params, str(v.aval)))
                ins.append(ref)
        for k, v in enumerate(e.outvars):
            where[v] = ("eq", pos, k)
        outs = tuple(str(v.aval) for v in e.outvars)
        prm = tuple(sorted((k, str(val)) for k, val in e.params.items()))
        key.append((e.primitive.name, tuple(ins), outs, prm))
    return tuple(key)


def tp_mesh(tp: int, cluster: ClusterSpec, options: CostOptions) -> LogicalMesh:
    """The ILP's mesh: ``tp`` devices of one host on one axis (``device``).  Bytes are
    priced at ``act_scale`` (traced in float32, run in half precision)."""
    s = options.act_scale
    (host_alpha, host_bw), (dev_alpha, dev_bw) = cluster.mesh_collective()
    return LogicalMesh(
        axes=("host", "device"),
        shape=(1, int(tp)),
        alpha=(host_alpha, dev_alpha),
        beta=(s / host_bw, s / dev_bw),
        peak_flops=cluster.flops_for(options.compute_dtype),
        memory_bandwidth=cluster.memory_bandwidth / s,
    )


class IlpCost(AnalyticCost):
    """Stage costs from per-layer sharding ILP plans (module docstring).

    Args:
        jaxpr: the forward (loss) jaxpr.
        layer_eqns: each layer's forward equation indices, in order.
        params: the jaxpr input variables (or indices of ``jaxpr.invars``) that are
            trained parameters.
        layers: the same layers' :class:`LayerStats` (FLOPs and boundary bytes, used by
            the resharding between stages and by recomputation).
        time_limit: seconds per ILP solve (HiGHS); its gap is kept per solve.
    """

    def __init__(
        self,
        jaxpr,
        layer_eqns: Sequence[Sequence[int]],
        params: Collection,
        layers: Sequence[LayerStats],
        cluster: ClusterSpec,
        options: CostOptions | None = None,
        *,
        time_limit: float = 10.0,
        mip_rel_gap: float = 1e-2,
    ):
        super().__init__(layers, cluster, options or CostOptions())
        self.jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        inv = self.jaxpr.invars
        self.params = {inv[p] if isinstance(p, int) else p for p in params}
        self.layer_eqns = tuple(tuple(e) for e in layer_eqns)
        self.time_limit, self.mip_rel_gap = time_limit, mip_rel_gap
        self._ids = var_ids(self.jaxpr)
        derived_of = {i for i, v in enumerate(inv) if v in self.params}
        self._derived = _param_derived(self.jaxpr, derived_of)
        sigs = [layer_signature(self.jaxpr, e, self.params) for e in self.layer_eqns]
        first: dict = {}
        self._rep = tuple(first.setdefault(s, i) for i, s in enumerate(sigs))
        self._memo: dict = {}  # shared by copies (e.g. one with other CostOptions)
        self._work = {"solves": 0, "seconds": 0.0}

    @property
    def solves(self) -> int:
        """ILP solves run so far (this model and its copies)."""
        return self._work["solves"]

    @property
    def solve_seconds(self) -> float:
        """Wall seconds of those solves."""
        return self._work["seconds"]

    @property
    def distinct_layers(self) -> int:
        """How many layer signatures the ILP solves for (per mesh)."""
        return len(set(self._rep))

    def views(self, submesh: tuple[int, int]) -> tuple[tuple, ...]:
        """The stage DP's choices on ``submesh``: each logical ``(dp, tp)`` view with the
        ILP's fastest plan (``"fast"``) and, when ``tp > 1``, its plan under a memory
        budget that makes it shard the parameters over ``tp`` (``"lean"``)."""
        out = []
        for dp, tp in logical_shapes(submesh, self.cluster.devices_per_host):
            out.append((dp, tp, "fast"))
            if tp > 1:
                out.append((dp, tp, "lean"))
        return tuple(out)

    def layer_cost(self, layer: int, submesh, view) -> LayerPlanCost:
        """``layer`` on ``view = (dp, tp[, plan])`` of ``submesh``: the ILP's plan on ``tp``
        devices run on ``1/dp`` of the micro-batch, each parameter's gradient all-reduced
        over the ``dp`` replicas (and over ``tp`` where the plan replicates it)."""
        dp, tp = view[:2]
        lean = len(view) > 2 and view[2] == "lean"
        one = self._plan(layer, tp, lean)[1]
        o = self.options
        state = one.state_bytes
        if o.zero and dp > 1:  # optimizer state (all but weight + gradient) over dp
            state = state * (4 + (o.bytes_per_param - 4) / dp) / o.bytes_per_param
        local = sum(nb for axes, nb in one.grad_bytes if axes == ("all",))
        grads = tuple(g for g in one.grad_bytes if g[0] != ("all",))
        if dp > 1:
            grads = (*grads, (("dp",), local))
        return LayerPlanCost(
            one.fwd_s / dp, one.comm_s / dp, grads, state, one.act_bytes / dp,
            one.solve_s, one.gap, one.fallback,
        )  # fmt: skip

    def _plan(self, layer: int, tp: int, lean: bool):
        """(solution, cost) of the layer's signature on ``tp`` devices (memoised)."""
        key = (self._rep[layer], tp, lean)
        if key not in self._memo:
            mesh = tp_mesh(tp, self.cluster, self.options)
            budget = None
            if lean:
                fast = self._plan(layer, tp, False)[0]
                budget = self._lean_budget(fast, layer, mesh)
                if budget is None:  # nothing replicated over tp: the fast plan is lean
                    self._memo[key] = self._memo[(self._rep[layer], tp, False)]
                    return self._memo[key]
            self._memo[key] = self._solve(self._rep[layer], mesh, budget)
        return self._memo[key]

    def _lean_budget(self, sol, layer: int, mesh: LogicalMesh) -> float | None:
        """Bytes per device (the ILP's accounting) that the fast plan ``sol`` exceeds
        unless its parameters replicated over ``device`` are split over it (90% of the
        saving asked), or None when none is replicated there."""
        tp = mesh.size(("device",))
        eqns = self.layer_eqns[self._rep[layer]]
        used = {v for i in eqns for v in self.jaxpr.eqns[i].invars if not is_literal(v)}
        saving = 0.0
        for v in (p for p in self.jaxpr.invars if p in self.params and p in used):
            n_shards, repl = self._split(sol, v, mesh)
            if "device" in repl and len(v.aval.shape) >= 1:
                nbytes = math.prod(v.aval.shape) * itemsize(v.aval.dtype) / n_shards
                saving += nbytes * (1 - 1 / tp)
        if tp <= 1 or saving <= 0:
            return None
        return sol.memory - 0.9 * saving

    def _solve(self, layer: int, mesh: LogicalMesh, budget: float | None = None):
        t0 = time.perf_counter()
        eqns = self.layer_eqns[layer]
        try:
            sol = solve_stage(
                self.jaxpr, mesh, None, budget, eqns=eqns, time_limit=self.time_limit,
                mip_rel_gap=self.mip_rel_gap,
            )  # fmt: skip
        except MeshshardInputError:  # no plan that lean: the fastest plan again
            sol = solve_stage(
                self.jaxpr, mesh, None, eqns=eqns, time_limit=self.time_limit,
                mip_rel_gap=self.mip_rel_gap,
            )  # fmt: skip
        self._work["solves"] += 1
        self._work["seconds"] += time.perf_counter() - t0
        return sol, self._costs(sol, eqns, mesh)

    def _costs(self, sol, eqns, mesh: LogicalMesh) -> LayerPlanCost:
        o = self.options
        grad_scale = (4.0 if o.compute_dtype == "float32" else 2.0) / 4.0  # traced float32
        grads: dict = {}
        state = 0.0
        used = {v for i in eqns for v in self.jaxpr.eqns[i].invars if not is_literal(v)}
        for v in (p for p in self.jaxpr.invars if p in self.params and p in used):
            n_shards, repl = self._split(sol, v, mesh)
            count = math.prod(v.aval.shape) / n_shards
            nbytes = count * itemsize(v.aval.dtype) * grad_scale
            grads[("all",)] = grads.get(("all",), 0.0) + nbytes  # every local gradient
            if repl:
                grads[repl] = grads.get(repl, 0.0) + nbytes
            state += count * o.bytes_per_param
        acts = sum(
            math.prod(v.aval.shape) * itemsize(v.aval.dtype) / self._split(sol, v, mesh)[0]
            for v in self._saved(eqns)
        )
        comm = sol.comm_seconds
        return LayerPlanCost(
            sol.objective, comm, tuple(sorted(grads.items())), state, acts * o.act_scale,
            sol.solve_time, sol.gap, sol.fallback,
        )  # fmt: skip

    def _split(self, sol, v, mesh: LogicalMesh) -> tuple[int, tuple[str, ...]]:
        """Shards of ``v`` under the solution and the split mesh axes it is replicated on."""
        spec = sol.specs.get(self._ids[v], ())
        layout = from_spec(tuple(spec), len(v.aval.shape))
        used = {a for axes in layout for a in axes}
        repl = tuple(a for a in mesh.axes if mesh.size((a,)) > 1 and a not in used)
        return shards(layout, mesh), repl

    def _saved(self, eqns: Sequence[int]) -> list:
        """The values the backward keeps (as ``stage_cost._saved`` counts them)."""
        seen: dict = {}
        for i in eqns:
            e = self.jaxpr.eqns[i]
            if e.primitive.name in HEAVY:
                vals = [v for v in e.invars if not is_literal(v) and v not in self._derived]
            elif e.primitive.name in _NONLINEAR:
                vals = list(e.outvars)
            else:
                continue
            for v in vals:
                if np.issubdtype(v.aval.dtype, np.floating):
                    seen.setdefault(v, None)
        return list(seen)

    def _grad_allreduce_s(self, grads, submesh, view) -> float:
        """Per step: the summed gradients of each group, all-reduced once: over the
        ``dp`` replicas hierarchically (across hosts when the submesh spans them), and
        over the ``tp`` devices of a host for what the plan replicates there."""
        dp, tp = view[:2]
        mesh = tp_mesh(tp, self.cluster, self.options)
        total = 0.0
        for axes, nbytes in grads:
            if axes == ("dp",):
                total += self.dp_allreduce_s(nbytes, submesh, dp)
            elif "device" in axes:
                total += mesh.collective_time(
                    "all-reduce", ("device",), nbytes / self.options.act_scale
                )
        return total

    def __call__(self, lo: int, hi: int, submesh, logical) -> StageCost:
        """Cost of layers ``lo..hi-1`` on ``submesh`` viewed as ``logical = (dp, tp)``."""
        o = self.options
        per = [self.layer_cost(i, submesh, logical) for i in range(lo, hi)]
        seconds = sum(p.seconds for p in per) + 2 * self.cluster.launch_overhead
        if o.remat:
            seconds += sum(p.fwd_s - p.comm_s for p in per)
        grads: dict = {}
        for p in per:
            for axes, nb in p.grad_bytes:
                grads[axes] = grads.get(axes, 0.0) + nb
        allreduce = self._grad_allreduce_s(sorted(grads.items()), submesh, logical)
        state = sum(p.state_bytes for p in per)
        if not o.remat:
            return StageCost(seconds, allreduce, state, sum(p.act_bytes for p in per))
        n = logical[0] * logical[1]
        inputs = sum(self.layers[i - 1].out_bytes for i in range(max(lo, 1), hi))
        biggest = max(p.act_bytes for p in per)
        return StageCost(seconds, allreduce, state, inputs * o.act_scale / n, biggest)

    def summary(self) -> str:
        """ILP work done so far: solves, their seconds, worst gap, greedy fallbacks."""
        sols = [c for _, c in self._memo.values()]
        gaps = [p.gap for p in sols if not p.fallback and not math.isnan(p.gap)]
        falls = sum(p.fallback for p in sols)
        return (
            f"stage costs from the sharding ILP: {len(self.layers)} layers, "
            f"{self.distinct_layers} distinct, {self.solves} solves in "
            f"{self.solve_seconds:.1f} s, worst gap {max(gaps, default=0.0):.2%}, "
            f"{falls} greedy fallbacks"
        )
