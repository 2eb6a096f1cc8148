"""The one place meshshard touches JAX's semi-public interpreter APIs.

Defining a new primitive needs rule tables that JAX exposes under
``jax.interpreters`` (autodiff, batching, MLIR lowering) rather than in its top-level
API.  Keeping every such import here means a JAX upgrade breaks one file, not many.
One function, :func:`register_array_type`, imports ``jax._src``: JAX has no public way
to let its functions take an array type of another library.
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
    "register_array_type",
    "instantiate_zeros",
    "jit_static_positions",
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


def jit_static_positions(fn, num_args: int) -> tuple[int, ...]:
    """The argument positions (of a call with ``num_args`` positional arguments) that a
    ``jax.jit``-wrapped ``fn`` takes as static: its ``static_argnums`` and the positions
    of its ``static_argnames``; ``()`` for any other function.

    A jitted step given to ``parallelize`` must get its static values as Python values,
    not tracers, or ``jax.jit`` fails hashing them.  JAX has no public accessor for a
    jitted function's options, so this reads its ``_jit_info``; a JAX without it gives
    ``()`` (the user then names them with ``static_argnums``).

    >>> import functools, jax
    >>> @functools.partial(jax.jit, static_argnums=(2,), static_argnames=("mode",))
    ... def f(a, b, c, mode="x"):
    ...     return a
    >>> jit_static_positions(f, 4), jit_static_positions(f, 3), jit_static_positions(len, 1)
    ((2, 3), (2,), ())
    """
    import inspect

    info = getattr(fn, "_jit_info", None)
    if info is None:
        return ()
    try:
        nums = {i % num_args for i in info.static_argnums if -num_args <= i < num_args}
        names = tuple(info.static_argnames)
    except (AttributeError, TypeError):
        return ()
    if names:
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        nums |= {params.index(n) for n in names if n in params[:num_args]}
    return tuple(sorted(nums))


def register_array_type(cls: type, to_local) -> bool:
    """Let ``jax.numpy`` functions and jitted functions take ``cls`` instances (arrays
    with ``shape`` and ``dtype`` that live elsewhere) as arrays: JAX reads their abstract
    value from ``shape``/``dtype`` and computes on ``to_local(x)``, a ``jax.Array``.
    JAX 0.10 dropped ``__jax_array__`` for this, and its replacement, JAX's own type
    tables, is private; if a later JAX moves them this returns False and such a call
    fails as it did before (``meshshard.fetch`` still gives host copies)."""
    try:
        from jax._src import core, dtypes

        core.pytype_aval_mappings[cls] = lambda x: core.ShapedArray(x.shape, x.dtype)
        dtypes.register_canonicalize_value_handler(cls, to_local)
    except (ImportError, AttributeError, TypeError):
        return False
    return True
