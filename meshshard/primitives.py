"""The pipeline-boundary primitive, and the loss-share primitive.

``mark_pipeline_boundary()`` in a model's forward pass records where one layer ends
and the next begins.  It is an identity: a single-device ``jax.jit`` of the same step
computes exactly what it would without it.  Under ``meshshard.grad`` each boundary
carries the values that cross it; its JVP marks the tangents and its transpose marks
the cotangents, so the backward pass holds a *mirrored* boundary for every forward one.
The compiler slices the traced step at these markers.
"""

from __future__ import annotations

import numpy as np

from meshshard._compat import Primitive, instantiate_zeros, register_identity_rules

__all__ = ["boundary_p", "loss_share_p", "mark_pipeline_boundary", "MARKER_KINDS"]

#: ``mark``: a user's marker (no operands); ``fwd``/``bwd``: a layer boundary in the forward
#: pass and its mirror in the backward pass; ``loss``/``loss_bwd``: the loss value and its
#: seed cotangent; ``grad_end``: the values ``meshshard.grad`` returns (loss, aux, gradients),
#: with a ``reduce`` parameter: per operand (label, reduction over micro-batches, source);
#: ``out``: the results of a forward-only step run with micro-batches, with the same
#: ``reduce`` parameter (``concat`` results are ``num_micro_batches`` times longer).
#: A ``loss_bwd`` marker may carry a ``scale`` parameter: it multiplies the seed
#: cotangent (each micro-batch's share of a mean loss, ``passes/loss_seed.py``).
MARKER_KINDS = ("mark", "fwd", "bwd", "loss", "loss_bwd", "grad_end", "out")

boundary_p = Primitive("pipeline_boundary")
boundary_p.multiple_results = True


def _scales(params) -> bool:
    """Whether a marker with ``params`` multiplies its operands (a scaled seed)."""
    return params.get("kind") in ("loss_bwd", "loss") and bool(params.get("scale"))


def _impl(*args, kind, index, **params):
    if _scales(dict(params, kind=kind)):
        return [x * np.asarray(params["scale"], x.dtype) for x in args]
    return list(args)


def _abstract_eval(*avals, kind, index, **params):
    m = params.get("num_micro_batches")
    if kind not in ("out", "grad_end") or m is None:
        return list(avals)
    return [
        a.update(shape=(a.shape[0] * m, *a.shape[1:])) if red == "concat" else a
        for a, (_, red, _) in zip(avals, params["reduce"], strict=True)
    ]


_MIRROR = {"fwd": "bwd", "bwd": "fwd", "loss": "loss_bwd", "loss_bwd": "loss"}


def _jvp(primals, tangents, *, kind, index, **params):
    outs = boundary_p.bind(*primals, kind=kind, index=index, **params)
    tangents = [instantiate_zeros(t) for t in tangents]
    return outs, boundary_p.bind(*tangents, kind=kind, index=index, **params)


def _transpose(cts, *args, kind, index, **params):
    cts = [instantiate_zeros(c) for c in cts]
    return boundary_p.bind(*cts, kind=_MIRROR.get(kind, kind), index=index, **params)


boundary_p.def_impl(_impl)
boundary_p.def_abstract_eval(_abstract_eval)
register_identity_rules(boundary_p, _jvp, _transpose, impl=_impl, computes=_scales)


#: One term of a loss that adds terms combining differently over micro-batches, taken
#: as its share of one micro-batch: the term times ``scale`` (``1/M``).  A summed loss
#: plus a mean (a masked token loss plus an unmasked auxiliary mean) or plus a constant
#: (a weight penalty) is the sum over micro-batches of each micro-batch's sum plus
#: ``1/M`` of the other terms; the compiler puts this primitive on those terms
#: (:mod:`meshshard.passes.reductions`), and its transpose scales their cotangents alike.
loss_share_p = Primitive("loss_share")
loss_share_p.multiple_results = True


def _share_impl(*args, scale):
    return [x * np.asarray(scale, x.dtype) for x in args]


def _share_jvp(primals, tangents, *, scale):
    tangents = [instantiate_zeros(t) for t in tangents]
    return loss_share_p.bind(*primals, scale=scale), loss_share_p.bind(*tangents, scale=scale)


def _share_transpose(cts, *args, scale):
    return loss_share_p.bind(*[instantiate_zeros(c) for c in cts], scale=scale)


loss_share_p.def_impl(_share_impl)
loss_share_p.def_abstract_eval(lambda *avals, scale: list(avals))
register_identity_rules(loss_share_p, _share_jvp, _share_transpose, impl=_share_impl)


def mark_pipeline_boundary(*values):
    """Mark the end of a layer in a model's forward pass.

    Called with no arguments (the usual form, between layers inside a Flax module's
    ``__call__``) it records a boundary and returns ``None``; ``meshshard.grad`` later
    decides which values cross it.  Called with arrays it returns them unchanged and
    marks exactly those as the boundary's values.  Either way it computes nothing.

    >>> import jax.numpy as jnp
    >>> mark_pipeline_boundary(jnp.ones(2))[0].shape
    (2,)
    """
    if not values:
        boundary_p.bind(kind="mark", index=-1)
        return None
    return boundary_p.bind(*values, kind="fwd", index=-1)
