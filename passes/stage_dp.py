"""Pass: layers -> stages -> submeshes, by Alpa's ``training_dp`` with communication in the cost.

Given per-layer costs (:mod:`~meshshard.passes.stage_cost`), the DP chooses how to split
``L`` layers into consecutive stages, the submesh shape of each stage (from
:func:`~meshshard.passes.meshes.submesh_choices`, which tile the cluster when their device
counts add up to it) and each stage's logical ``(dp, tp)`` view, minimising the 1F1B
iteration time::

    T = sum_s c_s + (M - 1) * max_s c_s + max_s a_s

``c_s`` is stage ``s``'s time per micro-batch (compute, tensor-parallel all-reduces, and
the cross-mesh resharding of its output activation forward and its gradient backward,
planned by :mod:`meshshard.resharding` between the two submeshes), ``a_s`` its data-
parallel gradient all-reduce once per step.  Memory enters as Alpa's: the stage ``s``
of ``S`` holds ``S - s`` micro-batches' activations under 1F1B; configurations that do
not fit are left out.

The DP (``f[s][l][d][m]``: layers ``l..`` in ``s`` stages on ``d`` devices, the first on
submesh ``m``) is Alpa's with the next stage's submesh in the state, so the resharding
time between the two is exact rather than ignored (alpa #459).  As in Alpa, an outer loop
sweeps ``t_max`` (the bound on every ``c_s``) upward from the smallest feasible value and
stops once ``M * t_max`` exceeds the best plan; candidate ``t_max`` values are rounded up
to a geometric grid of ratio ``1 + tolerance``.  ``a_s`` enters the DP amortised
(``a_s / M`` per micro-batch) and every plan the sweep produces is then scored with ``T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.meshes import logical_shapes, submesh_choices
from meshshard.passes.stage_cost import AnalyticCost, StageCost

__all__ = [
    "Stage",
    "StagePlan",
    "reshard_seconds",
    "evaluate",
    "stage_dp",
    "grid_plan",
    "grid_plans",
]


@dataclass(frozen=True)
class Stage:
    """Layers ``lo..hi-1`` on a ``submesh`` (hosts, devices) viewed as ``logical`` (dp, tp);
    a cost model with several plans per view (``cost.views``) adds the plan's name."""

    lo: int
    hi: int
    submesh: tuple[int, int]
    logical: tuple[int, int]

    def __str__(self) -> str:
        h, d = self.submesh
        dp, tp = self.logical[:2]
        how = f" ({self.logical[2]})" if len(self.logical) > 2 else ""
        return f"layers {self.lo}..{self.hi - 1} on ({h},{d}) as dp{dp} x tp{tp}{how}"


@dataclass(frozen=True)
class StagePlan:
    """Stages in order with the predicted iteration time and its parts."""

    stages: tuple[Stage, ...]
    seconds: float
    stage_seconds: tuple[float, ...]
    allreduce_seconds: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    name: str = "auto"
    notes: tuple[str, ...] = ()

    @property
    def submeshes(self) -> tuple[tuple[int, int], ...]:
        return tuple(s.submesh for s in self.stages)

    def __str__(self) -> str:
        head = f"{self.name}: {len(self.stages)} stages, predicted {self.seconds * 1e3:.4g} ms/iter"
        rows = [
            f"  s{i}: {st}  {c * 1e3:.4g} ms/mb, allreduce {a * 1e3:.3g} ms, "
            f"{m / 2**30:.3g} GiB/device"
            for i, (st, c, a, m) in enumerate(
                zip(
                    self.stages,
                    self.stage_seconds,
                    self.allreduce_seconds,
                    self.peak_bytes,
                    strict=True,
                )
            )
        ]
        return "\n".join([head, *rows, *(f"  note: {n}" for n in self.notes)])


def _same_host(a: tuple[int, int], b: tuple[int, int], cluster: ClusterSpec) -> bool:
    return a[0] == 1 and b[0] == 1 and a[1] + b[1] <= cluster.devices_per_host


@lru_cache(maxsize=4096)
def _planned_seconds(
    src: tuple[int, int], dst: tuple[int, int], nbytes: int, cluster: ClusterSpec
) -> float:
    from meshshard.plan import MeshSpec
    from meshshard.resharding.estimate import estimate_makespan
    from meshshard.resharding.planner import plan_resharding
    from meshshard.tiles import resharding_problem

    rows = math.lcm(src[0] * src[1], dst[0] * dst[1])
    cols = max(1, nbytes // (2 * rows))
    a = MeshSpec(0, src, tuple(range(src[0])))
    b = MeshSpec(1, dst, tuple(range(src[0], src[0] + dst[0])))
    both = (("host", "device"),)
    p = resharding_problem((rows, cols), "float16", a, both, b, both)
    r = plan_resharding(p, "broadcast", cluster, simulate=False)
    return estimate_makespan(r.messages, cluster, r.gathers)


def reshard_seconds(
    nbytes: float, src: tuple[int, int], dst: tuple[int, int], cluster: ClusterSpec
) -> float:
    """Seconds to move a batch-sharded activation of ``nbytes`` from ``src`` to ``dst``.

    Across hosts: our resharding planner's messages, timed by its makespan estimate.
    Two submeshes sharing a host: each destination device copies its shard over the fabric.
    """
    if nbytes <= 0:
        return 0.0
    if _same_host(src, dst, cluster):
        per_device = nbytes / min(src[1], dst[1])
        return per_device / cluster.intra_bandwidth + cluster.intra_latency
    # quantise to 1/64 octave so the cache serves close sizes
    q = 2 ** (round(math.log2(nbytes) * 64) / 64)
    return _planned_seconds(src, dst, int(q), cluster)


Cost = Callable[[int, int, tuple[int, int], tuple[int, int]], StageCost]


def evaluate(
    stages: Sequence[Stage],
    cost: AnalyticCost,
    num_micro_batches: int,
    *,
    name: str = "plan",
    notes: tuple[str, ...] = (),
) -> StagePlan:
    """Score ``stages`` with the module's ``T`` (resharding included); no memory check."""
    m = num_micro_batches
    secs, ars, peaks = [], [], []
    for i, st in enumerate(stages):
        c = cost(st.lo, st.hi, st.submesh, st.logical)
        t = c.seconds
        if i + 1 < len(stages):
            nb = cost.layers[st.hi - 1].out_bytes * cost.options.act_scale
            t += 2 * reshard_seconds(nb, st.submesh, stages[i + 1].submesh, cost.cluster)
        secs.append(t)
        ars.append(c.allreduce_s)
        peaks.append(c.memory(min(len(stages) - i, m)))
    total = sum(secs) + (m - 1) * max(secs) + max(ars)
    return StagePlan(tuple(stages), total, tuple(secs), tuple(ars), tuple(peaks), name, notes)


def fits(plan: StagePlan, cost: AnalyticCost) -> bool:
    """Whether every stage's peak memory fits the device (with the options' margin)."""
    cap = cost.cluster.device_memory * cost.options.memory_fraction
    return all(p <= cap for p in plan.peak_bytes)


@dataclass(frozen=True)
class _Tables:
    """Per (stages-from-here s, l, l2, m): best logical view's time and its index."""

    sec: np.ndarray  # (S+1, L, L+1, K): c' = c + a/M of the best fitting view, inf if none
    view: np.ndarray  # (S+1, L, L+1, K): index into views[m]
    reshard: np.ndarray  # (L+1, K, K): forward + backward transfer at boundary l2
    views: tuple[tuple[tuple[int, int], ...], ...]


def _tables(cost: AnalyticCost, choices, m_batches: int, max_stages: int, how: str) -> _Tables:
    big_l, k = len(cost.layers), len(choices)
    views = tuple(_views(cost, c) if how == "all" else ((c[0] * c[1], 1),) for c in choices)
    v_max = max(len(v) for v in views)
    shape = (big_l, big_l + 1, k, v_max)
    t, st, ac = (np.full(shape, np.inf) for _ in range(3))
    for lo in range(big_l):
        for hi in range(lo + 1, big_l + 1):
            for mi, sub in enumerate(choices):
                for vi, view in enumerate(views[mi]):
                    c = cost(lo, hi, sub, view)
                    t[lo, hi, mi, vi] = c.seconds + c.allreduce_s / m_batches
                    st[lo, hi, mi, vi] = c.state_bytes + c.transient_bytes
                    ac[lo, hi, mi, vi] = c.act_bytes
    cap = cost.cluster.device_memory * cost.options.memory_fraction
    sec = np.full((max_stages + 1, big_l, big_l + 1, k), np.inf)
    view = np.zeros((max_stages + 1, big_l, big_l + 1, k), dtype=np.int64)
    for s in range(1, max_stages + 1):
        ok = np.where(st + min(s, m_batches) * ac <= cap, t, np.inf)
        view[s] = np.argmin(ok, axis=-1)
        sec[s] = np.min(ok, axis=-1)
    reshard = np.zeros((big_l + 1, k, k))
    for b in range(1, big_l):
        nb = cost.layers[b - 1].out_bytes * cost.options.act_scale
        for i, a in enumerate(choices):
            for j, c2 in enumerate(choices):
                reshard[b, i, j] = 2 * reshard_seconds(nb, a, c2, cost.cluster)
    return _Tables(sec, view, reshard, views)


def _views(cost, submesh: tuple[int, int]) -> tuple[tuple, ...]:
    """The logical views of ``submesh`` the cost model offers (``cost.views`` when it has
    several plans per view, else every ``(dp, tp)``)."""
    if hasattr(cost, "views"):
        return cost.views(submesh)
    return logical_shapes(submesh, cost.cluster.devices_per_host)


def _dp_once(tab: _Tables, sizes, n_dev: int, t_max: float, max_stages: int):
    """``f[s]`` for s = 1..: min sum of stage times (each <= t_max) and the argmins."""
    sec = tab.sec
    big_l, k = sec.shape[1], sec.shape[3]
    inf = np.inf
    later = np.arange(big_l + 1)[None, :] > np.arange(big_l)[:, None]  # (L, L+1)
    f = np.full((big_l + 1, n_dev + 1, k), inf)  # s = 1: the last stage
    last = np.where(sec[1][:, big_l, :] <= t_max, sec[1][:, big_l, :], inf)  # (L, K)
    for m in range(k):
        if sizes[m] <= n_dev:
            f[:big_l, sizes[m], m] = last[:, m]
    fs, args = [None, f], [None, None]
    for s in range(2, max_stages + 1):
        g = np.full_like(f, inf)
        arg = np.zeros((big_l + 1, n_dev + 1, k), dtype=np.int64)
        for m in range(k):
            n = sizes[m]
            if n > n_dev:
                continue
            x = sec[s][:, :, m][:, :, None] + tab.reshard[None, :, m, :]  # (L, L+1, K)
            x = np.where((x <= t_max) & later[:, :, None], x, inf)
            x[:, big_l, :] = inf  # not the last stage
            shifted = np.full_like(f, inf)
            shifted[:, n:, :] = f[:, : n_dev + 1 - n, :]
            z = x[:, :, None, :] + shifted[None, :, :, :]  # (L, L+1, D+1, K)
            z = z.transpose(0, 2, 1, 3).reshape(big_l, n_dev + 1, -1)
            a = np.argmin(z, axis=-1)
            g[:big_l, :, m] = np.take_along_axis(z, a[..., None], -1)[..., 0]
            arg[:big_l, :, m] = a
        f = g
        fs.append(f)
        args.append(arg)
        if not np.isfinite(f[0]).any() and not np.isfinite(f[:big_l]).any():
            break
    return fs, args


def _walk(tab: _Tables, fs, args, sizes, choices, n_dev: int, s: int) -> list[Stage]:
    """The stages of the best ``s``-stage solution in ``fs``."""
    big_l, k = tab.sec.shape[1], tab.sec.shape[3]
    m = int(np.argmin(fs[s][0, n_dev]))
    stages, lo, d = [], 0, n_dev
    for r in range(s, 0, -1):
        if r == 1:
            hi, m2 = big_l, 0
        else:
            hi, m2 = divmod(int(args[r][lo, d, m]), k)
        view = tab.views[m][int(tab.view[r][lo, hi, m])]
        stages.append(Stage(lo, hi, choices[m], view))
        lo, d, m = hi, d - sizes[m], m2
    return stages


def _candidates(tab: _Tables, ratio: float) -> np.ndarray:
    vals = tab.sec[np.isfinite(tab.sec)]
    if not vals.size:
        return vals
    lo, hi = float(vals.min()), float(vals.max() + tab.reshard.max())
    steps = int(math.ceil(math.log(hi / lo) / math.log(ratio))) + 1
    return lo * ratio ** np.arange(steps + 1)


def stage_dp(
    cost: AnalyticCost,
    num_micro_batches: int,
    *,
    choices: Sequence[tuple[int, int]] | None = None,
    max_stages: int | None = None,
    tolerance: float = 5e-3,
    views: str = "all",
) -> StagePlan:
    """The best stage plan for ``cost``'s layers on its cluster (module docstring).

    ``choices``: submesh shapes allowed (default :func:`submesh_choices`); ``views``:
    ``"all"`` logical ``(dp, tp)`` views of each, or ``"data_parallel"`` only (what the
    runtime runs today); ``tolerance``: the ``t_max`` grid's ratio minus one.  Raises :class:`MeshshardInputError` when no
    split of the layers fits device memory, naming the smallest need found.
    """
    cluster, m_b = cost.cluster, num_micro_batches
    choices = tuple(choices or submesh_choices(cluster))
    n_dev = cluster.num_devices
    big_l = len(cost.layers)
    max_stages = min(max_stages or big_l, big_l, n_dev)
    sizes = np.array([h * d for h, d in choices])
    if views not in ("all", "data_parallel"):
        raise ValueError(f"views must be 'all' or 'data_parallel', got {views!r}")
    tab = _tables(cost, choices, m_b, max_stages, views)
    cands = _candidates(tab, 1 + tolerance)
    if not cands.size:
        _raise_no_fit(cost, choices, m_b)
    all_devices, n_dev = n_dev, _most_tiled(sizes, n_dev, max_stages)
    if not n_dev:
        raise MeshshardInputError(
            f"the submesh shapes {list(choices)} cannot tile any devices of {cluster} "
            f"with at most {max_stages} stages; allow other submesh shapes"
        )
    lo = _first_feasible(tab, sizes, n_dev, cands, max_stages)
    if lo is None:
        _raise_no_fit(cost, choices, m_b)
    best, sweeps = None, 0
    for t in cands[lo:]:
        if best is not None and m_b * t >= best.seconds:
            break
        fs, args = _dp_once(tab, sizes, n_dev, t, max_stages)
        sweeps += 1
        for s in range(1, len(fs)):
            if np.isfinite(fs[s][0, n_dev]).any():
                plan = evaluate(_walk(tab, fs, args, sizes, choices, n_dev, s), cost, m_b)
                if best is None or plan.seconds < best.seconds:
                    best = plan
    notes = (f"stage DP: {big_l} layers, {len(choices)} submesh shapes, {sweeps} t_max sweeps",)
    if n_dev < all_devices:
        notes += (
            f"{IDLE_DEVICES}{n_dev} of the {all_devices} devices of {cluster}: submeshes of shapes "
            f"{list(choices)}, at most {max_stages} stages (one per layer at most; the model "
            f"has {big_l} layers), cannot tile them all; mark more layers or allow other "
            "submesh shapes to use every device",
        )
    return StagePlan(**{**best.__dict__, "name": "auto", "notes": notes})


#: How the note of a plan that leaves devices idle starts (the user is warned of it).
IDLE_DEVICES = "the automatic stages use "


def _most_tiled(sizes, n_dev: int, max_stages: int) -> int:
    """The most devices, at most ``n_dev``, that at most ``max_stages`` submeshes of these
    sizes add up to (0: none): all of them, unless the model has too few layers for the
    submeshes allowed (3 layers on 4 hosts of 2 devices, meshes inside one host), where
    the plan leaves the rest idle rather than fail."""
    reach = {0}
    for _ in range(max_stages):
        reach |= {r + int(z) for r in reach for z in sizes if r + z <= n_dev}
    return max(reach)


def _feasible(tab, sizes, n_dev: int, t_max: float, max_stages: int) -> bool:
    fs = _dp_once(tab, sizes, n_dev, t_max, max_stages)[0]
    return any(np.isfinite(f[0, n_dev]).any() for f in fs[1:])


def _first_feasible(tab, sizes, n_dev: int, cands: np.ndarray, max_stages: int) -> int | None:
    """Index of the smallest feasible ``t_max`` (feasibility grows with ``t_max``)."""
    lo, hi = 0, len(cands) - 1
    if not _feasible(tab, sizes, n_dev, cands[hi], max_stages):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(tab, sizes, n_dev, cands[mid], max_stages):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (B, KiB, ..., TiB)."""
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 2**k:
            return f"{nbytes / 2**k:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _raise_no_fit(cost: AnalyticCost, choices, m_b: int):
    """Name the model's memory, the cluster and what would fit: the state over every
    device, the smallest per-device need of one layer on the largest submesh, how many
    such devices the state needs and how many parameters this cluster can hold."""
    c, big_l = cost.cluster, len(cost.layers)
    o = cost.options
    usable = c.device_memory * o.memory_fraction
    params = cost.total("param_count", 0, big_l)
    state = params * o.bytes_per_param
    need_devices = math.ceil(state / usable)
    largest = max(choices, key=lambda sh: sh[0] * sh[1])
    smallest = min(
        cost(lo, lo + 1, largest, v).memory(1) for lo in range(big_l) for v in _views(cost, largest)
    )
    holds = usable * c.num_devices / o.bytes_per_param
    raise MeshshardInputError(
        f"no stage plan fits device memory: the model ({params:,.0f} parameters, {big_l} "
        f"layers) needs {_size(state)} of parameter state ({o.bytes_per_param:g} "
        f"bytes/parameter), at best {_size(state / c.num_devices)} per device over all "
        f"{c.num_devices} devices of {c}, and a device holds {_size(usable)} usable "
        f"(memory_fraction {o.memory_fraction:g}); even one layer on a {largest} submesh "
        f"needs {_size(smallest)} per device with one micro-batch in flight. The state "
        f"alone needs at least {need_devices} such devices, and this cluster holds at most "
        f"~{holds:,.0f} parameters' state: use more or larger devices, fewer micro-batches "
        "in flight, or a smaller model"
    )


def grid_plan(
    cost: AnalyticCost, num_micro_batches: int, dp: int, tp: int, pp: int
) -> StagePlan | None:
    """The Megatron plan ``dp x tp x pp`` (uniform stages, TP inside a host), or None when
    the degrees do not fit the cluster or the layers."""
    c, big_l = cost.cluster, len(cost.layers)
    n = dp * tp
    if dp * tp * pp != c.num_devices or c.devices_per_host % tp or big_l % pp:
        return None
    if n > c.devices_per_host and n % c.devices_per_host:
        return None
    sub = (1, n) if n <= c.devices_per_host else (n // c.devices_per_host, c.devices_per_host)
    per = big_l // pp
    name = f"grid dp{dp} tp{tp} pp{pp}"
    plans = []
    for view in (v for v in _views(cost, sub) if tuple(v[:2]) == (dp, tp)):
        stages = [Stage(i * per, (i + 1) * per, sub, view) for i in range(pp)]
        plans.append(evaluate(stages, cost, num_micro_batches, name=name))
    fitting = [p for p in plans if fits(p, cost)] or plans
    return min(fitting, key=lambda p: p.seconds)


def grid_plans(cost: AnalyticCost, num_micro_batches: int) -> list[StagePlan]:
    """Every valid Megatron grid plan (memory not checked; see :func:`fits`)."""
    n = cost.cluster.num_devices
    out = []
    for tp in range(1, cost.cluster.devices_per_host + 1):
        for pp in range(1, n + 1):
            if n % (tp * pp) == 0:
                p = grid_plan(cost, num_micro_batches, n // (tp * pp), tp, pp)
                if p is not None:
                    out.append(p)
    return out


def zero3_plan(cost: AnalyticCost, num_micro_batches: int) -> StagePlan:
    """Pure data parallelism with ZeRO-3: all state sharded over the ``N`` devices; each
    micro-batch all-gathers the fp16 weights twice (forward, backward) and reduce-scatters
    the gradients (DeepSpeed's stage 3 with gradient accumulation)."""
    c, big_l = cost.cluster, len(cost.layers)
    n = c.num_devices
    whole = (c.num_hosts, c.devices_per_host)
    base = cost(0, big_l, whole, (n, 1))
    params = cost.total("param_count", 0, big_l) * 2.0
    # a ring all-gather / reduce-scatter is half an all-reduce
    half = cost.dp_allreduce_s(params, whole, n) / 2
    per_mb = base.seconds + 3 * half
    state = cost.total("param_count", 0, big_l) * cost.options.bytes_per_param / n
    peak = state + base.act_bytes + base.transient_bytes
    stage = Stage(0, big_l, whole, (n, 1))
    total = num_micro_batches * per_mb
    return StagePlan((stage,), total, (per_mb,), (0.0,), (peak,), "zero3")
