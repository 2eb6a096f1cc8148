"""PipeDream-2BW's update rule for ``PipeshardParallel(schedule="2bw")``.

What a step returns under ``2bw``: call ``k`` (from 0) of the parallelized step, given
``state_k``, returns exactly what the user's step returns, except that the gradient
``meshshard.grad`` computes is taken at the weights of the *previous* call's input
(``W(k-1)``, and ``W(0)`` for the first call) instead of ``W(k)``; the update is still
applied to ``W(k)``.  So ``W(k+1) = W(k) - lr * grad f(W(k-1))``: gradients coalesced
over the step's ``M`` micro-batches, each micro-batch's forward and backward on the same
version, staleness exactly 1, two weight versions per stage (``W(k)`` in the state,
``W(k-1)`` stashed by the step object).  The loss (and aux values) are those of the
stale weights, as in PipeDream-2BW.

How: the step is traced with the differentiated argument of its ``meshshard.grad``
replaced by a stashed copy, an extra step input; the step also returns the value it
replaced, which becomes the stash of the next call.  The first call compiles a plan
without the stash (``W(-1) = W(0)``), the later calls one with it.

No flush between steps: the later calls run *pipelined* (``Executable.pipelined``).
Call ``k`` submits step ``k`` to the workers, waits for step ``k - 1`` to finish and
returns step ``k``'s outputs as arrays still being computed (fetching one waits), so
step ``k + 1`` (the next call) starts while step ``k``'s last backwards drain.  On a
worker the two steps run side by side: step ``k + 1``'s forwards and backwards read the
stash ``W(k)`` (step ``k``'s input, already there) and only its update waits for
``W(k + 1)``, which step ``k`` writes.  At most two steps are in flight, so two weight
versions per stage.  ``MESHSHARD_2BW_PIPELINE=0`` runs every call as one flushed step
(same numbers, no overlap); plans with collectives (broadcasts or all-reduces) always
do.  The step order of the grid is what :func:`meshshard.passes.schedules.two_bw`
generates and the simulator times.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable

from meshshard.errors import MeshshardInputError

_STASH: contextvars.ContextVar = contextvars.ContextVar("meshshard_2bw_stash", default=None)


class _Stash:
    """The weights a 2BW step differentiates at (``shadow``) and the ones it replaced."""

    def __init__(self, shadow):
        self.shadow = shadow
        self.current = None
        self.used = False


def substitute(args: tuple, argnums) -> tuple:
    """Inside a 2BW step: record ``args[argnums]`` and swap in the stashed version.

    Called by ``meshshard.grad``; outside a 2BW step it returns ``args`` unchanged.
    """
    stash = _STASH.get()
    if stash is None:
        return args
    if stash.used:
        raise MeshshardInputError(
            "PipeshardParallel(schedule='2bw') supports one meshshard.grad call per step; "
            "combine the losses into one function or use schedule='1f1b'"
        )
    stash.used = True
    idx = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    stash.current = tuple(args[i] for i in idx)
    if stash.shadow is None:
        return args
    out = list(args)
    for i, value in zip(idx, stash.shadow, strict=True):
        out[i] = value
    return tuple(out)


class _StepOf:
    """A 2BW wrapper of a user's step; wrappers of one step compare equal, so a second
    ``parallelize`` of it (or ``lower`` then a call) is served from the trace cache.

    Its one attribute has a name of its own: ``ParallelizedFunction`` copies a wrapped
    function's ``__dict__`` (``functools.update_wrapper``), so a plain ``fn`` would
    replace the parallelized function's own.
    """

    def __init__(self, fn: Callable) -> None:
        self._two_bw_user_step = fn
        self.__name__ = getattr(fn, "__name__", "step")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._two_bw_user_step == self._two_bw_user_step

    def __hash__(self) -> int:
        return hash((type(self), self._two_bw_user_step))


class _FirstStep(_StepOf):
    def __call__(self, *args):
        return _traced(self._two_bw_user_step, None, args)


class _SteadyStep(_StepOf):
    def __call__(self, stash, *args):
        return _traced(self._two_bw_user_step, stash, args)


def first_step(fn: Callable) -> Callable:
    """``fn`` returning ``(outputs, the differentiated weights)``: the first 2BW call."""
    return _FirstStep(fn)


def steady_step(fn: Callable) -> Callable:
    """``step(stash, *args)``: ``fn`` differentiated at ``stash``, returning
    ``(outputs, the weights it replaced)``: every later 2BW call."""
    return _SteadyStep(fn)


def _traced(fn: Callable, shadow, args: tuple):
    stash = _Stash(shadow)
    token = _STASH.set(stash)
    try:
        out = fn(*args)
    finally:
        _STASH.reset(token)
    if stash.current is None:
        raise MeshshardInputError(
            "PipeshardParallel(schedule='2bw') needs a step that calls meshshard.grad "
            "(or meshshard.value_and_grad); a forward-only step has no weights to stash"
        )
    return out, stash.current


def stash_outputs(fn, out_shape) -> list[int]:
    """Positions, among the flattened outputs of ``fn`` traced to ``out_shape``, of the
    weights a 2BW step stashes for the next call (none when ``fn`` is no 2BW step)."""
    for _ in range(4):  # through wrappers that keep the step as ``fn`` (KeyedStep)
        if isinstance(fn, _StepOf) or not hasattr(fn, "fn"):
            break
        fn = fn.fn
    if not isinstance(fn, _StepOf):
        return []
    import jax

    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    return [i for i, p in enumerate(paths) if getattr(p[0], "idx", None) == 1]


def batch_dependent_stash_message() -> str:
    """Why a 2BW step whose differentiated weights depend on the batch is refused."""
    return (
        "PipeshardParallel(schedule='2bw') stashes the weights meshshard.grad "
        "differentiates at, for the next step's forward and backward, but this step "
        "computes them from the batch (SAM's ascent step from jax.grad, weights perturbed "
        "per batch): each micro-batch has its own, so there is no one version to stash; "
        "differentiate at the state's weights, or use schedule='1f1b'"
    )


class TwoBWStep:
    """Runs a step under 2BW: the first call plain, later calls with the stash."""

    def __init__(self, make: Callable, fn: Callable, batch_argnums, donate_argnums):
        if donate_argnums:
            raise MeshshardInputError(
                "PipeshardParallel(schedule='2bw') keeps the previous step's weights; "
                f"drop donate_argnums={tuple(donate_argnums)}"
            )
        self.first = make(first_step(fn), tuple(batch_argnums))
        self.steady = make(steady_step(fn), tuple(b + 1 for b in batch_argnums))
        self.steady.pipelined = os.environ.get("MESHSHARD_2BW_PIPELINE", "1") != "0"
        self.stash = None

    def __call__(self, *args):
        if self.stash is None:
            out, self.stash = self.first(*args)
        else:
            out, self.stash = self.steady(self.stash, *args)
        return out

    def settle(self) -> None:
        """Wait for every step still in flight (a checkpoint of the state needs it)."""
        exe = self.steady.executable
        if exe is not None:
            exe.settle()

    @property
    def last(self):
        """The compiled step that ran last (its plan and executable)."""
        return self.steady if self.steady.plan is not None else self.first
