"""Pass 1: trace the user's train step at micro-batch shape.

Input: the step function and example arguments (arrays or ``jax.ShapeDtypeStruct``).
Output: a frozen :class:`TracedStep` holding the step's jaxpr with the batch leaves
shrunk to one micro-batch, the flattened leaf paths and which leaves are batch.  The
runtime traces the same function the same way and checks ``fingerprint`` to be sure
it compiles exactly the program that was planned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from meshshard._compat import ClosedJaxpr
from meshshard.errors import MeshshardInputError
from meshshard.passes.inline import inline_update_calls


@dataclass(frozen=True)
class LeafInfo:
    """One flattened leaf of the step's arguments or results."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    is_batch: bool = False

    def __str__(self) -> str:
        b = " (batch)" if self.is_batch else ""
        return f"{self.path}: {self.dtype}{list(self.shape)}{b}"


@dataclass(frozen=True)
class TracedStep:
    """The step's jaxpr at micro-batch shape, plus how its flat inputs/outputs map to leaves."""

    closed: ClosedJaxpr
    inputs: tuple[LeafInfo, ...]
    outputs: tuple[LeafInfo, ...]
    num_micro_batches: int
    fingerprint: str
    out_tree: object = None

    @property
    def jaxpr(self):
        return self.closed.jaxpr

    def __str__(self) -> str:
        return f"TracedStep({len(self.jaxpr.eqns)} eqns, fingerprint {self.fingerprint})"


def _path_str(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _abstract(leaf, where: str, arg_name: str):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # RemoteArray and friends
        return jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype))
    if isinstance(leaf, bool | int | float) and arg_name != "batch":
        arr = np.asarray(leaf)
        return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype))
    raise MeshshardInputError(
        f"{arg_name} leaf {where} is a {type(leaf).__name__}, not an array; "
        "every leaf of a batch argument must be an array (numpy or jax) with the batch as "
        "its first dimension; move other values into a closure or a non-batch argument"
    )


def trace_step(
    fn: Callable,
    args: Sequence,
    *,
    batch_argnums: Sequence[int],
    num_micro_batches: int,
) -> TracedStep:
    """Trace ``fn(*args)`` with every batch leaf cut to ``1/num_micro_batches`` of its rows.

    Raises a clear error for non-array batch leaves and batches that do not divide.
    """
    args = tuple(args)
    for i in batch_argnums:
        if i >= len(args):
            raise MeshshardInputError(
                f"batch_argnums={tuple(batch_argnums)} names argument {i}, but the step was "
                f"called with {len(args)} arguments; pass batch_argnums indexing the batch"
            )
    flat_paths, _ = jax.tree_util.tree_flatten_with_path(args)
    leaves_abs, infos = [], []
    for path, leaf in flat_paths:
        argnum = path[0].idx
        is_batch = argnum in batch_argnums
        where = f"args[{argnum}]" + _path_str(path[1:]) if len(path) > 1 else f"args[{argnum}]"
        a = _abstract(leaf, where, "batch" if is_batch else "state")
        if is_batch:
            a = _micro_batch_shape(a, where, num_micro_batches)
        leaves_abs.append(a)
        full_shape = (
            tuple(np.shape(leaf)) if not isinstance(leaf, jax.ShapeDtypeStruct) else leaf.shape
        )
        infos.append(LeafInfo(where, tuple(full_shape), str(np.dtype(a.dtype)), is_batch))
    treedef = jax.tree.structure(args)
    abstract_args = jax.tree.unflatten(treedef, leaves_abs)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
    closed = inline_update_calls(closed)  # one equation per mesh in the update part
    out_paths, _ = jax.tree_util.tree_flatten_with_path(out_shape)
    outputs = tuple(
        LeafInfo("out" + _path_str(p), tuple(s.shape), str(np.dtype(s.dtype))) for p, s in out_paths
    )
    return TracedStep(
        closed=closed,
        inputs=tuple(infos),
        outputs=outputs,
        num_micro_batches=num_micro_batches,
        fingerprint=fingerprint(closed),
        out_tree=jax.tree.structure(out_shape),
    )


def _micro_batch_shape(a, where: str, m: int):
    if len(a.shape) == 0:
        raise MeshshardInputError(
            f"batch leaf {where} is a scalar; batch leaves need a leading batch dimension "
            "(pass scalars through a non-batch argument)"
        )
    n = a.shape[0]
    if n % m:
        raise MeshshardInputError(
            f"batch leaf {where} has {n} rows, not divisible by num_micro_batches={m}; "
            f"use a batch size that is a multiple of {m} or choose num_micro_batches dividing {n}"
        )
    return jax.ShapeDtypeStruct((n // m, *a.shape[1:]), a.dtype)


def fingerprint(closed: ClosedJaxpr) -> str:
    """A short stable hash of a jaxpr's text, to check two traces are the same program."""
    return hashlib.sha256(str(closed.jaxpr).encode()).hexdigest()[:16]
