"""Analytic per-stage costs for the stage DP: layers on a submesh under a logical (dp, tp) view.

The stage DP (:mod:`~meshshard.passes.stage_dp`) asks one question of a cost model::

    cost(lo, hi, submesh, logical) -> StageCost(seconds, allreduce_s, state_bytes, act_bytes)

for layers ``lo..hi-1`` on a submesh ``(hosts, devices)`` viewed as ``dp x tp`` devices.
This module answers it from :class:`LayerStats` (per layer, per micro-batch) with the
simulator's device roofline and alpha-beta collectives of the :class:`ClusterSpec`:

* compute: forward + backward FLOPs over ``dp * tp`` devices at the compute dtype's peak
  (or the memory roofline when heavier);
* tensor parallelism (Megatron pairs): the all-reduces :func:`layer_stats` counted, each
  over the ``tp`` devices of one host, on the activations of one data-parallel shard;
* collectives priced by :meth:`LogicalMesh.collective_time` (the simulator's alpha-beta
  ring closed forms, the same price the sharding ILP pays);
* data parallelism: one all-reduce of the stage's gradients (``1/tp`` of its parameter
  bytes) over the ``dp`` replicas per step (accumulated locally between micro-batches),
  hierarchical across hosts;
* memory per device: parameter state (weights, gradients, optimizer) over ``tp``, plus
  each in-flight micro-batch's saved activations over ``dp * tp``.

:class:`~meshshard.passes.stage_ilp_cost.IlpCost` answers the same question from the
sharding ILP's plan of each layer instead (Alpa's intra-op pass inside the stage DP).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.passes.layer_cluster import HEAVY, aval_nbytes, eqn_flops
from meshshard.passes.shard_costs import LogicalMesh

__all__ = ["LayerStats", "StageCost", "CostOptions", "layer_stats", "AnalyticCost"]

_VIEW = ("convert_element_type", "reshape", "transpose", "broadcast_in_dim", "copy")


@dataclass(frozen=True)
class LayerStats:
    """One layer's work for one micro-batch (global, before any sharding).

    ``tp_fwd_bytes``/``tp_bwd_bytes``: bytes all-reduced over the tensor-parallel group
    in the forward/backward pass when the layer's weight matmuls are split Megatron-style.
    ``out_bytes``: activations sent to the next layer (0 for the last).
    """

    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float
    param_count: int
    param_bytes: int
    act_bytes: int
    out_bytes: int
    tp_fwd_bytes: int = 0
    tp_bwd_bytes: int = 0

    def __str__(self) -> str:
        return (
            f"{self.flops_fwd:.3g}+{self.flops_bwd:.3g} FLOPs, {self.param_count:,} params, "
            f"act {self.act_bytes / 2**20:.1f} MiB, out {self.out_bytes / 2**20:.1f} MiB"
        )


@dataclass(frozen=True)
class StageCost:
    """Per micro-batch seconds, per-step all-reduce seconds and per-device bytes of a stage."""

    seconds: float
    allreduce_s: float
    state_bytes: float
    act_bytes: float
    transient_bytes: float = 0.0  # held once, whatever is in flight (a recomputed layer)

    def memory(self, in_flight: int) -> float:
        """Peak bytes per device with ``in_flight`` micro-batches' activations held."""
        return self.state_bytes + self.transient_bytes + in_flight * self.act_bytes


@dataclass(frozen=True)
class CostOptions:
    """How the traced model maps to the trained one.

    Args:
        compute_dtype: dtype whose peak FLOP/s applies (``float16`` for mixed precision).
        bytes_per_param: device bytes of state per parameter (16 = fp16 weight and
            gradient + fp32 master weight and two Adam moments, Megatron's accounting).
        act_scale: traced activation bytes x this (0.5: traced in float32, run in fp16).
        memory_fraction: share of device memory a plan may use.
        zero: shard the optimizer state over data-parallel replicas (ZeRO-1/2) too.
        remat: recompute each layer in the backward pass (Megatron's full activation
            recomputation): a micro-batch in flight keeps only each layer's input, one
            layer's activations are live at a time, and the forward runs twice.
    """

    compute_dtype: str = "float32"
    bytes_per_param: float = 16.0
    act_scale: float = 1.0
    memory_fraction: float = 0.9
    zero: bool = False
    remat: bool = False


def _param_derived(jaxpr, params: Collection[int]) -> set:
    out = {v for i, v in enumerate(jaxpr.invars) if i in params}
    for e in jaxpr.eqns:
        if e.primitive.name in _VIEW and any(v in out for v in e.invars if not hasattr(v, "val")):
            out.update(e.outvars)
    return out


def _tp_groups(jaxpr, params: Collection[int]) -> dict[int, tuple[str, int]]:
    """Equation index -> ("col"|"row", bytes all-reduced) for Megatron-split weight ops.

    Weight matmuls reading the same activation form one group; groups alternate column-
    then row-parallel.  A column group all-reduces its input's gradient (backward), a row
    group its output (forward); an embedding lookup (gather from a weight) is row-like.
    """
    derived = _param_derived(jaxpr, params)
    groups: dict = {}
    out: dict[int, tuple[str, int]] = {}
    parity = 0
    for i, e in enumerate(jaxpr.eqns):
        ins = [v for v in e.invars if not hasattr(v, "val")]
        if e.primitive.name == "gather" and ins and ins[0] in derived:
            out[i] = ("row", aval_nbytes(e.outvars[0].aval))
            parity = 0
            continue
        if e.primitive.name != "dot_general" or not any(v in derived for v in ins):
            continue
        act = next((v for v in ins if v not in derived), None)
        if act is None:
            continue
        if act in groups:
            continue  # same group as an earlier matmul of this activation
        kind = "col" if parity == 0 else "row"
        groups[act] = kind
        parity ^= 1
        nbytes = aval_nbytes(act.aval) if kind == "col" else aval_nbytes(e.outvars[0].aval)
        out[i] = (kind, nbytes)
    return out


def layer_stats(
    jaxpr, cuts: Sequence[int], params: Collection[int], bwd_factor: float = 2.0
) -> tuple[LayerStats, ...]:
    """Per-layer :class:`LayerStats` of a forward (loss) jaxpr cut at ``cuts``.

    ``params``: indices of the jaxpr inputs that are trained parameters.  Backward FLOPs
    are ``bwd_factor`` times the forward's (two matmuls per forward matmul).
    """
    from meshshard.passes.layer_cluster import crossing_bytes

    n = len(jaxpr.eqns)
    bounds = [0, *cuts, n]
    cross = crossing_bytes(jaxpr)
    tp = _tp_groups(jaxpr, params)
    derived = _param_derived(jaxpr, params)
    first_use: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not hasattr(v, "val"):
                first_use.setdefault(v, i)
    param_vars = [v for i, v in enumerate(jaxpr.invars) if i in params]
    out = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        eqns = jaxpr.eqns[a:b]
        flops = sum(eqn_flops(e) for e in eqns)
        touched = sum(aval_nbytes(v.aval) for e in eqns for v in (*e.invars, *e.outvars))
        mine = [v for v in param_vars if a <= first_use.get(v, -1) < b]
        acts = _saved(eqns, derived)
        fwd = sum(nb for i, (kind, nb) in tp.items() if a <= i < b and kind == "row")
        bwd = sum(nb for i, (kind, nb) in tp.items() if a <= i < b and kind == "col")
        out.append(
            LayerStats(
                flops_fwd=flops,
                flops_bwd=bwd_factor * flops,
                bytes_fwd=float(touched),
                param_count=sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in mine),
                param_bytes=sum(aval_nbytes(v.aval) for v in mine),
                act_bytes=int(acts),
                out_bytes=int(cross[b]) if b < n else 0,
                tp_fwd_bytes=int(fwd),
                tp_bwd_bytes=int(bwd),
            )
        )
    return tuple(out)


_NONLINEAR = ("exp", "tanh", "logistic", "erf", "log", "rsqrt", "integer_pow")


def _saved(eqns, derived: set) -> int:
    """Bytes the backward pass keeps (an estimate, as JAX's AD saves): each activation
    read by a matmul or a convolution once, and the outputs of nonlinear functions."""
    seen: set = set()
    total = 0
    for e in eqns:
        if e.primitive.name in HEAVY:
            vals = [v for v in e.invars if not hasattr(v, "val") and v not in derived]
        elif e.primitive.name in _NONLINEAR:
            vals = list(e.outvars)
        else:
            continue
        for v in vals:
            if v not in seen and np.issubdtype(v.aval.dtype, np.floating):
                seen.add(v)
                total += aval_nbytes(v.aval)
    return total


def ring_allreduce_s(nbytes: float, members: int, bandwidth: float, latency: float) -> float:
    """All-reduce of ``nbytes`` over ``members`` devices on links of ``bandwidth`` and
    ``latency``, priced by the one collective model of the compiler
    (:meth:`~meshshard.passes.shard_costs.LogicalMesh.collective_time`, the closed form of
    the simulator's ring), which the sharding ILP uses too."""
    mesh = LogicalMesh(("ring",), (max(1, int(members)),), (latency,), (1.0 / bandwidth,))
    return mesh.collective_time("all-reduce", ("ring",), nbytes)


class AnalyticCost:
    """The default stage cost model (module docstring); precomputes prefix sums of layers."""

    def __init__(
        self,
        layers: Sequence[LayerStats],
        cluster: ClusterSpec,
        options: CostOptions = CostOptions(),
    ):
        self.layers = tuple(layers)
        self.cluster = cluster
        self.options = options
        fields = (
            "flops_fwd",
            "flops_bwd",
            "bytes_fwd",
            "param_count",
            "param_bytes",
            "act_bytes",
            "tp_fwd_bytes",
            "tp_bwd_bytes",
        )
        self._pre = {
            f: np.concatenate([[0.0], np.cumsum([float(getattr(s, f)) for s in layers])])
            for f in fields
        }

    def total(self, field: str, lo: int, hi: int) -> float:
        return float(self._pre[field][hi] - self._pre[field][lo])

    def dp_allreduce_s(self, nbytes: float, submesh: tuple[int, int], dp: int) -> float:
        """Hierarchical all-reduce of ``nbytes`` over ``dp`` replicas laid over ``submesh``."""
        c = self.cluster
        hosts, devs = submesh
        if dp <= 1:
            return 0.0
        per_host = max(1, dp // hosts)  # replicas on each host
        (host_alpha, host_bw), (dev_alpha, dev_bw) = c.mesh_collective()
        intra = ring_allreduce_s(nbytes, per_host, dev_bw, dev_alpha)
        if hosts <= 1:
            return intra
        inter = ring_allreduce_s(nbytes, hosts, host_bw, host_alpha)
        return intra + inter

    def __call__(
        self, lo: int, hi: int, submesh: tuple[int, int], logical: tuple[int, int]
    ) -> StageCost:
        """Cost of layers ``lo..hi-1`` on ``submesh`` viewed as ``logical = (dp, tp)``."""
        c, o = self.cluster, self.options
        dp, tp = logical
        n = dp * tp
        flops = self.total("flops_fwd", lo, hi) * (2 if o.remat else 1)
        flops += self.total("flops_bwd", lo, hi)
        compute = flops / n / c.flops_for(o.compute_dtype)
        memory_traffic = 3 * self.total("bytes_fwd", lo, hi) * o.act_scale / n / c.memory_bandwidth
        t = max(compute, memory_traffic) + 2 * c.launch_overhead
        if tp > 1:
            _, (dev_alpha, dev_bw) = c.mesh_collective()  # inside the stage's programs
            tp_bytes = self.total("tp_fwd_bytes", lo, hi) + self.total("tp_bwd_bytes", lo, hi)
            t += ring_allreduce_s(tp_bytes * o.act_scale / dp, tp, dev_bw, dev_alpha)
        grads = self.total("param_count", lo, hi) * 2.0 / tp  # fp16/bf16-sized gradients
        if o.compute_dtype == "float32":
            grads *= 2
        allreduce = self.dp_allreduce_s(grads, submesh, dp)
        state_per_param = o.bytes_per_param
        if o.zero and dp > 1:  # optimizer state (all but weight + gradient) over dp
            state_per_param = 4 + (o.bytes_per_param - 4) / dp
        state = self.total("param_count", lo, hi) * state_per_param / tp
        if not o.remat:
            acts = self.total("act_bytes", lo, hi) * o.act_scale / n
            return StageCost(t, allreduce, state, acts)
        inputs = sum(self.layers[i - 1].out_bytes for i in range(max(lo, 1), hi))
        biggest = max(self.layers[i].act_bytes for i in range(lo, hi))
        return StageCost(t, allreduce, state, inputs * o.act_scale / n, biggest * o.act_scale / n)


def step_layer_stats(traced, slicing) -> tuple[LayerStats, ...]:
    """Per-layer :class:`LayerStats` of a traced train step sliced into layers: FLOPs of
    each layer's forward and backward equations, the parameters its forward reads, the
    activations its forward keeps and the values crossing the boundary after it."""
    from meshshard.jaxpr_util import is_marker
    from meshshard.passes.slicing import BWD, FWD

    jaxpr = traced.jaxpr
    state = {v for v, info in zip(jaxpr.invars, traced.inputs, strict=False) if not info.is_batch}
    params = {i for i, v in enumerate(jaxpr.invars) if v in state}
    derived = _param_derived(jaxpr, params)
    tp = _tp_groups(jaxpr, params)
    crossing = {
        e.params["index"]: sum(aval_nbytes(v.aval) for v in e.invars if not hasattr(v, "val"))
        for e in jaxpr.eqns
        if is_marker(e, "fwd")
    }
    out = []
    for layer in range(slicing.num_layers):
        f_idx, b_idx = slicing.eqns(layer, FWD), slicing.eqns(layer, BWD)
        f_eqns = [jaxpr.eqns[i] for i in f_idx]
        read = {v for e in f_eqns for v in e.invars if not hasattr(v, "val") and v in state}
        count = sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in read)
        out.append(
            LayerStats(
                flops_fwd=sum(eqn_flops(e) for e in f_eqns),
                flops_bwd=sum(eqn_flops(jaxpr.eqns[i]) for i in b_idx),
                bytes_fwd=float(
                    sum(aval_nbytes(v.aval) for e in f_eqns for v in (*e.invars, *e.outvars))
                ),
                param_count=count,
                param_bytes=sum(aval_nbytes(v.aval) for v in read),
                act_bytes=_saved(f_eqns, derived),
                out_bytes=int(crossing.get(layer, 0)),
                tp_fwd_bytes=sum(nb for i, (k, nb) in tp.items() if i in f_idx and k == "row"),
                tp_bwd_bytes=sum(nb for i, (k, nb) in tp.items() if i in f_idx and k == "col"),
            )
        )
    return tuple(out)
