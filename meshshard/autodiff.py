"""``meshshard.grad`` and ``meshshard.value_and_grad``.

They compute exactly what ``jax.grad``/``jax.value_and_grad`` compute.  In addition
they turn each ``mark_pipeline_boundary()`` in the loss function into a boundary that
carries the values crossing it, mark the loss, and mark the returned gradients.  The
compiler reads these markers to slice the step into forward and mirrored backward
stages and to tell the gradient computation (run per micro-batch) from the update.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar

import jax
import numpy as np

from meshshard import metrics, two_bw
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import (
    aval_nbytes,
    aval_size,
    eval_eqns,
    is_literal,
    is_marker,
    read_var,
    sub_jaxprs,
)
from meshshard.metrics import check_reduction
from meshshard.nnx_modules import module_filters, plain_argnums, split_modules
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.inline import inline_calls
from meshshard.passes.layer_cluster import MAX_AUTO_LAYERS
from meshshard.passes.reductions import bind_with_shares, shared_equations
from meshshard.passes.unroll_scans import (
    counter_indexed_stacks,
    counter_note,
    layer_stack_scans,
    marked_scans,
    scan_over_counter_stacks,
    split_note,
    split_scans,
)
from meshshard.primitives import boundary_p

__all__ = [
    "grad",
    "value_and_grad",
    "AutoLayers",
    "UnrolledStacks",
    "LayerCuts",
    "SharingLayerCuts",
]


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    aux_reduce: str | Mapping[str, str] | None = None,
    loss_reduce: str | None = None,
) -> Callable:
    """Like ``jax.value_and_grad``, and marks the pipeline boundaries for meshshard.

    With micro-batches the loss, its gradients and each aux value are combined over
    micro-batches as the full-batch step would: meshshard traces the step at micro-batch
    and full-batch shape to find whether the loss is a mean or a sum over the batch
    (gradients are then averaged or summed), and how each aux value reduces the batch
    (mean, sum, max, min).  ``aux_reduce`` declares it instead: one reduction for every
    aux leaf, or a dict from aux key (top-level key or ``jax.tree_util.keystr`` path)
    to reduction; ``meshshard.aux_sum(x)``-style markers do the same per value.
    ``loss_reduce`` ('mean' or 'sum') declares the loss's.  See ``meshshard.metrics``.

    >>> import jax.numpy as jnp
    >>> value_and_grad(lambda w: jnp.sum(w ** 2))(jnp.ones(2))[1]
    Array([2., 2.], dtype=float32)
    """
    if loss_reduce is not None and loss_reduce not in ("mean", "sum"):
        raise MeshshardInputError(
            f"meshshard.value_and_grad(loss_reduce={loss_reduce!r}): the loss combines over "
            "micro-batches as 'mean' or 'sum'"
        )

    @functools.wraps(fun)
    def wrapped(*args):
        modules = module_filters(args, argnums)  # Flax NNX modules: as nnx.value_and_grad
        if not modules:
            return _marked_value_and_grad(fun, args, argnums, has_aux, aux_reduce, loss_reduce)
        pure, merged, write_back = split_modules(args, modules)
        call = merged(fun)

        def with_rest(*a):  # the modules' other variables leave the grad as aux
            out, rest = call(*a)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, rest)

        argnums_ = plain_argnums(argnums)
        value, grads = _marked_value_and_grad(
            with_rest, pure, argnums_, True, aux_reduce, loss_reduce, rest_label=NNX_STATE
        )
        loss, (aux, rest) = value
        write_back(rest)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


#: The label of an NNX module's non-differentiated variables (batch statistics, random
#: counters) that ``meshshard.value_and_grad`` returns past the grad marker.
NNX_STATE = "aux (nnx variables of argument {i})"


def _marked_value_and_grad(
    fun, args, argnums, has_aux, aux_reduce, loss_reduce, rest_label: str | None = None
):
    """``jax.value_and_grad`` of ``fun`` with the user's pipeline boundaries marked, its
    results passed through the ``grad_end`` marker that records how each combines over
    micro-batches.  With ``rest_label``, ``fun``'s aux is ``(aux, rest)``: ``aux_reduce``
    applies to ``aux``, and the leaves of ``rest`` (a dict by argument position) are
    labelled ``rest_label`` formatted with the position, then their path."""
    args = two_bw.substitute(args, argnums)  # 2BW: differentiate at the stashed weights
    argset = {argnums} if isinstance(argnums, int) else set(argnums)
    n = len(args)
    weights = [
        k in argset or k - n in argset for k, a in enumerate(args) for _ in jax.tree.leaves(a)
    ]
    layered = _with_boundaries(fun, args, has_aux, weights)
    value, grads = jax.value_and_grad(layered, argnums=argnums, has_aux=has_aux)(*args)
    loss, aux = value if has_aux else (value, None)
    rest = None
    if rest_label is not None:
        aux, rest = aux
    aux = _declare_aux(aux, aux_reduce) if has_aux else None
    info = [("loss", loss_reduce or "", "declared" if loss_reduce else "")]
    if has_aux:
        paths = jax.tree_util.tree_flatten_with_path(aux)[0]
        info += [("aux" + jax.tree_util.keystr(p), "", "") for p, _ in paths]
    if rest_label is not None:  # {argument position: variables}
        paths = jax.tree_util.tree_flatten_with_path(rest)[0]
        keystr = jax.tree_util.keystr
        info += [(rest_label.format(i=p[0].key) + keystr(p[1:]), "", "") for p, _ in paths]
    info += [("grad", "", "")] * len(jax.tree.leaves(grads))
    if rest_label is not None:
        aux = (aux, rest)
    out = ((loss, aux), grads) if has_aux else (loss, grads)
    leaves, tree = jax.tree.flatten(out)
    leaves = boundary_p.bind(*leaves, kind="grad_end", index=0, reduce=tuple(info))
    return jax.tree.unflatten(tree, leaves)


def _declare_aux(aux, aux_reduce):
    """Wrap the aux leaves named by ``aux_reduce`` in their reduction markers."""
    if aux_reduce is None:
        return aux
    if isinstance(aux_reduce, str):
        check_reduction(aux_reduce, "meshshard.value_and_grad(aux_reduce=...)")
        return jax.tree.map(lambda x: metrics.aux_reduce(x, aux_reduce), aux)
    paths, tree = jax.tree_util.tree_flatten_with_path(aux)
    used, leaves = set(), []
    for p, x in paths:
        names = {jax.tree_util.keystr(p), *([str(getattr(p[0], "key", ""))] if p else [])}
        hit = [k for k in aux_reduce if k in names]
        if hit:
            used.add(hit[0])
            where = f"meshshard.value_and_grad(aux_reduce={{{hit[0]!r}: ...}})"
            x = metrics.aux_reduce(x, check_reduction(aux_reduce[hit[0]], where))
        leaves.append(x)
    unknown = sorted(set(aux_reduce) - used)
    if unknown:
        names = [jax.tree_util.keystr(p) for p, _ in paths]
        raise MeshshardInputError(
            f"meshshard.value_and_grad(aux_reduce=...) names {unknown}, which are not aux "
            f"values of the loss function (its aux leaves are {names}); use their keys"
        )
    return jax.tree.unflatten(tree, leaves)


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    aux_reduce: str | Mapping[str, str] | None = None,
    loss_reduce: str | None = None,
) -> Callable:
    """Like ``jax.grad``, and marks the pipeline boundaries for meshshard.

    >>> import jax.numpy as jnp
    >>> grad(lambda w: jnp.sum(w ** 2))(jnp.ones(2))
    Array([2., 2.], dtype=float32)
    """
    vg = value_and_grad(
        fun, argnums=argnums, has_aux=has_aux, aux_reduce=aux_reduce, loss_reduce=loss_reduce
    )

    @functools.wraps(fun)
    def wrapped(*args):
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _with_boundaries(fun: Callable, args: tuple, has_aux: bool, weights: list[bool]) -> Callable:
    """``fun`` re-expressed so each user marker carries the values that cross it;
    ``weights`` flags the flattened arguments that are differentiated."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    _check_loss(out_shape, has_aux)
    closed = inline_calls(closed)  # boundaries inside a jax.jit-wrapped loss or layer
    layers = _AUTO_LAYERS.get()
    closed, scan_notes = _split_layer_scans(closed, weights, layers, _UNROLL_STACKS.get())
    _check_nested_boundaries(closed.jaxpr)
    jaxpr = closed.jaxpr
    out_tree = jax.tree.structure(out_shape)
    marker_pos = [
        i
        for i, e in enumerate(jaxpr.eqns)
        if is_marker(e, "mark", "fwd") and e.params["index"] == -1
    ]
    live = _live_across(jaxpr, marker_pos)
    detached = _detached_markers(jaxpr, marker_pos, live, weights)
    index_of = {pos: k for k, pos in enumerate(p for p in marker_pos if p not in detached)}
    cuts = _auto_cuts(jaxpr, len(marker_pos), layers)
    cut_live = _live_across(jaxpr, list(cuts), before=True)
    cut_index = {p: (k, cut_live[p]) for k, p in enumerate(cuts)}
    setting = _LOSS_SHARES.get()
    shares = shared_equations(jaxpr, *setting) if setting else {}

    def shared(i, eqn, env) -> bool:  # equation i with 1/M shares of some operands
        return i in shares and bind_with_shares(eqn, env, *shares[i])

    def on_eqn(i, eqn, env):
        if i in cut_index:  # an automatic boundary before equation i
            k, crossing = cut_index[i]
            crossing = [v for v in crossing if _differentiable(v)]
            vals = boundary_p.bind(*[env[v] for v in crossing], kind="fwd", index=k)
            env.update(zip(crossing, vals, strict=True))
            return shared(i, eqn, env)  # then evaluate equation i itself
        if i not in index_of and i not in detached:
            return shared(i, eqn, env)
        for src, dst in zip(eqn.invars, eqn.outvars, strict=True):  # explicit-value form
            env[dst] = read_var(env, src)
        if i in detached:  # nothing crossing it is differentiated: no boundary
            return True
        crossing = [v for v in live[i] if _differentiable(v)]  # ints: no float0 cotangents
        vals = boundary_p.bind(*[env[v] for v in crossing], kind="fwd", index=index_of[i])
        env.update(zip(crossing, vals, strict=True))
        return True

    policy = _REMAT.get()

    def layered(*call_args):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, jax.tree.leaves(call_args), strict=True))
        if policy is None:
            eval_eqns(jaxpr.eqns, env, on_eqn=on_eqn)
        else:
            _eval_rematerialized(jaxpr, env, on_eqn, REMAT_POLICIES[policy], set(cut_index), shared)
        out = jax.tree.unflatten(out_tree, [read_var(env, v) for v in jaxpr.outvars])
        loss, aux = out if has_aux else (out, None)
        # ``detached`` only when there are some: a step's fingerprint (and so a saved
        # plan's) stays what it was without them
        extra = {"detached": len(detached)} if detached else {}
        if scan_notes:
            extra["split_scans"] = scan_notes
        (loss,) = boundary_p.bind(loss, kind="loss", index=0, **extra)
        return (loss, aux) if has_aux else loss

    return layered


#: Loss terms to take as 1/M shares while tracing (see :func:`loss_term_shares`).
_LOSS_SHARES: ContextVar[tuple | None] = ContextVar("meshshard_loss_shares", default=None)


@contextlib.contextmanager
def loss_term_shares(scale: float, paths: Sequence[tuple]):
    """Trace ``meshshard.grad`` with some terms of the loss taken as ``scale`` shares.

    The compiler traces a step again under this when its loss adds terms that combine
    differently over micro-batches (a batch sum plus a batch mean or a constant): each
    of ``paths`` (:func:`~meshshard.passes.reductions.share_paths`) leads from the loss
    to an addition and names the operands to scale, so every micro-batch's loss is its
    share of the full batch's and the micro-batches' losses and gradients add up."""
    token = _LOSS_SHARES.set((scale, tuple(paths)))
    try:
        yield
    finally:
        _LOSS_SHARES.reset(token)


#: ``PipeshardParallel.remat`` choices: which values a layer's forward keeps for its
#: backward (the rest the backward computes again).
REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
#: The ``remat=`` setting of the method being compiled (see :class:`Rematerialized`).
_REMAT: ContextVar[str | None] = ContextVar("meshshard_remat", default=None)


def _eval_rematerialized(jaxpr, env: dict, on_eqn, policy, cuts, shared=None) -> None:
    """Evaluate ``jaxpr``'s equations like ``eval_eqns(..., on_eqn=on_eqn)``, with each run
    of equations between markers inside ``jax.checkpoint(policy=policy)``: a layer's
    forward then keeps for its backward only what ``policy`` saves, and its backward
    computes the rest again.  Markers stay outside, where the compiler reads them.

    Small values the loss computes from its closed-over data alone (a masked mean's
    token count) are computed outside the checkpoint and read by it: recomputed inside
    the backward, they could not be the same value the compiler gives the forward
    (``passes/batch_statistics.py`` takes such a count over the full batch).

    ``shared(i, eqn, env)``: evaluates equation ``i`` itself when it takes 1/M shares of
    loss terms (:func:`loss_term_shares`), inside a checkpoint too; else returns False."""
    eqns = jaxpr.eqns
    n = len(eqns)
    position = {id(e): i for i, e in enumerate(eqns)}

    def evaluate(run: list, env: dict) -> None:
        if shared is None:
            eval_eqns(run, env)
        else:
            eval_eqns(run, env, on_eqn=lambda _, e, env: shared(position[id(e)], e, env))

    last_use = _last_uses(jaxpr)
    data = _data_only_values(jaxpr)

    def flush(run: list, end: int) -> None:
        run = _data_statistics_first(run, data, env)
        if not run:
            return
        defined = {v for e in run for v in e.outvars}
        reads = list(
            dict.fromkeys(
                v for e in run for v in e.invars if not hasattr(v, "val") and v not in defined
            )
        )
        outs = [v for e in run for v in e.outvars if last_use.get(v, -1) >= end]
        if not outs:
            evaluate(run, env)  # nothing it computes is read: no checkpoint to cut
            return

        def segment(*vals):
            local = dict(zip(reads, vals, strict=True))
            evaluate(run, local)
            return [local[v] for v in outs]

        vals = jax.checkpoint(segment, policy=policy)(*[env[v] for v in reads])
        env.update(zip(outs, vals, strict=True))

    run: list = []
    for i, e in enumerate(eqns):
        if is_marker(e):
            flush(run, i)
            run = []
            if not on_eqn(i, e, env):
                eval_eqns([e], env)
            continue
        if i in cuts:  # an automatic cut before equation i: bound, then i starts a run
            flush(run, i)
            run = []
            on_eqn(i, e, env)
        run.append(e)
    flush(run, n)


class _TracedWith:
    """``fn`` called with ``_setting`` (a ContextVar) set to ``value``, so that every
    ``meshshard.grad`` traced inside it sees the method's choice; equal wrappers of the
    same function compare equal (the compile caches key on the step function)."""

    _setting: ContextVar

    def __init__(self, fn: Callable, value):
        functools.update_wrapper(self, fn)  # first: it copies a wrapped wrapper's __dict__
        self.fn = fn
        self._value = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return (self.fn, self._value) == (other.fn, other._value)

    def __hash__(self) -> int:
        return hash((type(self), self.fn, self._value))

    def __call__(self, *args):
        token = self._setting.set(self._value)
        try:
            return self.fn(*args)
        finally:
            self._setting.reset(token)


class Rematerialized(_TracedWith):
    """``fn`` with per-layer rematerialization on: every ``meshshard.grad`` traced inside
    it evaluates each layer of its loss under ``jax.checkpoint`` with the policy named
    ``remat`` (:data:`REMAT_POLICIES`).  The compiler wraps a step this way for
    ``PipeshardParallel(remat=...)``."""

    _setting = _REMAT

    @property
    def remat(self) -> str:
        return self._value


#: The ``layers=`` setting of the method being compiled (see :class:`AutoLayers`).
_AUTO_LAYERS: ContextVar[str | int | None] = ContextVar("meshshard_auto_layers", default=None)


class AutoLayers(_TracedWith):
    """``fn`` with automatic layer clustering on: every ``meshshard.grad`` traced inside it
    cuts its loss into ``layers`` layers (:mod:`meshshard.passes.layer_cluster`).

    The compiler wraps a step this way for ``PipeshardParallel(layers=...)``; the workers
    trace the same wrapped function, so they cut at the same places.  A step without
    ``meshshard.grad`` (inference) is cut after its trace: the setting is recorded in the
    trace's :class:`LayerCuts` table for that.
    """

    _setting = _AUTO_LAYERS

    @property
    def layers(self) -> str | int:
        return self._value

    def __call__(self, *args):
        table = _LAYER_CUTS.get()
        if table is not None:
            table.layers = self._value
        return super().__call__(*args)


def _auto_cuts(
    jaxpr, num_markers: int, layers: str | int | None, what: str = "loss"
) -> tuple[int, ...]:
    """Cut positions for the ``layers=`` setting ``layers`` (none when it is off);
    ``what`` names the cut function in errors (``"loss"``, or ``"step"`` for inference)."""
    if layers is None:
        return ()
    if num_markers:
        raise MeshshardInputError(
            f"PipeshardParallel(layers={layers!r}) cuts the {what} into layers automatically, "
            f"but the {what} already calls mark_pipeline_boundary() {num_markers} times; drop "
            "layers= to use the markers, or remove the markers"
        )
    from meshshard.passes.layer_cluster import cluster_layers

    table = _LAYER_CUTS.get()
    key = (layers, tuple(e.primitive.name for e in jaxpr.eqns))
    if table is not None and key in table.chosen:
        return table.chosen[key]
    cuts = cluster_layers(jaxpr, layers, what=f"the {what} function")
    if table is not None:
        table.chosen[key] = cuts
    return cuts


class LayerCuts:
    """The cuts ``layers=`` chose for each loss program traced under it (the setting and
    the program's primitives in order -> cut positions).

    A step is traced at micro-batch and at full-batch shape, and the two traces are
    paired equation by equation (how the loss combines over micro-batches, the batch
    statistics).  The bytes crossing a cut grow with the batch and the values of the
    weights alone do not, so each shape alone may choose other cuts: the full batch's
    trace takes the micro-batch's, which run.  Tables compare by identity, so a trace
    under one is never JAX's cached trace under another."""

    def __init__(self, chosen: Mapping | None = None):
        self.chosen = dict(chosen or {})
        #: the ``layers=`` setting the traced step was wrapped with (see AutoLayers)
        self.layers: str | int | None = None

    def disagrees(self, other: LayerCuts) -> bool:
        """Whether ``other`` cut a program both cut elsewhere."""
        return any(self.chosen.get(k, v) != v for k, v in other.chosen.items())


#: The table the ``layers=`` cuts being traced are read from and recorded into.
_LAYER_CUTS: ContextVar[LayerCuts | None] = ContextVar("meshshard_layer_cuts", default=None)


class SharingLayerCuts(_TracedWith):
    """``fn`` with its ``layers=`` cuts read from (where a program was cut before) and
    recorded into a :class:`LayerCuts` table."""

    _setting = _LAYER_CUTS


#: Whether the method being compiled shards each program with the sharding ILP (see
#: :class:`UnrolledStacks`).
_UNROLL_STACKS: ContextVar[bool] = ContextVar("meshshard_unroll_stacks", default=False)


class UnrolledStacks(_TracedWith):
    """``fn`` with its scans over stacked layers unrolled: the sharding ILP lays a scan
    out as one unit (every iteration alike, :mod:`meshshard.passes.shard_loops`), so
    for ``sharding="auto"``, ``"zero2"`` and ``"zero3"`` every ``meshshard.grad`` traced
    inside it gives the ILP one copy of the layer per iteration to split on its own."""

    _setting = _UNROLL_STACKS


#: ``layers=N`` splits a scan over stacked layers into up to this many pieces per layer,
#: so the layer clustering can balance the layers to a fraction of one piece.
SCAN_PIECES_PER_LAYER = 4


def _split_layer_scans(closed, weights: list[bool], layers, unroll: bool):
    """``closed`` with its scans over stacked layers cut into pieces the stages can split
    (:mod:`meshshard.passes.unroll_scans`), and the plan's notes saying so: for the
    ``layers=`` setting ``layers``, or each unrolled when ``unroll`` (the sharding ILP)."""
    jaxpr = closed.jaxpr
    pieces = marked_scans(jaxpr)
    notes = [
        split_note(
            jaxpr.eqns[i],
            n,
            "its body calls mark_pipeline_boundary(), a boundary after each iteration",
        )
        for i, n in pieces.items()
    ]
    wanted = MAX_AUTO_LAYERS if layers == "auto" else layers
    by_layers = isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 1
    # fori_loop(..., ws[i] ...) as a scan over ws; not beside marked scans, whose
    # indices in ``pieces`` the rewrite would shift
    if (unroll or by_layers) and not pieces:
        found = counter_indexed_stacks(jaxpr, weights)
        notes += [counter_note(jaxpr.eqns[i], len(stacks)) for i, stacks in found.items()]
        closed = scan_over_counter_stacks(closed, found)
        jaxpr = closed.jaxpr
    for i in layer_stack_scans(jaxpr, weights) if unroll or by_layers else ():
        if i in pieces:
            continue
        eqn = jaxpr.eqns[i]
        length = eqn.params["length"]
        if unroll:  # the sharding ILP: every layer its own equations
            pieces[i] = length
            why = "a scan over stacked layers, which the sharding ILP would lay out as one"
        else:
            pieces[i] = min(length, SCAN_PIECES_PER_LAYER * wanted)
            why = f"a scan over stacked layers, which layers={layers!r} may cut between pieces"
        notes.append(split_note(eqn, pieces[i], why))
    return split_scans(closed, pieces), tuple(notes)


#: A value the loss computes from its data alone, up to this size, is computed outside
#: a rematerialized layer (see :func:`_eval_rematerialized`).
DATA_STATISTIC_MAX_BYTES = 1 << 16


def _data_only_values(jaxpr) -> dict:
    """Vars of the loss's jaxpr computed from its constants (the closed-over batch and
    state) and literals alone, not from the differentiated arguments -> the size of the
    largest constant each is computed from (0: from literals alone)."""
    data = {v: aval_size(v.aval) for v in jaxpr.constvars}
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not hasattr(v, "val")]
        if not e.effects and not is_marker(e) and all(v in data for v in ins):
            size = max((data[v] for v in ins), default=0)
            data.update((o, size) for o in e.outvars)
    return data


def _data_statistics_first(run: list, data: dict, env: dict) -> list:
    """Evaluate now the equations of ``run`` that compute small data-only values read by
    the rest of it, reduced from larger data (a statistic: a count, a batch mean, not a
    mask or a constant), and the data-only equations they need; return the rest."""
    inside = {
        v
        for e in run
        if not all(o in data for o in e.outvars)
        for v in e.invars
        if not hasattr(v, "val")
    }
    wanted = [
        v
        for e in run
        for v in e.outvars
        if v in data
        and v in inside
        and aval_nbytes(v.aval) <= DATA_STATISTIC_MAX_BYTES
        and aval_size(v.aval) < data[v]
    ]
    if not wanted:
        return run
    producer = {v: e for e in run for v in e.outvars}
    need, stack = set(), list(wanted)
    while stack:
        v = stack.pop()
        e = producer.get(v)
        if e is None or id(e) in need:
            continue
        need.add(id(e))
        stack += [a for a in e.invars if not hasattr(a, "val")]
    eval_eqns([e for e in run if id(e) in need], env)
    return [e for e in run if id(e) not in need]


def _detached_markers(
    jaxpr, positions: list[int], live: dict[int, list], weights: list[bool]
) -> frozenset[int]:
    """The user markers none of whose crossing values the loss is differentiated through:
    the layers of a model run under ``jax.lax.stop_gradient`` (a distillation teacher),
    of an aux-only computation, or layers before the first weight (the input's one-hot
    or normalization, a frozen backbone's layers: values computed from the batch and
    constants alone).  They would have no backward mirror, so they mark no pipeline
    boundary; their equations run in the layer they stand in between the others.
    ``weights``: which of ``jaxpr``'s inputs are differentiated."""
    if not positions or is_literal(jaxpr.outvars[0]):
        return frozenset()
    needed = {jaxpr.outvars[0]}  # the loss: the first output leaf
    for e in reversed(jaxpr.eqns):
        if e.primitive.name != "stop_gradient" and any(o in needed for o in e.outvars):
            needed.update(v for v in e.invars if not is_literal(v) and _differentiable(v))
    # what depends on the differentiated inputs
    varying = batch_dependent(jaxpr, weights, len(jaxpr.eqns), frozenset({"stop_gradient"}))
    return frozenset(p for p in positions if not any(v in needed and v in varying for v in live[p]))


def _live_across(jaxpr, positions: list[int], before: bool = False) -> dict[int, list]:
    """For each marker position, the values defined before it and used after it, the
    marker's own results included (the explicit-value form ``(h,) =
    mark_pipeline_boundary(h)``: what follows reads them, not their sources); with
    ``before``: for a cut before equation ``p``, also those equation ``p`` reads."""
    if not positions:
        return {}
    defined_at = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    last_use = _last_uses(jaxpr)
    out = {}
    for p in positions:
        after, upto = (p - 1, p - 1) if before else (p, p)
        out[p] = [v for v, d in defined_at.items() if d <= upto and last_use.get(v, -1) > after]
    return out


def _last_uses(jaxpr) -> dict:
    """Each variable's last reader: its equation index (``len(eqns)`` for an output)."""
    last_use: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not hasattr(v, "val"):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            last_use[v] = len(jaxpr.eqns)
    return last_use


def _check_loss(out_shape, has_aux: bool) -> None:
    if has_aux:
        if not (isinstance(out_shape, tuple) and len(out_shape) == 2):
            raise MeshshardInputError(
                "meshshard.grad(has_aux=True): the loss function must return (loss, aux); "
                f"it returned {jax.tree.structure(out_shape)}"
            )
        out_shape = out_shape[0]
    shape = getattr(out_shape, "shape", None)
    dtype = getattr(out_shape, "dtype", None)
    if shape != () or dtype is None or not np.issubdtype(dtype, np.floating):
        what = f"{dtype}{list(shape)}" if shape is not None else type(out_shape).__name__
        raise MeshshardInputError(
            f"meshshard.grad: the loss must be a scalar float, got {what}; "
            "reduce it to one number (e.g. jnp.mean over the batch) before returning it"
        )


def _has_boundary(jaxpr) -> bool:
    return any(
        is_marker(e, "mark", "fwd") or any(_has_boundary(j) for j in sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def _check_nested_boundaries(jaxpr) -> None:
    """Refuse a pipeline boundary inside remat, a loop, a cond or a custom derivative."""
    for e in jaxpr.eqns:
        if any(_has_boundary(j) for j in sub_jaxprs(e)):
            name = _FRIENDLY.get(e.primitive.name, e.primitive.name)
            raise MeshshardInputError(
                f"mark_pipeline_boundary() is called inside {name} ({e.primitive.name} "
                "equation); meshshard cuts stages only between top-level equations: put the "
                "boundary outside it, e.g. remat each layer separately and mark between layers"
            )


_FRIENDLY = {
    "remat2": "jax.checkpoint / nn.remat",
    "checkpoint": "jax.checkpoint / nn.remat",
    "scan": "lax.scan / nn.scan",
    "while": "a lax.while_loop / fori_loop",
    "cond": "lax.cond / lax.switch",
    "custom_jvp_call": "a jax.custom_jvp function",
    "custom_vjp_call": "a jax.custom_vjp function",
}


def _differentiable(v) -> bool:
    """Float values cross a boundary marker; integers and keys (no cotangent) cross as is."""
    return jax.dtypes.issubdtype(v.aval.dtype, np.inexact)
