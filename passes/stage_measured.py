"""Measured stage times into the stage DP's cost model (``stages="auto"`` with profiling).

Alpa profiles every candidate stage on every submesh before its DP (hours).  We profile
one plan instead: its stages' forward and backward programs, timed on their meshes,
say how far the analytic model (:class:`~meshshard.passes.stage_cost.AnalyticCost`) is
from this machine for those layers.  Each measured layer range's FLOPs and bytes are
scaled so the model's time for that range on that submesh equals the measurement; layers
no measurement covers take the median ratio (the model's error is mostly systematic:
kernel launch costs, achieved FLOP/s).  The DP then reruns on the scaled layers.

Pure: measurements in, layer statistics out; the API's ``lower(profile=True)`` does the
running.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.passes.stage_cost import AnalyticCost, LayerStats

__all__ = ["measured_stats"]


def measured_stats(
    stats: Sequence[LayerStats],
    cluster: ClusterSpec,
    stage_times: Sequence[tuple[int, int, tuple[int, int], float]],
) -> tuple[tuple[LayerStats, ...], tuple[str, ...]]:
    """``stats`` with each layer's compute scaled to match ``stage_times`` (``(lo, hi,
    submesh, seconds per micro-batch)``, data-parallel view), and plan notes saying how.

    >>> from meshshard.passes.stage_cost import LayerStats
    >>> one = LayerStats(1e9, 2e9, 1e6, 10, 40, 100, 100)
    >>> c = ClusterSpec(num_hosts=1, devices_per_host=2)
    >>> model = AnalyticCost([one, one], c)(0, 1, (1, 2), (2, 1)).seconds
    >>> got, notes = measured_stats([one, one], c, [(0, 1, (1, 2), 2 * model)])
    >>> round(AnalyticCost(got, c)(0, 1, (1, 2), (2, 1)).seconds / model, 3)
    2.0
    """
    if not stage_times:
        return tuple(stats), ()
    model = AnalyticCost(stats, cluster)
    fixed = 2 * cluster.launch_overhead  # per micro-batch: one forward, one backward launch
    scale: dict[int, float] = {}
    for lo, hi, submesh, seconds in stage_times:
        if hi > len(stats):
            raise MeshshardInputError(
                f"stage_times entry for layers {lo}..{hi - 1}: the step has {len(stats)} "
                "layers; measure the same model (profile it again)"
            )
        h, d = submesh
        predicted = model(lo, hi, submesh, (h * d, 1)).seconds
        ratio = max(seconds - fixed, 1e-12) / max(predicted - fixed, 1e-12)
        for i in range(lo, hi):
            scale[i] = ratio
    rest = statistics.median(scale.values())
    out = tuple(_scaled(s, scale.get(i, rest)) for i, s in enumerate(stats))
    ratios = ", ".join(f"{scale[i]:.3g}" for i in sorted(scale))
    note = (
        f"stage DP costs from {len(stage_times)} measured stage(s): compute x[{ratios}] for "
        f"measured layers {sorted(scale)}"
        + (f", x{rest:.3g} (their median) for the others" if len(scale) < len(stats) else "")
    )
    return out, (note,)


def _scaled(s: LayerStats, r: float) -> LayerStats:
    return replace(
        s, flops_fwd=s.flops_fwd * r, flops_bwd=s.flops_bwd * r, bytes_fwd=s.bytes_fwd * r
    )
