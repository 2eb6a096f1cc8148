"""The one place meshshard touches JAX's semi-public interpreter APIs.

Defining a new primitive needs rule tables that JAX exposes under
``jax.interpreters`` (autodiff, batching, MLIR lowering) rather than in its top-level
API.  Keeping every such import here means a JAX upgrade breaks one file, not many.
Nothing here imports ``jax._src``.
"""

from __future__ import annotations

from jax.extend.core import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    jaxpr_as_fun,
)
from jax.interpreters import ad, batching, mlir

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "Var",
    "jaxpr_as_fun",
    "register_identity_rules",
    "instantiate_zeros",
]


def instantiate_zeros(x):
    """Turn a symbolic zero cotangent/tangent into a real zero array."""
    return ad.instantiate_zeros(x)


def register_identity_rules(
    prim: Primitive, jvp_rule, transpose_rule, impl=None, computes=None
) -> None:
    """Register autodiff, vmap and lowering rules for an identity-like primitive.

    ``impl`` (a multiple-results function of the operands and parameters) is lowered
    for the equations whose parameters ``computes(params)`` says are not the identity:
    a marker that may carry a scale factor."""
    ad.primitive_jvps[prim] = jvp_rule
    ad.primitive_transposes[prim] = transpose_rule

    def batch_rule(args, dims, **params):
        return prim.bind(*args, **params), dims

    batching.primitive_batchers[prim] = batch_rule
    if impl is None:
        mlir.register_lowering(prim, lambda ctx, *args, **params: list(args))
        return
    lowered = mlir.lower_fun(impl, multiple_results=True)
    computes = computes or (lambda params: True)
    mlir.register_lowering(
        prim,
        lambda ctx, *args, **params: (
            lowered(ctx, *args, **params) if computes(params) else list(args)
        ),
    )
