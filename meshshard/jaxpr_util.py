"""Small helpers over jaxprs shared by the compiler and the runtime."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax.extend import source_info_util

from meshshard._compat import DropVar, JaxprEqn, Literal
from meshshard.primitives import boundary_p


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """Folders of code that is not the user's: the standard library, JAX, Flax, Optax
    and meshshard itself."""
    import flax
    import jax
    import jaxlib
    import optax

    import meshshard
    import meshshard.passes
    import meshshard.runtime

    pkgs = (os, jax, jaxlib, flax, optax, meshshard, meshshard.passes, meshshard.runtime)
    return tuple(os.path.dirname(m.__file__) + os.sep for m in pkgs)


def user_frame(eqn: JaxprEqn):
    """The innermost frame of user code in ``eqn``'s traceback (frames of the standard
    library, JAX, Flax, Optax and meshshard skipped), or None."""
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or ()
    return next((f for f in frames if not f.file_name.startswith(_library_folders())), None)


def user_line(eqn: JaxprEqn) -> str:
    """``file:line (function)`` of the innermost frame of user code that made ``eqn``,
    or ``<unknown>``; frames of JAX, Flax, Optax and meshshard are skipped."""
    f = user_frame(eqn)
    if f is None:
        return "<unknown>"
    return f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"


def with_caller_source(eqn: JaxprEqn, caller: JaxprEqn) -> JaxprEqn:
    """``eqn`` (from the body of ``caller``, a call being inlined) with ``caller``'s
    traceback when its own names no line of user code: a jitted library function's
    body (``jnp.var``) keeps the frames of wherever JAX first traced it, which says
    nothing about this call site."""
    if user_frame(eqn) is not None or user_frame(caller) is None:
        return eqn
    return eqn.replace(source_info=eqn.source_info.replace(traceback=caller.source_info.traceback))


def is_marker(eqn: JaxprEqn, *kinds: str) -> bool:
    """True if ``eqn`` is a pipeline-boundary marker (of one of ``kinds`` when given)."""
    return eqn.primitive is boundary_p and (not kinds or eqn.params["kind"] in kinds)


def bind_eqn(eqn: JaxprEqn, invals: Sequence) -> list:
    """Evaluate one equation on concrete values or tracers; returns its outputs as a list.

    The new equation keeps ``eqn``'s traceback, so messages can name the user's line
    that made it (as ``jax.core.eval_jaxpr`` does), however often passes re-trace it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with source_of(eqn), eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def source_of(eqn: JaxprEqn):
    """A context in which new equations take ``eqn``'s traceback: equations a pass binds
    in place of ``eqn`` then name the user's line that made it."""
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack()
    )


def eval_eqns(
    eqns: Sequence[JaxprEqn],
    env: dict,
    *,
    on_eqn: Callable[[int, JaxprEqn, dict], bool] | None = None,
) -> dict:
    """Evaluate ``eqns`` in order, reading and writing ``env`` (Var -> value).

    ``on_eqn(i, eqn, env)`` may handle an equation itself and return True to skip the
    default evaluation (used to rewrite markers).  Returns ``env``.
    """

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for i, eqn in enumerate(eqns):
        if on_eqn is not None and on_eqn(i, eqn, env):
            continue
        outs = bind_eqn(eqn, [read(v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val
    return env


def read_var(env: dict, v):
    """Value of a jaxpr atom (a Var in ``env`` or a Literal)."""
    return v.val if isinstance(v, Literal) else env[v]


def is_dropvar(v) -> bool:
    """True for the ``_`` placeholder jaxprs use for unused outputs."""
    return isinstance(v, DropVar)


def var_ids(jaxpr) -> dict:
    """Stable integer ids for every variable: inputs, then constants, then equation outputs.

    Two traces of the same program give the same ids, which is how a plan names values.
    """
    ids: dict = {}
    for v in (*jaxpr.invars, *jaxpr.constvars):
        ids[v] = len(ids)
    for e in jaxpr.eqns:
        for v in e.outvars:
            if not isinstance(v, DropVar):
                ids[v] = len(ids)
    return ids


def sub_jaxprs(eqn: JaxprEqn):
    """The jaxprs an equation holds in its params (pjit, remat, custom_jvp, cond branches...),
    so a walk over a program can look inside calls instead of stopping at them."""
    for p in eqn.params.values():
        for x in p if isinstance(p, tuple | list) else (p,):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                yield j


def paired_bodies(em: JaxprEqn, ef: JaxprEqn):
    """The sub-jaxprs of ``em`` paired with ``ef``'s (the same equation traced at another
    batch size) whose inputs are the equation's own (a call's, a checkpoint's, a scan's,
    a custom derivative's; not a cond's branches) and whose equations pair one to one."""
    for bm, bf in zip(sub_jaxprs(em), sub_jaxprs(ef), strict=False):
        if len(bm.invars) == len(em.invars) and [e.primitive for e in bm.eqns] == [
            e.primitive for e in bf.eqns
        ]:
            yield bm, bf


def is_inexact(v) -> bool:
    """True for a variable of a floating or complex type: one that carries gradients and
    partial sums (integer indices and masks do not)."""
    return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact)


def is_literal(v) -> bool:
    """True for a jaxpr literal operand."""
    return isinstance(v, Literal)


def retrace(closed, on_eqn=None, extra_inputs: Sequence = (), *, prepare=None, finish=None):
    """Re-express ``closed`` as a new ClosedJaxpr by evaluating it under ``jax.make_jaxpr``.

    The compiler's jaxpr rewrites are written this way (public API, no jaxpr surgery):
    ``on_eqn(i, eqn, env, extra)`` may bind replacement equations and return True, with
    ``extra`` the tracers of ``extra_inputs`` (``jax.ShapeDtypeStruct``s appended as new
    inputs after the original ones).  ``prepare(env)`` runs once the inputs are bound;
    ``finish(values)`` maps the output values before they are returned.
    """
    import jax

    jaxpr = closed.jaxpr
    n = len(jaxpr.invars)

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, args[:n], strict=True))
        if prepare is not None:
            prepare(env)
        extra = args[n:]
        hook = None if on_eqn is None else (lambda i, e, env: on_eqn(i, e, env, extra))
        eval_eqns(jaxpr.eqns, env, on_eqn=hook)
        outs = [read_var(env, v) for v in jaxpr.outvars]
        return outs if finish is None else finish(outs)

    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in jaxpr.invars
    ]
    return jax.make_jaxpr(run)(*avals, *extra_inputs)


def set_marker_params(closed, kind: str, **params):
    """``closed`` with every boundary marker of ``kind`` given ``params`` (the others
    kept): how a pass records a decision on a marker (the ``grad_end`` reductions, the
    ``loss_bwd`` seed's scale)."""

    def hook(i, eqn, env, extra) -> bool:
        if not is_marker(eqn, kind):
            return False
        e = eqn.replace(params=dict(eqn.params, **params))
        outs = bind_eqn(e, [read_var(env, v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not is_dropvar(v):
                env[v] = o
        return True

    return retrace(closed, hook)


def itemsize(dtype) -> int:
    """Bytes per element of a jaxpr value's dtype, JAX's extended dtypes (PRNG keys, as
    ``nn.RNN`` and dropout put in a step) included: NumPy cannot interpret those."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return np.dtype(dtype).itemsize


def aval_size(aval) -> int:
    """Elements of a jaxpr value's abstract value (0-d: 1; tokens and the like: 1)."""
    import numpy as np

    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def aval_nbytes(aval) -> int:
    """Bytes of a jaxpr value's abstract value (0 for one without a dtype, a token)."""
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else aval_size(aval) * itemsize(dtype)


def contraction_flops(eqn: JaxprEqn) -> float | None:
    """FLOPs of a matmul or a convolution (``2 * out * contracted``), None for any other
    equation: the compiler's cost models price these by arithmetic, the rest by bytes.

    A convolution contracts each output element over its kernel's input features and
    window, ``kernel size / output features`` whatever the dimension numbers' layout
    (HWIO, OIHW, or the swapped ones of its own gradients) and group counts.
    """
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = 1
        for d in lhs_contract:
            k *= int(lhs[d])
        return 2.0 * aval_size(eqn.outvars[0].aval) * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = int(rhs[eqn.params["dimension_numbers"].rhs_spec[0]])
        return (
            2.0 * aval_size(eqn.outvars[0].aval) * (aval_size(eqn.invars[1].aval) // out_features)
        )
    return None


def without_markers(closed):
    """``closed`` with every pipeline marker replaced by its operands: the step as one
    program, for a step that runs on one stage and one micro-batch (markers are
    identities until a pass gives one a ``scale``)."""

    def hook(i, eqn, env, extra) -> bool:
        if eqn.primitive is not boundary_p:
            return False
        for dst, src in zip(eqn.outvars, eqn.invars, strict=True):
            if not is_dropvar(dst):
                env[dst] = read_var(env, src)
        return True

    return retrace(closed, hook)
