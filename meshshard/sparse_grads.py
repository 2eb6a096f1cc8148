"""Embedding gradients as (row indices, rows): what the ``sparse`` communication moves.

An embedding lookup's gradient is zero outside the rows its batch touched, so a
replica can send ``(indices, rows)`` of those rows only; the receiver adds every
replica's rows into a dense table (:func:`densify`).  That sum equals the sum of the
dense gradients: untouched rows are exact zeros, and a row touched by several replicas
is added in replica order, as the dense sum does.

>>> import numpy as np
>>> g = np.zeros((5, 2), np.float32); g[[1, 3]] = [[1, 2], [3, 4]]
>>> idx, rows = to_rows(g, np.array([3, 1, 3]))
>>> idx.tolist(), densify([(idx, rows)], 5).tolist() == g.tolist()
([1, 3], True)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from meshshard.errors import MeshshardRuntimeError

__all__ = [
    "densify",
    "pack_rows",
    "rows_nbytes",
    "sum_rows",
    "to_rows",
    "touched_rows",
    "unpack_rows",
]


def to_rows(grad: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``grad`` (a |V| x H embedding gradient) that ``tokens`` touched, sorted
    by row index, with their indices (int32)."""
    idx = np.unique(np.asarray(tokens).reshape(-1)).astype(np.int32)
    return idx, np.asarray(grad)[idx]


def densify(parts: Iterable[tuple[np.ndarray, np.ndarray]], vocab: int) -> np.ndarray:
    """The dense sum of several replicas' ``(indices, rows)``, in replica order."""
    out = None
    for idx, rows in parts:
        if out is None:
            out = np.zeros((vocab,) + rows.shape[1:], rows.dtype)
        out[idx] = out[idx] + rows  # indices are unique per part
    if out is None:
        raise ValueError("densify needs at least one (indices, rows) part")
    return out


def rows_nbytes(tokens: int, vocab: int, hidden: int, itemsize: int = 2) -> int:
    """Bytes of one replica's (indices, rows) when its batch holds ``tokens`` tokens
    (at most ``vocab`` distinct rows; int32 indices)."""
    rows = min(tokens, vocab)
    return rows * (hidden * itemsize + 4)


# --- the wire format of the replicas' sparse all-gather (runtime/replica_grads.py) -----
def touched_rows(grad: np.ndarray) -> np.ndarray:
    """Indices (int32, ascending) of the rows of ``grad`` with any bit set: a row that is
    all +0.0 adds nothing to a sum, so only the others travel (-0.0 does travel)."""
    g = np.ascontiguousarray(grad)
    bits = g.view(np.dtype(f"u{g.dtype.itemsize}")).reshape(g.shape[0], -1)
    return np.flatnonzero(bits.any(axis=1)).astype(np.int32)


def pack_rows(grad: np.ndarray, max_rows: int, what: str = "gradient") -> np.ndarray:
    """``grad``'s touched rows as one byte string of a fixed size: ``max_rows`` int32
    indices (padding: -1) then ``max_rows`` rows (padding: zeros).  Raises
    MeshshardRuntimeError naming ``what`` if more rows are touched than ``max_rows``."""
    g = np.ascontiguousarray(grad)
    idx = touched_rows(g)
    if len(idx) > max_rows:
        raise MeshshardRuntimeError(
            f"{what} has {len(idx)} nonzero rows, more than the {max_rows} its plan sends "
            "as sparse rows (a NaN or inf gradient fills every row); run without the "
            "'sparse' communication switch to all-reduce it densely"
        )
    ids = np.full(max_rows, -1, np.int32)
    ids[: len(idx)] = idx
    rows = np.zeros((max_rows,) + g.shape[1:], g.dtype)
    rows[: len(idx)] = g[idx]
    return np.concatenate([ids.view(np.uint8), rows.reshape(-1).view(np.uint8)])


def unpack_rows(
    payload: np.ndarray, shape: Sequence[int], dtype, max_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_rows`: ``(indices, rows)`` without the padding."""
    raw = np.ascontiguousarray(payload).view(np.uint8)
    ids = raw[: 4 * max_rows].view(np.int32)
    rows = raw[4 * max_rows :].view(np.dtype(dtype)).reshape((max_rows, *shape[1:]))
    n = int(np.count_nonzero(ids >= 0))
    return ids[:n], rows[:n]


def sum_rows(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], shape: Sequence[int], dtype, sum_dtype
) -> np.ndarray:
    """The dense sum of the members' ``(indices, rows)``, bit for bit what an all-reduce
    that adds the dense tensors in member order in ``sum_dtype`` gives: the first
    member's rows placed, each next member's added, and ``+ 0`` where it touched nothing
    but an earlier member did (that turns a -0.0 into +0.0, as the dense sum would)."""
    out = np.zeros(tuple(shape), np.dtype(sum_dtype))
    seen = np.zeros(0, np.int32)
    for k, (idx, rows) in enumerate(parts):
        if k == 0:
            out[idx] = rows
        else:
            out[idx] = out[idx] + rows.astype(out.dtype)
            rest = np.setdiff1d(seen, idx, assume_unique=True)
            out[rest] = out[rest] + out.dtype.type(0)
        seen = np.union1d(seen, idx)
    return out.astype(np.dtype(dtype), copy=False)
