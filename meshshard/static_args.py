"""Static arguments of a parallelized step: values the step branches on, not arrays.

``parallelize(step, static_argnums=...)`` follows ``jax.jit``: a static argument is
passed to the step as the Python value itself (a flag, a mode string, a config object),
and each distinct value gets its own compiled step.  The default, ``"auto"``, marks as
static the arguments that could never be arrays (strings, booleans, enums, and objects
JAX sees as one leaf that is not an array), the way Alpa's ``parallelize`` does, so a
step like ``train_step(state, batch, "train")`` runs instead of being refused.

    >>> import numpy as np
    >>> static_positions((np.ones(2), "train", True, 3), "auto")
    (1, 2)
    >>> static_positions((np.ones(2), 3), (-1,))
    (1,)
    >>> step = WithStatic(lambda x, mode, y: (mode, x + y), ((1, "eval"),))
    >>> step(1, 2)
    ('eval', 3)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from enum import Enum

import jax
import numpy as np

from meshshard.errors import MeshshardInputError

__all__ = ["WithStatic", "dynamic_positions", "static_key", "static_positions"]

_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, int, float, complex, dict, list, tuple)


def _is_static_value(value: object) -> bool:
    """True for a value that cannot be an array argument: a string, a bool, an enum
    member, or an object JAX treats as one leaf that has no shape and dtype."""
    if isinstance(value, str | bool | Enum):
        return True
    if value is None or isinstance(value, _ARRAY_LIKE):
        return False
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # RemoteArray, ShapeDtypeStruct
        return False
    # one level of flattening: a registered container (TrainState) has children
    children = jax.tree.leaves(value, is_leaf=lambda x: x is not value)
    return len(children) == 1 and children[0] is value


def static_positions(args: tuple, static_argnums: Sequence[int] | str) -> tuple[int, ...]:
    """The positions in ``args`` that are static, sorted: those ``static_argnums`` names
    (negative ones count from the end), or with ``"auto"`` those holding a value that
    cannot be an array (module docstring)."""
    if isinstance(static_argnums, str):
        return tuple(i for i, a in enumerate(args) if _is_static_value(a))
    return argnum_positions(static_argnums, len(args), "static_argnums")


def argnum_positions(argnums: Sequence[int], n: int, what: str) -> tuple[int, ...]:
    """``argnums`` as positions among a call's ``n`` arguments (negative ones count from
    the end, as in ``jax.jit``); one outside them is refused naming ``what``, as
    ``jax.jit`` refuses it, instead of being ignored."""
    for i in argnums:
        if not -n <= i < n:
            raise MeshshardInputError(
                f"{what} names argument {i}, but the step was called with {n} "
                "argument(s); pass positions of the step's arguments"
            )
    return tuple(sorted({i % n for i in argnums}))


def static_key(args: tuple, positions: tuple[int, ...]) -> tuple[tuple[int, Hashable], ...]:
    """``((position, value), ...)`` of the static arguments: the key of their compiled
    step, so the values must be hashable (as for ``jax.jit``)."""
    key = tuple((i, args[i]) for i in positions)
    for i, value in key:
        try:
            hash(value)
        except TypeError:
            raise MeshshardInputError(
                f"static argument args[{i}] ({type(value).__name__}) is not hashable; a "
                "static argument keys its compiled step, so pass a hashable value (a "
                "tuple, a frozen dataclass) or leave it out of static_argnums"
            ) from None
    return key


def dynamic_positions(
    argnums: Sequence[int], static: tuple[int, ...], what: str
) -> tuple[int, ...]:
    """``argnums`` (positions in the full call) as positions among the arguments left once
    the static ones are taken out; a static position there is refused with ``what`` (the
    option's name) in the message."""
    clash = sorted(set(argnums) & set(static))
    if clash:
        raise MeshshardInputError(
            f"argument(s) {clash} are static (static_argnums, or 'auto': not arrays) but "
            f"also in {what}; {what} must name array arguments"
        )
    return tuple(i - sum(s < i for s in static) for i in argnums)


class WithStatic:
    """``fn`` with its static arguments bound: called with the dynamic arguments only, it
    puts the static values back in their places.  Equal for equal ``fn`` and values, so
    the trace cache serves a repeated compile."""

    def __init__(self, fn: Callable, statics: tuple[tuple[int, Hashable], ...]):
        self.step_fn = fn  # not ``fn``: update_wrapper copies this __dict__ onward
        self.statics = statics
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        full = list(args)
        for i, value in self.statics:  # sorted by position, so each lands in place
            full.insert(i, value)
        return self.step_fn(*full)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, WithStatic)
            and self.step_fn == other.step_fn
            and self.statics == other.statics
        )

    def __hash__(self) -> int:
        return hash((WithStatic, self.step_fn, self.statics))

    def __repr__(self) -> str:
        bound = ", ".join(f"args[{i}]={v!r}" for i, v in self.statics)
        return f"WithStatic({getattr(self.step_fn, '__name__', self.step_fn)!r}, {bound})"
