"""Pass 0a'''': pass the batch values a step computes before ``meshshard.grad`` and reads
after it through the grad's marker, as aux values.

A step may compute per-example values outside the loss function and use them both in
the loss and in the update.  MoCo encodes its keys with a momentum encoder before the
grad, contrasts the queries with them inside the loss, and enqueues them afterwards::

    k = jax.lax.stop_gradient(key_encoder(kparams, batch["x2"]))
    loss, grads = meshshard.value_and_grad(lambda p: contrast(p, batch["x1"], k, queue))(p)
    queue = jnp.concatenate([k, queue])[:K]

Everything before the grad runs per micro-batch inside a stage program, and the update
runs once per step, so it cannot read one micro-batch's ``k``.  The values returned as
aux from the loss function face the same problem and are combined over micro-batches
(per-example rows concatenated, sums added, means averaged; see
:mod:`~meshshard.passes.reductions`).  This pass gives such values the same treatment,
as if the user had returned them as aux: each batch-dependent value computed before the
``grad_end`` marker that an equation after it (or the step's output) reads becomes a
new operand of the marker, labelled ``before meshshard.grad #k``, and the reads after
the marker see the marker's result.  Values that do not depend on the batch are left to
:mod:`~meshshard.passes.hoist`, which recomputes them in the update.
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import PRE_GRAD_LABEL, marker_reductions

#: The label of a value this pass passes through the ``grad_end`` marker (``#k`` in order).
LABEL = PRE_GRAD_LABEL


def read_after_grad(jaxpr, is_batch) -> list:
    """The batch-dependent values computed before the ``grad_end`` marker that an
    equation after it, or the step's output, reads (in order of first read)."""
    g = next((i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)
    if g is None:
        return []
    dep = batch_dependent(jaxpr, list(is_batch) + [False] * (len(jaxpr.invars) - len(is_batch)), g)
    made = {v for e in jaxpr.eqns[:g] for v in e.outvars}
    late = [v for e in jaxpr.eqns[g + 1 :] for v in e.invars] + list(jaxpr.outvars)
    return list(dict.fromkeys(v for v in late if not is_literal(v) and v in made and v in dep))


def pass_through_grad(closed: ClosedJaxpr, is_batch) -> ClosedJaxpr:
    """``closed`` with the values of :func:`read_after_grad` carried through the
    ``grad_end`` marker as aux operands, which the reads after it see."""
    values = read_after_grad(closed.jaxpr, is_batch)
    if not values:
        return closed
    labels = tuple((f"{LABEL} #{k}", "", "") for k in range(len(values)))

    def hook(i, eqn, env, extra) -> bool:
        if not is_marker(eqn, "grad_end"):
            return False
        n = len(eqn.invars)
        reduce = marker_reductions(eqn) + labels
        marker = eqn.replace(params=dict(eqn.params, reduce=reduce))
        outs = bind_eqn(marker, [read_var(env, a) for a in eqn.invars] + [env[v] for v in values])
        for v, o in zip(eqn.outvars, outs[:n], strict=True):
            if not is_dropvar(v):
                env[v] = o
        for v, o in zip(values, outs[n:], strict=True):
            env[v] = o  # read after the marker: its result
        return True

    return retrace(closed, hook)
