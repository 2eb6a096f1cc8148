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

from collections.abc import Iterable

import numpy as np

__all__ = ["densify", "rows_nbytes", "to_rows"]


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
