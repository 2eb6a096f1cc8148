"""Flax NNX modules as the differentiated arguments of ``meshshard.value_and_grad``.

``nnx.value_and_grad(loss_fn)(model)`` differentiates a module's ``nnx.Param``
variables only, and writes the loss function's changes to its other variables (batch
statistics, random-stream counters) back into the module.  It is ``jax.value_and_grad``
underneath, which meshshard cannot pipeline, so ``meshshard.value_and_grad`` takes a
module the same way: each differentiated argument that is an NNX graph node is split
into its graph, its parameters (what is differentiated) and the rest (``nnx.split``),
merged back inside the loss, and the rest's new values are returned from the grad like
an aux value and written into the module (``nnx.update``).  An NNX train step then needs
one change, the import of ``value_and_grad``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import jax


def _nnx():
    from flax import nnx

    return nnx


def _is_module(x) -> bool:
    """An NNX object holding variables (a module, an optimizer): not a lone Variable."""
    nnx = _nnx()
    return isinstance(x, nnx.Pytree) and nnx.graph.is_graph_node(x)


def _has_module(x) -> bool:
    return any(_is_module(leaf) for leaf in jax.tree.leaves(x, is_leaf=_is_module))


def module_filters(args: tuple, argnums: int | Sequence[int]) -> dict[int, object]:
    """``{position: filter}`` of the differentiated arguments that are, or hold, NNX
    modules, the filter choosing the variables to differentiate (``nnx.Param``, or an
    ``nnx.DiffState``'s), and of the other arguments holding modules (``nnx.Param``:
    split alike, not differentiated, their written variables returned too); empty for
    a step that differentiates no NNX module."""
    if "flax.nnx" not in sys.modules:  # no NNX object can exist: skip the import
        return {}
    nnx = _nnx()
    found = {}
    for a in (argnums,) if isinstance(argnums, int | nnx.DiffState) else argnums:
        i, wrt = (a.argnum, a.filter) if isinstance(a, nnx.DiffState) else (a, nnx.Param)
        if 0 <= i < len(args) and _has_module(args[i]):
            found[i] = wrt
    if found:  # modules the loss only reads (a teacher) may still write variables
        for i, a in enumerate(args):
            if i not in found and _has_module(a):
                found[i] = nnx.Param
    return found


def plain_argnums(argnums):
    """``argnums`` with each ``nnx.DiffState`` replaced by its position."""
    nnx = _nnx()
    if isinstance(argnums, int | nnx.DiffState):
        return argnums.argnum if isinstance(argnums, nnx.DiffState) else argnums
    return tuple(a.argnum if isinstance(a, nnx.DiffState) else a for a in argnums)


def split_modules(args: tuple, filters: dict[int, object]):
    """``(pure, merged, write_back)`` for the modules in ``args[i]``, ``i`` in ``filters``.

    ``pure``: the arguments with each module replaced by its differentiated variables
    (an ``nnx.State``).  ``merged(fun)``: a function of ``pure``-like arguments that
    merges the modules back, calls ``fun`` and returns ``(out, rest)``: its output and,
    per module (keyed ``"<position><path>"``), the other variables the call wrote.
    Unchanged ones are left out: a value the grad passes through unchanged is refused,
    and writing it back is a no-op.  ``write_back(rest)``: writes them into the caller's
    modules (``nnx.update``), as ``nnx.value_and_grad`` does."""
    nnx = _nnx()
    pure, trees, parts = list(args), {}, {}
    for i, wrt in filters.items():
        found, trees[i] = jax.tree_util.tree_flatten_with_path(args[i], is_leaf=_is_module)
        leaves = []
        for path, leaf in found:
            if _is_module(leaf):
                graph, diff, rest = nnx.split(leaf, wrt, ...)
                parts[(i, len(leaves))] = (f"{i}{jax.tree_util.keystr(path)}", graph, rest, leaf)
                leaf = diff
            leaves.append(leaf)
        pure[i] = jax.tree.unflatten(trees[i], leaves)

    def merged(fun: Callable) -> Callable:
        def call(*pure_args):
            full, modules = list(pure_args), {}
            for i, tree in trees.items():
                leaves = tree.flatten_up_to(pure_args[i])
                for k, leaf in enumerate(leaves):
                    if (i, k) in parts:
                        _, graph, rest, _ = parts[(i, k)]
                        # new Variable objects, made in this trace, so the loss may write them
                        leaves[k] = nnx.merge(graph, leaf, jax.tree.map(lambda x: x, rest))
                        modules[(i, k)] = leaves[k]
                full[i] = jax.tree.unflatten(tree, leaves)
            out = fun(*full)
            written = {}
            for (i, k), module in modules.items():
                key, _, before, _ = parts[(i, k)]
                after = nnx.split(module, filters[i], ...)[2]
                changed = _changed(_values(before), after)
                if changed is not None:  # what the loss wrote (batch statistics, counters)
                    written[key] = changed
            return out, written

        return call

    def write_back(rest: dict) -> None:
        owner = {key: module for key, _, _, module in parts.values()}
        for key, state in rest.items():
            nnx.update(owner[key], state)

    return tuple(pure), merged, write_back


#: The start of the note (and warning) on NNX variables changed in place and lost.
LOST_NOTE = "the step changes NNX variables of its arguments in place"


def in_place_snapshot(args: tuple) -> list:
    """The NNX modules among ``args`` (at any depth of their pytrees) with their
    variables' values, taken before a step runs, for :func:`lost_in_place_note`."""
    if "flax.nnx" not in sys.modules:
        return []
    nnx = _nnx()
    found, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_module)
    return [(path, node, _values(nnx.state(node))) for path, node in found if _is_module(node)]


def unreturned_changes(snapshot: list, out) -> dict[str, object]:
    """``{"args[i]...": nnx.State}`` of the variables of ``snapshot``'s
    modules that the step changed in place (``optimizer.update(model, grads)``) and
    does not return (the values it returns are the caller's already)."""
    if not snapshot:
        return {}
    nnx = _nnx()
    returned = {id(x) for x in jax.tree.leaves(out)}
    found = {}
    for path, node, was in snapshot:
        changed = _changed(was, nnx.state(node), returned)
        if changed is not None:
            found["args" + jax.tree_util.keystr(path)] = changed
    return found


def _values(state) -> dict:
    """``{path: value}`` of an ``nnx.State``'s variables."""
    return {p: v.get_value() for p, v in _nnx().to_flat_state(state)}


def _changed(was: dict, state, returned=frozenset()):
    """The variables of ``state`` whose value is no longer the one in ``was`` (:func:`_values`
    taken before), less those whose new value is among the ``returned`` ids, as an
    ``nnx.State``; None when there are none."""
    nnx = _nnx()
    changed = [
        (p, v)
        for p, v in nnx.to_flat_state(state)
        if v.get_value() is not was.get(p) and id(v.get_value()) not in returned
    ]
    return nnx.from_flat_state(changed) if changed else None


def lost_in_place_note(snapshot: list, out) -> str | None:
    """A note naming the modules of ``snapshot`` whose variables the step changed in
    place without returning the new values, or None.

    ``parallelize`` writes such changes back (:class:`WritesBack`), as ``nnx.jit`` does;
    a step run another way (PipeDream-2BW) loses them, as under ``jax.jit``: a model
    that silently never trains."""
    lost = unreturned_changes(snapshot, out)
    if not lost:
        return None
    kinds = {"args" + jax.tree_util.keystr(p): type(n).__name__ for p, n, _ in snapshot}
    flat = _nnx().to_flat_state
    named = [f"{k} ({kinds[k]}, {len(flat(v))} variables)" for k, v in lost.items()]
    return (
        f"{LOST_NOTE} and does not return them: {', '.join(named)}. Under "
        "schedule='2bw' these changes are lost when the call returns, as under jax.jit "
        "(other methods write them back, as nnx.jit does): return the modules, e.g. "
        "`return (model, optimizer), loss`, and pass the returned ones to the next call"
    )


def holds_modules(args: tuple) -> bool:
    """True when ``args`` hold an NNX module or optimizer at any depth."""
    return "flax.nnx" in sys.modules and _has_module(args)


class WritesBack:
    """A step that takes NNX modules, returning ``(out, written)``: its results and the
    variables it changed in place without returning them, which
    :func:`write_in_place` then writes into the caller's modules, as ``nnx.jit`` does
    (``optimizer.update(model, grads)`` in a step that returns only the loss).

    Equal for equal steps, so the trace cache serves a repeated compile; picklable."""

    def __init__(self, fn: Callable):
        self.step_fn = fn  # not ``fn``: update_wrapper copies this __dict__ onward
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        snapshot = in_place_snapshot(args)
        out = self.step_fn(*args)
        return out, unreturned_changes(snapshot, out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WritesBack) and self.step_fn == other.step_fn

    def __hash__(self) -> int:
        return hash((WritesBack, self.step_fn))

    def __repr__(self) -> str:
        return f"WritesBack({getattr(self.step_fn, '__name__', self.step_fn)!r})"


def write_in_place(args: tuple, written: dict) -> None:
    """Write :class:`WritesBack`'s ``written`` variables into the modules of ``args``."""
    if not written:
        return
    nnx = _nnx()
    found, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_module)
    for path, node in found:
        state = written.get("args" + jax.tree_util.keystr(path))
        if state is not None and _is_module(node):
            nnx.update(node, state)
