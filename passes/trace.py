"""Pass 1: trace the user's train step at micro-batch shape.

Input: the step function and example arguments (arrays or ``jax.ShapeDtypeStruct``).
Output: a frozen :class:`TracedStep` holding the step's jaxpr with the batch leaves
shrunk to one micro-batch, the flattened leaf paths and which leaves are batch.  The
runtime traces the same function the same way and checks ``fingerprint`` to be sure
it compiles exactly the program that was planned.

The step is traced twice, at full-batch and at micro-batch shape; each trace has its
``jax.jit`` calls inlined (:mod:`~meshshard.passes.inline`) and its keys held as raw
data (:mod:`~meshshard.passes.physical_keys`).  Comparing the two finds the random
keys among the batch leaves (never cut: a leaf a draw uses as its key), the draws that
carry the batch (:mod:`~meshshard.passes.random_draws`) and how each value
``meshshard.grad`` returns combines over micro-batches
(:mod:`~meshshard.passes.reductions`), statistics of the batch data (a masked mean's
token count) taken over the full batch by the driver and read as new inputs
(:mod:`~meshshard.passes.batch_statistics`), batch values computed before the grad and
read after it passed through it as aux (:mod:`~meshshard.passes.pre_grad_values`), batch
metrics computed after the grad being computed per micro-batch before it
(:mod:`~meshshard.passes.sink_metrics`) and a mean
loss's backward seeded with each micro-batch's ``1/M`` share
(:mod:`~meshshard.passes.loss_seed`); batch-independent values the update reads from
before the grad are recomputed there (:mod:`~meshshard.passes.hoist`); a gradient summed
over several layers (a shared parameter) is returned per layer and summed in the update
(:mod:`~meshshard.passes.shared_grads`); a forward-only step's results are combined over
micro-batches (:mod:`~meshshard.passes.forward_only`); the update part takes the full
batch's constants where the step computed one from the batch's size
(:mod:`~meshshard.passes.update_constants`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import jax
import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.autodiff import LayerCuts, SharingLayerCuts, loss_term_shares
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import is_literal, is_marker, without_markers
from meshshard.passes.batch_coupling import coupled_statistics
from meshshard.passes.batch_indexing import batch_positions
from meshshard.passes.batch_statistics import (
    PATH,
    Statistics,
    find_statistics,
    hoist_statistics,
    statistics_program,
)
from meshshard.passes.forward_only import (
    combine_outputs,
    has_transposed_eqns,
    is_forward_only,
    output_reductions,
    several_grads_message,
    with_auto_layers,
)
from meshshard.passes.hoist import hoist_to_update
from meshshard.passes.inline import inline_calls
from meshshard.passes.inline_remat import inline_remat
from meshshard.passes.inline_update import inline_update_calls
from meshshard.passes.loss_seed import seed_micro_batch_shares
from meshshard.passes.narrow_gradients import narrow_padded_gradients
from meshshard.passes.physical_keys import physical_keys
from meshshard.passes.pre_grad_values import (
    literals_past_grad,
    pass_through_grad,
    read_after_grad,
    refuse_update_batch_reads,
)
from meshshard.passes.random_draws import INDEX_PATH, find_batch_draws, slice_batch_draws
from meshshard.passes.reductions import (
    LOSS_TERMS_FIX,
    UNSHARED_TERMS_FIX,
    LossTermShares,
    resolve,
    same_program,
    set_reductions,
    share_outputs,
)
from meshshard.passes.scatter_totals import split_scatter_totals
from meshshard.passes.shared_grads import split_shared_gradients
from meshshard.passes.sink_metrics import (
    batch_aux_positions,
    combined_after_grad,
    kept_after_grad,
    sink_batch_metrics,
)
from meshshard.passes.update_constants import use_full_batch_constants
from meshshard.passes.user_shardings import drop_user_shardings, user_sharding_note
from meshshard.passes.weight_views import recompute_weight_views
from meshshard.two_bw import batch_dependent_stash_message, stash_outputs


@dataclass(frozen=True)
class LeafInfo:
    """One flattened leaf of the step's arguments or results."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    is_batch: bool = False
    is_key: bool = False
    weak_type: bool = False

    def __str__(self) -> str:
        b = " (batch)" if self.is_batch else ""
        k = " (key)" if self.is_key else ""
        w = " (weak)" if self.weak_type else ""
        return f"{self.path}: {self.dtype}{list(self.shape)}{b}{k}{w}"


@dataclass(frozen=True)
class TracedStep:
    """The step's jaxpr at micro-batch shape, plus how its flat inputs/outputs map to leaves."""

    closed: ClosedJaxpr
    inputs: tuple[LeafInfo, ...]
    outputs: tuple[LeafInfo, ...]
    num_micro_batches: int
    fingerprint: str
    out_tree: object = None
    #: a step without meshshard.grad whose jaxpr holds a backward pass (jax.grad)
    transposed: bool = False
    #: per output leaf, the PRNG implementation of a typed key the step returns as raw
    #: data (None for other leaves); ``KeyedStep.restore`` wraps them back
    out_key_impls: tuple = ()
    #: the driver's program for the batch statistics the step reads as inputs after its
    #: own leaves (:mod:`~meshshard.passes.batch_statistics`), or None
    statistics: Statistics | None = None
    #: plan notes naming batch reductions of activations used on the batch again, which
    #: each micro-batch computes for itself (:mod:`~meshshard.passes.batch_coupling`)
    coupled: tuple[str, ...] = ()
    #: plan notes (and warnings) from tracing the step: its own sharding constraints,
    #: dropped (:mod:`~meshshard.passes.user_shardings`), NNX variables it changes in
    #: place and loses (:func:`~meshshard.nnx_modules.lost_in_place_note`)
    notes: tuple[str, ...] = ()
    #: how many times the step calls meshshard.grad; a step that calls it more than
    #: once (a GAN's two updates) runs as one program, its markers removed
    grad_calls: int = 1

    @property
    def jaxpr(self):
        return self.closed.jaxpr

    def __str__(self) -> str:
        return f"TracedStep({len(self.jaxpr.eqns)} eqns, fingerprint {self.fingerprint})"


def _path_str(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _argnum(where: str) -> int:
    """The argument position of a leaf named ``args[i]...``."""
    return int(where[len("args[") : where.index("]")])


def _not_the_batch(where: str) -> str:
    """The hint for a batch leaf that cannot be one: the batch may be another argument."""
    arg = f"args[{_argnum(where)}]"
    return f" (if {arg} is not the batch, pass the batch's position as batch_argnums)"


def abstract_leaf(
    leaf, scalars: tuple[type, ...] = (bool, int, float)
) -> jax.ShapeDtypeStruct | None:
    """What ``jax.jit`` traces ``leaf`` as: an array's (a NumPy, JAX or remote array)
    shape and dtype, weakly typed where the array is; a Python scalar of one of
    ``scalars`` weakly typed but for a bool (``0.5 * bf16_params`` stays bfloat16);
    None for anything else."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, jax.Array):  # (a typed key's dtype is no NumPy dtype)
        weak = bool(getattr(leaf, "weak_type", False))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=weak)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # NumPy, RemoteArray and friends
        weak = bool(getattr(leaf, "weak_type", False))
        return jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype), weak_type=weak)
    if scalars and isinstance(leaf, scalars):
        arr = np.asarray(leaf)
        dtype = jax.dtypes.canonicalize_dtype(arr.dtype)
        return jax.ShapeDtypeStruct(arr.shape, dtype, weak_type=not isinstance(leaf, bool))
    return None


def _abstract(leaf, where: str, arg_name: str):
    found = abstract_leaf(leaf, () if arg_name == "batch" else (bool, int, float))
    if found is not None:
        return found
    if arg_name == "batch":
        fix = (
            "every leaf of a batch argument must be an array (numpy or jax) with the batch "
            "as its first dimension; move other values into a closure or a non-batch "
            f"argument{_not_the_batch(where)}"
        )
    else:
        fix = (
            "pass the whole argument as static (parallelize(..., static_argnums=...): the "
            "step sees the Python value, compiled once per value), or move the value into "
            "a closure"
        )
    raise MeshshardInputError(
        f"{arg_name} leaf {where} is a {type(leaf).__name__}, not an array; {fix}"
    )


#: Traces kept per process, most recently used last.  The driver traces a step once
#: per compile and every worker traces it again; the same function (or the same planned
#: fingerprint) at the same argument shapes gives the same jaxpr, so a repeat is served
#: from here, as ``jax.jit`` serves its repeated traces from its cache.
TRACE_CACHE_SIZE = 8
_TRACES: OrderedDict = OrderedDict()
_TRACES_LOCK = threading.Lock()


def trace_step(
    fn: Callable,
    args: Sequence,
    *,
    batch_argnums: Sequence[int],
    num_micro_batches: int,
    fingerprint: str | None = None,
) -> TracedStep:
    """Trace ``fn(*args)`` with every batch leaf cut to ``1/num_micro_batches`` of its rows.

    Raises a clear error for non-array batch leaves and batches that do not divide.
    When a random draw carries the batch, the traced step takes one more input, the
    micro-batch index (``INDEX_PATH``, ``int32[M]`` cut into ``int32[1]`` rows).

    A repeat of an earlier call in this process (the same ``fn``, or a step whose
    planned ``fingerprint`` an earlier trace produced, at the same shapes) returns that
    trace (``TRACE_CACHE_SIZE`` kept): a worker unpickles its own copy of ``fn``, so it
    names the program it expects by the plan's fingerprint.
    """
    args = tuple(args)
    for i in batch_argnums:
        if not 0 <= i < len(args):
            raise MeshshardInputError(
                f"batch_argnums={tuple(batch_argnums)} names argument {i}, but the step was "
                f"called with {len(args)} arguments; pass batch_argnums indexing the batch"
            )
    flat_paths, treedef = jax.tree_util.tree_flatten_with_path(args)
    wheres, full_abs, in_batch = [], [], []
    for path, leaf in flat_paths:
        argnum = path[0].idx
        where = f"args[{argnum}]" + _path_str(path[1:]) if len(path) > 1 else f"args[{argnum}]"
        is_batch = argnum in batch_argnums
        wheres.append(where)
        in_batch.append(is_batch)
        full_abs.append(_abstract(leaf, where, "batch" if is_batch else "state"))
        if is_batch and not full_abs[-1].shape:  # named before the model fails on it
            raise MeshshardInputError(
                f"batch leaf {where} is a scalar; batch leaves need a leading batch "
                f"dimension: pass scalars through a non-batch argument{_not_the_batch(where)}"
            )
    sig = (
        treedef,
        tuple(
            (tuple(a.shape), str(np.dtype(a.dtype)), getattr(a, "weak_type", False))
            for a in full_abs
        ),
        tuple(batch_argnums),
        num_micro_batches,
        bool(jax.config.jax_enable_x64),
    )
    keys = [("fp", fingerprint, sig)] if fingerprint is not None else []
    if isinstance(fn, Hashable):  # hashing may still raise: _cached and the store catch it
        keys.append(("fn", fn, sig))
    for key in keys:
        hit = _cached(key)
        if hit is not None:
            if hasattr(fn, "out_impls"):  # a KeyedStep not traced itself: as its twin was
                fn.out_impls = hit.out_key_impls
            return hit
    traced = _trace_step(fn, num_micro_batches, treedef, wheres, full_abs, in_batch)
    with _TRACES_LOCK:
        for key in [*keys, ("fp", traced.fingerprint, sig)]:
            try:
                _TRACES[key] = traced
                _TRACES.move_to_end(key)
            except TypeError:
                continue
        while len(_TRACES) > TRACE_CACHE_SIZE * 2:  # two keys per trace
            _TRACES.popitem(last=False)
    return traced


def _cached(key) -> TracedStep | None:
    with _TRACES_LOCK:
        try:
            traced = _TRACES.get(key)
        except TypeError:  # an unhashable leaf of the key
            return None
        if traced is not None:
            _TRACES.move_to_end(key)
        return traced


def _trace_step(fn, m: int, treedef, wheres, full_abs, in_batch) -> TracedStep:
    """:func:`trace_step` without the cache.  A loss that adds a batch sum to a batch
    mean or a constant is traced again with those terms as 1/M shares of each
    micro-batch's loss (:func:`meshshard.autodiff.loss_term_shares`)."""
    try:
        return _trace_step_once(fn, m, treedef, wheres, full_abs, in_batch, allow_shares=True)
    except LossTermShares as shares:
        if shares.outputs:  # a forward-only step's results
            token = _OUTPUT_SHARES.set((1.0 / m, shares.outputs))
            try:
                return _trace_step_once(fn, m, treedef, wheres, full_abs, in_batch)
            finally:
                _OUTPUT_SHARES.reset(token)
        with loss_term_shares(1.0 / m, shares.paths):
            try:
                return _trace_step_once(fn, m, treedef, wheres, full_abs, in_batch)
            except MeshshardInputError as e:  # the shares found no place to go
                if LOSS_TERMS_FIX not in str(e):
                    raise
                raise MeshshardInputError(str(e).replace(LOSS_TERMS_FIX, UNSHARED_TERMS_FIX)) from e


#: A forward-only step's result terms to take as 1/M shares while tracing: (scale,
#: result index -> paths), see :func:`~meshshard.passes.reductions.share_outputs`.
_OUTPUT_SHARES: ContextVar[tuple | None] = ContextVar("meshshard_output_shares", default=None)


def _trace_step_once(
    fn, m: int, treedef, wheres, full_abs, in_batch, allow_shares: bool = False
) -> TracedStep:
    """:func:`_trace_step`, one trace; ``allow_shares``: see :func:`resolve`."""
    full_cuts, micro_cuts = LayerCuts(), LayerCuts()  # layers=: the cuts each shape chose
    try:
        full, full_out, transposed, notes = _trace(fn, treedef, full_abs, full_cuts)
    except Exception as exc:  # leaves of other lengths are the likelier fault: say so
        if m > 1 and not isinstance(exc, MeshshardInputError):
            _check_row_counts(full_abs, wheres, in_batch, m, cause=exc)
        raise
    grad_calls = sum(is_marker(e, "grad_end") for e in full.jaxpr.eqns)
    if grad_calls > 1:
        if m > 1:
            raise MeshshardInputError(several_grads_message(grad_calls, f"num_micro_batches={m}"))
        full, transposed = without_markers(full), True  # one program, as under jax.grad
    keys = key_inputs(full.jaxpr)
    is_batch = [b and i not in keys for i, b in enumerate(in_batch)]
    if m > 1:
        _check_row_counts(full_abs, wheres, is_batch, m)
    micro_abs = [
        _micro_batch_shape(a, w, m) if b else a
        for a, w, b in zip(full_abs, wheres, is_batch, strict=True)
    ]
    micro, out_shape = (
        (full, full_out)
        if m == 1
        else _trace_micro(fn, treedef, micro_abs, m, wheres, full_abs, micro_cuts)
    )
    if full_cuts.disagrees(micro_cuts):  # the micro-batch's cuts run: pair the traces
        full = _trace(fn, treedef, full_abs, LayerCuts(micro_cuts.chosen))[0]
    layers = (micro_cuts if m > 1 else full_cuts).layers
    if layers is not None and is_forward_only(micro.jaxpr) and not transposed:  # inference
        weights = [not b for b in is_batch]
        micro, full, split_notes = with_auto_layers(micro, full, layers, weights)
        notes += split_notes
    if m > 1:  # a graph batch's edge lists, keys per row number: not cut into micro-batches
        positions = batch_positions(micro, full, is_batch, wheres)
        if positions:
            raise MeshshardInputError(positions.message(m))
    outs = micro.jaxpr.outvars
    stash = {outs[i] for i in stash_outputs(fn, out_shape) if not is_literal(outs[i])}  # 2BW
    if stash and stash.intersection(read_after_grad(micro.jaxpr, is_batch)):
        raise MeshshardInputError(batch_dependent_stash_message())

    def through(closed):  # batch values from before the grad read after it: as aux
        if m > 1:  # a running total scattered into: total + a histogram of the batch
            closed = split_scatter_totals(closed, is_batch)
        return literals_past_grad(pass_through_grad(closed, is_batch))

    micro, full = (through(micro),) * 2 if m == 1 else (through(micro), through(full))
    batch_aux = batch_aux_positions(micro, full) if m > 1 else frozenset()
    combined = combined_after_grad(micro, full, is_batch, batch_aux, m) if m > 1 else frozenset()
    keep = kept_after_grad(micro, full, is_batch, batch_aux, m, combined) if m > 1 else frozenset()

    def sink(closed):  # batch metrics computed after the grad: per micro-batch
        return sink_batch_metrics(through(closed), is_batch, batch_aux, keep, combined)

    micro, full = (sink(micro),) * 2 if m == 1 else (sink(micro), sink(full))
    refuse_update_batch_reads(micro, is_batch, wheres)
    if m > 1:  # the update runs once per step: constants of the full batch's size
        micro = use_full_batch_constants(micro, full, is_batch)
    found = find_statistics(micro, full, is_batch) if m > 1 else None
    statistics = statistics_program(full, found, is_batch) if found else None
    if found:  # the batch data's statistics: new inputs, computed from the full batch
        micro, full = hoist_statistics(micro, found), hoist_statistics(full, found)
    stat_infos = [
        LeafInfo(PATH.format(k=k), tuple(v.aval.shape), str(np.dtype(v.aval.dtype)))
        for k, v in enumerate(micro.jaxpr.invars[len(is_batch) :])
    ]
    flags = is_batch + [False] * len(stat_infos)  # per input of micro: a batch leaf?
    coupled = coupled_statistics(micro, full, flags) if m > 1 else ()
    draws = find_batch_draws(micro, full, m)
    pair = _reduction_traces(fn, treedef, micro, full, micro_abs, is_batch, m, sink, micro_cuts)
    pair_flags = is_batch + [False] * (len(pair[0].jaxpr.invars) - len(is_batch))  # + statistics
    reduce = resolve(*pair, pair_flags, m, allow_shares)
    closed = slice_batch_draws(micro, draws)
    closed = hoist_to_update(closed, flags + [True] * bool(draws))
    closed, reduce = seed_micro_batch_shares(closed, reduce, m)
    closed = narrow_padded_gradients(set_reductions(closed, reduce, m))
    closed = split_shared_gradients(closed)
    closed = recompute_weight_views(closed, flags + [True] * bool(draws))
    closed = inline_remat(closed)
    out_paths, _ = jax.tree_util.tree_flatten_with_path(out_shape)
    forward_only = is_forward_only(closed.jaxpr)
    if m > 1 and forward_only and not transposed:  # results combined (forward_only.py)
        labels = ["out" + jax.tree_util.keystr(p) for p, _ in out_paths]
        how = output_reductions(micro, full, flags, m, labels, allow_shares)
        closed = combine_outputs(closed, how, m)
    infos = [
        LeafInfo(w, tuple(a.shape), str(np.dtype(a.dtype)), b, i in keys)
        for i, (w, a, b) in enumerate(zip(wheres, full_abs, is_batch, strict=True))
    ]
    infos += stat_infos
    if draws:
        infos.append(LeafInfo(INDEX_PATH, (m,), "int32", True))
    outputs = tuple(  # weak types as jax.jit returns them (a Python 0.0 is a weak float32)
        LeafInfo(
            "out" + _path_str(p),
            tuple(v.aval.shape),
            str(np.dtype(v.aval.dtype)),
            weak_type=bool(getattr(s, "weak_type", False)),
        )
        for (p, s), v in zip(out_paths, closed.jaxpr.outvars, strict=True)
    )
    return TracedStep(
        closed=closed,
        inputs=tuple(infos),
        outputs=outputs,
        num_micro_batches=m,
        fingerprint=fingerprint(closed),
        out_tree=jax.tree.structure(out_shape),
        transposed=forward_only and transposed,
        out_key_impls=tuple(getattr(fn, "out_impls", ())),
        statistics=statistics,
        coupled=coupled,
        grad_calls=grad_calls,
        notes=notes,
    )


def _trace_micro(fn, treedef, micro_abs, m: int, wheres, full_abs, cuts: LayerCuts) -> tuple:
    """The step traced at micro-batch shape, and its output shape.  The full batch traced
    already, so a failure here comes from cutting the batch leaves: say so, and which."""
    try:
        return _trace(fn, treedef, micro_abs, cuts)[:2]
    except MeshshardInputError:
        raise
    except Exception as e:
        was_cut = [a is not c for a, c in zip(full_abs, micro_abs, strict=True)]
        cut = [
            f"{w} {a.shape[0]} -> {c.shape[0]}"
            for w, a, c in zip(wheres, full_abs, micro_abs, strict=True)
            if tuple(a.shape) != tuple(c.shape)
        ]
        raise MeshshardInputError(
            f"the step traces with the full batch but not with micro-batches (each batch "
            f"leaf cut to 1/{m} of its rows{': ' + ', '.join(cut[:6]) if cut else ''}"
            f"{' ...' if len(cut) > 6 else ''}): {type(e).__name__}: {e}\nA leaf that is not "
            "per-example (loss weights, a per-feature vector, a lookup table) belongs in a "
            "non-batch argument, and code that assumes the full batch size must read it "
            "from the arrays' shapes; or use num_micro_batches=1"
            f"{_batch_elsewhere(full_abs, wheres, was_cut)}"
            f"{_rows_in_the_state(full_abs, wheres, was_cut, str(e))}"
        ) from e


def _reduction_traces(fn, treedef, micro, full, micro_abs, is_batch, m: int, sink, cuts):
    """Two traces whose batch sizes differ ``m``-fold (none for the second when ``m`` is
    1), for ``resolve`` to tell how the loss and aux values combine over micro-batches.

    Normally the micro-batch and the full batch.  Where those two do not pair, the step
    is traced again at 2 and ``2 m`` rows, or else 3 and ``3 m``, each pair cut where its
    first trace is (``cuts``: the micro-batch's :class:`LayerCuts`).  JAX specializes a
    dimension of size 1, so a one-row micro-batch often traces other equations than the
    full batch; and a ``lax.cond`` keeps one copy of residuals for its backward that are
    the same value, which the micro-batch's shapes can make two of them (its rows equal
    to a layer's width): the same operations, with other numbers of operands.  A step
    whose operations differ otherwise (Python code on the batch size) is not traced at
    other sizes, where it might pair and hide that its batch's program is another."""
    if m == 1 or same_program(micro, full):
        return micro, full
    rows = {a.shape[0] for a, b in zip(micro_abs, is_batch, strict=True) if b and a.shape}
    same_ops = [e.primitive for e in micro.jaxpr.eqns] == [e.primitive for e in full.jaxpr.eqns]
    if rows != {1} and not same_ops:  # Python code on the batch size: other sizes may hide it
        return micro, full

    def at(n):
        return [
            jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype) if b and a.shape else a
            for a, b in zip(micro_abs, is_batch, strict=True)
        ]

    shared = LayerCuts(cuts.chosen)
    for n in (k for k in (2, 3) if {k} != rows):
        few = sink(_trace(fn, treedef, at(n), shared)[0])
        many = sink(_trace(fn, treedef, at(n * m), shared)[0])
        if same_program(few, many):
            found = find_statistics(few, many, is_batch)  # as the micro-batch reads them
            if found:
                return hoist_statistics(few, found), hoist_statistics(many, found)
            return few, many
    return micro, full


def _trace(
    fn: Callable, treedef, leaves: list, cuts: LayerCuts | None = None
) -> tuple[ClosedJaxpr, object, bool, tuple]:
    """The step's jaxpr with calls inlined, keys held as raw data and the user's own
    sharding constraints dropped, its output shape, whether it holds transposed
    (backward) equations, and the notes on what the user should know (or ()).
    ``layers=`` cuts are shared through ``cuts`` (:class:`LayerCuts`)."""
    target = fn if cuts is None else SharingLayerCuts(fn, cuts)
    args = jax.tree.unflatten(treedef, leaves)
    try:
        closed, out = jax.make_jaxpr(target, return_shape=True)(*args)
    except TypeError as exc:  # JAX's words name neither the step nor the result's path
        bad = _non_array_results(target, args)
        if bad:
            raise MeshshardInputError(_non_array_message(fn, bad)) from exc
        raise
    except NameError as exc:  # pmap-style code: jax.lax.pmean(grads, "batch")
        axis = _unbound_axis(exc)
        if axis is None:
            raise
        raise MeshshardInputError(_unbound_axis_message(fn, axis)) from exc
    lost = getattr(fn, "in_place_note", None)  # a KeyedStep's (meshshard.keys)
    transposed = has_transposed_eqns(closed)  # before re-traces drop the name stacks
    note = user_sharding_note(closed)
    closed = drop_user_shardings(closed)
    # jit-wrapped steps/losses first, then one equation per mesh in the update part
    closed = physical_keys(inline_update_calls(inline_calls(closed)))
    shares = _OUTPUT_SHARES.get()
    if shares is not None:
        closed = share_outputs(closed, *shares)
    return closed, out, transposed, tuple(n for n in (note, lost) if n)


def _unbound_axis(exc: NameError) -> str | None:
    """The axis name JAX found unbound in ``exc`` ('' if it did not say which), or None
    for another NameError."""
    text = str(exc)
    if "unbound axis name" not in text:
        return None
    return text.split("unbound axis name:", 1)[-1].split(".")[0].strip() if ":" in text else ""


def _unbound_axis_message(fn, axis: str) -> str:
    """Why a step written for ``jax.pmap`` (a collective over a named axis) is refused."""
    name = _user_name(fn)
    which = f" {axis!r}" if axis else ""
    return (
        f"{name} calls a collective over the named axis{which} (jax.lax.pmean, psum, "
        "all_gather ... as code written for jax.pmap does), which no mapped axis binds "
        "here: meshshard runs the step over the whole batch, as jax.jit does, and splits "
        "and combines it itself, so the gradients meshshard.grad returns are already the "
        "full batch's; drop the collective"
    )


def _is_array_result(leaf) -> bool:
    """Whether a step may return ``leaf``: an array, a NumPy or Python number."""
    numbers = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
    return isinstance(leaf, numbers) or hasattr(leaf, "__jax_array__")


def _non_array_results(target: Callable, args) -> list[tuple[str, str]]:
    """(path, type name) of each result leaf of ``target(*args)`` that is not an array,
    found by tracing it again with those leaves dropped (only after a trace failed)."""
    bad: list[tuple[str, str]] = []

    def arrays_only(*a):
        out = target(*a)
        paths, treedef = jax.tree_util.tree_flatten_with_path(out)
        kept = []
        for path, leaf in paths:
            if _is_array_result(leaf):
                kept.append(leaf)
            else:
                bad.append(("out" + jax.tree_util.keystr(path), type(leaf).__name__))
                kept.append(None)
        return jax.tree.unflatten(treedef, kept)

    with contextlib.suppress(Exception):  # the first failure is the one to report
        jax.make_jaxpr(arrays_only)(*args)
    return bad


def _user_name(fn: Callable) -> str:
    """The name of the user's step function under meshshard's wrappers (keys, layers=)."""
    for _ in range(8):
        if isinstance(getattr(fn, "__name__", None), str):
            return fn.__name__
        fn = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None)
    return "the step"


def _non_array_message(fn: Callable, bad: list[tuple[str, str]]) -> str:
    name = _user_name(fn)
    listed = ", ".join(f"{path} (type {kind})" for path, kind in bad[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    return (
        f"{name} returns values that are not arrays: {listed}{more}; a parallelized step "
        "returns arrays and numbers only (as jax.jit's does): compute strings, flags and "
        "other Python objects outside the step, or return them as arrays"
    )


def key_inputs(jaxpr) -> frozenset:
    """Indices of the inputs used as random keys (operands of ``random_wrap``)."""
    pos = {v: i for i, v in enumerate(jaxpr.invars)}
    return frozenset(
        pos[v]
        for e in jaxpr.eqns
        if e.primitive.name == "random_wrap"
        for v in e.invars
        if not is_literal(v) and v in pos
    )


def _check_row_counts(full_abs, wheres, is_batch, m: int, cause=None) -> None:
    """Raise MeshshardInputError (from ``cause``, the error tracing the step raised, if
    any) unless every batch leaf has the same number of rows: micro-batches cut each
    one's leading axis into ``m``, so a leaf of another length (a vector of class weights
    carried in the batch dict) would be cut as well, and each micro-batch would silently
    read a piece of it."""
    rows: dict[int, list[str]] = {}
    for a, w, b in zip(full_abs, wheres, is_batch, strict=True):
        if b:
            rows.setdefault(a.shape[0], []).append(w)
    if len(rows) < 2:
        return
    common = max(rows, key=lambda n: len(rows[n]))
    odd = ", ".join(f"{w} ({n} rows)" for n, ws in rows.items() if n != common for w in ws)
    raise MeshshardInputError(
        f"the batch leaves have different numbers of rows: {odd}, while "
        f"{rows[common][0]} has {common}; num_micro_batches={m} cuts the leading axis of "
        "every batch leaf, so each must have the batch size first; pass values that are "
        "not per-example (class weights, a table) through a non-batch argument or a "
        "closure, or run with num_micro_batches=1 where the leaves cannot be cut alike (a "
        f"graph batch's nodes and edges){_batch_elsewhere(full_abs, wheres, is_batch)}"
    ) from cause


def _batch_elsewhere(full_abs, wheres, is_batch) -> str:
    """A hint when another argument looks like the batch (every array leaf with one
    number of rows): while the one named holds leaves of several, the arguments may be
    in another order than ``batch_argnums`` says (``step(batch, state)``); while it
    holds that many rows too, the batch may come in several arguments (``step(state,
    images, labels)``), of which the default takes the first only."""
    rows: dict[int, set[int]] = {}
    named: dict[int, set[int]] = {}
    for a, w, b in zip(full_abs, wheres, is_batch, strict=True):
        if a.shape:
            (named if b else rows).setdefault(_argnum(w), set()).add(a.shape[0])
    alike = [i for i, counts in sorted(rows.items()) if len(counts) == 1]
    batch_rows = set().union(*named.values()) if named else set()
    if len(batch_rows) == 1:
        more = [i for i in alike if rows[i] == batch_rows]
        if more:
            argnums = ", ".join(map(str, sorted({*named, *more})))
            return (
                f"; {', '.join(f'args[{i}]' for i in more)} "
                f"{'has' if len(more) == 1 else 'have'} {batch_rows.pop()} rows, as the "
                f"batch has: if the batch comes in several arguments, pass "
                f"batch_argnums=({argnums})"
            )
    if not alike:
        return ""
    i = alike[0]
    return (
        f"; args[{i}]'s leaves all have {rows[i].pop()} rows: if it is the batch, pass "
        f"batch_argnums=({i},)"
    )


def _rows_in_the_state(full_abs, wheres, is_batch, error: str) -> str:
    """A hint when the error names the shape of a non-batch leaf with as many rows as
    the batch: a value kept per example between steps (an RNN's hidden state carried
    over truncated backpropagation, a memory) that each micro-batch needs its rows of."""
    rows = {a.shape[0] for a, b in zip(full_abs, is_batch, strict=True) if b and a.shape}
    if len(rows) != 1:
        return ""
    (n,) = rows
    named = [
        w
        for a, w, b in zip(full_abs, wheres, is_batch, strict=True)
        if not b and a.shape and a.shape[0] == n and str(tuple(a.shape)) in error
    ]
    if not named:
        return ""
    return (
        f"; {', '.join(named[:3])} {'has' if len(named) == 1 else 'have'} {n} rows, as the "
        "batch has: a value kept per example from step to step (an RNN's hidden state) "
        "must travel with the batch: pass it in a batch argument (batch_argnums) so each "
        "micro-batch reads its own rows, and return its new rows from the step"
    )


def _micro_batch_shape(a, where: str, m: int):
    n = a.shape[0]  # a batch leaf: not a scalar (trace_step names one)
    if n % m:
        raise MeshshardInputError(
            f"batch leaf {where} has {n} rows, not divisible by num_micro_batches={m}; "
            f"use a batch size that is a multiple of {m} or choose num_micro_batches dividing {n}"
            f" (micro-batches cut the leading axis of every batch leaf, here of shape "
            f"{tuple(a.shape)}: a time-major leaf must be made batch-first)"
        )
    return jax.ShapeDtypeStruct((n // m, *a.shape[1:]), a.dtype)


def fingerprint(closed: ClosedJaxpr) -> str:
    """A short stable hash of a traced program: its jaxpr's text and the values of its
    constants (arrays the step closes over, which the text names but does not show).

    Two steps that differ only in a closed-over array (a mask, loss weights, a
    learning rate held as an array) are different programs: with the text alone they
    shared a fingerprint, and a worker looking up its trace by the plan's fingerprint
    ran the other step's constants.  A jaxpr without constants hashes its text alone,
    as before."""
    h = hashlib.sha256(str(closed.jaxpr).encode())
    for c in closed.consts:
        dtype = getattr(c, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            c = jax.random.key_data(c)
        a = np.ascontiguousarray(np.asarray(c))
        h.update(f"|{a.dtype}{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]
