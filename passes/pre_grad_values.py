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
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import (
    bind_eqn,
    is_dropvar,
    is_literal,
    is_marker,
    read_var,
    retrace,
    user_line,
)
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import PRE_GRAD_LABEL, marker_reductions
from meshshard.passes.update_constants import after_grad_end

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


def update_reads_batch_message(where: str, eqn) -> str:
    """The refusal of a step whose update part (after ``meshshard.grad``) reads the
    batch leaf ``where`` in ``eqn`` together with what the grad computes (an accuracy of
    the updated parameters on the batch): the update runs once per step, without the
    batch."""
    return (
        f"the update part of the step (after meshshard.grad) reads the batch leaf {where} "
        f"({eqn.primitive.name} at {user_line(eqn)}), together with what the grad "
        "computes; it runs once per step on the meshes, without the batch: compute "
        "everything that needs the batch inside the loss function (return it as aux with "
        "has_aux=True). An optimizer whose update evaluates the loss again (optax.lbfgs's "
        "line search, value_fn=...; optax.contrib.sophia's obj_fn) cannot run here: give "
        "optax.lbfgs a step size instead (optax.lbfgs(learning_rate=..., linesearch=None)), "
        "or use an optimizer that takes gradients only"
    )


def refuse_update_batch_reads(closed: ClosedJaxpr, is_batch, wheres) -> None:
    """Raise MeshshardInputError if an equation after the ``grad_end`` marker reads a
    batch leaf (``is_batch``, named by ``wheres``) once the batch values the update may
    read have been passed through the marker (this pass) or moved in front of it
    (:mod:`~meshshard.passes.sink_metrics`): what remains reads the batch together with
    the grad's results, which no micro-batch can compute.  Checked before the passes
    that give the update the full batch's constants, which such a read breaks."""
    jaxpr = closed.jaxpr
    start = after_grad_end(jaxpr)
    if start is None:
        return
    leaf = {v: k for k, (v, b) in enumerate(zip(jaxpr.invars, is_batch, strict=False)) if b}
    for eqn in jaxpr.eqns[start:]:
        for v in eqn.invars:
            if not is_literal(v) and v in leaf:
                raise MeshshardInputError(update_reads_batch_message(wheres[leaf[v]], eqn))


def literals_past_grad(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` whose reads after the ``grad_end`` marker of an aux value that is a
    literal (``{"examples": jnp.float32(x.shape[0])}`` returned as aux) read the literal
    itself, not the marker's result for it: a constant needs no mesh to come from (its
    marker result was computed on none, and the update's placement failed on it), and
    a literal after the marker takes the full batch's value where the batch size made
    it (:mod:`~meshshard.passes.update_constants`)."""
    marker = next((e for e in closed.jaxpr.eqns if is_marker(e, "grad_end")), None)
    if marker is None or not any(is_literal(v) for v in marker.invars):
        return closed

    def hook(i, eqn, env, extra) -> bool:
        if not is_marker(eqn, "grad_end"):
            return False
        outs = bind_eqn(eqn, [read_var(env, a) for a in eqn.invars])
        for a, v, o in zip(eqn.invars, eqn.outvars, outs, strict=True):
            if not is_dropvar(v):
                env[v] = a.val if is_literal(a) else o
        return True

    return retrace(closed, hook)
