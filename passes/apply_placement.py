"""Pass 4: place the update (apply-gradient) equations on the meshes, in phases.

Each gradient lives on the stage that computed it and each parameter on the stage that
reads it (its owner), so an update equation whose operands live on one mesh runs
there.  An equation whose operands all live on several meshes (a value every mesh
received) runs on each of them.  Equations that touch no placed value (a step
counter, a learning-rate schedule) are replicated onto every mesh that consumes their
result.  Values of different meshes meet in two ways:

* **partial reductions**: a small ``add``/``max``/``min``/``and``/``or`` of values on
  different meshes (the sum of squares of a global norm, ``all(g <= 1)``) becomes a
  partial result per mesh (its own terms) and one cross-mesh **all-reduce**, after
  which every mesh holds the total;
* **moves**: any other equation runs on the mesh holding most of its operand bytes;
  the other operands are sent there by the resharding planner.  An operand that an
  update equation grew from a smaller one (a zero-padded gradient slice,
  ``passes/narrow_gradients.py``; a broadcast) is not sent: its smaller operand is, and
  the growing equation runs again at the destination.

Communication splits the update into *phases*: phase ``k+1`` of a mesh starts once the
all-reduces and moves that end phase ``k`` are complete.  A step with no cross-mesh
update has one phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import aval_nbytes, is_dropvar, is_literal

#: Primitive -> the reduction an all-reduce applies for it.
REDUCIBLE = {"add": "sum", "add_any": "sum", "max": "max", "min": "min", "and": "and", "or": "or"}
#: Equations that make one operand larger: where their result must move, their operand
#: moves instead and they run again at the destination.
GROWING = frozenset({"pad", "broadcast_in_dim"})
#: Values up to this size are combined by partial reductions and an all-reduce; larger
#: ones are moved to one mesh through the resharding planner.
ALLREDUCE_MAX_BYTES = 4096


@dataclass(frozen=True)
class Reduction:
    """An all-reduce of ``var``: each mesh reduces its ``parts`` (var ids of the terms it
    holds) in phase ``phase``; ``literals`` are terms added on mesh 0."""

    var: int
    op: str
    phase: int
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    literals: tuple[float, ...] = ()

    def __str__(self) -> str:
        parts = " ".join(f"m{m}:{list(v)}" for m, v in self.parts)
        return f"allreduce {self.op} %{self.var} after phase {self.phase} ({parts})"


@dataclass(frozen=True)
class Move:
    """Value ``var`` sent from mesh ``src`` after phase ``phase`` to mesh ``dst``."""

    var: int
    src: int
    dst: int
    phase: int

    def __str__(self) -> str:
        return f"move %{self.var} m{self.src} -> m{self.dst} after phase {self.phase}"


@dataclass(frozen=True)
class ApplyPlacement:
    """Where and in which phase each update equation runs, and the communication between.

    ``runs``: (eqn index, ((mesh, phase), ...)); ``arrivals``: (var id, ((mesh, phase),
    ...)) when each value computed, moved or reduced in the update becomes readable.
    """

    num_phases: int
    runs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    arrivals: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    reductions: tuple[Reduction, ...]
    moves: tuple[Move, ...]
    lazy_needs: tuple[tuple[int, tuple[int, ...]], ...]

    def meshes_of_eqn(self, i: int) -> tuple[int, ...]:
        return tuple(m for m, _ in dict(self.runs)[i])


class _Placer:
    """The forward walk over the update equations (see the module docstring)."""

    def __init__(self, jaxpr, ids, seeds, num_meshes, describe):
        self.jaxpr = jaxpr
        self.ids = ids
        self.num_meshes = num_meshes
        self.describe = describe
        self.ready: dict = {v: {m: 0 for m in ms} for v, ms in seeds.items()}
        self.partial: dict = {}  # Var -> (op, [(atom, mesh)])
        self.runs: dict[int, dict[int, int]] = {}
        self.lazy: list[int] = []
        self.needed: dict = {}  # ANY Var -> set of meshes
        self.reductions: list[Reduction] = []
        self.moves: list[Move] = []
        self.producer: dict = {}  # Var -> index of the update equation computing it

    def place(self, apply_eqns) -> None:
        eqns = self.jaxpr.eqns
        for i in apply_eqns:
            e = eqns[i]
            ins = [v for v in e.invars if not is_literal(v)]
            op = REDUCIBLE.get(e.primitive.name)
            if op and self._combines_meshes(e, ins):
                self._partial(e, op)
                continue
            for v in ins:
                if v in self.partial:
                    self._materialize(v)
            located = [v for v in ins if v in self.ready]
            if not located:
                self.lazy.append(i)
                continue
            where = set.intersection(*(set(self.ready[v]) for v in located))
            if not where:
                where = {self._gather(e, located)}
            ph = {m: max(self.ready[v][m] for v in located) for m in where}
            for v in ins:
                if v not in self.ready:
                    self.needed.setdefault(v, set()).update(where)
            self.runs[i] = ph
            for v in e.outvars:
                if not is_dropvar(v):
                    self.ready[v] = dict(ph)
                    self.producer[v] = i
        for v in self.jaxpr.outvars:
            if not is_literal(v) and v in self.partial:
                self._materialize(v)

    def _combines_meshes(self, e, ins) -> bool:
        out = e.outvars[0]
        if any(tuple(v.aval.shape) != tuple(out.aval.shape) for v in ins):
            return False
        if aval_nbytes(out.aval) > ALLREDUCE_MAX_BYTES:
            return False
        if any(v in self.partial for v in ins):
            return True
        located = [set(self.ready[v]) for v in ins if v in self.ready]
        return len(located) > 1 and not set.intersection(*located)

    def _partial(self, e, op: str) -> None:
        terms: list = []
        for v in e.invars:
            if not is_literal(v) and v in self.partial:
                if self.partial[v][0] == op:
                    terms += self.partial[v][1]
                    continue
                self._materialize(v)
            if is_literal(v) or v not in self.ready:
                terms.append((v, 0))
                if not is_literal(v):
                    self.needed.setdefault(v, set()).add(0)
            else:
                terms.append((v, min(self.ready[v], key=lambda m: (self.ready[v][m], m))))
        self.partial[e.outvars[0]] = (op, terms)

    def _materialize(self, v) -> None:
        op, terms = self.partial.pop(v)
        phase = max(
            (self.ready[a][m] for a, m in terms if not is_literal(a) and a in self.ready),
            default=0,
        )
        parts = {m: [] for m in range(self.num_meshes)}
        literals = []
        for a, m in terms:
            if is_literal(a):
                literals.append(float(np.asarray(a.val)))
            else:
                parts[m].append(self.ids[a])
        self.reductions.append(
            Reduction(
                self.ids[v],
                op,
                phase,
                tuple((m, tuple(p)) for m, p in parts.items()),
                tuple(literals),
            )
        )
        self.ready[v] = {m: phase + 1 for m in range(self.num_meshes)}

    def _gather(self, e, located) -> int:
        """Move ``e``'s operands to the mesh holding most of their bytes; returns it."""
        weight: dict[int, int] = {}
        for v in located:
            for m in self.ready[v]:
                weight[m] = weight.get(m, 0) + aval_nbytes(v.aval)
        target = min(weight, key=lambda m: (-weight[m], m))
        for v in located:
            self._send(v, target)
        return target

    def _send(self, v, target: int) -> None:
        """Make ``v`` readable on ``target``: computed there again from its smaller
        operand when an update equation grew it (a padded gradient slice, a broadcast),
        else moved from the mesh where it is ready first."""
        if target in self.ready[v]:
            return
        i = self.producer.get(v)
        grown = self.jaxpr.eqns[i] if i is not None else None
        ins = [] if grown is None else [u for u in grown.invars if not is_literal(u)]
        if (
            grown is not None
            and grown.primitive.name in GROWING
            and len(ins) == 1
            and ins[0] in self.ready
            and aval_nbytes(ins[0].aval) < aval_nbytes(v.aval)
        ):
            self._send(ins[0], target)
            phase = self.ready[ins[0]][target]
            self.runs[i][target] = phase
            for out in grown.outvars:
                if not is_dropvar(out):
                    self.ready[out][target] = phase
            return
        src = min(self.ready[v], key=lambda m: (self.ready[v][m], m))
        phase = self.ready[v][src]
        self.moves.append(Move(self.ids[v], src, target, phase))
        self.ready[v][target] = phase + 1

    def place_lazy(self) -> None:
        """Equations that read no placed value run (in phase 0) wherever their results
        are needed; a result nobody needs stays on mesh 0."""
        eqns = self.jaxpr.eqns
        for i in reversed(self.lazy):
            e = eqns[i]
            where = set().union(*(self.needed.get(v, set()) for v in e.outvars)) or {0}
            self.runs[i] = {m: 0 for m in where}
            for v in e.invars:
                if not is_literal(v):
                    self.needed.setdefault(v, set()).update(where)
        for i in self.lazy:
            for v in eqns[i].outvars:
                if not is_dropvar(v):
                    self.ready[v] = {m: 0 for m in self.runs[i]}


def place_apply(
    jaxpr,
    ids: dict,
    apply_eqns: tuple[int, ...],
    seeds: dict,
    num_meshes: int,
    describe,
) -> ApplyPlacement:
    """Place the update equations given ``seeds`` (Var -> meshes) for gradients and
    owned parameters.  ``describe(var)`` names a value for error messages."""
    p = _Placer(jaxpr, ids, {v: _as_set(s) for v, s in seeds.items()}, num_meshes, describe)
    p.place(apply_eqns)
    p.place_lazy()
    passed = set(jaxpr.invars)  # a step input returned as is needs no mesh (OutputSource.INPUT)
    for v in jaxpr.outvars:
        if not is_literal(v) and v not in p.ready and v not in seeds and v not in passed:
            raise MeshshardInputError(
                f"step output {describe(v)} could not be placed on a mesh; this is a bug "
                "in meshshard's update placement: please report it with the step"
            )
    last = [ph for r in p.runs.values() for ph in r.values()]
    last += [r.phase + 1 for r in p.reductions] + [m.phase + 1 for m in p.moves]
    arrivals = [(ids[v], tuple(sorted(where.items()))) for v, where in p.ready.items() if v in ids]
    return ApplyPlacement(
        num_phases=max(last, default=0) + 1,
        runs=tuple((i, tuple(sorted(p.runs[i].items()))) for i in apply_eqns if i in p.runs),
        arrivals=tuple(sorted(arrivals)),
        reductions=tuple(p.reductions),
        moves=tuple(p.moves),
        lazy_needs=tuple(
            sorted((ids[v], tuple(sorted(ms))) for v, ms in p.needed.items() if v in ids)
        ),
    )


def _as_set(s) -> frozenset:
    return frozenset([s]) if isinstance(s, int) else frozenset(s)
