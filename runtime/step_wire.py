"""What one step's call carries between the driver and a worker, and in what order.

A step's message to a worker holds only what changes from step to step: the batch
arrays, the store key (or host value) of each state leaf, one base key, and the keys to
free.  Which leaf each entry is, and which output slot each stored result is kept under,
both sides read from one :class:`StepLayout` derived from the plan.  So the message is
lists of ints and arrays, cheap to send through Ray: no per-leaf Python objects (buffer
references, key wrappers) for its serializer to pickle one by one, which cost the driver
several milliseconds per step on a GPT with 160 state leaves.

Output slot ``j`` of a step is stored under key ``base + offset(j)``: the driver reserves
``num_keys`` consecutive keys per step and already knows every result's key, so a worker
returns only what comes back by value (losses, counters).

    >>> from meshshard.plan import InputSpec, OutputSpec
    >>> from meshshard.refs import BufferRef
    >>> p = BufferRef.of("P0")
    >>> inputs = (InputSpec(0, "w", "state", (2,), "float32", ((p, 0),)),)
    >>> outputs = (OutputSpec(0, "w", (2,), "float32", "buffer", ((p, 0),)),)
    >>> layout = StepLayout.build(inputs, outputs, {p: (3,)})
    >>> w = layout.workers[3]
    >>> w.state_leaves, [(str(g), i, off) for g, i, off in w.out_slots]
    ((0,), [('P0', 0, 0)])
    >>> layout.outputs[0].holders, layout.num_keys
    (((3, 0),), 1)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshshard.refs import BufferRef, LeafKind, OutputSource

#: (group, index, key offset): one output slot a worker stores each step.
OutSlot = tuple[BufferRef, int, int]


@dataclass(frozen=True)
class WorkerLayout:
    """One worker's share of a step: the batch and state leaves it receives, in the
    order of the call's lists, and the output slots it keeps with their key offsets."""

    batch_leaves: tuple[int, ...]
    state_leaves: tuple[int, ...]
    out_slots: tuple[OutSlot, ...]


#: A worker the step does not involve.
EMPTY_LAYOUT = WorkerLayout((), (), ())


@dataclass(frozen=True)
class OutputLayout:
    """Where one program output of the step is kept: ``(worker, key offset)`` for every
    worker holding a copy or a part, the first one answering for by-value results, and
    the workers of each mesh holding it (a checkpoint writes one of them)."""

    holders: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StepLayout:
    """The numbering the driver and every worker share for one plan's step calls."""

    workers: Mapping[int, WorkerLayout]
    #: per plan output: its :class:`OutputLayout`, or None when no program produces it
    outputs: tuple[OutputLayout | None, ...]
    num_keys: int

    @staticmethod
    def build(inputs: Sequence, outputs: Sequence, mesh_workers: Mapping) -> StepLayout:
        """The layout of a plan's ``inputs`` and ``outputs`` (``InputSpec``s and
        ``OutputSpec``s); ``mesh_workers[group]`` lists the workers holding ``group``."""
        batch: dict[int, dict[int, None]] = {}
        state: dict[int, dict[int, None]] = {}
        for spec in inputs:
            if spec.kind is LeafKind.UNUSED:
                continue
            into = batch if spec.kind is LeafKind.BATCH else state
            for group, _ in spec.slots:
                for w in mesh_workers[group]:
                    into.setdefault(w, {})[spec.leaf] = None
        offsets: dict[tuple[BufferRef, int], int] = {}
        slots: dict[int, dict[tuple[BufferRef, int], int]] = {}
        layouts: list[OutputLayout | None] = []
        for o in outputs:
            if o.source is not OutputSource.BUFFER:
                layouts.append(None)
                continue
            holders: dict[int, int] = {}
            for gi in o.slots:
                off = offsets.setdefault(gi, len(offsets))
                for w in mesh_workers[gi[0]]:
                    slots.setdefault(w, {})[gi] = off
                    holders[w] = off
            groups = tuple(tuple(mesh_workers[g]) for g, _ in o.slots)
            layouts.append(OutputLayout(tuple(holders.items()), groups))
        workers = {}
        for w in sorted(set(batch) | set(state) | set(slots)):
            workers[w] = WorkerLayout(
                tuple(batch.get(w, ())),
                tuple(state.get(w, ())),
                tuple((g, i, off) for (g, i), off in slots.get(w, {}).items()),
            )
        return StepLayout(workers, tuple(layouts), len(offsets))

    @staticmethod
    def of_plan(plan) -> StepLayout:
        """The layout of ``plan``'s step calls."""
        workers = {m.id: tuple(m.workers) for m in plan.meshes}
        groups = {g for spec in (*plan.inputs, *plan.outputs) for g, _ in spec.slots}
        mesh_workers = {g: workers[plan.buffer(g).mesh] for g in groups}
        return StepLayout.build(plan.inputs, plan.outputs, mesh_workers)


class KeyCounter:
    """Ids of stored arrays, handed out one at a time or in consecutive blocks.

    >>> keys = KeyCounter()
    >>> next(keys), keys.reserve(3), next(keys)
    (1, 2, 5)
    """

    def __init__(self, start: int = 1):
        self._lock = threading.Lock()
        self._next = start

    def __iter__(self) -> KeyCounter:
        return self

    def __next__(self) -> int:
        return self.reserve(1)

    def reserve(self, n: int) -> int:
        """The first of ``n`` consecutive fresh keys."""
        with self._lock:
            base = self._next
            self._next += n
        return base
