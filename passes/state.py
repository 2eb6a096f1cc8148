"""The immutable compile state every pass reads and returns, and the pass record.

A pass is a pure function ``CompileState -> CompileState`` that fills one or more
fields (:func:`dataclasses.replace`); :data:`meshshard.passes.pipeline.PASSES`
declares them in order.  Fields a pass has not reached yet are None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshshard.cluster import ClusterSpec
from meshshard.instructions import WorkerStream
from meshshard.methods import Method
from meshshard.passes.slicing import LayerSlicing
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.plan import BufferSpec, MeshSpec, Plan, Schedule, TransferSpec


@dataclass(frozen=True)
class CompileState:
    """Everything decided so far for one traced step (None: not yet decided)."""

    traced: TracedStep
    method: Method
    cluster: ClusterSpec
    slicing: LayerSlicing | None = None
    layer_groups: tuple[tuple[int, ...], ...] | None = None
    meshes: tuple[MeshSpec, ...] | None = None
    graph: StageGraph | None = None
    buffers: tuple[BufferSpec, ...] | None = None
    shardings: tuple | None = None  # MeshSharding per mesh (passes/shard_plan.py)
    unreduced: dict | None = None  # program -> values held unreduced (shard_accumulate.py)
    transfers: tuple[TransferSpec, ...] | None = None
    schedule: Schedule | None = None
    streams: tuple[WorkerStream, ...] | None = None
    plan: Plan | None = None
    layout_notes: tuple[str, ...] = ()  # what the stage layout decided and why (plan notes)

    def __str__(self) -> str:
        done = [
            name
            for name in ("slicing", "meshes", "graph", "buffers", "transfers", "schedule")
            + ("streams", "plan")
            if getattr(self, name) is not None
        ]
        return f"CompileState({self.method!r}; decided: {', '.join(done) or 'nothing'})"


@dataclass(frozen=True)
class Pass:
    """A named pure function over the compile state."""

    name: str
    run: Callable[[CompileState], CompileState]

    def __str__(self) -> str:
        return self.name


class PassCheckError(AssertionError):
    """A pass left the IR breaking an invariant (found with ``MESHSHARD_CHECKS=1``)."""
