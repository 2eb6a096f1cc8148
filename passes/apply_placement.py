"""Pass 4: place the apply-gradient equations on the meshes that own the parameters.

Each gradient lives on the stage that computed it and each parameter on the stage that
reads it, so an update equation that touches them runs there.  Equations that touch no
placed value (an optimizer's step counter, a learning-rate schedule) are replicated
onto every mesh that consumes their result.  State leaves (optimizer moments) follow
the equations that read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_dropvar, is_literal


@dataclass(frozen=True)
class ApplyPlacement:
    """Meshes (stage ids) of each apply equation and of each state input leaf."""

    eqn_meshes: tuple[tuple[int, tuple[int, ...]], ...]
    input_meshes: tuple[tuple[int, tuple[int, ...]], ...]

    def meshes_of_eqn(self, i: int) -> tuple[int, ...]:
        return dict(self.eqn_meshes)[i]

    def meshes_of_input(self, leaf: int) -> tuple[int, ...]:
        return dict(self.input_meshes).get(leaf, ())


def place_apply(
    jaxpr,
    apply_eqns: tuple[int, ...],
    seeds: dict,
    state_leaves: tuple[int, ...],
    describe,
) -> ApplyPlacement:
    """Place apply equations given ``seeds`` (Var -> stage) for gradients and read parameters.

    ``describe(var)`` names a value for error messages.
    """
    placed: dict = dict(seeds)  # Var -> frozenset of stages
    placed = {v: frozenset([s]) if isinstance(s, int) else frozenset(s) for v, s in placed.items()}
    eqn_mesh: dict[int, frozenset] = {}
    eqns = jaxpr.eqns
    for i in apply_eqns:
        e = eqns[i]
        found = frozenset().union(
            *[placed.get(v, frozenset()) for v in e.invars if not is_literal(v)]
        )
        if len(found) > 1:
            names = ", ".join(describe(v) for v in e.invars if not is_literal(v) and v in placed)
            raise MeshshardInputError(
                f"the update step combines values that live on different stages "
                f"{sorted(found)} in one operation ({e.primitive.name} of {names}); "
                "cross-stage updates such as global-norm gradient clipping or tied weights "
                "are not supported yet: clip per parameter or use one stage"
            )
        if found:
            eqn_mesh[i] = found
            for v in e.outvars:
                placed[v] = found
    # Backward: unplaced equations go wherever their results are consumed.
    needed: dict = {}
    for i in reversed(apply_eqns):
        e = eqns[i]
        if i in eqn_mesh:
            for v in e.invars:
                if not is_literal(v):
                    needed[v] = needed.get(v, frozenset()) | eqn_mesh[i]
            continue
        where = frozenset().union(
            *[needed.get(v, frozenset()) for v in e.outvars if not is_dropvar(v)]
        )
        eqn_mesh[i] = where or frozenset([0])
        for v in e.invars:
            if not is_literal(v):
                needed[v] = needed.get(v, frozenset()) | eqn_mesh[i]
    input_meshes = []
    invars = jaxpr.invars
    for leaf in state_leaves:
        v = invars[leaf]
        where = placed.get(v, frozenset()) | needed.get(v, frozenset())
        if where:
            input_meshes.append((leaf, tuple(sorted(where))))
    return ApplyPlacement(
        eqn_meshes=tuple((i, tuple(sorted(eqn_mesh[i]))) for i in apply_eqns),
        input_meshes=tuple(input_meshes),
    )
