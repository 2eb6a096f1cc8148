"""Pass 0c: make every random draw equal to the full-batch step's draw.

Semantics promised: the pipelined step draws exactly the random numbers that ``jax.jit``
of the unmodified step draws on the full batch.  Keys are never cut into micro-batches,
so a draw whose shape does not involve the batch (a noise scalar, a weight
perturbation) is already identical on every micro-batch.  A draw whose shape carries
the batch dimension (dropout masks, noise added to activations) is traced at micro-batch
shape as a *different* draw; this pass finds it by comparing the micro-batch trace with
the full-batch trace (equation by equation) and replaces it by the full-batch draw
followed by a slice at the micro-batch's offset, read from a new ``int32[1]`` input
holding the micro-batch index.

Why draw the full shape and slice rather than offset the counters: the slice is exact
for every PRNG implementation and every ``jax_threefry_partitionable`` setting (the
non-partitionable threefry makes each element depend on the total size), and uses only
public primitives.  The cost is generating ``M`` times the random bits of one
micro-batch per draw (elementwise, cheap next to the matmuls it masks); a counter-offset
rewrite for the partitionable threefry would remove it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax import lax

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import bind_eqn, is_dropvar, read_var, retrace

#: Primitives that draw random values with a ``shape`` parameter.
DRAW_PRIMITIVES = frozenset({"random_bits", "random_split"})

#: The extra input the rewritten step takes (the micro-batch index, ``int32[1]``).
INDEX_PATH = "<micro-batch index>"


@dataclass(frozen=True)
class BatchDraw:
    """Draw equation ``eqn`` carries the batch along its shape's ``axis`` (``size`` rows)."""

    eqn: int
    axis: int
    size: int
    full_shape: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"eqn {self.eqn}: draw {list(self.full_shape)}, slice axis {self.axis} by {self.size}"
        )


def find_batch_draws(micro: ClosedJaxpr, full: ClosedJaxpr, m: int) -> tuple[BatchDraw, ...]:
    """Draws of ``micro`` whose shape is ``1/m`` of the matching draw of ``full`` on one axis."""
    me, fe = micro.jaxpr.eqns, full.jaxpr.eqns
    draws_at = [i for i, e in enumerate(me) if e.primitive.name in DRAW_PRIMITIVES]
    if not draws_at or m == 1:
        return ()
    if [e.primitive.name for e in me] != [e.primitive.name for e in fe]:
        e = me[draws_at[0]]
        raise MeshshardInputError(
            f"the step draws random numbers ({e.primitive.name}) but traces to different "
            f"programs at micro-batch and full-batch shape ({len(me)} vs {len(fe)} "
            "equations), so meshshard cannot match each draw with the full batch's; make "
            "the step's Python control flow independent of the batch size"
        )
    out = []
    for i in draws_at:
        ms, fs = tuple(me[i].params["shape"]), tuple(fe[i].params["shape"])
        if ms == fs:
            continue
        axes = [d for d, (a, b) in enumerate(zip(ms, fs, strict=True)) if a != b]
        if len(ms) != len(fs) or len(axes) != 1 or fs[axes[0]] != m * ms[axes[0]]:
            raise MeshshardInputError(
                f"random draw {me[i].primitive.name} has shape {list(ms)} per micro-batch "
                f"but {list(fs)} on the full batch; meshshard can only slice a draw along "
                "one dimension that is the batch: draw with the batch as one dimension"
            )
        key_ndim = len(me[i].invars[0].aval.shape)
        out.append(BatchDraw(i, key_ndim + axes[0], ms[axes[0]], fs))
    return tuple(out)


def slice_batch_draws(closed: ClosedJaxpr, draws: tuple[BatchDraw, ...]) -> ClosedJaxpr:
    """``closed`` with each batch draw replaced by full draw + slice; adds the index input."""
    if not draws:
        return closed
    by_eqn = {d.eqn: d for d in draws}

    def hook(i, eqn, env, extra) -> bool:
        d = by_eqn.get(i)
        if d is None:
            return False
        (index,) = extra
        params = dict(eqn.params, shape=d.full_shape)
        full_eqn = eqn.replace(params=params)
        (full,) = bind_eqn(full_eqn, [read_var(env, v) for v in eqn.invars])
        start = index[0] * np.int32(d.size)
        part = lax.dynamic_slice_in_dim(full, start, d.size, axis=d.axis)
        if not is_dropvar(eqn.outvars[0]):
            env[eqn.outvars[0]] = part
        return True

    return retrace(closed, hook, (jax.ShapeDtypeStruct((1,), np.int32),))
