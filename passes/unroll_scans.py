"""Pass: cut a loss function's scans over stacked layers into pieces a pipeline can split.

Large models stack their layers' weights and run them with one ``lax.scan`` (Flax
``nn.scan``, MaxText's ``scan_layers``).  Stages are cut only between top-level
equations, so such a scan is one indivisible equation: every layer lands in one stage,
and a ``mark_pipeline_boundary()`` in the scanned layer could not be honoured.  This
pass rewrites those scans as equivalent top-level code:

* a scan whose body calls ``mark_pipeline_boundary()`` is unrolled, one copy of the
  body per iteration, so each iteration's marker becomes a boundary (as if the layers
  had been written in a Python loop);
* for ``PipeshardParallel(layers=N)``, a scan over stacked layers (a float operand it
  scans over comes from the differentiated weights alone, and its body holds a matmul
  or convolution) is split into consecutive shorter scans over slices of its operands,
  which the layer clustering may cut between; under the sharding ILP (which would lay
  a scan out as one unit, every layer alike) it is unrolled.  A scan over time or over
  the batch is left whole (the ILP splits it as its body allows).

What is computed is unchanged: the pieces run the same body over the same slices, in
the same order, carrying the same values.  The stacked weights stay one array, read by
every stage holding a piece; their gradient is the sum of the pieces' (as for a weight
shared between stages).

    >>> import jax, jax.numpy as jnp
    >>> def f(ws, x):
    ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()
    >>> closed = jax.make_jaxpr(f)(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
    >>> [e.params["length"] for e in split_scans(closed, {0: 2}).jaxpr.eqns if e.primitive.name == "scan"]
    [2, 2]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import (
    bind_eqn,
    eval_eqns,
    is_literal,
    is_marker,
    read_var,
    retrace,
    source_of,
    sub_jaxprs,
    user_line,
)
from meshshard.passes.inline import eval_inlined, inline_hook
from meshshard.passes.layer_cluster import is_heavy

__all__ = [
    "has_marker",
    "marked_scans",
    "layer_stack_scans",
    "counter_indexed_stacks",
    "scan_over_counter_stacks",
    "counter_note",
    "split_scans",
    "piece_bounds",
    "split_note",
]


def has_marker(jaxpr, kinds: tuple[str, ...] = ("mark",)) -> bool:
    """True if ``jaxpr`` holds a marker of ``kinds`` anywhere, nested calls included (by
    default a ``mark_pipeline_boundary()`` call)."""
    return any(
        is_marker(e, *kinds) or any(has_marker(j, kinds) for j in sub_jaxprs(e)) for e in jaxpr.eqns
    )


def _unrolls(eqn) -> bool:
    """A scan whose body marks a boundary, and takes no ``meshshard.grad`` (gradients
    accumulated by hand over chunks are refused by name, not unrolled into many grads)."""
    if not _is_scan(eqn):
        return False
    body = eqn.params["jaxpr"].jaxpr
    return has_marker(body) and not has_marker(body, ("grad_end",))


def _is_scan(eqn) -> bool:
    return eqn.primitive.name == "scan"


def marked_scans(jaxpr) -> dict[int, int]:
    """``{equation index: length}`` of the top-level scans whose body calls
    ``mark_pipeline_boundary()``: each is to be unrolled completely."""
    return {i: e.params["length"] for i, e in enumerate(jaxpr.eqns) if _unrolls(e)}


def layer_stack_scans(jaxpr, weights: Sequence[bool]) -> list[int]:
    """Indices of the top-level scans over stacked layers: a float operand scanned over
    is computed from the inputs flagged in ``weights`` alone (the differentiated
    arguments), and the body holds a matmul or convolution."""
    found = []
    for i, e, pure in _heavy_scans(jaxpr, weights):
        start = e.params["num_consts"] + e.params["num_carry"]
        xs = e.invars[start:]
        if any(
            not is_literal(v) and v in pure and jnp.issubdtype(v.aval.dtype, jnp.floating)
            for v in xs
        ):
            found.append(i)
    return found


def counter_indexed_stacks(jaxpr, weights: Sequence[bool]) -> dict[int, tuple[int, ...]]:
    """``{equation index: stacked operands}`` of the top-level scans that read stacked
    layers by their counter, as ``fori_loop(0, L, lambda i, h: layer(ws[i], h), h)``
    does: a float operand held constant through the scan, computed from the inputs
    flagged in ``weights`` alone, that the body reads only as row ``i`` with ``i`` the
    loop counter (a carry starting at a literal ``lo`` and growing by one each
    iteration, so row ``lo + t`` at iteration ``t``).  The body must hold a matmul or
    convolution.  Such a scan is a scan over the rows ``lo .. lo + L`` of each stacked
    operand (:func:`scan_over_counter_stacks`)."""
    found = {}
    for i, e, pure in _heavy_scans(jaxpr, weights):
        stacks = () if _unrolls(e) else _counter_stacks(e, pure)
        if stacks:
            found[i] = stacks
    return found


def _heavy_scans(jaxpr, weights: Sequence[bool]):
    """``(index, equation, values of the weights alone so far)`` for each top-level scan
    whose body holds a matmul or convolution; ``weights`` flags the inputs."""
    pure = {v for v, w in zip(jaxpr.invars, weights, strict=True) if w}
    for i, e in enumerate(jaxpr.eqns):
        reads = [v for v in e.invars if not is_literal(v)]
        if reads and all(v in pure for v in reads):
            pure.update(e.outvars)
        if _is_scan(e) and is_heavy(e):
            yield i, e, pure


def _counter_stacks(eqn, pure: set) -> tuple[int, ...]:
    """The constant operands of scan ``eqn`` it reads as row ``counter`` (see
    :func:`counter_indexed_stacks`), by position among its operands."""
    p = eqn.params
    nc, length = p["num_consts"], p["length"]
    body = p["jaxpr"].jaxpr
    counter = _counter(eqn)
    if counter is None or p["reverse"]:
        return ()
    lo = int(np.asarray(eqn.invars[nc + counter].val))
    counter_var = body.invars[nc + counter]
    uses: dict = {}
    for e in body.eqns:
        for k, v in enumerate(e.invars):
            if not is_literal(v):
                uses.setdefault(v, []).append((e, k))
    for v in body.outvars:
        if not is_literal(v):
            uses.setdefault(v, []).append((None, -1))
    stacks = []
    for k in range(nc):
        top, inner = eqn.invars[k], body.invars[k]
        if is_literal(top) or top not in pure or not jnp.issubdtype(top.aval.dtype, jnp.floating):
            continue
        shape = tuple(top.aval.shape)
        if not shape or shape[0] < lo + length or inner not in uses:
            continue
        if all(
            e is not None
            and pos == 0
            and e.primitive.name == "dynamic_slice"
            and tuple(e.params["slice_sizes"]) == (1, *shape[1:])
            and _reads_row_counter(body, e, counter_var, lo, length)
            for e, pos in uses[inner]
        ):
            stacks.append(k)
    return tuple(stacks)


def _counter(eqn) -> int | None:
    """The carry of scan ``eqn`` that counts its iterations (an integer starting at a
    literal and returned plus one), or None."""
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    body = p["jaxpr"].jaxpr
    made = {o: e for e in body.eqns for o in e.outvars}
    for c in range(nk):
        init, inner, out = eqn.invars[nc + c], body.invars[nc + c], body.outvars[c]
        if not is_literal(init) or not jnp.issubdtype(inner.aval.dtype, jnp.integer):
            continue
        e = made.get(out)
        if e is None or e.primitive.name != "add":
            continue
        a, b = e.invars
        if (a is inner and is_literal(b) and b.val == 1) or (
            b is inner and is_literal(a) and a.val == 1
        ):
            return c
    return None


def _reads_row_counter(body, ds, counter_var, lo: int, length: int) -> bool:
    """Whether ``dynamic_slice`` equation ``ds`` of ``body`` reads row ``counter`` and
    starts every other dim at 0, for each counter value ``lo .. lo + length - 1``: its
    index operands are computed from the counter and literals alone (as ``ws[i]`` wraps
    a negative ``i``), evaluated on each value."""
    needed, made = [], {o: e for e in body.eqns for o in e.outvars}
    stack, seen = [v for v in ds.invars[1:] if not is_literal(v)], set()
    while stack:
        v = stack.pop()
        if v is counter_var or v in seen:
            continue
        seen.add(v)
        e = made.get(v)
        if e is None or e.primitive.name in ("scan", "while", "cond", "pjit"):
            return False  # another input, or control flow: not the counter alone
        needed.append(e)
        stack += [u for u in e.invars if not is_literal(u)]
    order = {id(e): n for n, e in enumerate(body.eqns)}
    needed = sorted({id(e): e for e in needed}.values(), key=lambda e: order[id(e)])
    with jax.ensure_compile_time_eval():  # concrete, inside the step's trace
        for value in range(lo, lo + length):
            env = {counter_var: np.asarray(value, counter_var.aval.dtype)}
            eval_eqns(needed, env)
            starts = [int(np.asarray(read_var(env, v))) for v in ds.invars[1:]]
            if starts != [value] + [0] * (len(starts) - 1):
                return False
    return True


def scan_over_counter_stacks(closed: ClosedJaxpr, found: Mapping[int, tuple[int, ...]]):
    """``closed`` with each scan of ``found`` (:func:`counter_indexed_stacks`) scanning
    over the rows it read by its counter: the same iterations on the same rows, now a
    scan over stacked layers that :func:`split_scans` can cut."""
    return _rewritten(closed, found, _scan_rows)


def _scan_rows(eqn, env: dict, stacks: tuple[int, ...]) -> None:
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    lo = int(np.asarray(eqn.invars[nc + _counter(eqn)].val))
    vals = [read_var(env, v) for v in eqn.invars]
    with source_of(eqn):
        rows = [vals[k][lo : lo + length] for k in stacks]
    inner = {body.jaxpr.invars[k]: n for n, k in enumerate(stacks)}

    def step(carry, xs):
        row, x = xs
        benv = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        ins = [*vals[:nc], *carry, *x]
        benv.update((v, a) for v, a in zip(body.jaxpr.invars, ins, strict=True) if v not in inner)

        def take_row(j, e, benv) -> bool:  # ws[i] -> this iteration's row
            if e.primitive.name == "dynamic_slice" and e.invars[0] in inner:
                benv[e.outvars[0]] = row[inner[e.invars[0]]][None]
                return True
            return False

        eval_eqns(body.jaxpr.eqns, benv, on_eqn=take_row)
        outs = [read_var(benv, v) for v in body.jaxpr.outvars]
        return outs[:nk], outs[nk:]

    with source_of(eqn):
        carry, ys = jax.lax.scan(
            step,
            vals[nc : nc + nk],
            (rows, vals[nc + nk :]),
            length=length,
            unroll=p.get("unroll", 1),
        )
    for var, val in zip(eqn.outvars, [*carry, *ys], strict=True):
        env[var] = val


def piece_bounds(length: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` consecutive ranges covering ``range(length)``, sizes differing by at most one."""
    pieces = max(1, min(pieces, length))
    edges = np.linspace(0, length, pieces + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def split_scans(closed: ClosedJaxpr, pieces: Mapping[int, int]) -> ClosedJaxpr:
    """``closed`` with the top-level scan at each index of ``pieces`` run as that many
    consecutive scans; a piece of one iteration is the body itself, inlined.  Scans
    nested in an inlined body that call ``mark_pipeline_boundary()`` are unrolled too."""
    return _rewritten(closed, pieces, _run_in_pieces)


def _rewritten(closed: ClosedJaxpr, at: Mapping, rewrite) -> ClosedJaxpr:
    """``closed`` with the top-level equation at each index of ``at`` evaluated by
    ``rewrite(eqn, env, at[index])`` instead (unchanged when ``at`` is empty)."""
    if not at:
        return closed

    def hook(i, eqn, env, extra=()) -> bool:
        if i not in at:
            return False
        rewrite(eqn, env, at[i])
        return True

    return retrace(closed, hook)


def _unroll_marked(i, eqn, env, extra=()) -> bool:
    """``eval_eqns`` hook inside an inlined body: calls inlined, marked scans unrolled."""
    if _unrolls(eqn):
        _run_in_pieces(eqn, env, eqn.params["length"])
        return True
    return inline_hook(i, eqn, env, extra)


def _run_in_pieces(eqn, env: dict, pieces: int) -> None:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    vals = [read_var(env, v) for v in eqn.invars]
    consts, carry, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    bounds = piece_bounds(p["length"], pieces)
    ys_of: dict[tuple[int, int], list] = {}
    for a, b in reversed(bounds) if p["reverse"] else bounds:
        if b - a == 1:
            with source_of(eqn):
                x_i = [x[a] for x in xs]
            outs = eval_inlined(p["jaxpr"], eqn, [*consts, *carry, *x_i], _unroll_marked)
            with source_of(eqn):
                ys = [y[None] for y in outs[nk:]]
        else:
            with source_of(eqn):
                part = [x[a:b] for x in xs]
            outs = bind_eqn(eqn.replace(params=dict(p, length=b - a)), [*consts, *carry, *part])
            ys = outs[nk:]
        carry = outs[:nk]
        ys_of[(a, b)] = ys
    with source_of(eqn):
        if bounds:
            stacked = [
                jnp.concatenate(col) for col in zip(*(ys_of[c] for c in bounds), strict=True)
            ]
        else:
            stacked = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[nk:]]
    for var, val in zip(eqn.outvars, [*carry, *stacked], strict=True):
        env[var] = val


def counter_note(eqn, stacks: int) -> str:
    """The plan's note for a scan that read ``stacks`` stacked operands by its counter."""
    return (
        f"fori_loop at {user_line(eqn)} ({eqn.params['length']} iterations) reads "
        f"{stacks} stacked operand(s) one row per iteration: run as a scan over their rows"
    )


def split_note(eqn, pieces: int, why: str) -> str:
    """The plan's note for a scan split into ``pieces``."""
    length = eqn.params["length"]
    how = "unrolled" if pieces >= length else f"split into {pieces} scans"
    return f"lax.scan at {user_line(eqn)} ({length} iterations) {how}: {why}"
