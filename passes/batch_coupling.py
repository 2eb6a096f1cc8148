"""Pass 0a''': find where a step couples the examples of its batch through its activations.

A layer that reduces parameter-dependent values over the batch and uses the result on
every example again (Flax ``BatchNorm`` in training mode, a centring ``h - h.mean(0)``,
a ``lax.cond`` on a batch mean, the first row ``h[0]`` broadcast back) computes, with
micro-batches, each micro-batch's own statistic: GPipe's semantics, not the full-batch
step's.  No combination of micro-batches fixes that after the fact (the statistic feeds
the rest of the forward), so meshshard keeps per-micro-batch semantics and says so: this
pass names each such reduction with the line of user code that made it, for a plan note
and a compile-time warning.

Found from the step traced at micro-batch and full-batch shape, paired equation by
equation (as :mod:`~meshshard.passes.reductions` does): an equation before the gradients'
end whose inputs change shape with the batch and whose outputs do not *reduces the
batch*; its outputs, and values computed from them without the batch, are the
statistic; an equation that reads the statistic and outputs batch-shaped values *uses it
on the batch*.  Not reported: statistics of the batch data alone (their full-batch value
is taken by :mod:`~meshshard.passes.batch_statistics`), values whose reduction the user
declared (``loss_reduce``, ``aux_reduce``: gradient accumulation's semantics, asked
for).  A reduction inside a user's ``jax.checkpoint``, scan or custom derivative is
found in its body, paired with the full-batch trace's.
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import is_literal, is_marker, paired_bodies, user_line
from meshshard.passes.batch_statistics import data_only, declared_slices
from meshshard.passes.hoist import batch_dependent
from meshshard.passes.reductions import batch_shape_changes, marker_reductions, same_program

__all__ = ["NOTE", "coupled_statistics"]

#: The start of each plan note (and warning) this pass writes.
NOTE = "per micro-batch, not the full batch:"


def coupled_statistics(micro: ClosedJaxpr, full: ClosedJaxpr | None, is_batch) -> tuple[str, ...]:
    """Plan notes naming the user's lines that reduce activations over the batch for a
    value the step uses on the batch again (so each micro-batch uses its own), one note
    per line; none with one micro-batch (``full`` None), when the two traces do not
    pair, or when the loss's reduction was declared."""
    if full is None or not same_program(micro, full):
        return ()
    mj, fj = micro.jaxpr, full.jaxpr
    ends = [i for i, e in enumerate(mj.eqns) if is_marker(e, "grad_end")]
    if ends and any(
        label == "loss" and source == "declared"
        for label, _, source in marker_reductions(mj.eqns[ends[0]])
    ):
        return ()
    stop = ends[0] if ends else len(mj.eqns)
    flags = list(is_batch) + [False] * (len(mj.invars) - len(is_batch))
    used: dict = {}  # id -> equation that reduced the batch, in order
    _find(mj, fj, stop, flags, data_only(mj, flags), declared_slices(mj), used)
    by_line: dict[str, list[str]] = {}
    for eqn in used.values():
        by_line.setdefault(user_line(eqn), []).append(eqn.primitive.name)
    return tuple(_note(line, prims) for line, prims in by_line.items())


def _find(mj, fj, stop: int, flags, data: set, declared: set, used: dict) -> None:
    """Add to ``used`` each equation of ``mj.eqns[:stop]`` (paired with ``fj``'s) that
    reduces activations over the batch for a value used on the batch again, looking
    inside the bodies of a user's ``jax.checkpoint``, scan or custom derivative too.
    ``flags``: per input of ``mj``, whether it depends on the batch."""
    dep = batch_dependent(mj, flags, stop)
    origin: dict = {}  # statistic var -> the equation that reduced the batch
    for em, ef in zip(mj.eqns[:stop], fj.eqns[:stop], strict=True):
        if is_marker(em):  # the identity per position
            for a, o in zip(em.invars, em.outvars, strict=False):
                if not is_literal(a) and a in origin:
                    origin[o] = origin[a]
            continue
        ins, outs = batch_shape_changes(em, ef)
        read = [origin[v] for v in em.invars if not is_literal(v) and v in origin]
        if outs:
            used.update((id(k), k) for k in read)
        elif read:
            origin.update((o, read[0]) for o in em.outvars)
        elif ins and any(_activation(o, dep, data, declared) for o in em.outvars):
            origin.update((o, em) for o in em.outvars)
        if ins and outs:
            for bm, bf in paired_bodies(em, ef):
                inner_flags = [not is_literal(v) and v in dep for v in em.invars]
                inner_data = data_only(bm, [not is_literal(v) and v in data for v in em.invars])
                _find(bm, bf, len(bm.eqns), inner_flags, inner_data, set(), used)


def _activation(v, dep, data, declared) -> bool:
    return v in dep and v not in data and v not in declared


def _note(line: str, prims: list[str]) -> str:
    what = ", ".join(dict.fromkeys(prims))
    count = f"{len(prims)} reductions" if len(prims) > 1 else "a reduction"
    return (
        f"{NOTE} {line} makes {count} ({what}) of activations over the batch whose "
        "result the step uses on every example (a batch norm in training mode, a branch "
        "on a batch mean, centring on it): each micro-batch uses its own, as in GPipe, so "
        "the step differs from jax.jit on the whole batch. num_micro_batches=1 computes "
        "it over the whole batch"
    )
