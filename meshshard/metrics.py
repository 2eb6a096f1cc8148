"""How ``has_aux`` metrics and the loss combine over micro-batches.

A pipelined step runs the loss function once per micro-batch; the full-batch step runs
it once.  Each value ``meshshard.grad`` returns is combined over micro-batches with a
*reduction* so that the result equals the full-batch value:

* ``mean``: exact for a mean over the batch (and for values that do not depend on the
  batch);
* ``sum``: exact for a sum over the batch (counts, summed losses);
* ``max`` / ``min``: exact for a maximum / minimum over the batch.

The compiler finds the reduction by tracing the step at micro-batch and full-batch
shape; a value can declare it with a marker (``aux_sum(x)``) or with
``meshshard.value_and_grad(..., aux_reduce={"name": "sum"})``.

>>> import jax.numpy as jnp
>>> aux_max(jnp.float32(3.0))
Array(3., dtype=float32)
"""

from __future__ import annotations

from meshshard._compat import Primitive, instantiate_zeros, register_identity_rules
from meshshard.errors import MeshshardInputError

__all__ = ["REDUCTIONS", "aux_max", "aux_mean", "aux_min", "aux_reduce_p", "aux_sum"]

REDUCTIONS = ("mean", "sum", "max", "min")

aux_reduce_p = Primitive("aux_reduce")
aux_reduce_p.multiple_results = True
aux_reduce_p.def_impl(lambda *xs, reduce: list(xs))
aux_reduce_p.def_abstract_eval(lambda *avals, reduce: list(avals))


def _jvp(primals, tangents, *, reduce):
    return aux_reduce_p.bind(*primals, reduce=reduce), [instantiate_zeros(t) for t in tangents]


def _transpose(cts, *xs, reduce):
    return [instantiate_zeros(c) for c in cts]


register_identity_rules(aux_reduce_p, _jvp, _transpose)


def check_reduction(reduce: str, where: str) -> str:
    """``reduce`` if it is a known reduction, else an error naming ``where``."""
    if reduce not in REDUCTIONS:
        raise MeshshardInputError(f"{where}: unknown reduction {reduce!r}; use one of {REDUCTIONS}")
    return reduce


def aux_reduce(x, reduce: str):
    """Mark ``x`` (an aux value of the loss function) as combined with ``reduce``."""
    check_reduction(reduce, "meshshard.aux_reduce")
    (out,) = aux_reduce_p.bind(x, reduce=reduce)
    return out


def aux_sum(x):
    """Mark an aux value as a sum over the batch (micro-batches' values are added)."""
    return aux_reduce(x, "sum")


def aux_mean(x):
    """Mark an aux value as a mean over the batch (micro-batches' values are averaged)."""
    return aux_reduce(x, "mean")


def aux_max(x):
    """Mark an aux value as a maximum over the batch."""
    return aux_reduce(x, "max")


def aux_min(x):
    """Mark an aux value as a minimum over the batch."""
    return aux_reduce(x, "min")
