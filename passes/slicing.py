"""Pass 2: split compute-grad from apply-grad and cut the gradient part into layers.

Reads the boundary markers that ``meshshard.grad`` leaves in the traced step:

* every equation up to the ``grad_end`` marker is *compute-grad* (run per micro-batch);
  everything after it is *apply-grad* (run once per step);
* forward markers ``fwd k`` cut the forward pass into layers ``0..L-1``; the mirrored
  ``bwd k`` markers cut the backward pass the same way; the ``loss`` marker ends the
  last layer's forward.

A marker belongs to the layer that *consumes* the values it carries, so values cross a
cut only through a marker's operands.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_marker, sub_jaxprs

FWD, BWD, GRAD_END, APPLY = "F", "B", "G", "A"


@dataclass(frozen=True)
class LayerSlicing:
    """Per equation of the traced step: its layer (-1 for apply) and phase (F, B, G, A)."""

    num_layers: int
    layer: tuple[int, ...]
    phase: tuple[str, ...]
    grad_end: int

    def eqns(self, layer: int, phase: str) -> tuple[int, ...]:
        """Indices of the equations of ``layer`` in ``phase``."""
        return tuple(
            i
            for i, (ly, ph) in enumerate(zip(self.layer, self.phase, strict=True))
            if ly == layer and ph == phase
        )

    @property
    def apply_eqns(self) -> tuple[int, ...]:
        return tuple(i for i, ph in enumerate(self.phase) if ph == APPLY)

    def __str__(self) -> str:
        counts = Counter(zip(self.layer, self.phase, strict=True))
        parts = [
            f"L{ly}.{ph}:{counts[(ly, ph)]}"
            for ly in range(self.num_layers)
            for ph in (FWD, BWD)
            if counts[(ly, ph)]
        ]
        return f"LayerSlicing({self.num_layers} layers; {' '.join(parts)}; apply:{len(self.apply_eqns)})"


#: How a message names the control-flow primitives whose bodies may hide boundaries.
_LOOPS = {
    "while": "a jax.lax.fori_loop or while_loop",
    "scan": "a jax.lax.scan, fori_loop or nn.scan",
    "cond": "a jax.lax.cond or switch branch",
}


def boundaries_inside(jaxpr, kinds: tuple[str, ...] = ("mark", "fwd")) -> str:
    """What holds boundary markers of ``kinds`` below the step's top level (the body of
    a decode loop: ``fori_loop`` over positions calling the whole model; ``grad_end``:
    ``meshshard.grad`` called per chunk inside a ``scan``), as a message phrase, or ''.
    Stages are cut at top-level markers only."""
    for e in jaxpr.eqns:
        for sub in sub_jaxprs(e):
            if any(is_marker(x, *kinds) for x in sub.eqns) or boundaries_inside(sub, kinds):
                return _LOOPS.get(e.primitive.name, f"a {e.primitive.name}")
    return ""


def slice_layers(jaxpr) -> LayerSlicing:
    """Assign every equation of the step's jaxpr to a (layer, phase)."""
    eqns = jaxpr.eqns
    grad_ends = [i for i, e in enumerate(eqns) if is_marker(e, "grad_end")]
    if not grad_ends:
        raise MeshshardInputError(
            "the train step computes no gradient through meshshard: call "
            "meshshard.grad or meshshard.value_and_grad (not jax.grad) on the loss function"
        )
    if len(grad_ends) > 1:
        raise MeshshardInputError(
            f"the train step calls meshshard.grad {len(grad_ends)} times; call it once per "
            "step (combine losses into one function)"
        )
    g = grad_ends[0]
    fwd = {e.params["index"]: i for i, e in enumerate(eqns[:g]) if is_marker(e, "fwd")}
    bwd = {e.params["index"]: i for i, e in enumerate(eqns[:g]) if is_marker(e, "bwd")}
    loss = [i for i, e in enumerate(eqns[:g]) if is_marker(e, "loss")]
    if len(loss) != 1:
        raise MeshshardInputError("could not find the loss marker; use meshshard.value_and_grad")
    if set(fwd) != set(bwd):
        missing = sorted(set(fwd) - set(bwd))
        raise MeshshardInputError(
            f"pipeline boundaries {missing} have no backward mirror: the values crossing them "
            "do not influence the loss, or the loss was differentiated with jax.grad; "
            "use meshshard.grad and remove boundaries after the last layer that matters"
        )
    num_layers = len(fwd) + 1
    order = sorted(fwd)
    if order != list(range(len(order))):
        raise MeshshardInputError(f"pipeline boundary indices {order} are not 0..{len(order) - 1}")
    for k in order[1:]:
        if not fwd[k - 1] < fwd[k] or not bwd[k] < bwd[k - 1]:
            raise MeshshardInputError("pipeline boundaries appear out of order in the traced step")
    layer, phase = [], []
    fwd_cuts = [fwd[k] for k in order]  # marker k starts layer k+1
    loss_pos = loss[0]
    for i in range(len(eqns)):
        if i > g:
            layer.append(-1)
            phase.append(APPLY)
        elif i == g:
            layer.append(-1)
            phase.append(GRAD_END)
        elif i <= loss_pos:
            layer.append(sum(1 for c in fwd_cuts if c <= i))
            phase.append(FWD)
        else:
            # bwd markers appear as k = L-2, ..., 0; marker k starts layer k's backward
            passed = [k for k in order if bwd[k] <= i]
            layer.append(min(passed) if passed else num_layers - 1)
            phase.append(BWD)
    return LayerSlicing(num_layers, tuple(layer), tuple(phase), g)


def split_scan_notes(jaxpr) -> list[str]:
    """The plan's notes for the scans ``meshshard.grad`` cut into pieces
    (:mod:`meshshard.passes.unroll_scans`), read from its ``loss`` markers."""
    return [n for e in jaxpr.eqns if is_marker(e, "loss") for n in e.params.get("split_scans", ())]


def detached_notes(jaxpr) -> list[str]:
    """A plan note when ``meshshard.grad`` found pipeline boundaries that carry nothing
    the loss is differentiated through (its ``loss`` marker's ``detached`` count)."""
    n = sum(e.params.get("detached", 0) for e in jaxpr.eqns if is_marker(e, "loss"))
    if not n:
        return []
    return [
        f"{n} pipeline boundar{'y' if n == 1 else 'ies'} inside meshshard.grad carr"
        f"{'ies' if n == 1 else 'y'} no value the loss is differentiated through (layers "
        "under jax.lax.stop_gradient, such as a distillation teacher's, aux-only layers, "
        "or layers before the first differentiated weight): not a stage boundary; those "
        "layers run in the stage of the layer they stand in"
    ]
