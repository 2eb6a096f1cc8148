"""Pass helper: lay out ``v`` model chunks per mesh for interleaved 1F1B.

With ``PipeshardParallel(stages=[...S meshes...], schedule="interleaved_1f1b",
virtual_stages=v)`` the layers split into ``S * v`` logical stages; logical stage ``L``
runs on physical mesh ``L % S``.  The compiler sees ``S * v`` meshes (mesh ``L`` is a
view of the hosts of mesh ``L % S``), so every pass keeps "stage ``L`` on mesh ``L``";
a worker's stream then holds the tasks of all ``v`` chunks it runs, in the order of the
interleaved grid (:func:`meshshard.passes.schedules.interleaved_one_f_one_b`).

>>> from meshshard.plan import MeshSpec
>>> groups, meshes = virtual_layout((MeshSpec(0, (1, 2), (0,)), MeshSpec(1, (1, 2), (1,))), 4, 2)
>>> groups, [m.hosts for m in meshes]
(((0,), (1,), (2,), (3,)), [(0,), (1,), (0,), (1,)])
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.errors import MeshshardInputError
from meshshard.passes.stage_graph import checked_stage_layers, group_layers
from meshshard.plan import MeshSpec

__all__ = ["virtual_layout"]


def virtual_layout(
    meshes: tuple[MeshSpec, ...],
    num_layers: int,
    virtual_stages: int,
    stage_layers: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[tuple[tuple[int, ...], ...], tuple[MeshSpec, ...]]:
    """Layer groups of the ``S * v`` logical stages (the user's ``stage_layers``, else
    equal numbers of layers) and their (shared) meshes."""
    S, v = len(meshes), virtual_stages
    if S < 2:
        raise MeshshardInputError(
            f"PipeshardParallel(virtual_stages={v}) interleaves chunks over several meshes; "
            "give at least two stages"
        )
    if num_layers < S * v:
        raise MeshshardInputError(
            f"PipeshardParallel(virtual_stages={v}) over {S} meshes needs at least {S * v} "
            f"pipeline layers, the step has {num_layers}; mark more boundaries or lower "
            "virtual_stages"
        )
    logical = tuple(replace(meshes[L % S], id=L) for L in range(S * v))
    if stage_layers is not None:
        return checked_stage_layers(stage_layers, num_layers), logical
    return group_layers(num_layers, S * v), logical
