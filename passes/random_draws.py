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

Draws inside nested jaxprs are matched the same way, along the same nesting path in
both traces: a ``jax.checkpoint``/``nn.remat`` body (whose recomputation in the
backward pass must redraw the forward's mask), a ``scan`` body (``nn.scan``; each
iteration's draw is sliced the same way), ``cond`` branches, ``while`` bodies, ``jit``
calls and the primal function of a ``custom_jvp``/``custom_vjp``.  The micro-batch index
enters such a body as one more operand.  A draw carrying the batch inside any other
construct (``shard_map``...) is refused at plan time, naming the construct.

Why draw the full shape and slice rather than offset the counters: the slice is exact
for every PRNG implementation and every ``jax_threefry_partitionable`` setting (the
non-partitionable threefry makes each element depend on the total size), and uses only
public primitives.  The cost is generating ``M`` times the random bits of one
micro-batch per draw (elementwise, cheap next to the matmuls it masks); a counter-offset
rewrite for the partitionable threefry would remove it.

>>> import jax, jax.numpy as jnp
>>> def f(x, k):
...     return jax.checkpoint(lambda x: x * jax.random.normal(k, x.shape))(x)
>>> trace = lambda n: jax.make_jaxpr(f)(jnp.ones((n, 3)), jax.random.key(0))
>>> for d in find_batch_draws(trace(2), trace(8), 4):
...     print(d)
remat2 eqn 0 > jit eqn 0 > jit eqn 0 > jit eqn 0 > eqn 2: draw [8, 3], slice axis 0 by 2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import numpy as np
from jax import lax

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import bind_eqn, eval_eqns, is_dropvar, read_var, retrace
from meshshard.passes.reductions import paired_prefix

#: Primitives that draw random values with a ``shape`` parameter.
DRAW_PRIMITIVES = frozenset({"random_bits", "random_split"})

#: The extra input the rewritten step takes (the micro-batch index, ``int32[1]``).
INDEX_PATH = "<micro-batch index>"


@dataclass(frozen=True)
class Step:
    """One level of nesting: sub-jaxpr ``param`` (``branch``-th of a tuple) of equation
    ``eqn``, a ``primitive``."""

    eqn: int
    primitive: str
    param: str
    branch: int = 0

    def __str__(self) -> str:
        return f"{self.primitive} eqn {self.eqn}"


@dataclass(frozen=True)
class BatchDraw:
    """Draw equation ``eqn`` carries the batch along its shape's ``axis`` (``size`` rows).

    ``path`` leads from the step's top level to the (sub-)jaxpr holding the equation;
    empty for a top-level draw.
    """

    eqn: int
    axis: int
    size: int
    full_shape: tuple[int, ...]
    path: tuple[Step, ...] = ()

    def __str__(self) -> str:
        where = "".join(f"{s} > " for s in self.path)
        return (
            f"{where}eqn {self.eqn}: draw {list(self.full_shape)}, "
            f"slice axis {self.axis} by {self.size}"
        )


def _subs(eqn):
    """``(param, branch, jaxpr, consts)`` for each sub-jaxpr ``eqn`` holds, in param order."""
    for name, p in eqn.params.items():
        for k, x in enumerate(p if isinstance(p, tuple | list) else (p,)):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                yield name, k, j, tuple(getattr(x, "consts", ()))


def _first_draw(jaxpr) -> str | None:
    """The primitive name of the first draw in ``jaxpr`` or its sub-jaxprs; None if none."""
    for e in jaxpr.eqns:
        if e.primitive.name in DRAW_PRIMITIVES:
            return e.primitive.name
        for s in _subs(e):
            name = _first_draw(s[2])
            if name is not None:
                return name
    return None


def find_batch_draws(micro: ClosedJaxpr, full: ClosedJaxpr, m: int) -> tuple[BatchDraw, ...]:
    """Draws of ``micro`` whose shape is ``1/m`` of the matching draw of ``full`` on one
    axis, at any nesting depth.  Raises if such a draw sits where it cannot be sliced."""
    if m == 1:
        return ()
    draws = tuple(_find(micro.jaxpr, full.jaxpr, m, ()))
    for d in draws:
        _check_enterable(d)
    return draws


def _find(mj, fj, m: int, path: tuple[Step, ...]) -> list[BatchDraw]:
    """The batch draws of ``mj`` (and its sub-jaxprs), matched with ``fj``'s by position.

    The traces need to pair only up to their last draw: with one-row micro-batches JAX
    traces the backward's transposes of size-1 broadcasts as other equations, after the
    forward's dropout masks."""
    me, fe = mj.eqns, fj.eqns
    draw = _first_draw(mj)
    if draw is None:
        return []
    paired = paired_prefix(mj, fj)
    late = _first_draw(mj.replace(eqns=me[paired:])) if paired < len(me) else None
    if late is not None:
        raise _different_programs(late, path, f"{len(me)} vs {len(fe)} equations")
    out = []
    for i, (a, b) in enumerate(zip(me[:paired], fe[:paired], strict=True)):
        if a.primitive.name in DRAW_PRIMITIVES:
            d = _batch_draw(a, b, m, i, path)
            if d is not None:
                out.append(d)
        subs_a, subs_b = list(_subs(a)), list(_subs(b))
        if [s[:2] for s in subs_a] != [s[:2] for s in subs_b]:
            raise _different_programs(draw, path, f"{a.primitive.name} eqn {i} differs")
        for (name, k, sa, _), (_, _, sb, _) in zip(subs_a, subs_b, strict=True):
            out += _find(sa, sb, m, (*path, Step(i, a.primitive.name, name, k)))
    return out


def _different_programs(draw: str, path: tuple[Step, ...], how: str) -> MeshshardInputError:
    where = f" inside {' > '.join(map(str, path))}" if path else ""
    return MeshshardInputError(
        f"the step draws random numbers ({draw}) but traces to different programs at "
        f"micro-batch and full-batch shape{where} ({how}), so meshshard cannot match each "
        "draw with the full batch's; make the step's Python control flow independent of "
        "the batch size (with micro-batches of one row, JAX itself traces some size-1 "
        "dimensions otherwise: two rows or more avoid that)"
    )


def _batch_draw(a, b, m: int, i: int, path) -> BatchDraw | None:
    """The :class:`BatchDraw` of micro draw ``a`` against full draw ``b``; None if equal."""
    ms, fs = tuple(a.params["shape"]), tuple(b.params["shape"])
    if ms == fs:
        return None
    axes = [d for d, (x, y) in enumerate(zip(ms, fs, strict=False)) if x != y]
    if len(ms) != len(fs) or len(axes) != 1 or fs[axes[0]] != m * ms[axes[0]]:
        where = f" inside {' > '.join(map(str, path))}" if path else ""
        raise MeshshardInputError(
            f"random draw {a.primitive.name}{where} has shape {list(ms)} per micro-batch "
            f"but {list(fs)} on the full batch; meshshard can only slice a draw along "
            "one dimension that is the batch: draw with the batch as one dimension"
        )
    key_ndim = len(a.invars[0].aval.shape)
    return BatchDraw(i, key_ndim + axes[0], ms[axes[0]], fs, path)


def _check_enterable(d: BatchDraw) -> None:
    """Refuse a batch draw nested in a construct the rewrite cannot thread the index into."""
    for s in d.path:
        if s.primitive not in _RULES:
            raise MeshshardInputError(
                f"a random draw of shape {list(d.full_shape)} (full batch) inside a "
                f"{s.primitive} equation ({d}) carries the batch, and meshshard cannot "
                f"slice a draw inside {s.primitive} per micro-batch; draw the random "
                f"values (e.g. the dropout mask) outside the {s.primitive} function and "
                "pass them in, or use num_micro_batches=1"
            )


def slice_batch_draws(closed: ClosedJaxpr, draws: tuple[BatchDraw, ...]) -> ClosedJaxpr:
    """``closed`` with each batch draw replaced by full draw + slice; adds the index input."""
    if not draws:
        return closed

    at = _by_eqn(draws)

    def hook(i, eqn, env, extra) -> bool:
        (index,) = extra
        return _rewrite_eqn(eqn, env, at.get(i, ()), index)

    return retrace(closed, hook, (jax.ShapeDtypeStruct((1,), np.int32),))


def _by_eqn(draws) -> dict[int, list[BatchDraw]]:
    """``draws`` (paths relative to one jaxpr) by the equation of that jaxpr they are in."""
    at: dict[int, list[BatchDraw]] = {}
    for d in draws:
        at.setdefault(d.path[0].eqn if d.path else d.eqn, []).append(d)
    return at


def _rewrite_eqn(eqn, env: dict, draws, index) -> bool:
    """Bind ``eqn`` with ``draws`` (it, or draws inside it) sliced; False if there are none."""
    if not draws:
        return False
    here = [d for d in draws if not d.path]
    below = [d for d in draws if d.path]
    invals = [read_var(env, v) for v in eqn.invars]
    if here:
        (d,) = here
        (full,) = bind_eqn(eqn.replace(params=dict(eqn.params, shape=d.full_shape)), invals)
        outs = [lax.dynamic_slice_in_dim(full, index[0] * np.int32(d.size), d.size, d.axis)]
    else:

        def sub(param: str, branch: int = 0) -> tuple:
            return tuple(
                replace(d, path=d.path[1:])
                for d in below
                if (d.path[0].param, d.path[0].branch) == (param, branch)
            )

        outs = _RULES[eqn.primitive.name](eqn, invals, sub, index)
    for var, val in zip(eqn.outvars, outs, strict=True):
        if not is_dropvar(var):
            env[var] = val
    return True


def _eval(jaxpr, consts, args, draws, index) -> list:
    """Evaluate ``jaxpr`` on ``args`` with ``draws`` (paths relative to it) sliced."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    at = _by_eqn(draws)
    eval_eqns(jaxpr.eqns, env, on_eqn=lambda i, e, env: _rewrite_eqn(e, env, at.get(i, ()), index))
    return [read_var(env, v) for v in jaxpr.outvars]


def _closed(eqn, param: str, branch: int = 0) -> tuple:
    """``(jaxpr, consts)`` of one sub-jaxpr of ``eqn``."""
    x = eqn.params[param]
    x = x[branch] if isinstance(x, tuple | list) else x
    return getattr(x, "jaxpr", x), tuple(getattr(x, "consts", ()))


# --- one rule per construct the index is threaded into -------------------------------
# ``rule(eqn, invals, sub, index) -> outputs``; ``sub(param, branch)`` gives the draws
# inside that sub-jaxpr.  Each re-binds the construct with the index as one more
# operand: the public ``lax`` control flow closes over it; remat gets it as an input.


def _inline_rule(eqn, invals, sub, index) -> list:
    """A ``jit`` call: evaluated in place (``passes/inline.py`` does this at top level).

    Also a ``custom_jvp``/``custom_vjp`` call: the traced step already holds its
    backward pass and is never differentiated again, so only the primal function (the
    ``call_jaxpr``, what ``jax.jit`` runs too) is evaluated; the rule is not needed.
    """
    param = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
    jaxpr, consts = _closed(eqn, param)
    return _eval(jaxpr, consts, invals, sub(param), index)


def _remat_rule(eqn, invals, sub, index) -> list:
    """``jax.checkpoint``: the same primitive and params, its body taking the index last
    (so the backward pass's recomputation redraws exactly the forward's mask)."""
    jaxpr, _ = _closed(eqn, "jaxpr")
    draws = sub("jaxpr")
    avals = [_sds(v.aval) for v in jaxpr.invars]
    traced = jax.make_jaxpr(lambda *a: _eval(jaxpr, (), a[:-1], draws, a[-1]))(
        *avals, jax.ShapeDtypeStruct((1,), np.int32)
    )
    tj = traced.jaxpr  # remat bodies take no consts: they become leading operands
    body = tj.replace(constvars=[], invars=[*tj.constvars, *tj.invars])
    params = dict(eqn.params, jaxpr=body)
    cse = params.get("prevent_cse")
    if isinstance(cse, tuple):  # per operand
        params["prevent_cse"] = (False,) * len(traced.consts) + cse + (False,)
    return list(eqn.primitive.bind(*traced.consts, *invals, index, **params))


def _scan_rule(eqn, invals, sub, index) -> list:
    """``lax.scan``: each iteration's draw is the full-batch draw of that iteration, sliced."""
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    jaxpr, consts = _closed(eqn, "jaxpr")
    draws = sub("jaxpr")
    cs, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

    def body(carry, x):
        outs = _eval(jaxpr, consts, [*cs, *carry, *x], draws, index)
        return outs[:nk], outs[nk:]

    carry, ys = lax.scan(
        body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _cond_rule(eqn, invals, sub, index) -> list:
    """``lax.cond``/``lax.switch``: every branch rewritten, the index closed over."""
    branches = [
        lambda *ops, k=k: _eval(*_closed(eqn, "branches", k), ops, sub("branches", k), index)
        for k in range(len(eqn.params["branches"]))
    ]
    return list(lax.switch(invals[0], branches, *invals[1:]))


def _while_rule(eqn, invals, sub, index) -> list:
    """``lax.while_loop``: condition and body rewritten, the index closed over."""
    p = eqn.params
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    cj, cconsts = _closed(eqn, "cond_jaxpr")
    bj, bconsts = _closed(eqn, "body_jaxpr")

    def cond(c):
        return _eval(cj, cconsts, [*cc, *c], sub("cond_jaxpr"), index)[0]

    def body(c):
        return _eval(bj, bconsts, [*bc, *c], sub("body_jaxpr"), index)

    return list(lax.while_loop(cond, body, list(init)))


def _sds(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


#: How the index is threaded into each construct that may hold a batch draw; a draw
#: inside any other is refused (:func:`_check_enterable`).
_RULES: dict[str, Callable] = {
    "jit": _inline_rule,
    "pjit": _inline_rule,
    "closed_call": _inline_rule,
    "core_call": _inline_rule,
    "custom_jvp_call": _inline_rule,
    "custom_vjp_call": _inline_rule,
    "remat2": _remat_rule,
    "checkpoint": _remat_rule,
    "scan": _scan_rule,
    "cond": _cond_rule,
    "while": _while_rule,
}
