"""Pass: cut a loss function's jaxpr into layers when the user marked none.

Alpa's automatic layer construction (ALPA_NOTES §1 row 3): a dynamic program over the
top-level equations picks ``L - 1`` cut positions that

* keep every layer's FLOPs at most ``(1 + eps)`` times the mean (or the largest single
  equation, when one equation alone is heavier),
* give every layer at least one heavy operation (``dot_general``/``conv``), and
* minimise the largest number of bytes crossing a cut (values defined before the cut
  and read after it; the function's own inputs never cross, each stage reads its
  parameters directly), then the total bytes crossing all cuts, then (among cuts
  crossing equal bytes) the unevenness of the layers' FLOPs.

A cut at position ``p`` means "a pipeline boundary before equation ``p``";
:mod:`meshshard.autodiff` inserts the boundary there, carrying the crossing values.

    >>> import jax, jax.numpy as jnp
    >>> def f(w1, w2, w3, x):
    ...     h = jnp.tanh(x @ w1)
    ...     h = jnp.tanh(h @ w2)
    ...     return jnp.sum(h @ w3)
    >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    >>> j = jax.make_jaxpr(f)(w, w, w, x).jaxpr
    >>> cluster_layers(j, 3)
    (2, 4)
    >>> print(layer_table(j, (2, 4)))
    layer 0: eqns [0, 2) 72 FLOPs, 1 heavy, 32 B out
    layer 1: eqns [2, 4) 72 FLOPs, 1 heavy, 32 B out
    layer 2: eqns [4, 6) 65 FLOPs, 1 heavy
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshshard.errors import MeshshardInputError
from meshshard.jaxpr_util import aval_nbytes, aval_size, contraction_flops, sub_jaxprs

__all__ = [
    "HEAVY",
    "aval_nbytes",
    "DEFAULT_EPS",
    "eqn_flops",
    "is_heavy",
    "crossing_bytes",
    "cluster_layers",
    "auto_layer_count",
    "layer_table",
]

HEAVY = ("dot_general", "conv_general_dilated")
DEFAULT_EPS = 0.5  # Alpa's AutoLayerOption default
MAX_AUTO_LAYERS = 16


def eqn_flops(eqn) -> float:
    """FLOPs of one equation: ``2 * out * contracted`` for a dot or a convolution, one per
    output element otherwise; equations holding sub-jaxprs (pjit, remat, custom_jvp)
    count their body, a scan its body once per iteration (a while loop's trip count is
    unknown: once)."""
    heavy = contraction_flops(eqn)
    if heavy is not None:
        return heavy
    subs = list(sub_jaxprs(eqn))
    if subs:
        trips = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        return trips * float(sum(eqn_flops(e) for j in subs for e in j.eqns))
    return float(sum(aval_size(v.aval) for v in eqn.outvars))


def is_heavy(eqn) -> bool:
    """True for a matmul or a convolution, or an equation whose body holds one."""
    if eqn.primitive.name in HEAVY:
        return True
    return any(is_heavy(e) for j in sub_jaxprs(eqn) for e in j.eqns)


def crossing_bytes(jaxpr) -> np.ndarray:
    """``out[p]``: bytes of values defined by equations before ``p`` and read at or after
    ``p`` (``p`` in ``0..N``; the jaxpr's outputs count as read at ``N``)."""
    n = len(jaxpr.eqns)
    defined: dict = {}
    last: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not hasattr(v, "val"):
                last[v] = i
        for v in e.outvars:
            defined[v] = i
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            last[v] = n
    diff = np.zeros(n + 2)
    for v, d in defined.items():
        u = last.get(v, -1)
        if u > d:  # crosses every cut p with d < p <= u
            diff[d + 1] += aval_nbytes(v.aval)
            diff[u + 1] -= aval_nbytes(v.aval)
    return np.cumsum(diff)[: n + 1]


def auto_layer_count(jaxpr, max_layers: int = MAX_AUTO_LAYERS) -> int:
    """``layers="auto"``: one layer per heavy operation, at most ``max_layers``."""
    heavy = sum(is_heavy(e) for e in jaxpr.eqns)
    return max(1, min(heavy, max_layers))


def cluster_layers(
    jaxpr, num_layers: int | str, eps: float = DEFAULT_EPS, what: str = "the loss function"
) -> tuple[int, ...]:
    """Cut positions (equation indices, ascending) splitting ``jaxpr`` into ``num_layers``.

    ``num_layers="auto"`` takes :func:`auto_layer_count`.  Raises a clear error, naming
    the cut function as ``what``, when it has fewer heavy operations than layers asked for.
    """
    n = len(jaxpr.eqns)
    if num_layers == "auto":
        num_layers = auto_layer_count(jaxpr)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise MeshshardInputError(
            f"layers={num_layers!r}: pass 'auto' or a positive int number of layers"
        )
    heavy = np.array([is_heavy(e) for e in jaxpr.eqns], dtype=np.int64)
    if num_layers > max(1, int(heavy.sum())):
        raise MeshshardInputError(
            f"layers={num_layers} asks for more layers than {what} has heavy "
            f"operations ({int(heavy.sum())} dot_general/conv equations); each layer needs "
            f"one: ask for at most {max(1, int(heavy.sum()))} layers or layers='auto'"
        )
    if num_layers == 1:
        return ()
    flops = np.array([eqn_flops(e) for e in jaxpr.eqns])
    fpre = np.concatenate([[0.0], np.cumsum(flops)])
    hpre = np.concatenate([[0], np.cumsum(heavy)])
    bound = max((1 + eps) * fpre[-1] / num_layers, float(flops.max(initial=0.0)))
    cost = crossing_bytes(jaxpr)
    while True:  # no split within the bound: loosen it (it always fits at the total)
        windows = _windows(fpre, hpre, bound * (1 + 1e-9))
        best_max = _dp(cost, windows, num_layers, n, "max")[0]
        if math.isfinite(best_max) or bound >= fpre[-1]:
            break
        bound = min(bound * 1.25, fpre[-1])
    masked = np.where(cost <= best_max, cost, np.inf)
    total, cuts = _dp(masked, windows, num_layers, n, "sum", balance=fpre)
    assert math.isfinite(total), "every layer count up to the heavy ops fits at the total"
    return cuts


def _windows(fpre: np.ndarray, hpre: np.ndarray, bound: float) -> list[tuple[int, int]]:
    """For each layer end ``j``: the range ``[lo, hi]`` of starts ``i`` making ``[i, j)`` valid."""
    n = len(fpre) - 1
    out = [(1, 0)]  # j = 0: no layer ends there
    for j in range(1, n + 1):
        lo = int(np.searchsorted(fpre, fpre[j] - bound, side="left"))
        # at least one heavy op in [i, j): hpre[i] <= hpre[j] - 1
        hi = int(np.searchsorted(hpre, hpre[j] - 1, side="right")) - 1
        out.append((lo, min(hi, j - 1)))
    return out


def _dp(cost: np.ndarray, windows, num_layers: int, n: int, how: str, balance=None):
    """Best cuts: ``g[k][j]`` = best value with ``k`` layers covering ``[0, j)``, cut at ``j``
    charged (``how`` = "max" or "sum" of the charged cuts).

    With ``balance`` (the FLOPs' prefix sums), each layer also adds half the square of its
    share of the FLOPs: less than one byte in all, so among cuts crossing equal bytes
    the most even layers win (equal blocks scanned or looped alike tie on bytes)."""
    inf = np.inf
    g = np.full(n + 1, inf)
    g[0] = 0.0
    back = []
    for k in range(1, num_layers + 1):
        new = np.full(n + 1, inf)
        arg = np.full(n + 1, -1, dtype=np.int64)
        ends = range(n, n + 1) if k == num_layers else range(1, n)
        for j in ends:
            lo, hi = windows[j]
            if lo > hi:
                continue
            seg = g[lo : hi + 1]
            if balance is not None and balance[-1] > 0:
                seg = seg + 0.5 * ((balance[j] - balance[lo : hi + 1]) / balance[-1]) ** 2
            i = int(np.argmin(seg))
            if not math.isfinite(seg[i]):
                continue
            here = 0.0 if j == n else cost[j]
            new[j] = max(seg[i], here) if how == "max" else seg[i] + here
            arg[j] = lo + i
        g = new
        back.append(arg)
    if not math.isfinite(g[n]):
        return math.inf, ()
    cuts, j = [], n
    for k in range(num_layers - 1, -1, -1):
        i = int(back[k][j])
        if k:
            cuts.append(i)
        j = i
    return float(g[n]), tuple(sorted(cuts))


def layer_table(jaxpr, cuts: Sequence[int]) -> str:
    """One line per layer: its equations, FLOPs, heavy operations and bytes crossing its end."""
    n = len(jaxpr.eqns)
    bounds = [0, *cuts, n]
    cost = crossing_bytes(jaxpr)
    lines = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        fl = sum(eqn_flops(e) for e in jaxpr.eqns[a:b])
        hv = sum(is_heavy(e) for e in jaxpr.eqns[a:b])
        out = f", {int(cost[b])} B out" if b < n else ""
        lines.append(f"layer {k}: eqns [{a}, {b}) {fl:.4g} FLOPs, {hv} heavy{out}")
    return "\n".join(lines)
