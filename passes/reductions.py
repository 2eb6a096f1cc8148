"""Pass 0e: decide how the loss, its gradients and each aux value combine over micro-batches.

Found by tracing, not assumed: the step is traced at micro-batch and at full-batch
shape, and the two jaxprs are compared equation by equation along the backward slice of
each value ``meshshard.grad`` returns.  An equation whose inputs change shape with the
batch but whose outputs do not *reduces the batch* (``reduce_sum``, a contraction,
``reduce_max``...); a literal that is ``M`` times larger on the full batch and divides
(``jnp.mean``'s ``div x N``) *normalizes* by the batch size.  So:

* a sum-like reduction and a normalizer: ``mean``; a sum-like reduction alone: ``sum``;
* ``reduce_max`` alone: ``max``; ``reduce_min`` alone: ``min``;
* nothing that depends on the batch: ``mean`` (the value is the same on every
  micro-batch);
* a division by a value computed from the batch or a mix: not inferred (a masked mean's
  count of the batch data alone reaches here as an input already, taken over the full
  batch by :mod:`~meshshard.passes.batch_statistics`: the mean is then a sum);
* a non-linear function of the reduced value (``sqrt`` of a sum of squares: a norm; a
  product of two batch sums; a ``log`` of a sum): not inferred, since no combination of
  per-micro-batch values gives the full-batch one;
* terms that combine differently, added: a batch sum plus a constant (a weight penalty
  added to a summed loss would count once per micro-batch) or a mean plus a sum: not
  inferred as they stand (a mean plus a constant is a mean), but a loss of these is a
  sum once each micro-batch adds 1/M of its mean and constant terms
  (:class:`LossTermShares`: the step is traced again with ``loss_share`` equations on
  them); two maxima: not inferred;
* a value that pairs examples with one another (in-batch similarities ``z @ z.T``, the
  batch in two dimensions): not inferred, since a micro-batch sees only its own examples;
* an order statistic over the batch (a sort or top-k along it: ``jnp.median``, a
  quantile, the k largest losses): not inferred; as the loss it is refused with a fix
  that declares no reduction (the micro-batches' medians do not combine into the batch's).

A loss that is a maximum or minimum over the batch is refused: the micro-batches'
gradients do not combine into its gradient.  A value's slice follows a boundary marker
(the identity per position) through the traced value's own position only.

The loss decides its gradients (``mean``: averaged over micro-batches, ``sum``: summed);
:mod:`~meshshard.passes.loss_seed` then turns a mean loss's into sums of 1/M-seeded shares.
A declared reduction (marker or ``aux_reduce``) wins.  An aux value whose reduction is not
inferred gets the default (``mean`` for floats, ``sum`` for integers) and the plan says so.
The result is written into the ``grad_end`` marker's ``reduce`` parameter, which the
runtime reads.
"""

from __future__ import annotations

import os

import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import (
    is_dropvar,
    is_literal,
    is_marker,
    retrace,
    set_marker_params,
    user_frame,
    user_line,
    var_ids,
)
from meshshard.metrics import aux_reduce_p
from meshshard.passes.hoist import batch_dependent
from meshshard.primitives import loss_share_p

SUM_LIKE = frozenset({"reduce_sum", "dot_general", "cumsum", "scatter-add"})
#: How a reduction's source starts when it was not inferred (a default was taken).
DEFAULT = "default: "
#: Linear in their one operand: a batch sum (or mean, max, min) passes through them and
#: still combines over micro-batches the same way.
LINEAR_AFTER = frozenset(
    {
        "neg",
        "convert_element_type",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "copy",
        "copy_p",
        "reduce_precision",
        "slice",
        "dynamic_slice",
        "stop_gradient",
    }
)
# (a nested jit call, ``pjit``, is not listed: it may hide anything, a norm included)


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _is_index_dtype(v) -> bool:
    try:
        dtype = np.dtype(v.aval.dtype)
    except (AttributeError, TypeError):  # a token, or an extended dtype (a typed key)
        return False
    return np.issubdtype(dtype, np.integer) or dtype == np.bool_


def _normalizes(em, ef, m: int) -> str:
    """'norm' if ``em`` divides by (or multiplies by the inverse of) the batch size.

    Integer and boolean equations are never a normaliser: their batch-size literals are
    index arithmetic (``x[jnp.arange(n), labels]`` wraps negative indices with
    ``add(i, n)``), which picks values without scaling them.
    """
    if all(_is_index_dtype(o) for o in em.outvars):
        return ""
    out = ""
    for pos, (a, b) in enumerate(zip(em.invars, ef.invars, strict=True)):
        if not (is_literal(a) and is_literal(b)):
            continue
        x, y = np.asarray(a.val, np.float64), np.asarray(b.val, np.float64)
        if x.shape != () or x == y:
            continue
        name = em.primitive.name
        if name == "div" and pos == 1 and np.isclose(y, m * x):
            out = "norm"
        elif name == "mul" and np.isclose(x, m * y):
            out = "norm"
        else:
            return "other"
    return out


def classify(
    micro: ClosedJaxpr, full: ClosedJaxpr, var, m: int, dep: set, shares: dict | None = None
) -> tuple[str, str]:
    """(reduction or '', why) for value ``var`` of ``micro``; ``dep``: batch-dependent vars.

    A batch statistic the step uses on the batch again (a batch norm's mean, SAM's
    ascent direction ``g / norm(g)``) is an input to each micro-batch's share, which
    computes its own (GPipe's semantics, reported by
    :mod:`~meshshard.passes.batch_coupling`): ``var``'s slice stops there, so how it
    was computed does not decide how ``var`` combines.  So does a ``loss_share``: a
    1/M share of a batch mean or of a constant, which adds up over micro-batches.

    ``shares``: a dict to collect, instead of refusing them, the additions of a batch
    sum and a batch mean or a constant, as ``{id(eqn): (eqn, operand positions)}`` of
    the operands to take as 1/M shares (a value whose tail holds one is then a sum)."""
    shared = frozenset(
        o for e in micro.jaxpr.eqns if e.primitive is loss_share_p for o in e.outvars
    )
    memo = {
        _STATISTICS: used_on_the_batch(micro, full, dep) | shared,
        _SHARED: shared,
        _SHARES: shares,
    }
    return _classify(micro, full, var, m, dep, memo)


#: The key under which :func:`classify`'s memo holds the statistics its slices stop at.
_STATISTICS = object()
#: ... the results of the step's ``loss_share`` equations ...
_SHARED = object()
#: ... and the additions found to need shares (None: refuse them instead).
_SHARES = object()


class LossTermShares(Exception):
    """The loss adds a batch sum to terms that combine otherwise (a mean, a constant):
    it combines over micro-batches once those terms are 1/M shares.  ``paths``: where,
    as :func:`share_paths` gives them; the compiler traces the step again with them
    (:func:`meshshard.autodiff.loss_term_shares`).  ``outputs``: instead, for a
    forward-only step, result index -> such paths (:func:`share_outputs`)."""

    def __init__(self, paths: tuple = (), outputs: dict | None = None):
        super().__init__("the loss needs 1/M shares of some of its terms")
        self.paths = paths
        self.outputs = outputs


def share_paths(micro: ClosedJaxpr, var, shares: dict) -> tuple:
    """``(steps, primitive name, operand positions)`` for each addition in ``shares``
    (from :func:`classify`): ``steps`` are the ``(primitive name, operand index)`` pairs
    that lead from the loss ``var`` to it, boundary markers skipped, which find the same
    addition in the loss function's own jaxpr."""
    producer = {v: e for e in micro.jaxpr.eqns for v in e.outvars}
    found, stack, seen = {}, [(var, ())], set()
    while stack and len(found) < len(shares):
        v, steps = stack.pop()
        if is_literal(v) or v not in producer:
            continue
        e = producer[v]
        if is_marker(e):
            stack.append((e.invars[list(e.outvars).index(v)], steps))
            continue
        if id(e) in seen or len(steps) > 64:
            continue
        seen.add(id(e))
        if id(e) in shares:
            found[id(e)] = (steps, e.primitive.name, tuple(sorted(shares[id(e)][1])))
        stack += [(x, (*steps, (e.primitive.name, k))) for k, x in enumerate(e.invars)]
    return tuple(found.values())


def shared_equations(jaxpr, scale: float, paths, output: int = 0) -> dict:
    """Equation index of ``jaxpr`` -> (scale, operand positions to scale), for each of
    ``paths`` (:func:`share_paths`, taken from result ``output``, boundary markers
    skipped) that leads to an equation of the primitive it names; one that does not is
    left out, and the value it was for is refused as it would be without shares."""
    if len(jaxpr.outvars) <= output:
        return {}
    producer = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}

    def made(v):
        while not is_literal(v) and v in producer:
            i, e = producer[v]
            if not is_marker(e):
                return i, e
            v = e.invars[list(e.outvars).index(v)]  # a marker: the identity per position
        return None, None

    out = {}
    for steps, target, positions in paths:
        v = jaxpr.outvars[output]
        for name, k in steps:
            _, e = made(v)
            if e is None or e.primitive.name != name or k >= len(e.invars):
                break
            v = e.invars[k]
        else:
            i, e = made(v)
            if e is not None and e.primitive.name == target:
                out[i] = (scale, frozenset(positions))
    return out


def bind_with_shares(eqn, env: dict, scale: float, positions: frozenset) -> bool:
    """Evaluate addition ``eqn`` reading ``env`` with ``scale`` shares
    (``loss_share``) of the operands at ``positions``; writes its result, returns True."""
    vals = [v.val if is_literal(v) else env[v] for v in eqn.invars]
    vals = [
        loss_share_p.bind(x, scale=scale)[0] if k in positions else x for k, x in enumerate(vals)
    ]
    env[eqn.outvars[0]] = eqn.primitive.bind(*vals, **eqn.params)
    return True


def share_outputs(closed: ClosedJaxpr, scale: float, paths_by_output: dict) -> ClosedJaxpr:
    """``closed`` with ``scale`` shares of the terms ``paths_by_output`` names (result
    index -> :func:`share_paths`): a forward-only step's result that adds a batch sum to
    a batch mean or a constant then sums over micro-batches to the full batch's."""
    index = {}
    for output, paths in paths_by_output.items():
        index.update(shared_equations(closed.jaxpr, scale, paths, output))
    if not index:
        return closed

    def hook(i, eqn, env, extra) -> bool:
        return i in index and bind_with_shares(eqn, env, *index[i])

    return retrace(closed, hook)


def used_on_the_batch(micro: ClosedJaxpr, full: ClosedJaxpr, dep: set) -> frozenset:
    """The batch-dependent values of ``micro`` without the batch as a dimension that an
    equation reads to compute values with it: batch statistics used on every example."""
    out = set()
    for em, ef in zip(micro.jaxpr.eqns, full.jaxpr.eqns, strict=True):
        if is_marker(em) or not batch_shape_changes(em, ef)[1]:
            continue
        for a, b in zip(em.invars, ef.invars, strict=True):
            if not is_literal(a) and a in dep and _shape(a) == _shape(b):
                out.add(a)
    return frozenset(out)


def _classify(micro, full, var, m: int, dep: set, memo: dict) -> tuple[str, str]:
    """:func:`classify`, each value once per call: a sum's terms are classified on their
    own (:func:`_mixed_terms`), and a chain of additions shares its partial sums, so
    without ``memo`` the work doubled with every term added."""
    if var not in memo:
        memo[var] = _classify_once(micro, full, var, m, dep, memo)
    return memo[var]


def _classify_once(micro, full, var, m: int, dep: set, memo: dict) -> tuple[str, str]:
    if not is_literal(var) and var in memo[_SHARED]:
        return _share_kind(micro, full, var, m, dep, memo)
    if full_batch_shape(micro, full, var) != _shape(var):
        return "batch", f"it has the batch as a dimension ({list(_shape(var))} per micro-batch)"
    kinds, normalizers = set(), []
    producers = list(paired_producers(micro, full, var, memo[_STATISTICS]))
    ranked = _ranked_producer(producers)  # first: a median's arithmetic is beside the point
    if ranked:
        return "", ranked
    for em, ef, ins, outs in producers:
        if is_marker(em) or em.primitive is aux_reduce_p:
            continue
        if ins and not outs and em.primitive.name in _BODY_TOTALS:
            needed = {var} | {v for e, *_ in producers for v in e.invars if not is_literal(v)}
            total = _BODY_TOTALS[em.primitive.name]
            red, why = total(em, ef, producers, needed, m, dep)
            if not red:
                return "", why
            kinds.add("reduce_sum")
            normalizers += [em] * (red == "mean")  # the body's mean divides by the batch
            continue
        if ins and not outs:
            kinds.add(em.primitive.name)
            if em.primitive.name == "scatter-add" and not _into_zeros(em, producers):
                return "", (
                    "it scatter-adds the batch into a value that does not start at zero "
                    "(x.at[i].add(...) of a running total), which each micro-batch would "
                    "add again; scatter into zeros and add the total to that "
                    "(total + jnp.zeros_like(total).at[i].add(...))"
                )
        how = _normalizes(em, ef, m)
        if how == "other":
            return "", f"{em.primitive.name} by a literal that changes with the batch size"
        if how == "norm":
            normalizers.append(em)
    norms = len(normalizers)
    mixed = _mixed_examples(micro, producers)
    if mixed:
        return "", mixed
    twice = _normalized_twice(micro, producers, normalizers, var)
    if twice is not None:
        return "", (
            "it divides by the batch size twice (a mean divided by the batch size again: the "
            "batch's sum over its size squared), which no combination of the micro-batches' "
            f"values reproduces{_at_user_line(twice)}"
        )
    tail = _tail(producers, var)
    shares_read = (
        {v for em in tail[0] for v in em.invars if not is_literal(v)} & memo[_SHARED]
        if memo[_SHARED]
        else set()
    )
    if shares_read:  # a share is a reduced value: what follows it must be linear too
        tail = (tail[0], tail[1] | shares_read)
    if _divides_by_batch_total(producers, tail[0], dep):
        return "", "it divides by a total computed from the batch (e.g. a masked mean)"
    bad, where = _nonlinear_after_reduction(micro, tail)
    if bad:
        return "", f"it applies {bad} to a value reduced over the batch{where}"
    mixed = _mixed_terms(micro, full, producers, tail[0], m, dep, memo)
    if mixed:
        return "", mixed
    sharing = [em for em in tail[0] if memo[_SHARES] and id(em) in memo[_SHARES]]
    if shares_read or sharing:
        shared = set(shares_read) | {o for em in sharing for o in em.outvars}
        if _feeds(micro, shared, normalizers):  # (0.0 + sum(l)) / n: a mean of shares
            return "mean", SHARED_MEAN
        return "sum", SHARED_SUM
    if not kinds:
        return ("mean", "same on every micro-batch") if not norms else ("", "normalizer only")
    if kinds <= SUM_LIKE:
        return ("mean", "mean over the batch") if norms else ("sum", "sum over the batch")
    extremes = {EXTREMES[k] for k in kinds if k in EXTREMES}
    if kinds <= EXTREMES.keys() and len(extremes) == 1 and not norms:
        which = extremes.pop()  # a batch max, or a running max x.at[i].max(rows)
        flip, where = _nonlinear_after_reduction(micro, tail, keep_order=True)
        if flip:  # -max(x) is the min of -x: a max over micro-batches would be wrong
            return "", (
                f"it applies {flip} to a batch {which}imum, which may reverse its order{where}"
            )
        return which, "reduction over the batch"
    if kinds & {"scatter", "scatter-mul"}:
        return "", WRITES_ROWS
    if kinds & {"argmax", "argmin"}:
        return "", POSITION_IN_BATCH
    return "", f"it reduces the batch with {sorted(kinds)}"


#: Why-phrases of a value that adds terms combining differently over micro-batches.
MIXED_TERMS = (
    "it adds a batch ",
    "it adds two batch ",
    "it adds a value that does not depend on the batch to",
    "it picks between a batch ",
)
#: What to do with such a value (other than the loss, whose terms become 1/M shares):
#: no one declared reduction of the total is right.
MIXED_TERMS_FIX = (
    "return its terms as separate values (each combines on its own) and add them after "
    "the step; no single declared reduction of the total equals it"
)


#: The loss's: its batch sums plus means or constants are combined already (1/M shares),
#: so what is left mixes other kinds, and one declared reduction would be wrong too.
LOSS_TERMS_FIX = (
    "make each term of the loss a mean or a sum over the batch (a batch sum plus means "
    "and constants is combined for you); declaring loss_reduce would combine every term "
    "alike, which is wrong for these"
)


#: The fix for a loss whose terms need 1/M shares that could not be put on them: the
#: addition sits inside a function whose body the loss's re-trace does not enter.
UNSHARED_TERMS_FIX = (
    "meshshard combines a batch sum plus means and constants by taking the means and "
    "constants as 1/M shares of each micro-batch's loss, but could not put the shares on "
    "these terms (inside your own jax.checkpoint, custom derivative or loop?): add the "
    "terms outside it, or make each a mean or a sum over the batch; declaring "
    "loss_reduce would combine every term alike, which is wrong for these"
)


def fix_for(why: str, otherwise: str, mixed: str = MIXED_TERMS_FIX) -> str:
    """The fix to suggest for a value refused or defaulted because ``why``: ``mixed``
    for terms that combine differently, added or picked between, else ``otherwise``."""
    return mixed if any(m in why for m in MIXED_TERMS) else otherwise


#: How a loss that adds a batch sum to 1/M shares of other terms is said to combine.
SHARED_SUM = (
    "a sum over the batch plus terms that are not (a batch mean, a value the same on every "
    "micro-batch), which each micro-batch adds as 1/M shares"
)


#: ... and when that sum is then divided by the batch size (a total kept from 0.0 in a
#: Python loop, divided by the number of examples): each micro-batch's share of it is
#: divided by its own size, and the micro-batches' values average to the batch's.
SHARED_MEAN = (
    "a mean over the batch of a sum plus terms that are not (a batch mean, a value the "
    "same on every micro-batch), which each micro-batch adds as 1/M shares"
)


#: Primitives with bodies whose outputs may hold a batch total beside per-row values.
_BODIED = frozenset({"scan", "while", "cond", "custom_vjp_call", "custom_jvp_call"})


#: Operations whose result scales as their operands do: a division by the batch size
#: before them divides their result too.
_SCALES_LINEARLY = LINEAR_AFTER | {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "reduce_sum",
    "dot_general",
    "select_n",
    "concatenate",
    "cumsum",
    *_BODIED,  # their bodies are classified on their own; a mean's body counts once
}


def _normalized_twice(micro: ClosedJaxpr, producers, normalizers: list, var):
    """The second of ``normalizers`` (equations dividing by the batch size, among
    ``var``'s ``producers``) on one path to ``var``, or None: ``sum(x) / n / n`` or
    ``jnp.mean(x) / n``.  Normalizers on separate terms (``mean(a) + mean(b)``) count
    once each."""
    if len(normalizers) < 2:
        return None
    ids = {id(e) for e, *_ in producers}
    norm = {id(e) for e in normalizers}
    depth: dict = {}
    for e in micro.jaxpr.eqns:
        if id(e) not in ids:
            continue
        if is_marker(e):  # the identity per position, carrying unrelated values too
            for v, o in zip(e.invars, e.outvars, strict=True):
                depth[o] = 0 if is_literal(v) else depth.get(v, 0)
            continue
        ins = (depth.get(v, 0) for v in e.invars if not is_literal(v))
        # a non-linear step (jnp.sign of an input gradient, a square) rescales no sum
        d = max(ins, default=0) if e.primitive.name in _SCALES_LINEARLY else 0
        d += id(e) in norm
        if d > 1:
            return e
        for o in e.outvars:
            depth[o] = d
    return None


def _feeds(micro: ClosedJaxpr, values: set, eqns: list) -> bool:
    """Whether any of ``eqns`` (equations of ``micro``) reads ``values`` or a value
    computed from them."""
    if not eqns:
        return False
    reach, targets = set(values), {id(e) for e in eqns}
    for e in micro.jaxpr.eqns:
        if any(not is_literal(v) and v in reach for v in e.invars):
            if id(e) in targets:
                return True
            reach.update(e.outvars)
    return False


def _share_kind(micro, full, var, m: int, dep: set, memo: dict) -> tuple[str, str]:
    """How the result ``var`` of a ``loss_share`` combines: ``sum`` when it shares a batch
    mean or a value the same on every micro-batch (each micro-batch adds ``1/M`` of it)."""
    eqn = next(e for e in micro.jaxpr.eqns if var in e.outvars)
    x = eqn.invars[list(eqn.outvars).index(var)]
    if is_literal(x) or x not in dep:
        return "sum", "a 1/M share of a value the same on every micro-batch"
    red, why = _classify(micro, full, x, m, dep, memo)
    if red == "mean":
        return "sum", "a 1/M share of a batch mean"
    return "", why or f"it takes a 1/M share of a batch {red}"


#: Reductions whose micro-batch results combine by their maximum or minimum: a batch's
#: extreme, ``jnp.any``/``jnp.all`` of it, and rows folded into an array by index with
#: ``x.at[i].max(rows)`` (each micro-batch's array holds the extremes of its rows;
#: theirs, of all rows).
EXTREMES = {
    "reduce_max": "max",
    "scatter-max": "max",
    "reduce_or": "max",  # jnp.any: true if any micro-batch's is
    "reduce_min": "min",
    "scatter-min": "min",
    "reduce_and": "min",  # jnp.all: true if every micro-batch's is
}

#: Why a value that writes the batch's rows into an array by index is refused: each
#: micro-batch's array holds its own rows only, and no reduction of them gives the
#: batch's (a mean halves every row), so a default would be a wrong number.
WRITES_ROWS = "it writes the batch's rows into an array by index (x.at[i].set(rows) or .mul(rows))"


#: Why the position of the batch's best example (``jnp.argmax`` along the batch) is
#: refused: each micro-batch's is a position among its own rows, and no reduction of
#: the positions gives the batch's.
POSITION_IN_BATCH = "it is a position in the batch (jnp.argmax or argmin along it)"


def _position_message(label: str, producer, m: int) -> str:
    """The refusal of a value (``label``, made by ``producer``) that is a
    :data:`POSITION_IN_BATCH`."""
    return (
        f"{label}{_at_line(producer)} is a position in the batch (jnp.argmax or jnp.argmin "
        f"along it): with num_micro_batches={m} each micro-batch's is a position among its "
        "own rows, and no combination of them gives the batch's; return the per-example "
        "scores (they come back concatenated over the micro-batches) and take the argmax "
        "outside the step, or use num_micro_batches=1"
    )


def _writes_rows_message(label: str, producer, m: int) -> str:
    """The refusal of a value (``label``, made by ``producer``) that :data:`WRITES_ROWS`."""
    where = _at_line(producer)
    return (
        f"{label}{where} writes the batch's rows into an array by index (x.at[i].set(rows): a "
        f"memory bank of features by example id): with num_micro_batches={m} each "
        "micro-batch's array would hold only its own rows, and no combination of them "
        "gives the batch's (a mean halves every row); return the rows and their indices "
        "from the step (per-example values come back concatenated over the micro-batches) "
        "and write them outside it (bank = bank.at[idx].set(rows) under jax.jit), or use "
        "num_micro_batches=1"
    )


#: The refusals of values whose micro-batch results no reduction combines, by reason.
_REFUSED = {WRITES_ROWS: _writes_rows_message, POSITION_IN_BATCH: _position_message}


def _at_line(producer) -> str:
    """`` (file:line)`` of the user code that made ``producer``, or nothing."""
    f = user_frame(producer) if producer is not None else None
    return f" ({os.path.basename(f.file_name)}:{f.line_num})" if f is not None else ""


def _scan_total(em, ef, producers, needed: set, m: int, dep: set) -> tuple[str, str]:
    """How a ``scan`` or ``while`` loop that reduces the batch combines: ``sum`` or
    ``mean`` when each of its reducing outputs in ``needed`` (those the classified value
    reads, as the other totals take it) is a carry that starts
    at zero and adds, every step, a term that is a batch sum or mean (a loss summed over
    time steps: ``total + sum(...)``), or a scan's stacked per-step terms, each such a
    term, that ``var`` sums over the steps (:func:`_summed_over_steps`); else ('',
    why).  The term is classified in the loop body, paired with the full-batch trace's
    (:func:`classify`).  A ``while`` loop's trip count must not read the batch."""
    if em.primitive.name == "while":  # operands: cond consts, body consts, carries
        skip, nc, ncar = em.params["cond_nconsts"], em.params["body_nconsts"], len(em.outvars)
        bm, bf = em.params["body_jaxpr"], ef.params["body_jaxpr"]
        if any(v in dep for v in _loop_condition_reads(em)):
            return "", (
                f"it reduces the batch in a while loop whose trip count reads the batch"
                f"{_at_user_line(em)}"
            )
    else:
        skip, nc, ncar = 0, em.params["num_consts"], em.params["num_carry"]
        bm, bf = em.params["jaxpr"], ef.params["jaxpr"]
    operands = em.invars[skip:]
    made = {v: e for e, *_ in producers for v in e.outvars}
    kinds = set()
    for k in _reduced_outputs(em, ef, needed):
        a = em.outvars[k]
        why = (
            f"it reduces the batch in a {em.primitive.name} loop other than by adding to a "
            "carry that starts at zero"
        )
        if not same_program(bm, bf):
            return "", why
        if k >= ncar:  # stacked per-step totals (lax.map of a chunk's loss)
            if not _summed_over_steps(a, producers):
                return "", why
            term = bm.jaxpr.outvars[k]
        elif not all_zeros(operands[nc + k], made):
            return "", why
        else:
            carry_in, carry_out = bm.jaxpr.invars[nc + k], bm.jaxpr.outvars[k]
            body_made = {v: e for e in bm.jaxpr.eqns for v in e.outvars}
            add = body_made.get(carry_out)
            if add is None or add.primitive.name not in ("add", "add_any"):
                return "", why
            terms = [v for v in add.invars if _cast_of(v, body_made) is not carry_in]
            if len(terms) != 1 or is_literal(terms[0]) or len(add.invars) != 2:
                return "", why
            term = terms[0]
        if is_literal(term):
            return "", why
        red, why = classify(bm, bf, term, m, _body_dep(bm, operands, dep))
        if red not in ("sum", "mean"):
            return "", why or f"its {em.primitive.name} loop adds a batch {red} to a carry"
        kinds.add(red)
    if len(kinds) != 1:
        return "", f"its {em.primitive.name} loop totals a batch sum and a batch mean"
    return kinds.pop(), f"{em.primitive.name} over time"


def _summed_over_steps(stacked, producers) -> bool:
    """Whether every equation among ``producers`` that reads a scan's ``stacked`` output
    sums it over the steps (``jnp.sum(lax.map(chunk_loss, chunks))``).  Only that total
    is the batch's: a step's own value is not when the chunks cut the batch (its rows
    ``reshape(n, -1)``: each micro-batch's chunk ``j`` holds other rows than the
    batch's)."""
    readers = [e for e, *_ in producers if stacked in e.invars]
    return bool(readers) and all(
        e.primitive.name == "reduce_sum" and 0 in e.params["axes"] for e in readers
    )


def _loop_condition_reads(em) -> list:
    """The operands of ``while`` equation ``em`` that its condition reads: its own
    constants and the carries its condition's body looks at."""
    cj, cn, bn = em.params["cond_jaxpr"].jaxpr, em.params["cond_nconsts"], em.params["body_nconsts"]
    carries = em.invars[cn + bn :]
    used = {v for e in cj.eqns for v in e.invars if not is_literal(v)} | set(cj.outvars)
    return [
        op
        for op, inner in zip([*em.invars[:cn], *carries], cj.invars, strict=True)
        if inner in used and not is_literal(op)
    ]


def _cond_total(em, ef, producers, needed: set, m: int, dep: set) -> tuple[str, str]:
    """How a ``lax.cond`` whose branches reduce the batch combines: ``sum`` or ``mean``
    when the predicate is the same on every micro-batch (it does not read the batch) and
    every branch's output in ``needed`` is a batch sum, or every one a batch mean
    (or a constant), each classified in its branch, paired with the full-batch trace's
    (:func:`classify`); else ('', why).  A branch that takes a masked mean divides by its
    micro-batch's own count, so it is refused, as are branches that combine differently
    and values reduced outside the ``cond`` that its branches read."""
    where = _at_user_line(em)
    pred, operands = em.invars[0], em.invars[1:]
    if not is_literal(pred) and pred in dep:
        return "", (
            f"it picks a lax.cond branch by a value computed from the batch{where}, which "
            "each micro-batch would compute from its own examples"
        )
    if any(
        not is_literal(a) and a in dep and _shape(a) == _shape(b)
        for a, b in zip(operands, ef.invars[1:], strict=True)
    ):
        return "", (
            f"it passes a value reduced over the batch into a lax.cond{where}, whose "
            "branches meshshard cannot follow from one micro-batch to the batch; reduce "
            "inside the branches, or pick with jnp.where"
        )
    branches = list(zip(em.params["branches"], ef.params["branches"], strict=True))
    kinds, whys, refused = _body_totals(
        em, ef, branches, operands, needed, m, dep, f"a branch of its lax.cond{where}"
    )
    if refused:
        return "", refused
    if len(kinds) != 1:
        return "", (
            f"its lax.cond's branches{where} combine differently over micro-batches: "
            f"{' in one, '.join(sorted(set(whys)))} in another"
        )
    return kinds.pop(), "a lax.cond on a value the same on every micro-batch"


#: Calls of a function with a custom derivative: their body is the primal function.
_CUSTOM_CALLS = ("custom_vjp_call", "custom_jvp_call")


def _custom_call_total(em, ef, producers, needed: set, m: int, dep: set) -> tuple[str, str]:
    """How a call of a function with a custom derivative (a fused cross-entropy kernel
    under ``jax.custom_vjp``) that reduces the batch combines: as the primal function in
    its body does (:func:`classify`), whose derivative the custom one is taken to be."""
    where = _at_user_line(em)
    body = [(em.params["call_jaxpr"], ef.params["call_jaxpr"])]
    kinds, whys, refused = _body_totals(
        em, ef, body, em.invars, needed, m, dep, f"the function with a custom derivative{where}"
    )
    if refused:
        return "", refused
    if len(kinds) != 1:
        return "", f"the function with a custom derivative{where} returns a batch sum and a mean"
    return kinds.pop(), whys[-1]


def _body_totals(em, ef, bodies, operands, needed: set, m: int, dep: set, what: str):
    """``(kinds, whys, refusal)``: each output of ``em`` in ``needed`` that reduces the
    batch (:func:`_reduced_outputs`), classified in each of ``bodies`` (pairs of the
    micro-batch and full-batch traces' bodies, whose inputs are ``operands``) as a
    ``sum`` or a ``mean`` (a constant output counts as a mean), in order, or why one of
    them is neither; ``what`` names the body in that reason."""
    kinds, whys = set(), []
    for k in _reduced_outputs(em, ef, needed):
        for bm, bf in bodies:
            if not same_program(bm, bf):
                return (
                    kinds,
                    whys,
                    (f"{what} traces to different programs at micro-batch and full-batch shape"),
                )
            out = bm.jaxpr.outvars[k]
            red, why = (
                ("mean", "a constant")
                if is_literal(out)
                else classify(bm, bf, out, m, _body_dep(bm, operands, dep))
            )
            if red not in ("sum", "mean"):
                return kinds, whys, f"in {what}, {why or f'a batch {red}'}"
            kinds.add(red)
            whys.append(why)
    return kinds, whys, ""


def _reduced_outputs(em, ef, needed: set) -> list[int]:
    """Positions of the outputs of a body equation ``em`` (its twin ``ef`` in the full
    trace) that the classified value reads (``needed``) and that do not keep the batch."""
    return [
        k
        for k, (a, b) in enumerate(zip(em.outvars, ef.outvars, strict=True))
        if not is_dropvar(a) and a in needed and _shape(a) == _shape(b)
    ]


def _body_dep(body, operands, dep: set) -> set:
    """The batch-dependent values of ``body`` (a ``ClosedJaxpr`` whose inputs are
    ``operands`` of the equation holding it), from ``dep``, the outer ones."""
    return batch_dependent(
        body.jaxpr, [not is_literal(v) and v in dep for v in operands], len(body.jaxpr.eqns)
    )


#: How each primitive with a body that reduces the batch combines (see each function).
_BODY_TOTALS = {
    "scan": _scan_total,
    "while": _scan_total,
    "cond": _cond_total,
    **{name: _custom_call_total for name in _CUSTOM_CALLS},
}


def _cast_of(v, made: dict):
    """``v`` less the casts and copies that made it (a weakly typed carry is cast)."""
    while not is_literal(v) and v in made and made[v].primitive.name in _CASTS:
        v = made[v].invars[0]
    return v


_CASTS = frozenset({"convert_element_type", "copy", "copy_p"})


def _into_zeros(scatter, producers) -> bool:
    """Whether a ``scatter-add`` among ``producers`` adds into zeros."""
    return all_zeros(scatter.invars[0], {v: e for e, *_ in producers for v in e.outvars})


def all_zeros(v, made: dict) -> bool:
    """Whether ``v`` is all zeros: a zero literal, or one broadcast (``jnp.zeros``)."""
    while (
        not is_literal(v)
        and v in made
        and made[v].primitive.name
        in (
            "broadcast_in_dim",
            "convert_element_type",
        )
    ):
        v = made[v].invars[0]
    return is_literal(v) and not np.any(np.asarray(v.val))


#: Primitives that let one example's value depend on other rows (never concatenated).
_MIXING = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev"})


def concat_problem(micro, full, var, m: int) -> str | None:
    """Why ``var`` (which keeps the batch) is not per-example rows, or None if it is."""
    ms, fs = _shape(var), full_batch_shape(micro, full, var)
    if not ms or fs != (ms[0] * m, *ms[1:]):
        return f"it has the batch as a dimension other than the first ({list(fs)} on the batch)"
    for em, ef, ins, outs in paired_producers(micro, full, var):
        name = em.primitive.name
        if (ins and not outs) or name in _MIXING or _normalizes(em, ef, m):
            return f"each row depends on other rows of the batch ({name})"
    return None


def _mixed_examples(micro: ClosedJaxpr, producers) -> str:
    """Why the value mixes examples with one another, or ''.

    An equation whose result carries the batch in two dimensions (in-batch similarities
    ``z @ z.T``, a ``(B, B)`` mask) pairs every example with every other: on a
    micro-batch it sees only that micro-batch's examples (its negatives, say), so no
    combination of per-micro-batch values gives the full-batch one."""
    pos = {id(e): i for i, e in enumerate(micro.jaxpr.eqns)}
    for em, ef, _, outs in sorted(producers, key=lambda p: pos[id(p[0])]):
        if not outs:
            continue
        for a, b in zip(em.outvars, ef.outvars, strict=True):
            k = sum(x != y for x, y in zip(_shape(a), _shape(b), strict=True))
            if k > 1:
                return (
                    f"it mixes examples: {em.primitive.name} makes a value with the batch in "
                    f"{k} dimensions {list(_shape(a))} (e.g. in-batch similarities), which "
                    f"one micro-batch cannot reproduce{_at_user_line(em)}"
                )
        name = em.primitive.name
        axis = _along_axis(em)
        if axis is not None and axis in _batch_axes(em, ef):
            return (
                f"it mixes examples: {name} runs along the batch dimension (axis {axis}), so "
                "each result reads other examples' values, which a micro-batch does not hold "
                f"(is the batch the leading axis of every batch leaf?){_at_user_line(em)}"
            )
        if name == "scan" and em.params["length"] != ef.params["length"] and _carries_xs(em):
            return (
                f"it mixes examples: a scan runs over the batch dimension ({em.params['length']}"
                " rows per micro-batch) and carries state from one row to the next, which "
                "restarts on every micro-batch (a time-major batch? the batch must be the "
                "leading axis of every batch leaf)"
            )
    return ""


#: Operations along one axis whose every result reads the other rows on that axis:
#: running reductions (each row reads the rows before it), sorts and top-k (each reads
#: all of them).  The parameter naming the axis; top_k without one runs along the last.
ALONG_AXIS = {
    "cumsum": "axis",
    "cumprod": "axis",
    "cummax": "axis",
    "cummin": "axis",
    "cumlogsumexp": "axis",
    "sort": "dimension",
    "top_k": "axis",
}


def _along_axis(em) -> int | None:
    """The axis equation ``em`` runs along, if it is one of :data:`ALONG_AXIS`."""
    name = em.primitive.name
    if name not in ALONG_AXIS:
        return None
    axis = em.params.get(ALONG_AXIS[name])
    if axis is None:  # top_k before it took an axis: the last
        axis = len(_shape(em.invars[0])) - 1
    return axis % max(len(_shape(em.invars[0])), 1)


def _batch_axes(em, ef) -> set:
    """The operand dimensions of ``em`` whose size changes with the batch."""
    return {
        d
        for a, b in zip(em.invars, ef.invars, strict=True)
        for d, (x, y) in enumerate(zip(_shape(a), _shape(b), strict=True))
        if x != y
    }


#: Operations that rank values along one axis; along the batch, an order statistic.
RANKING = frozenset({"sort", "top_k"})


def _ranks_the_batch(em, ef) -> bool:
    """Whether equation ``em`` (``ef`` in the full-batch trace) sorts or ranks values
    along the batch dimension."""
    if em.primitive.name not in RANKING or em.primitive is not ef.primitive:
        return False
    pairs = zip(em.invars, ef.invars, strict=True)
    if any(len(_shape(a)) != len(_shape(b)) for a, b in pairs):
        return False
    return _along_axis(em) in _batch_axes(em, ef)


#: How :func:`_order_statistic_why` names a random shuffle of the batch.
SHUFFLE = "a random permutation of the batch"


def _is_shuffle(em) -> bool:
    """Whether sort ``em`` orders values by unsigned random bits, as
    ``jax.random.permutation`` and ``jax.random.shuffle`` do: a random shuffle."""
    ops = em.invars
    return (
        em.primitive.name == "sort"
        and em.params.get("num_keys") == 1
        and len(ops) == 2
        and str(getattr(ops[0].aval, "dtype", "")) == "uint32"
    )


def _order_statistic_why(em) -> str:
    """Why a value ranked by ``em`` along the batch combines no way over micro-batches."""
    if _is_shuffle(em):
        return (
            f"it mixes examples: {SHUFFLE} (jax.random.permutation, as mixup or cutmix "
            f"draws its partner examples; a sort by random bits along axis "
            f"{_along_axis(em)}) pairs examples from anywhere in the batch, so no "
            f"micro-batch can compute its share{_at_user_line(em)}"
        )
    return (
        f"it mixes examples: {em.primitive.name} runs along the batch dimension (axis "
        f"{_along_axis(em)}) of a per-example value: an order statistic over the batch (a "
        "sort, median, quantile or top-k, e.g. jnp.median(l), jnp.sort(l)[-k:], "
        "jax.lax.top_k(l, k)) ranks each example against the whole batch, so it cannot be "
        "computed per micro-batch and combined (the median of the micro-batches' medians "
        f"is not the batch's){_at_user_line(em)}"
    )


def _ranked_producer(producers) -> str:
    """:func:`_order_statistic_why` of the first of ``producers`` (paired, as from
    :func:`paired_producers`) that ranks the batch, or ''."""
    for em, ef, ins, _ in producers:
        if ins and _ranks_the_batch(em, ef):
            return _order_statistic_why(em)
    return ""


def order_statistic(micro: ClosedJaxpr, full: ClosedJaxpr, var) -> str:
    """Why ``var`` is an order statistic over the batch (it is computed from a sort or
    top-k along the batch dimension), or ''.  Traces that do not pair up equation by
    equation pair their sorts and top-ks in order: ``jnp.sort(l)[-4:]`` on a micro-batch
    of 4 examples slices nothing, so the two traces differ by that slice."""
    if same_program(micro, full):
        return _ranked_producer(paired_producers(micro, full, var))
    mj, fj = micro.jaxpr, full.jaxpr
    ranked = [(i, e) for i, e in enumerate(mj.eqns) if e.primitive.name in RANKING]
    ranked_full = [e for e in fj.eqns if e.primitive.name in RANKING]
    if len(ranked) != len(ranked_full):
        return ""
    in_slice = {i for i, _ in _slice(mj, var)}
    for (i, em), ef in zip(ranked, ranked_full, strict=True):
        if i in in_slice and _ranks_the_batch(em, ef):
            return _order_statistic_why(em)
    return ""


def _carries_xs(em) -> bool:
    """Whether scan equation ``em``'s carry after a step depends on the rows it scans
    (conservatively: any input of an inner equation reaches all its outputs)."""
    body = em.params["jaxpr"].jaxpr
    n_consts, n_carry = em.params["num_consts"], em.params["num_carry"]
    carry_in, carry_out = body.invars[n_consts : n_consts + n_carry], body.outvars[:n_carry]
    dep = set(body.invars[n_consts + n_carry :])
    changed = True
    while changed:
        changed = False
        for e in body.eqns:
            if any(not is_literal(v) and v in dep for v in e.invars):
                new = [o for o in e.outvars if o not in dep]
                dep.update(new)
                changed |= bool(new)
        for ci, co in zip(carry_in, carry_out, strict=True):
            if not is_literal(co) and co in dep and ci not in dep:
                dep.add(ci)
                changed = True
    return any(not is_literal(co) and co in dep for co in carry_out)


def _mixed_terms(micro: ClosedJaxpr, full: ClosedJaxpr, producers, tail, m: int, dep, memo) -> str:
    """Why a sum of terms in the value's tail combines no single way, or ''.

    Adding batch reductions is linear only when every term combines the same way: a
    mean plus anything the same on every micro-batch (a weight penalty) is a mean, and
    batch sums add to a sum, but a batch sum plus a constant counts the constant once
    per micro-batch, a mean plus a sum is neither (both are sums once the mean and the
    constant are 1/M shares: collected in ``memo[_SHARES]`` when it is a dict, see
    :func:`classify`), and two maxima do not add to the maximum of the sums.  A
    concatenation (a split scan's per-layer values, see
    :mod:`~meshshard.passes.unroll_scans`) follows the same rules, except that its parts
    stay apart: maxima concatenate to maxima.  So does a ``select_n`` whose predicate is
    the same on every micro-batch (``jnp.where(step < warmup, 0.5 * loss, loss)``): it
    picks one of its cases, which must combine alike.  Each term is classified on its
    own (:func:`classify`).  Only
    sums in the value's tail count (as in :func:`_nonlinear_after_reduction`): batch
    norm's fast variance ``mean(x**2) - mean(x)**2`` is a batch statistic used on the
    batch again, per micro-batch, not a term of the value.  ``tail``: the value's tail
    equations (:func:`_tail`)."""
    tail = {id(em) for em in tail}
    for em, _, ins, outs in producers:
        if (
            ins
            or outs
            or em.primitive.name not in ("add", "sub", "add_any", "concatenate", "select_n")
        ):
            continue
        if id(em) not in tail:
            continue
        kinds = []
        cases = em.invars[1:] if em.primitive.name == "select_n" else em.invars
        for v in cases:
            if is_literal(v):
                kinds.append("const")
                continue
            red, why = _classify(micro, full, v, m, dep, memo)
            if v not in dep and v not in memo[_SHARED]:  # the same on every micro-batch...
                if not red:  # ... unless divided by the batch size: each divides by its own
                    return SCALED_CONSTANT + _at_user_line(em)
                kinds.append("const")
                continue
            if not red:
                return why
            kinds.append(red)
        terms = [k for k in kinds if k != "const"]
        joins = em.primitive.name == "concatenate"
        if _shareable(em, kinds, memo[_SHARES]):
            positions = {k for k, kind in enumerate(kinds) if kind != "sum"}
            memo[_SHARES][id(em)] = (em, frozenset(positions))
            continue
        picks = em.primitive.name == "select_n"
        verb = "concatenates" if joins else "picks between" if picks else "adds"
        if len(set(terms)) > 1:
            return f"it {verb} a batch {terms[0]} and a batch {terms[1]}"
        if terms and terms[0] == "sum" and "const" in kinds:
            what = (
                "picks between a batch sum and a value that does not depend on the batch"
                if picks
                else f"{verb} a value that does not depend on the batch to a batch sum"
            )
            return f"it {what} (each micro-batch's value would count it once)"
        if len(terms) > 1 and terms[0] in ("max", "min") and not (joins or picks):
            return f"it adds two batch {terms[0]}ima"
    return ""


#: Why a sum with a term that divides a value independent of the batch by the batch
#: size is refused: each micro-batch divides it by its own size, M times the batch's.
SCALED_CONSTANT = (
    "it adds a value that does not depend on the batch divided by the batch size (a "
    "penalty over the batch size), which each micro-batch would divide by its own size"
)


def _shareable(em, kinds: list, shares: dict | None) -> bool:
    """Whether addition ``em``, whose operands combine as ``kinds``, adds a batch sum to
    batch means or constants that 1/M shares would make sums (with ``shares`` to collect
    it in: :func:`classify`)."""
    if shares is None or em.primitive.name not in ("add", "sub", "add_any"):
        return False
    if "sum" not in kinds or not set(kinds) <= {"sum", "mean", "const"} or set(kinds) == {"sum"}:
        return False
    return all(np.issubdtype(np.dtype(v.aval.dtype), np.inexact) for v in em.invars)


def _tail(producers, var) -> tuple[list, set]:
    """``var``'s tail: the equations it is computed by after its last batch reductions,
    on values without a batch dimension (unordered), and the outputs of those last
    batch reductions."""
    by_out = {o: p for p in producers for o in p[0].outvars}
    tail, reduced, seen, stack = [], set(), set(), [var]
    while stack:
        v = stack.pop()
        if is_literal(v) or v not in by_out:
            continue
        em, ef, ins, outs = by_out[v]
        k = list(em.outvars).index(v) if is_marker(em) else None  # see paired_producers
        if (id(em), k) in seen:
            continue
        seen.add((id(em), k))
        if k is not None:  # the identity per position: whether *this* one has the batch
            ins = outs = _shape(em.invars[k]) != _shape(ef.invars[k])
        if ins and not outs:  # a batch reduction: the tail starts after it
            reduced.update(em.outvars)
        elif not ins and not outs:
            if all(e is not em for e in tail):
                tail.append(em)
            stack += [em.invars[k]] if k is not None else list(em.invars)
    return tail, reduced


def _at_user_line(eqn) -> str:
    """`` (at file:line (function))`` naming the user's code that made ``eqn``, or ''
    when no frame of user code is known: a refusal that points at the line to change."""
    line = user_line(eqn)
    return "" if line == "<unknown>" else f" (at {line})"


def _nonlinear_after_reduction(micro: ClosedJaxpr, tail, keep_order=False) -> tuple[str, str]:
    """The first non-linear primitive between the batch reductions ``var`` is made from
    and ``var`` itself, and where the user's code applies it (:func:`_at_user_line`),
    or ``('', '')``.  Only the value's *tail* counts: the equations after its
    last batch reduction, on values without a batch dimension.  A batch statistic used
    on the batch again (batch norm's ``rsqrt`` of the variance) is per-micro-batch
    semantics, not a combination, and is left alone.  ``keep_order`` (for a maximum or
    minimum): also the first step that may reverse order (``neg``, subtracting it, a
    product or quotient with anything but a positive literal).  ``tail``: the value's
    tail and its last reductions' outputs (:func:`_tail`)."""
    pos = {id(e): i for i, e in enumerate(micro.jaxpr.eqns)}
    tail, reduced = tail[0], set(tail[1])
    for em in sorted(tail, key=lambda e: pos[id(e)]):
        which = [k for k, v in enumerate(em.invars) if not is_literal(v) and v in reduced]
        if not which:
            continue
        if is_marker(em):  # the identity per position
            reduced.update(em.outvars[k] for k in which)
            continue
        name = em.primitive.name
        linear = (
            em.primitive is aux_reduce_p
            or (name in LINEAR_AFTER and len(which) == 1)
            or name in ("add", "sub", "add_any")
            # per-layer values a split scan's pieces stack (unroll_scans): element-wise
            # each is the reduction it was, and _mixed_terms checks they agree
            or name == "concatenate"
            or (name == "mul" and len(which) == 1)
            or (name == "div" and which == [0])
            # summed or weighted over another axis (an ensemble's mean of its members'
            # batch means): still linear, but a sum of maxima is no maximum
            or (name in ("reduce_sum", "dot_general") and len(which) == 1 and not keep_order)
            # jnp.where(step < warmup, 0.5 * loss, loss): a predicate the same on every
            # micro-batch picks one case everywhere; _mixed_terms checks the cases agree
            or (name == "select_n" and 0 not in which)
            # lax.cond(step < warmup, lambda l: 0.5 * l, lambda l: l, loss): the same on
            # every micro-batch, each branch linear in the one reduced operand
            or (name == "cond" and 0 not in which and _linear_branches(em, which, keep_order))
        )
        if not linear or (keep_order and _may_reverse(em, which)):
            return name, _at_user_line(em)
        reduced.update(em.outvars)
    return "", ""


def _linear_branches(em, which, keep_order: bool) -> bool:
    """Whether every branch of ``cond`` equation ``em`` computes each output linearly from
    its one reduced operand (``which``: its position among ``em``'s operands, after the
    predicate), so whichever branch the step takes combines as that operand does."""
    if len(which) != 1:  # two reduced operands may combine differently
        return False
    for branch in em.params["branches"]:
        inner = branch.jaxpr.invars[which[0] - 1]
        bad, _ = _nonlinear_after_reduction(branch, (branch.jaxpr.eqns, {inner}), keep_order)
        if bad:
            return False
        flags = [v is inner for v in branch.jaxpr.invars]
        reach = batch_dependent(branch.jaxpr, flags, len(branch.jaxpr.eqns))  # what it reads
        if any(is_literal(v) or v not in reach for v in branch.jaxpr.outvars):
            return False  # a constant in one branch: a sum picked against it is no sum
    return True


def _may_reverse(em, which) -> bool:
    """Whether equation ``em`` may reverse the order of its operands ``which``."""
    name = em.primitive.name
    if name == "neg" or (name == "sub" and 1 in which):
        return True
    if name in ("mul", "div"):
        other = [v for k, v in enumerate(em.invars) if k not in which]
        return not all(is_literal(v) and np.all(np.asarray(v.val) > 0) for v in other)
    return False


def full_batch_shape(micro: ClosedJaxpr, full: ClosedJaxpr, var) -> tuple:
    """The shape ``var`` of the micro-batch trace has in the full-batch trace."""
    mj, fj = micro.jaxpr, full.jaxpr
    producer = {v: i for i, e in enumerate(mj.eqns) for v in e.outvars}
    idx = {v: k for k, v in enumerate(mj.invars)}
    return _shape(_full_var(mj, fj, var, producer, idx))


def paired_producers(micro: ClosedJaxpr, full: ClosedJaxpr, var, stop: frozenset = frozenset()):
    """Every equation ``var`` depends on, once each, as ``(micro eqn, full eqn, ins, outs)``;
    ``ins``/``outs``: whether its inputs / outputs change shape with the batch size (a
    ``scan``'s or ``cond``'s outputs: those ``var`` depends on, so a loop summing the
    batch into a carry reduces it even when it also returns per-row states, and so does
    a ``lax.cond`` whose branches reduce it beside the per-row residuals they keep for
    the backward).  The two traces match
    equation by equation, which is what lets a value's reduction
    over the batch be read off its producers.  Values in ``stop`` count as inputs."""
    fj = full.jaxpr
    found = list(_slice(micro.jaxpr, var, stop))
    needed = {var} | {v for _, e in found for v in e.invars if not is_literal(v)}
    for i, em in found:
        ef = fj.eqns[i]
        ins, outs = batch_shape_changes(em, ef)
        # a loop's total beside its batch rows; a lax.cond's loss beside the residuals
        # its branches keep for the backward
        if outs and em.primitive.name in _BODIED:
            outs = any(
                _shape(a) != _shape(b)
                for a, b in zip(em.outvars, ef.outvars, strict=True)
                if a in needed
            )
        yield em, ef, ins, outs


def batch_shape_changes(em, ef) -> tuple[bool, bool]:
    """Whether the inputs, and whether the outputs, of equation ``em`` of the micro-batch
    trace change shape in its twin ``ef`` of the full-batch trace: inputs that do and
    outputs that do not make a reduction over the batch."""
    ins = any(_shape(a) != _shape(b) for a, b in zip(em.invars, ef.invars, strict=True))
    outs = any(_shape(a) != _shape(b) for a, b in zip(em.outvars, ef.outvars, strict=True))
    return ins, outs


def _slice(jaxpr, var, stop=frozenset()):
    """Every equation of ``jaxpr`` that ``var`` depends on, as ``(index, eqn)``, once each
    (a boundary marker once per position it carries ``var``'s slice through); not those
    that only values in ``stop`` (other than ``var``) depend on."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    seen, stack = set(), [var]
    while stack:
        v = stack.pop()
        if is_literal(v) or v not in producer or (v in stop and v is not var):
            continue
        i = producer[v]
        e = jaxpr.eqns[i]
        # a boundary marker is the identity per position and carries unrelated values
        # too: follow only the traced value's own input, or every value crossing the
        # same boundary would join this one's slice
        k = list(e.outvars).index(v) if is_marker(e) else None
        if (i, k) in seen:
            continue
        seen.add((i, k))
        stack += [e.invars[k]] if k is not None else list(e.invars)
        yield i, e


def paired_prefix(mj, fj) -> int:
    """How many leading equations of two traces' jaxprs run the same primitives (all of
    them when :func:`same_program`): where a one-row micro-batch's trace and the full
    batch's still pair (JAX traces the backward's transposes of size-1 broadcasts as
    other equations)."""
    n = 0
    for a, b in zip(mj.eqns, fj.eqns, strict=False):
        if a.primitive is not b.primitive or len(a.outvars) != len(b.outvars):
            break
        n += 1
    return n


def same_program(micro: ClosedJaxpr, full: ClosedJaxpr) -> bool:
    """Whether two traces of one step run the same primitives in the same order, each
    with as many operands and results (so their equations pair up by position).  A
    ``lax.cond``'s residuals for the backward may differ in number: JAX keeps one copy of
    residuals that are the same value, which a micro-batch's shapes can make them."""
    me, fe = micro.jaxpr.eqns, full.jaxpr.eqns
    return [_arity(e) for e in me] == [_arity(e) for e in fe]


def _arity(eqn) -> tuple:
    return eqn.primitive, len(eqn.invars), len(eqn.outvars)


def _divides_by_batch_total(producers, tail, dep) -> bool:
    """Whether one of the value's ``tail`` equations (:func:`_tail`) divides by a value
    computed from the batch without the batch as a dimension (``sum(l) / sum(w)``).
    Divisions before the last batch reduction are left alone: they divide per-example
    values by a batch statistic used on the batch again (a hand-written batch norm's
    ``(h - mean) / std``, SAM's ascent step ``g / norm(g)``), which each micro-batch
    computes for itself, as with Flax's ``BatchNorm`` (see
    :mod:`~meshshard.passes.batch_coupling`)."""
    tail = {id(em) for em in tail}
    for em, ef, _, _ in producers:
        if id(em) not in tail or em.primitive.name != "div":
            continue
        d_m, d_f = em.invars[1], ef.invars[1]
        if not is_literal(d_m) and d_m in dep and _shape(d_m) == _shape(d_f):
            return True
    return False


def _full_var(mj, fj, var, producer, idx):
    if var in idx:
        return fj.invars[idx[var]]
    i = producer[var]
    return fj.eqns[i].outvars[list(mj.eqns[i].outvars).index(var)]


def marker_reductions(g) -> tuple:
    """The ``grad_end`` marker ``g``'s ``reduce`` parameter: per operand (label,
    reduction, source); every operand a gradient when the marker has none."""
    return tuple(g.params.get("reduce") or (("grad", "", ""),) * len(g.invars))


def resolve(
    micro: ClosedJaxpr, full: ClosedJaxpr | None, is_batch, m: int, allow_shares: bool = False
) -> tuple:
    """The ``grad_end`` marker's ``reduce`` parameter with every reduction decided.

    With ``allow_shares``, a loss that adds a batch sum to a batch mean or a constant
    raises :class:`LossTermShares` (the step is traced again with those terms as 1/M
    shares) instead of being refused."""
    mj = micro.jaxpr
    g = next((e for e in mj.eqns if is_marker(e, "grad_end")), None)
    if g is None:
        return None
    producer = {v: e for e in mj.eqns for v in e.outvars}
    dep = batch_dependent(mj, is_batch, len(mj.eqns))
    info = marker_reductions(g)
    out, loss = [], None
    for (label, red, source), v in zip(info, g.invars, strict=True):
        p = producer.get(v) if not is_literal(v) else None
        if not red and p is not None and p.primitive is aux_reduce_p:
            red, source = p.params["reduce"], "declared"
        if label == "grad":
            red, source = loss, "follows the loss"
        elif not red and (m == 1 or full is None or is_literal(v)):
            red, source = "mean", "one micro-batch" if m == 1 else "constant"
        elif not red and not same_program(micro, full):
            if label == "loss":
                _refuse_an_order_statistic(micro, full, v)
                # A guessed mean would average the gradients of a summed loss (or sum
                # those of a mean): wrong numbers, so refuse as for an unclassifiable loss.
                raise MeshshardInputError(
                    "meshshard cannot tell how the loss combines over micro-batches: the "
                    "step traces differently at micro-batch and full-batch shape (Python "
                    "code that branches or loops on the batch size, e.g. chunking the "
                    "batch), so its reductions cannot be matched; declare it with "
                    "meshshard.value_and_grad(..., loss_reduce='mean' or 'sum'), make the "
                    "program independent of the batch size, or use num_micro_batches=1"
                )
            red = "mean" if np.issubdtype(v.aval.dtype, np.floating) else "sum"
            source = f"{DEFAULT}the step traces differently at micro-batch and full-batch shape"
        elif not red:
            red, why = classify(micro, full, v, m, dep)
            if not red and label == "loss" and allow_shares:
                paths = term_share_paths(micro, full, v, m, dep)
                if paths:
                    raise LossTermShares(paths)
            if red == "batch":
                red, why = _per_example(micro, full, v, m, label, why, p)
            source = f"traced: {why}" if red else f"{DEFAULT}{why}"
            if not red and label == "loss":
                _refuse_an_order_statistic(micro, full, v)
                fix = fix_for(
                    why,
                    "make the loss a mean or a sum over the batch (with a masked mean, divide "
                    "by a count passed as a non-batch argument), or declare it with "
                    "meshshard.value_and_grad(..., loss_reduce='mean' or 'sum') (a declared "
                    "mean averages the micro-batches' losses with equal weights, whatever "
                    "their counts)",
                    LOSS_TERMS_FIX,
                )
                raise MeshshardInputError(
                    f"meshshard cannot tell how the loss combines over micro-batches: {why}; {fix}"
                )
            if not red and why in _REFUSED:
                raise MeshshardInputError(_REFUSED[why](label, p, m))
            if not red and label.startswith(PRE_GRAD_LABEL):
                raise MeshshardInputError(_unclassified_pre_grad_message(p, why))
            if not red:
                red = "mean" if np.issubdtype(v.aval.dtype, np.floating) else "sum"
        if label == "loss" and red in ("max", "min") and source != "declared":
            raise MeshshardInputError(
                f"the loss is a {red}imum over the batch: its gradient is that of the one "
                f"example that attains it, and the micro-batches' gradients do not combine "
                f"into it (an elementwise {red} of gradients is not a gradient); make the "
                "loss a mean or a sum over the batch, or use num_micro_batches=1"
            )
        if label == "loss":
            loss = red
        out.append((label, red, source))
    return tuple(out)


def term_share_paths(micro: ClosedJaxpr, full: ClosedJaxpr, var, m: int, dep: set) -> tuple:
    """:func:`share_paths` of the terms of ``var`` (refused as it stands) that, taken as
    1/M shares, make it a sum over micro-batches (a batch sum plus a batch mean or a
    constant), or a mean when that sum is then divided by the batch size; ``()`` when
    none do."""
    shares: dict = {}
    red, _ = classify(micro, full, var, m, dep, shares)
    if red not in ("sum", "mean") or not shares:
        return ()
    paths = share_paths(micro, var, shares)
    return paths if len(paths) == len(shares) else ()


#: How :mod:`~meshshard.passes.pre_grad_values` labels the batch values it passes
#: through the ``grad_end`` marker.
PRE_GRAD_LABEL = "before meshshard.grad"
#: How :mod:`~meshshard.passes.sink_metrics` labels the after-grad values it moves in
#: front of the marker.
AFTER_GRAD_LABEL = "after meshshard.grad"


def _unclassified_pre_grad_message(producer, why: str) -> str:
    """Why a batch value computed before the grad and read after it is refused: unlike
    an aux value the user returned (a default reduction, warned), nothing asked for it
    to be combined over micro-batches, so a guess would be a silent wrong number."""
    where = _at_line(producer)
    return (
        f"a value the step computes from the batch before meshshard.grad{where} and reads "
        f"after it, or returns, combines no known way over micro-batches: {why}; compute "
        "it inside the loss function and return it as aux, declare how it combines "
        "(meshshard.aux_mean/aux_sum/aux_max/aux_min(x)), return its per-example rows "
        "instead, or use num_micro_batches=1"
    )


def _per_example(micro, full, v, m: int, label: str, why: str, producer) -> tuple[str, str]:
    """``("concat", why)`` for a value ``meshshard.grad`` returns that holds one row per
    example (logits or predictions returned as aux): the micro-batches' rows, in order,
    are the batch's.  Raises MeshshardInputError for a per-example loss and for a value
    that keeps the batch some other way (``producer``: the equation that made it, for the
    user's line)."""
    if label == "loss":  # a scalar loss keeps the batch only under jax.vmap
        raise MeshshardInputError(
            f"the loss meshshard.grad differentiates {why.removeprefix('it ')}: per-example "
            "losses, as meshshard.grad under jax.vmap gives (per-example gradients, e.g. "
            "for DP-SGD); every gradient then keeps the batch, and micro-batches cannot "
            "accumulate them; run the step with num_micro_batches=1 (pipeline stages and "
            "data parallelism still apply)"
        )
    problem = concat_problem(micro, full, v, m)
    if problem is None:
        return "concat", "per-example values"
    where = _at_line(producer)
    if label.startswith(AFTER_GRAD_LABEL):  # moved in front of the grad by sink_metrics
        raise MeshshardInputError(
            f"a value the step computes from the batch after meshshard.grad{where} keeps "
            f"the batch, but {problem}: the update part of the step runs once per step, so "
            "such a value is computed per micro-batch and combined by mean, sum, max or "
            "min, or concatenated when it holds one row per example, and this one combines "
            "none of those ways; compute it inside the loss function and return it as "
            "aux, or use num_micro_batches=1. An optimizer whose update evaluates the loss "
            "again (optax.contrib.sophia's obj_fn, optax.lbfgs's line search) cannot run "
            "in the update: give it gradients only"
        )
    what = (
        f"a value the step computes from the batch before meshshard.grad{where}"
        if label.startswith(PRE_GRAD_LABEL)
        else f"the {label} value meshshard.grad returns"
    )
    raise MeshshardInputError(
        f"{what} keeps the batch, but {problem}: meshshard combines such a value over "
        "micro-batches by mean, sum, max or min, or concatenates it when it holds one row "
        "per example (the batch as its first dimension); reduce it over the batch inside "
        "the loss function, return per-example rows, or use num_micro_batches=1"
    )


def _refuse_an_order_statistic(micro: ClosedJaxpr, full: ClosedJaxpr, loss) -> None:
    """Raise MeshshardInputError if ``loss`` is an order statistic over the batch (a
    median, a quantile, the k largest per-example losses): declaring its reduction would
    combine the micro-batches' own statistics, which differ from the batch's."""
    why = order_statistic(micro, full, loss)
    if why and SHUFFLE in why:
        raise MeshshardInputError(
            f"meshshard cannot tell how the loss combines over micro-batches: {why}; shuffle "
            "or mix the examples before the step (in the input pipeline), or run it with "
            "num_micro_batches=1"
        )
    if why:
        raise MeshshardInputError(
            f"meshshard cannot tell how the loss combines over micro-batches: {why}; compute "
            "it with num_micro_batches=1, or outside the step, or use a mean or a sum over "
            "the batch as the loss (declaring loss_reduce='mean' or 'sum' would combine the "
            "micro-batches' own order statistics, not the batch's)"
        )


def set_reductions(closed: ClosedJaxpr, reduce: tuple, m: int = 1) -> ClosedJaxpr:
    """``closed`` with the ``grad_end`` marker's ``reduce`` parameter replaced."""
    if reduce is None:
        return closed
    if any(red == "concat" for _, red, _ in reduce):
        return set_marker_params(closed, "grad_end", reduce=reduce, num_micro_batches=m)
    return set_marker_params(closed, "grad_end", reduce=reduce)


def reductions_of(jaxpr) -> tuple:
    """The ``reduce`` parameter of the step's ``grad_end`` marker, or of a forward-only
    step's ``out`` marker (``()`` if none)."""
    g = next((e for e in jaxpr.eqns if is_marker(e, "grad_end", "out")), None)
    return () if g is None else tuple(g.params.get("reduce") or ())


def accumulator_reductions(jaxpr) -> dict[int, str]:
    """Var id (:func:`~meshshard.jaxpr_util.var_ids`) of each accumulated value (a result
    of the ``grad_end`` or ``out`` marker, an accumulator tensor's ``var``) -> the
    reduction that combines it over micro-batches, where one was decided."""
    g = next((e for e in jaxpr.eqns if is_marker(e, "grad_end", "out")), None)
    if g is None:
        return {}
    ids = var_ids(jaxpr)
    info = tuple(g.params.get("reduce") or ())
    return {ids[v]: r[1] for v, r in zip(g.outvars, info, strict=False) if v in ids and r[1]}


def reduction_notes(jaxpr, m: int, guessed_only: bool = False) -> list[str]:
    """Plan notes: how the loss and each aux value combine over ``m`` micro-batches.
    ``guessed_only``: just the values that took a default (their reduction was not
    inferred), which the user is warned of."""
    if m == 1:
        return []
    notes = []
    for label, red, source in reductions_of(jaxpr):
        if label == "grad" or (guessed_only and not source.startswith(DEFAULT)):
            continue
        what = "gradients and loss" if label == "loss" else label
        notes.append(f"{what}: {red} over {m} micro-batches ({source})")
    return notes
