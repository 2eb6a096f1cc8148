"""Find where a step reorders or shifts the batch's rows (mixup by a flipped batch).

``x + x[::-1]`` (timm's mixup pairs each example with its mirror), ``jnp.roll(h, 1,
axis=0)``, ``h[1:] - h[:-1]`` and ``h[: n // 2]`` pair or pick examples by their position
in the batch.  Each micro-batch would flip, roll or cut its own rows: other partners than
``jax.jit``'s on the whole batch, with no error.  Found so the step can be refused.

The step is traced at micro-batch and full-batch shape and walked equation by equation.
Each value that depends on the batch and has one axis growing with it carries a
*layout*: its rows along that axis are copies of the batch's examples, one *segment*
each, in order (a batch leaf is one segment; ``jnp.concatenate([v1, v2])`` of two views
is two).  Slicing, splitting or padding whole segments keeps the examples' order
(``z[:n], z[n:]`` of the two views, and the backward pass's pads of their cotangents);
reversing the axis, or cutting it inside a segment or at bounds that do not grow with the
batch, reorders the rows and is reported.  Values whose layout the walk cannot follow (a
gather, a reduction, layouts that meet in one operation) are not followed further:
other passes judge those.
"""

from __future__ import annotations

import math

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import is_literal, paired_bodies, sub_jaxprs, user_frame, user_line

__all__ = ["grown_dims", "reordered_rows"]

#: The label of a segment of zeros (a pad), which holds no example.
ZEROS = -1


def reordered_rows(micro: ClosedJaxpr, full: ClosedJaxpr, is_batch) -> tuple[str, ...]:
    """The user lines of ``micro`` (paired with ``full``, the same step at full-batch
    shape) that reverse, shift or cut the batch's rows by position."""
    layouts = {}
    for i, (vm, vf) in enumerate(zip(micro.jaxpr.invars, full.jaxpr.invars, strict=True)):
        if i < len(is_batch) and is_batch[i] and _grown_axis(vm, vf) is not None:
            layouts[vm] = (0,)
    found: dict[str, None] = {}
    _walk(micro.jaxpr, full.jaxpr, layouts, found)
    return tuple(found)


def _walk(mj, fj, layouts: dict, found: dict, caller=None) -> None:
    """Follow the layouts through ``mj`` (paired with ``fj``), adding to ``found`` the
    line of each equation that reorders rows (``caller``'s where a library function's
    body names no line of user code)."""
    for em, ef in zip(mj.eqns, fj.eqns, strict=True):
        laid = [(k, layouts[v]) for k, v in enumerate(em.invars) if _laid(v, layouts)]
        if not laid:
            continue
        bodies = list(paired_bodies(em, ef))
        for bm, bf in bodies:
            _enter(em, bm, bf, layouts, found, em if user_frame(em) else caller)
        if bodies or next(sub_jaxprs(em), None) is not None:
            continue  # the body said what its results hold (a cond's: not followed)
        outs = _step(em, ef, laid)
        if outs is _REORDERS:
            found[user_line(em if user_frame(em) or caller is None else caller)] = None
        elif outs is not None:
            layouts.update((o, lay) for o, lay in zip(em.outvars, outs, strict=True) if lay)


def _laid(v, layouts) -> bool:
    return not is_literal(v) and v in layouts


def _enter(em, bm, bf, layouts: dict, found: dict, caller) -> None:
    """Walk a call's, a checkpoint's or a scan's body with its operands' layouts; the
    call's results take its body's."""
    inner = {b: layouts[v] for v, b in zip(em.invars, bm.invars, strict=True) if _laid(v, layouts)}
    _walk(bm, bf, inner, found, caller)
    if len(bm.outvars) == len(em.outvars):
        for o, b in zip(em.outvars, bm.outvars, strict=True):
            if _laid(b, inner):
                layouts[o] = inner[b]


#: What :func:`_step` returns for an equation that reorders the rows.
_REORDERS = object()


def _step(em, ef, laid):
    """The layouts of ``em``'s outputs (None where not followed), or ``_REORDERS``."""
    name = em.primitive.name
    k, lay = laid[0]
    axis = _grown_axis(em.invars[k], ef.invars[k])
    if axis is None:
        return None
    if name == "rev":
        return _REORDERS if axis in em.params["dimensions"] else [lay]
    if name == "slice":
        return _slice_layout(em, ef, lay, axis)
    if name == "split":
        return _split_layouts(em, ef, lay, axis)
    if name == "tile":  # whole copies of the rows, one after another
        return [lay * em.params["reps"][axis]]
    if name == "pad":
        return _pad_layout(em, ef, lay, axis)
    if name == "concatenate":
        return _concat_layout(em, ef, layouts_of=dict(laid), axis=axis)
    if name in ("dynamic_slice", "dynamic_update_slice") or _along(em, k, axis):
        # rows picked at a computed position (h[jnp.argmax(l)]), sorts, reductions along
        # the batch: order statistics, which other passes judge
        return None
    if len({lay2 for _, lay2 in laid}) != 1:
        return None  # layouts meet: not followed
    return [
        _same_rows(o, f, em.invars[k], ef.invars[k], lay)
        for o, f in zip(em.outvars, ef.outvars, strict=True)
    ]


def _along(em, k: int, axis: int) -> bool:
    """Whether ``em`` works along axis ``axis`` of its operand ``k`` (sorts, sums or
    contracts it, gathers or scatters), rather than row by row."""
    p, name = em.params, em.primitive.name
    if name == "gather":  # an embedding lookup by the batch's ids keeps their rows
        return k != 1
    if name.startswith("scatter"):
        return True
    if name == "top_k":
        return axis == len(em.invars[k].aval.shape) - 1
    if p.get("dimension") == axis or p.get("axis") == axis or axis in (p.get("axes") or ()):
        return True  # a sort, cumulative sum, reduction or argmax along the batch
    if name == "dot_general":
        (contract_l, contract_r), _ = p["dimension_numbers"]
        return axis in (contract_l if k == 0 else contract_r)
    if name == "conv_general_dilated":
        lhs_batch = p["dimension_numbers"].lhs_spec[0]
        return k != 0 or axis != lhs_batch
    return False


def _same_rows(out_m, out_f, in_m, in_f, lay):
    """``lay`` for an output whose one growing axis has the input's rows, or whole
    multiples of them where the batch leads in both (``(n, t, f)`` merged to ``(n * t,
    f)``: each example's rows together); else None (a tile's copies, not followed)."""
    axis, in_axis = _grown_axis(out_m, out_f), _grown_axis(in_m, in_f)
    if axis is None:
        return None
    n_out, n_in = out_m.aval.shape[axis], in_m.aval.shape[in_axis]
    if n_out == n_in:
        return lay
    leading = math.prod(out_m.aval.shape[:axis]) == math.prod(in_m.aval.shape[:in_axis]) == 1
    return lay if leading and n_out % n_in == 0 else None


def _cut(lay, start_m, stop_m, start_f, stop_f, size_m, size_f):
    """The segments rows ``[start, stop)`` cover, or ``_REORDERS`` unless the cut falls on
    segment bounds in both traces (bounds that grow with the batch)."""
    unit_m, unit_f = size_m // len(lay), size_f // len(lay)
    whole = all(x % unit_m == 0 for x in (start_m, stop_m)) and (start_f, stop_f) == (
        start_m // unit_m * unit_f,
        stop_m // unit_m * unit_f,
    )
    return lay[start_m // unit_m : stop_m // unit_m] if whole else _REORDERS


def _slice_layout(em, ef, lay, axis):
    strides = em.params.get("strides")
    if strides is not None and strides[axis] != 1:
        return None  # every k-th row: the same rows per micro-batch when k divides them
    size_m, size_f = em.invars[0].aval.shape[axis], ef.invars[0].aval.shape[axis]
    cut = _cut(
        lay,
        em.params["start_indices"][axis],
        em.params["limit_indices"][axis],
        ef.params["start_indices"][axis],
        ef.params["limit_indices"][axis],
        size_m,
        size_f,
    )
    return cut if cut is _REORDERS else [cut]


def _split_layouts(em, ef, lay, axis):
    if em.params["axis"] != axis:
        return [lay] * len(em.outvars)
    size_m, size_f = em.invars[0].aval.shape[axis], ef.invars[0].aval.shape[axis]
    outs, at_m, at_f = [], 0, 0
    for n_m, n_f in zip(em.params["sizes"], ef.params["sizes"], strict=True):
        cut = _cut(lay, at_m, at_m + n_m, at_f, at_f + n_f, size_m, size_f)
        if cut is _REORDERS:
            return _REORDERS
        outs.append(cut)
        at_m, at_f = at_m + n_m, at_f + n_f
    return outs


def _pad_layout(em, ef, lay, axis):
    (lo_m, hi_m, mid_m), (lo_f, hi_f, mid_f) = (
        em.params["padding_config"][axis],
        ef.params["padding_config"][axis],
    )
    if (lo_m, hi_m, mid_m) == (0, 0, 0):
        return [lay]
    if mid_m or mid_f:
        return None  # rows spread apart (a strided slice's cotangent): not followed
    size_m, size_f = em.invars[0].aval.shape[axis], ef.invars[0].aval.shape[axis]
    unit_m, unit_f = size_m // len(lay), size_f // len(lay)
    whole = all(
        x % unit_m == 0 and y == x // unit_m * unit_f for x, y in ((lo_m, lo_f), (hi_m, hi_f))
    )
    if not whole:
        return _REORDERS
    return [(ZEROS,) * (lo_m // unit_m) + lay + (ZEROS,) * (hi_m // unit_m)]


def _concat_layout(em, ef, layouts_of: dict, axis: int):
    if em.params["dimension"] != axis:
        same = set(layouts_of.values())
        return [same.pop()] if len(same) == 1 else None
    if len(layouts_of) != len(em.invars):
        return None  # rows that are not the batch's joined in: not followed
    segments, units = (), set()
    for k, v in enumerate(em.invars):
        lay = layouts_of[k]
        units.add(v.aval.shape[axis] // len(lay))
        segments += lay
    return [segments] if len(units) == 1 else None


def grown_dims(micro_var, full_var) -> set[int]:
    """The dimensions of a value whose size differs between the two traces."""
    a, b = getattr(micro_var.aval, "shape", ()), getattr(full_var.aval, "shape", ())
    if len(a) != len(b):
        return set()
    return {d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y}


def _grown_axis(vm, vf) -> int | None:
    """The one axis of a value whose size differs between the two traces, if one."""
    grown = grown_dims(vm, vf)
    return grown.pop() if len(grown) == 1 else None
