"""Pass: a running total scattered into after the grad becomes total plus a histogram.

``counts.at[pred].add(1)`` in the update part of a micro-batched step (a running
per-class count, a confusion matrix kept in the state) is one ``scatter-add`` whose
operand is the total and whose indices carry the batch.  Computed per micro-batch, as
every batch metric after the grad is (:mod:`~meshshard.passes.sink_metrics`), each
micro-batch would add its examples to the whole total, and no combination of the M
results gives the step's.  The same value written ``counts + jnp.zeros_like(counts)
.at[pred].add(1)`` is a histogram of the batch (a sum over micro-batches) added to the
total once, in the update, which is what this pass rewrites it to; the rest of the
compiler then treats it as any batch sum read after the grad.  The result equals
``jax.jit``'s up to the order of the additions.

>>> import jax, jax.numpy as jnp
>>> import meshshard
>>> def step(w, counts, x):
...     (loss, pred), g = meshshard.value_and_grad(
...         lambda w: (jnp.sum(x @ w), jnp.argmax(x, 1)), has_aux=True)(w)
...     return w - g, counts.at[pred].add(1)
>>> closed = jax.make_jaxpr(step)(jnp.ones(3), jnp.zeros(3, int), jnp.ones((2, 3)))
>>> names = lambda c: [e.primitive.name for e in c.jaxpr.eqns[-3:]]
>>> names(closed)
['broadcast_in_dim', 'broadcast_in_dim', 'scatter-add']
>>> names(split_scatter_totals(closed, [False, False, True]))  # zeros, scatter, add
['broadcast_in_dim', 'scatter-add', 'add']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_literal, read_var, retrace
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import all_zeros
from meshshard.passes.update_constants import after_grad_end

__all__ = ["split_scatter_totals"]


def split_scatter_totals(closed: ClosedJaxpr, is_batch) -> ClosedJaxpr:
    """``closed`` with each after-grad ``scatter-add`` into a value that does not
    depend on the batch, of indices or updates that do, written as that value plus the
    same scatter into zeros; ``closed`` itself when there is none."""
    jaxpr = closed.jaxpr
    start = after_grad_end(jaxpr)
    if start is None:
        return closed
    dep = batch_dependent(jaxpr, list(is_batch), len(jaxpr.eqns))
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    targets = set()
    for i in range(start, len(jaxpr.eqns)):
        e = jaxpr.eqns[i]
        if e.primitive.name != "scatter-add":
            continue
        total, *rest = e.invars
        batch_part = any(not is_literal(v) and v in dep for v in rest)
        if (
            batch_part
            and not (not is_literal(total) and total in dep)
            and not all_zeros(total, made)
        ):
            targets.add(i)
    if not targets:
        return closed

    def hook(i, eqn, env, extra) -> bool:
        if i not in targets:
            return False
        total, *rest = [read_var(env, v) for v in eqn.invars]
        (histogram,) = bind_eqn(eqn, [jnp.zeros_like(total), *rest])
        env[eqn.outvars[0]] = jax.lax.add(total, histogram)
        return True

    return retrace(closed, hook)
