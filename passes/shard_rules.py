"""Sharding strategies per primitive: the rule table of the sharding ILP.

A *layout* says, per tensor dim, which mesh axes split it (``(('device',), ())`` = dim 0
split over ``device``, dim 1 whole).  A :class:`Strategy` of an equation fixes the layout
of each output, the layout each operand must arrive in, the collectives the equation then
needs (a split contraction all-reduces its output) and how many devices share its work.
``STRATEGY_RULES[primitive name]`` builds them; a primitive without a rule runs
replicated (every operand whole, output whole), which is always correct.

    >>> from meshshard.passes.shard_costs import LogicalMesh
    >>> mesh = LogicalMesh(("host", "device"), (1, 2), (0.0, 0.0), (0.0, 0.0))
    >>> layouts((4, 6), mesh)
    (((), ()), (('device',), ()), ((), ('device',)))
    >>> to_spec(((), ("host", "device"))), to_spec(((),))
    ((None, ('host', 'device')), ())
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshshard.jaxpr_util import itemsize as dtype_bytes
from meshshard.passes.shard_costs import Comm, LogicalMesh
from meshshard.plan import Spec

__all__ = [
    "Layout",
    "Strategy",
    "STRATEGY_RULES",
    "ELEMENTWISE",
    "layouts",
    "to_spec",
    "from_spec",
    "local_bytes",
    "shards",
    "strategies",
    "reshard_comms",
    "is_elementwise_call",
]

Layout = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run an equation: output layouts, required operand layouts (``None`` for
    literals), the collectives it needs and the number of devices its work splits over."""

    name: str
    outs: tuple[Layout, ...]
    ins: tuple[Layout | None, ...]
    comms: tuple[Comm, ...] = ()
    split: int = 1


def to_spec(layout: Layout) -> Spec:
    """A layout as plan spec data (``PartitionSpec`` entries), trailing whole dims dropped."""
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in layout]
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def from_spec(spec: Spec, ndim: int) -> Layout:
    """Inverse of :func:`to_spec` for a tensor of ``ndim`` dims."""
    out = []
    for i in range(ndim):
        e = spec[i] if i < len(spec) else None
        out.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
    return tuple(out)


def shards(layout: Layout, mesh: LogicalMesh) -> int:
    """How many pieces a tensor of ``layout`` is cut into."""
    return math.prod(mesh.size(a) for a in layout if a)


def local_bytes(shape: Sequence[int], dtype, layout: Layout, mesh: LogicalMesh) -> float:
    """Bytes one device holds of a tensor of ``shape``/``dtype`` in ``layout``."""
    return math.prod(shape) * dtype_bytes(dtype) / shards(layout, mesh)


def _split_axes(mesh: LogicalMesh) -> tuple[str, ...]:
    return tuple(a for a, s in zip(mesh.axes, mesh.shape, strict=True) if s > 1)


def _assignments(nroles: int, mesh: LogicalMesh):
    """Every map from the mesh's split axes to a role in ``range(nroles)`` or None."""
    axes = _split_axes(mesh)
    for choice in itertools.product([None, *range(nroles)], repeat=len(axes)):
        groups: dict[int, tuple[str, ...]] = {}
        for a, r in zip(axes, choice, strict=True):
            if r is not None:
                groups[r] = groups.get(r, ()) + (a,)
        yield groups


def layouts(shape: Sequence[int], mesh: LogicalMesh) -> tuple[Layout, ...]:
    """Every layout of ``shape`` on ``mesh`` whose splits divide their dims (replicated first)."""
    out = []
    for groups in _assignments(len(shape), mesh):
        if all(shape[d] % mesh.size(a) == 0 for d, a in groups.items()):
            out.append(tuple(groups.get(d, ()) for d in range(len(shape))))
    return tuple(out)


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _whole(v) -> Layout:
    return tuple(() for _ in _shape(v))


def _replicated(eqn, mesh: LogicalMesh) -> list[Strategy]:
    ins = tuple(None if _is_literal(v) else _whole(v) for v in eqn.invars)
    return [Strategy("replicated", tuple(_whole(o) for o in eqn.outvars), ins)]


def _is_literal(v) -> bool:
    return not hasattr(v, "count") and hasattr(v, "val")


def _elementwise(eqn, mesh: LogicalMesh) -> list[Strategy]:
    out_shape = _shape(eqn.outvars[0])
    if any(_shape(o) != out_shape for o in eqn.outvars):
        return _replicated(eqn, mesh)
    ins_shapes = [_shape(v) for v in eqn.invars]

    def fits(s):  # a scalar, or the output's shape with some dims of size 1 (broadcast)
        return s == () or (
            len(s) == len(out_shape) and all(a in (1, b) for a, b in zip(s, out_shape, strict=True))
        )

    if not all(fits(s) for s in ins_shapes):
        return _replicated(eqn, mesh)
    out = []
    for lay in layouts(out_shape, mesh):
        ins = tuple(
            None
            if _is_literal(v)
            else tuple(x if a == b else () for x, a, b in zip(lay, s, out_shape, strict=False))
            for v, s in zip(eqn.invars, ins_shapes, strict=True)
        )
        out.append(
            Strategy(_name(lay), tuple(lay for _ in eqn.outvars), ins, (), shards(lay, mesh))
        )
        if any(lay) and len(eqn.outvars) == 1:  # compute split, gather the result once
            o = eqn.outvars[0]
            comms = reshard_comms(out_shape, o.aval.dtype, lay, _whole(o), mesh)
            out.append(Strategy(_name(lay) + "->P()", (_whole(o),), ins, comms, shards(lay, mesh)))
    return out


def _gather(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """Split the indices' batch dims (and the operand's batching dims paired with them),
    or a dim the gather takes whole from the operand (an embedding's feature dim)."""
    dn = eqn.params["dimension_numbers"]
    operand, indices = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_shape = _shape(eqn.outvars[0])
    sizes = eqn.params["slice_sizes"]
    out_batch = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
    window = [
        j
        for j in range(len(operand))
        if j not in dn.collapsed_slice_dims and j not in dn.operand_batching_dims
    ]
    if len(out_batch) != len(indices) - 1 or len(window) != len(dn.offset_dims):
        return _replicated(eqn, mesh)
    roles = []  # (size, operand dims, indices dims, output dims)
    for i in range(len(indices) - 1):
        op = ()
        if i in dn.start_indices_batching_dims:
            op = (dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)],)
        roles.append((indices[i], op, (i,), (out_batch[i],)))
    for k, j in enumerate(window):
        if sizes[j] == operand[j]:
            roles.append((operand[j], (j,), (), (dn.offset_dims[k],)))
    return _role_strategies(eqn, mesh, roles, (operand, indices), out_shape)


def _scatter_add(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """An embedding gradient: split the updates' scatter dims with the indices (each
    device scatters its rows into a whole table: the output is all-reduced, as a split
    contraction is), a full window dim with the operand's dim (the feature dim: no
    collective), or batching dims paired on all three."""
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = (_shape(v) for v in eqn.invars[:3])
    scatter = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    window = [
        j
        for j in range(len(operand))
        if j not in dn.inserted_window_dims and j not in dn.operand_batching_dims
    ]
    if len(scatter) != len(indices) - 1 or len(window) != len(dn.update_window_dims):
        return _replicated(eqn, mesh)
    roles = []  # (size, operand dims, indices dims, updates dims, reduces the output)
    for k, ud in enumerate(scatter):
        if k in dn.scatter_indices_batching_dims:
            od = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(k)]
            roles.append((updates[ud], (od,), (k,), (ud,), False))
        else:
            roles.append((updates[ud], (), (k,), (ud,), True))
    for k, ud in enumerate(dn.update_window_dims):
        if updates[ud] == operand[window[k]]:
            roles.append((updates[ud], (window[k],), (), (ud,), False))
    itemsize = dtype_bytes(eqn.outvars[0].aval.dtype)
    out = []
    for groups in _assignments(len(roles), mesh):
        if any(roles[r][0] % mesh.size(a) for r, a in groups.items()):
            continue
        lays = [[()] * len(x) for x in (operand, indices, updates)]
        reduce_axes: tuple[str, ...] = ()
        for r, axes in groups.items():
            for which, dims in enumerate(roles[r][1:4]):
                for d in dims:
                    lays[which][d] = axes
            if roles[r][4]:
                reduce_axes += axes
        out_lay = tuple(lays[0])
        comms = ()
        if reduce_axes:
            nbytes = math.prod(operand) * itemsize / shards(out_lay, mesh)
            comms = (Comm("all-reduce", tuple(a for a in mesh.axes if a in reduce_axes), nbytes),)
        ins = tuple(tuple(x) for x in lays) + tuple(
            None if _is_literal(v) else _whole(v) for v in eqn.invars[3:]
        )
        split = math.prod(mesh.size(a) for a in groups.values())
        name = f"upd{_name(tuple(lays[2]))}"
        out.append(Strategy(name, (out_lay,), ins, comms, split))
    return out


def _role_strategies(eqn, mesh, roles, in_shapes, out_shape) -> list[Strategy]:
    out = []
    for groups in _assignments(len(roles), mesh):
        if any(roles[r][0] % mesh.size(a) for r, a in groups.items()):
            continue
        lays = [[()] * len(s) for s in in_shapes]
        out_lay = [()] * len(out_shape)
        for r, axes in groups.items():
            _, op, ix, od = roles[r]
            for d in op:
                lays[0][d] = axes
            for d in ix:
                lays[1][d] = axes
            for d in od:
                out_lay[d] = axes
        ins = [tuple(x) for x in lays] + [
            None if _is_literal(v) else _whole(v) for v in eqn.invars[len(in_shapes) :]
        ]
        split = math.prod(mesh.size(a) for a in groups.values())
        out.append(Strategy(_name(tuple(out_lay)), (tuple(out_lay),), tuple(ins), (), split))
    return out


def _name(layout: Layout) -> str:
    return str(to_spec(layout))


def _contraction(eqn, mesh: LogicalMesh, roles) -> list[Strategy]:
    """Strategies of a two-operand contraction (a matmul, a convolution) from its roles
    ``(size, lhs dims, rhs dims, out dims, contracted)``: each assignment of mesh axes to
    roles that divide splits those dims, and splitting a contracted role all-reduces the
    output."""
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_shape = _shape(eqn.outvars[0])
    itemsize = dtype_bytes(eqn.outvars[0].aval.dtype)
    out = []
    for groups in _assignments(len(roles), mesh):
        if any(roles[r][0] % mesh.size(a) for r, a in groups.items()):
            continue
        lhs, rhs, res = [()] * len(ls), [()] * len(rs), [()] * len(out_shape)
        reduce_axes: tuple[str, ...] = ()
        for r, axes in groups.items():
            _, la, ra, oa, contracted = roles[r]
            for lay, dims in ((lhs, la), (rhs, ra), (res, oa)):
                for d in dims:
                    lay[d] = axes
            if contracted:
                reduce_axes += axes
        out_lay = tuple(res)
        comms = ()
        if reduce_axes:
            nbytes = math.prod(out_shape) * itemsize / shards(out_lay, mesh)
            comms = (Comm("all-reduce", tuple(a for a in mesh.axes if a in reduce_axes), nbytes),)
        split = math.prod(mesh.size(a) for a in groups.values())
        name = f"lhs{_name(tuple(lhs))} rhs{_name(tuple(rhs))}"
        out.append(Strategy(name, (out_lay,), (tuple(lhs), tuple(rhs)), comms, split))
    return out


def _dot_general(eqn, mesh: LogicalMesh) -> list[Strategy]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    lf = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rs)) if d not in rc and d not in rb]
    # the output holds the batch pairs, then the lhs free dims, then the rhs free dims
    nb, nl = len(lb), len(lf)
    roles = (
        [(ls[a], (a,), (b,), (i,), False) for i, (a, b) in enumerate(zip(lb, rb, strict=True))]
        + [(ls[a], (a,), (b,), (), True) for a, b in zip(lc, rc, strict=True)]
        + [(ls[a], (a,), (), (nb + i,), False) for i, a in enumerate(lf)]
        + [(rs[b], (), (b,), (nb + nl + i,), False) for i, b in enumerate(rf)]
    )
    return _contraction(eqn, mesh, roles)


def _conv(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """A convolution splits like a matmul along its non-spatial dims: the batch (data
    parallel), the kernel's output features (tensor parallel), or the input features it
    contracts (the output all-reduced: the kernel gradient of a batch-split layer, whose
    dimension numbers put the batch there).  A grouped convolution whose groups read one
    input feature each (depthwise, with any channel multiplier) splits its batch or whole
    groups (a depthwise layer's channels need no communication); other grouped ones run
    replicated, as XLA runs them.  A kernel gradient (``batch_group_count``) splits the
    same groups or the contracted batch.  Windows run over the spatial dims, which stay
    whole."""
    dn = eqn.params["dimension_numbers"]
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    feature_groups = eqn.params["feature_group_count"]
    batch_groups = eqn.params["batch_group_count"]
    contracted = (ls[dn.lhs_spec[1]], (dn.lhs_spec[1],), (dn.rhs_spec[1],), (), True)
    kernel_out = (dn.rhs_spec[0],), (dn.out_spec[1],)
    if batch_groups != 1:
        # each group of output features reads its own contiguous block of the lhs batch
        return _contraction(
            eqn, mesh, [(batch_groups, (dn.lhs_spec[0],), *kernel_out, False), contracted]
        )
    if feature_groups != 1 and rs[dn.rhs_spec[1]] != 1:
        # XLA's partitioners (Shardy and GSPMD alike) all-gather such a convolution's
        # input whatever its split unless each group reads one input feature
        return _replicated(eqn, mesh)
    roles = [(ls[dn.lhs_spec[0]], (dn.lhs_spec[0],), (), (dn.out_spec[0],), False)]
    if feature_groups == 1:
        roles += [(rs[dn.rhs_spec[0]], (), *kernel_out, False), contracted]
    else:
        # groups are contiguous blocks of the lhs features and of the kernel's outputs
        roles.append((feature_groups, (dn.lhs_spec[1],), *kernel_out, False))
    return _contraction(eqn, mesh, roles)


def _along(eqn, mesh: LogicalMesh, free: Sequence[int]) -> list[Strategy]:
    """Split only the ``free`` dims, which the equation maps one to one from every array
    operand of the output's rank to the output (scalars stay whole): the batch and
    feature dims of a pooling window, a pad or a reversal that leaves them alone."""
    out_shape = _shape(eqn.outvars[0])
    arrays = [v for v in eqn.invars if len(_shape(v)) == len(out_shape) and out_shape]
    if any(_shape(v)[d] != out_shape[d] for v in arrays for d in free):
        return _replicated(eqn, mesh)
    out = []
    for lay in layouts(out_shape, mesh):
        if any(axes for d, axes in enumerate(lay) if d not in free):
            continue
        ins = tuple(
            None if _is_literal(v) else lay if len(_shape(v)) == len(out_shape) else _whole(v)
            for v in eqn.invars
        )
        outs = tuple(lay for _ in eqn.outvars)
        out.append(Strategy(_name(lay), outs, ins, (), shards(lay, mesh)))
    return out


def _window(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """Pooling (``reduce_window_*``) and its gradient (``select_and_scatter_add``): the
    dims whose window is one element, unstrided and unpadded split freely."""
    p = eqn.params
    rank = len(p["window_dimensions"])
    ones = (1,) * rank
    free = [
        d
        for d in range(rank)
        if p["window_dimensions"][d] == 1
        and p["window_strides"][d] == 1
        and tuple(p["padding"][d]) == (0, 0)
        and p.get("base_dilation", ones)[d] == 1
        and p.get("window_dilation", ones)[d] == 1
    ]
    return _along(eqn, mesh, free)


def _pad(eqn, mesh: LogicalMesh) -> list[Strategy]:
    free = [d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) == (0, 0, 0)]
    return _along(eqn, mesh, free)


def _rev(eqn, mesh: LogicalMesh) -> list[Strategy]:
    reversed_dims = set(eqn.params["dimensions"])
    return _along(
        eqn, mesh, [d for d in range(len(_shape(eqn.outvars[0]))) if d not in reversed_dims]
    )


def _slice(eqn, mesh: LogicalMesh) -> list[Strategy]:
    shape, p = _shape(eqn.invars[0]), eqn.params
    strides = p["strides"] or (1,) * len(shape)
    free = [
        d
        for d in range(len(shape))
        if p["start_indices"][d] == 0 and p["limit_indices"][d] == shape[d] and strides[d] == 1
    ]
    return _along(eqn, mesh, free)


def _dynamic_slice(eqn, mesh: LogicalMesh) -> list[Strategy]:
    shape = _shape(eqn.invars[0])
    sizes = eqn.params["slice_sizes"]
    return _along(eqn, mesh, [d for d in range(len(shape)) if sizes[d] == shape[d]])


def _dynamic_update_slice(eqn, mesh: LogicalMesh) -> list[Strategy]:
    shape, update = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    return _along(eqn, mesh, [d for d in range(len(shape)) if update[d] == shape[d]])


def _along_all_but(param: str) -> Rule:
    """Rule for an equation working along the dim named by ``eqn.params[param]`` (a
    cumulative sum, a sort, ``top_k`` of router scores, the last dim where the parameter
    is absent): every other dim splits freely."""

    def rule(eqn, mesh: LogicalMesh) -> list[Strategy]:
        along = eqn.params.get(param, -1)
        rank = len(_shape(eqn.outvars[0]))
        return _along(eqn, mesh, [d for d in range(rank) if d != along % rank])

    return rule


def _tile(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """``jnp.tile``: a dim repeated once splits with its operand; a dim of one element
    repeated (a class token tiled over the batch) splits the output only."""
    reps = eqn.params["reps"]
    operand, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if len(reps) != len(operand):
        return _replicated(eqn, mesh)
    out = []
    for lay in layouts(out_shape, mesh):
        if any(axes and reps[d] != 1 and operand[d] != 1 for d, axes in enumerate(lay)):
            continue
        ins = (tuple(axes if reps[d] == 1 else () for d, axes in enumerate(lay)),)
        out.append(Strategy(_name(lay), (lay,), ins, (), shards(lay, mesh)))
    return out


def _joined(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """``concatenate`` and ``split`` (``jnp.split`` of a fused QKV projection) along one
    dim: the others split freely."""
    axis = eqn.params["dimension"] if "dimension" in eqn.params else eqn.params["axis"]
    return _along(eqn, mesh, [d for d in range(len(_shape(eqn.outvars[0]))) if d != axis])


def _broadcast_in_dim(eqn, mesh: LogicalMesh) -> list[Strategy]:
    out_shape = tuple(eqn.params["shape"])
    in_shape = _shape(eqn.invars[0])
    dims = eqn.params["broadcast_dimensions"]
    out = []
    for lay in layouts(out_shape, mesh):
        ins = [tuple(lay[d] if in_shape[i] == out_shape[d] else () for i, d in enumerate(dims))]
        ins += [None if _is_literal(v) else _whole(v) for v in eqn.invars[1:]]
        out.append(Strategy(_name(lay), (lay,), tuple(ins), (), 1))
    return out


def _reduce(eqn, mesh: LogicalMesh, *, combinable: bool = True) -> list[Strategy]:
    axes = tuple(eqn.params["axes"])
    in_shape = _shape(eqn.invars[0])
    out_shape = _shape(eqn.outvars[0])
    itemsize = dtype_bytes(eqn.outvars[0].aval.dtype)
    out = []
    for lay in layouts(in_shape, mesh):
        red = tuple(a for d in axes for a in lay[d])
        if red and not combinable:
            continue
        out_lay = tuple(x for d, x in enumerate(lay) if d not in axes)
        comms = ()
        if red:
            nbytes = math.prod(out_shape) * itemsize / shards(out_lay, mesh)
            comms = (Comm("all-reduce", tuple(a for a in mesh.axes if a in red), nbytes),)
        outs = tuple(out_lay for _ in eqn.outvars)
        out.append(Strategy(_name(lay), outs, (lay,), comms, shards(lay, mesh)))
    return out


def _argreduce(eqn, mesh):
    return _reduce(eqn, mesh, combinable=False)


def _transpose(eqn, mesh: LogicalMesh) -> list[Strategy]:
    perm = eqn.params["permutation"]
    out = []
    for lay in layouts(_shape(eqn.invars[0]), mesh):
        out_lay = tuple(lay[p] for p in perm)
        out.append(Strategy(_name(lay), (out_lay,), (lay,), (), 1))
    return out


def _prefix(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[:i]) for i in range(len(shape))]


def _reshape(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """A split dim survives a reshape when it leads the same group of elements on both
    sides (equal products of the dims before it) and its split divides both sizes.  A
    reshape with ``dimensions`` (a transpose, then the reshape: a grouped convolution's
    kernel gradient) is matched on the transposed dims."""
    order = eqn.params.get("dimensions") or tuple(range(len(_shape(eqn.invars[0]))))
    ins_shape = tuple(_shape(eqn.invars[0])[d] for d in order)
    out_shape = tuple(eqn.params["new_sizes"])
    pin, pout = _prefix(ins_shape), _prefix(out_shape)
    out = []
    for lay in layouts(_shape(eqn.invars[0]), mesh):
        out_lay = [()] * len(out_shape)
        ok = True
        for d, axes in enumerate(lay[o] for o in order):
            if not axes:
                continue
            n = mesh.size(axes)
            match = [
                j
                for j in range(len(out_shape))
                if pout[j] == pin[d] and out_shape[j] % n == 0 and out_shape[j] > 1
            ]
            if not match:
                ok = False
                break
            out_lay[match[0]] = axes
        if ok:
            out.append(Strategy(_name(lay), (tuple(out_lay),), (lay,), (), 1))
    return out


def _squeeze(eqn, mesh: LogicalMesh) -> list[Strategy]:
    drop = set(eqn.params["dimensions"])
    out = []
    for lay in layouts(_shape(eqn.invars[0]), mesh):
        out_lay = tuple(x for d, x in enumerate(lay) if d not in drop)
        out.append(Strategy(_name(lay), (out_lay,), (lay,), (), 1))
    return out


ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor
    random_bits random_wrap random_unwrap""".split()
) - {"random_bits", "random_wrap", "random_unwrap"}


def is_elementwise_call(eqn) -> bool:
    """True for a ``custom_jvp_call``/``custom_vjp_call``/``checkpoint`` whose body only
    holds elementwise equations on one shape (``jax.nn.relu``, ``gelu``): it shards like
    an elementwise equation, so it is not run replicated."""
    sub = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr", eqn.params.get("fun_jaxpr")))
    if sub is None:
        return False
    sub = getattr(sub, "jaxpr", sub)
    shape = _shape(eqn.outvars[0]) if eqn.outvars else None
    for e in sub.eqns:
        if e.primitive.name in ELEMENTWISE or e.primitive.name == "broadcast_in_dim":
            if any(_shape(o) not in ((), shape) for o in e.outvars):
                return False
            if e.primitive.name == "broadcast_in_dim" and _shape(e.invars[0]) != ():
                return False
        elif e.primitive.name in CALLS or e.primitive.name in INNER_CALLS:
            if not is_elementwise_call(e):
                return False
        else:
            return False
    return True


#: Pooling windows and the max-pool gradient.
WINDOWED = frozenset(
    {
        "reduce_window_sum",
        "reduce_window_max",
        "reduce_window_min",
        "select_and_scatter_add",
        "select_and_gather_add",
    }
)

CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint"})
#: Calls a custom derivative's body may wrap (``jax.nn.relu`` is ``jit(max(x, 0))``
#: there): the inlining pass does not reach inside ``custom_jvp_call``.
INNER_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _call(eqn, mesh: LogicalMesh) -> list[Strategy]:
    return _elementwise(eqn, mesh) if is_elementwise_call(eqn) else _replicated(eqn, mesh)


def _scan(eqn, mesh: LogicalMesh) -> list[Strategy]:
    from meshshard.passes.shard_loops import scan_strategies  # it reads this table

    return scan_strategies(eqn, mesh)


def _cond(eqn, mesh: LogicalMesh) -> list[Strategy]:
    from meshshard.passes.shard_loops import cond_strategies  # it reads this table

    return cond_strategies(eqn, mesh)


Rule = Callable[..., list[Strategy]]

#: primitive name -> rule(eqn, mesh) -> strategies.  Others run replicated.
STRATEGY_RULES: dict[str, Rule] = {
    **{p: _elementwise for p in ELEMENTWISE},
    **{p: _call for p in CALLS},
    "dot_general": _dot_general,
    "broadcast_in_dim": _broadcast_in_dim,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "reduce_and": _reduce,
    "reduce_or": _reduce,
    "argmax": _argreduce,
    "argmin": _argreduce,
    "reduce_prod": _argreduce,
    "transpose": _transpose,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "gather": _gather,
    "scatter-add": _scatter_add,
    "conv_general_dilated": _conv,
    **{p: _window for p in WINDOWED},
    "pad": _pad,
    "rev": _rev,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": _joined,
    "tile": _tile,
    "split": _joined,
    **{
        p: _along_all_but("axis") for p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
    },
    "top_k": _along_all_but("axis"),
    "sort": _along_all_but("dimension"),
    "scan": _scan,
    "cond": _cond,
    # elementwise where the bit widths match (a dropout mask's bits read as floats);
    # a width change adds or drops a dim, and _elementwise then runs it replicated
    "bitcast_convert_type": _elementwise,
}


def strategies(eqn, mesh: LogicalMesh) -> list[Strategy]:
    """The strategies of ``eqn`` on ``mesh`` (replicated when no rule applies)."""
    rule = STRATEGY_RULES.get(eqn.primitive.name)
    got = rule(eqn, mesh) if rule is not None else []
    return got or _replicated(eqn, mesh)


def _nested_elsewhere(src: Layout, dst: Layout, mesh) -> bool:
    """Every device's destination block lies inside one source block (each dim cut
    into a multiple of its source parts), though not always its own: XLA slices each
    block out where it lies and moves it with one collective-permute."""
    own = True
    for a, b in zip(src, dst, strict=True):
        a, b = tuple(a), tuple(b)
        if mesh.size(b) % mesh.size(a):
            return False
        own = own and b[: len(a)] == a
    return not own


def reshard_comms(
    shape: Sequence[int], dtype, src: Layout, dst: Layout, mesh: LogicalMesh
) -> tuple[Comm, ...]:
    """Collectives that turn a tensor in layout ``src`` into layout ``dst``.

    Per mesh axis: kept on the same dim, nothing; dropped, an all-gather; newly added,
    a local slice (free); moved to another dim, an all-to-all.  Bytes follow the
    simulator convention, on the tensor as held just before that axis is handled.
    A dim split over several axes keeps its blocks in place only if the axes that stay
    on it are the major ones, in order: XLA first moves the shards to their new devices
    with a collective-permute otherwise (a dim over ``(host, device)`` gathered over
    ``host`` alone leaves blocks that ``device`` no longer indexes in place), of the
    smaller of the source and destination blocks (it slices first, or gathers after).

    >>> from meshshard.passes.shard_costs import LogicalMesh
    >>> from meshshard.cluster import ClusterSpec
    >>> m = LogicalMesh.of((2, 2), ClusterSpec())
    >>> [str(c) for c in reshard_comms((8, 4), "float32", (("host", "device"), ()), (("device",), ()), m)]
    ['collective-permute[host,device] 32 B', 'all-gather[host] 64 B']
    >>> [str(c) for c in reshard_comms((8, 4), "float32", (("host", "device"), ()), (("host",), ()), m)]
    ['all-gather[device] 64 B']

    A dim both gathered over one axis and moved to another dim over another is
    gathered whole (XLA's "involuntary full rematerialization"), then sliced:

    >>> [str(c) for c in reshard_comms((8, 4), "float32", (("host", "device"), ()), ((), ("device",)), m)]
    ['all-gather[host,device] 128 B']

    When every destination block lies inside one source block (each dim cut into a
    multiple of its source parts) but not the device's own, XLA slices the blocks where
    they lie and permutes them, rather than gathering and slicing again.

    >>> [str(c) for c in reshard_comms((8, 4), "float32", (("device",), ()), (("host",), ()), m)]
    ['collective-permute[host,device] 64 B']
    """
    if src == dst:
        return ()
    full = math.prod(shape) * dtype_bytes(dtype)
    where_src = {a: d for d, axes in enumerate(src) for a in axes}
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    gather = tuple(a for a in mesh.axes if a in where_src and a not in where_dst)
    move = tuple(
        a for a in mesh.axes if a in where_src and a in where_dst and where_src[a] != where_dst[a]
    )
    out = []
    for axes in src:
        if any(a in gather for a in axes) and any(a in move for a in axes):
            # a dim both gathered and moved: XLA gathers the whole tensor and slices it
            # ("involuntary full rematerialization")
            return (Comm("all-gather", tuple(a for a in mesh.axes if a in where_src), full),)
    if _nested_elsewhere(src, dst, mesh):  # slice where each block lies, move it once
        axes = tuple(a for a in mesh.axes if where_src.get(a) != where_dst.get(a))
        return (Comm("collective-permute", axes, full / shards(dst, mesh)),)
    for d, axes in enumerate(src):
        stay = tuple(a for a in axes if where_dst.get(a) == d)
        if stay and (tuple(axes[: len(stay)]) != stay or tuple(dst[d][: len(stay)]) != stay):
            finer = max(shards(src, mesh), shards(dst, mesh))  # it moves the smaller blocks
            out.append(Comm("collective-permute", tuple(axes), full / finer))
    if move:
        out.append(Comm("all-to-all", move, full / shards(src, mesh)))
    if gather:
        kept = math.prod(mesh.size((a,)) for a in where_src if a not in gather)
        out.append(Comm("all-gather", gather, full / kept))
    return tuple(out)
