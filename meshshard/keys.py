"""Typed random keys at the step's boundary: the step runs on their raw ``uint32`` data.

``jax.random.key`` arrays have an extended dtype (``key<fry>``) that NumPy, buffers and
transports cannot hold.  :func:`physical_call` hands the compiler a step that takes and
returns the keys' raw data (``jax.random.key_data``) and wraps them back inside, so
every argument and result is an ordinary array; :meth:`KeyedStep.restore` turns raw
results back into typed keys for the caller.  Raw ``uint32`` keys need nothing.

>>> import jax
>>> step = KeyedStep(lambda k: jax.random.split(k), jax.tree.structure((0,)), ("threefry2x32",))
>>> jax.eval_shape(step, jax.ShapeDtypeStruct((2,), "uint32"))
ShapeDtypeStruct(shape=(2, 2), dtype=uint32)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from meshshard.nnx_modules import in_place_snapshot, lost_in_place_note


def is_typed_key(x) -> bool:
    """True for a typed key array or a ``ShapeDtypeStruct`` of a key dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # a key dtype is JAX's own type
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_signatures(leaves) -> tuple[tuple, bool]:
    """Each leaf's ``(shape, dtype, weak type)``, what a compiled step is looked up by
    (``jax.jit`` traces a weakly typed leaf apart), and whether any leaf is a typed key.
    One pass: a step call looks at its ~160 state leaves each time."""
    sig, typed = [], False
    for a in leaves:
        try:  # a jax.Array or a RemoteArray: no getattr defaults needed
            shape, dtype, weak = a.shape, a.dtype, a.weak_type
        except AttributeError:
            shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
            weak = getattr(a, "weak_type", False)
            if dtype is None:  # a Python scalar
                sig.append((shape, type(a), weak))
                continue
        if not typed and not isinstance(dtype, np.dtype):  # a key dtype is JAX's own type
            typed = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        sig.append((shape, dtype, weak))
    return tuple(sig), typed


def key_impl(x) -> str:
    """The PRNG implementation's name of typed key ``x`` (array or ShapeDtypeStruct)."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return str(jax.random.key_impl(x))
    found = []
    jax.eval_shape(lambda k: found.append(str(jax.random.key_impl(k))) or k, x)
    return found[0]


def _raw(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.eval_shape(jax.random.key_data, x)
    return jax.random.key_data(x)


class KeyedStep:
    """``fn`` taking and returning raw key data where it takes and returns typed keys.

    Picklable (Ray ships it to the workers, which trace it like the planner did).
    """

    def __init__(self, fn: Callable, treedef, impls: tuple):
        self.fn = fn
        self.treedef = treedef
        self.impls = impls
        self.out_impls: tuple = ()
        #: set by each call: NNX variables the step changed in place and lost, or None
        self.in_place_note: str | None = None

    def _identity(self) -> tuple:
        return (self.fn, self.treedef, self.impls)

    def __eq__(self, other: object) -> bool:
        # equal wrappers of one step trace alike: a second ``parallelize`` (or ``lower``
        # then a call) of the same function is served from the trace cache
        if not isinstance(other, KeyedStep):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __call__(self, *args):
        leaves = jax.tree.leaves(args)
        typed = [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, self.impls, strict=True)
        ]
        args = jax.tree.unflatten(self.treedef, typed)
        snapshot = in_place_snapshot(args)
        out = self.fn(*args)
        self.in_place_note = lost_in_place_note(snapshot, out)
        out_leaves, out_tree = jax.tree.flatten(out)
        self.out_impls = tuple(key_impl(o) if is_typed_key(o) else None for o in out_leaves)
        raw = [_raw(o) if is_typed_key(o) else o for o in out_leaves]
        return jax.tree.unflatten(out_tree, raw)

    def restore(self, out):
        """The step's results with raw key data wrapped back into typed keys."""
        if not any(self.out_impls):
            return out
        leaves, tree = jax.tree.flatten(out)
        leaves = [
            x if impl is None else jax.random.wrap_key_data(np.asarray(x), impl=impl)
            for x, impl in zip(leaves, self.out_impls, strict=True)
        ]
        return jax.tree.unflatten(tree, leaves)


def physical_call(fn: Callable, args: tuple) -> tuple[KeyedStep, tuple]:
    """``(step, args)`` with typed keys in ``args`` replaced by their raw data."""
    step, raw_args, _, _ = physical_leaves(fn, args)
    return step, raw_args


def physical_leaves(fn: Callable, args: tuple) -> tuple[KeyedStep, tuple, list, object]:
    """:func:`physical_call` plus the raw arguments' leaves and tree structure, so a
    step call flattens its arguments once."""
    leaves, treedef = jax.tree.flatten(args)
    impls = tuple(key_impl(x) if is_typed_key(x) else None for x in leaves)
    if not any(impls):
        return KeyedStep(fn, treedef, impls), args, leaves, treedef
    raw = [x if impl is None else _raw(x) for x, impl in zip(leaves, impls, strict=True)]
    return KeyedStep(fn, treedef, impls), jax.tree.unflatten(treedef, raw), raw, treedef
