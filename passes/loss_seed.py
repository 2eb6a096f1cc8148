"""Pass 0e (after the reductions): seed each micro-batch's backward pass with its share of a mean loss.

``jax.grad`` seeds the backward pass with a cotangent of 1 on the loss.  A step run
with ``M`` micro-batches computes the loss of each micro-batch; when that loss is a
mean over the batch, each example weighs ``M`` times as much in its micro-batch's mean
as in the full batch's, so every cotangent inside the micro-batch's backward pass is
``M`` times the full-batch step's.  Averaging the micro-batches' gradients afterwards
gives the same gradient when the backward pass is linear in its cotangents, but not
when it is not: a custom derivative that clips or quantizes its cotangent, or a
low-precision backward that over- or underflows, sees other numbers than the
full-batch step.

This pass seeds the backward pass with ``1/M`` instead (the ``loss_bwd`` marker's
``scale``), as a gradient-accumulation loop that divides its loss by the number of
accumulation steps does: every cotangent then equals the full-batch step's, and the
micro-batches' gradients are *summed*.  The loss value itself is untouched and still
averaged.  A summed loss already has full-batch cotangents and is left as it is.
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import is_marker, set_marker_params

#: The ``source`` of a gradient's reduction when this pass decided it.
SHARE_SOURCE = "a 1/M share of the mean loss's gradient: the backward is seeded with 1/M"


def seed_micro_batch_shares(closed: ClosedJaxpr, reduce: tuple | None, m: int) -> tuple:
    """``(closed, reduce)`` with a mean loss's backward seeded with ``1/m`` and its
    gradients summed over the ``m`` micro-batches (unchanged for ``m == 1``, a summed
    loss, or a step without exactly one seed)."""
    if m == 1 or not reduce:
        return closed, reduce
    loss = next((red for label, red, _ in reduce if label == "loss"), None)
    seeds = [e for e in closed.jaxpr.eqns if is_marker(e, "loss_bwd")]
    if loss != "mean" or len(seeds) != 1:
        return closed, reduce

    shares = tuple(
        (label, "sum", SHARE_SOURCE) if label == "grad" else (label, red, source)
        for label, red, source in reduce
    )
    return set_marker_params(closed, "loss_bwd", scale=1.0 / m), shares
