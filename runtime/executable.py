"""Driver side of a compiled step: hand inputs to workers, collect outputs.

Runtime code never plans: an :class:`Executable` takes a finished :class:`Plan` and a
backend (Ray host-actors, or threads in this process) and runs it.  One call of the
step is one message per worker; workers run their whole stream without the driver.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.plan import Plan
from meshshard.runtime.worker import StoreKey

#: Ids of stored arrays; one sequence per driver process, since stores outlive plans.
_KEYS = itertools.count(1)


class Backend(Protocol):
    """Where workers live: compile once, run steps, fetch and free stored arrays."""

    def compile(self, fn, abstract_args, batch_argnums, plan: Plan) -> dict[int, float]: ...

    def run_step(self, per_worker: dict[int, tuple]) -> dict[int, dict]: ...

    def fetch(self, worker: int, key: int) -> list: ...

    def free(self, worker: int, keys: Sequence[int]) -> None: ...


class RemoteArray:
    """An array that lives on a mesh's workers between steps.

    ``np.asarray(x)`` fetches it; passing it back into the step uses it in place.
    """

    def __init__(self, owner: Executable, keys: dict[int, int], shape, dtype):
        self._owner = weakref.ref(owner)
        self.keys = dict(keys)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.deleted = False
        self._backend = owner.backend
        self._schedule_free = owner.schedule_free

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def fetch(self) -> np.ndarray:
        """Copy the value to this process."""
        if self.deleted:
            raise MeshshardInputError(
                "this array was donated to a later step (donate_argnums) and no longer exists; "
                "use the state that step returned"
            )
        out = np.empty(self.shape, self.dtype)
        filled = np.zeros(self.shape, bool)
        for w, key in self.keys.items():  # replicas: stop once every element is known
            for index, data in self._backend.fetch(w, key):
                sl = tuple(slice(a, b) for a, b in index)
                out[sl] = data
                filled[sl] = True
            if filled.all():
                break
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.fetch()
        return a.astype(dtype) if dtype is not None else a

    def __repr__(self) -> str:
        where = ",".join(f"w{w}" for w in self.keys)
        return f"RemoteArray({self.dtype}{list(self.shape)} on {where})"

    def _release(self) -> None:
        if not self.deleted:
            self.deleted = True
            for w, key in self.keys.items():
                self._schedule_free(w, key)

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown
            pass


class Executable:
    """Runs one plan on a backend; call it like the original step function."""

    def __init__(
        self, plan: Plan, backend: Backend, fn, abstract_args, batch_argnums, donate_argnums=()
    ):
        self.plan = plan
        self.backend = backend
        self.batch_argnums = tuple(batch_argnums)
        self.donate_argnums = tuple(donate_argnums)
        self._pending_free: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.compile_seconds = backend.compile(fn, abstract_args, batch_argnums, plan)
        self._mesh_workers = {m.id: m.workers for m in plan.meshes}
        self.last_worker_seconds: dict[int, float] = {}

    def __call__(self, *args):
        plan = self.plan
        flat, _ = jax.tree.flatten(args)
        if len(flat) != len(plan.inputs):
            raise MeshshardInputError(
                f"the step was compiled for {len(plan.inputs)} input leaves but got {len(flat)}; "
                "call it with arguments of the same structure as when it was compiled"
            )
        per_worker_batch: dict[int, dict] = {w: {} for w in plan.workers}
        per_worker_state: dict[int, dict] = {w: {} for w in plan.workers}
        fetched: dict[int, np.ndarray] = {}
        for spec, leaf in zip(plan.inputs, flat, strict=True):
            if spec.kind == "unused":
                continue
            for group, _ in spec.slots:
                for w in self._mesh_workers[plan.buffer(group).mesh]:
                    if spec.kind == "batch":
                        per_worker_batch[w][spec.leaf] = np.asarray(leaf)
                    elif isinstance(leaf, RemoteArray) and w in leaf.keys and not leaf.deleted:
                        per_worker_state[w][spec.leaf] = StoreKey(leaf.keys[w])
                    else:
                        if spec.leaf not in fetched:
                            fetched[spec.leaf] = np.asarray(leaf)
                        per_worker_state[w][spec.leaf] = fetched[spec.leaf]
        out_keys: dict[int, dict] = {w: {} for w in plan.workers}
        for o in plan.outputs:
            for group, idx in o.slots:
                key = next(_KEYS)
                for w in self._mesh_workers[plan.buffer(group).mesh]:
                    out_keys[w][(group, idx)] = key
        donated = self._donated(args)
        with self._lock:
            frees, self._pending_free = self._pending_free, {}
        requests = {
            w: (per_worker_batch[w], per_worker_state[w], out_keys[w], frees.get(w, []))
            for w in plan.workers
        }
        results = self.backend.run_step(requests)
        for r in donated:
            r._release()
        return self._outputs(args, flat, results, out_keys)

    def schedule_free(self, worker: int, key: int) -> None:
        """Drop a stored array on ``worker`` with the next step (arrays die between steps)."""
        with self._lock:
            self._pending_free.setdefault(worker, []).append(key)

    def _donated(self, args) -> list[RemoteArray]:
        out = []
        for i in self.donate_argnums:
            out += [x for x in jax.tree.leaves(args[i]) if isinstance(x, RemoteArray)]
        return out

    def _outputs(self, args, flat, results, out_keys):
        plan = self.plan
        leaves = []
        for o in plan.outputs:
            if o.source == "literal":
                leaves.append(np.asarray(o.literal, dtype=o.dtype).reshape(o.shape))
            elif o.source == "input":
                leaves.append(flat[o.input_leaf])
            else:
                group, idx = o.slots[0]
                w0 = self._mesh_workers[plan.buffer(group).mesh][0]
                first = results[w0][(group, idx)]
                if not isinstance(first, StoreKey):
                    leaves.append(first.reshape(o.shape))
                    continue
                keys = {}
                for g, i in o.slots:
                    for w in self._mesh_workers[plan.buffer(g).mesh]:
                        keys[w] = int(results[w][(g, i)])
                leaves.append(RemoteArray(self, keys, o.shape, o.dtype))
        return jax.tree.unflatten(self._out_tree, leaves)

    def set_out_tree(self, tree) -> None:
        """The pytree structure of the step's results."""
        self._out_tree = tree


def run_in_threads(workers, fn) -> dict:
    """``{w: fn(w)}`` with every worker in its own thread; a failure of any worker is
    raised after all have finished, with every worker's message."""
    results: dict = {}
    errors: dict[int, BaseException] = {}

    def one(w) -> None:
        try:
            results[w] = fn(w)
        except BaseException as exc:  # reported below with every worker's failure
            errors[w] = exc

    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raise_worker_errors(errors)
    return results


def raise_worker_errors(errors: dict[int, BaseException]) -> None:
    """Re-raise the first worker failure with every worker's message."""
    if not errors:
        return
    msg = "\n\n".join(f"{e}" for _, e in sorted(errors.items()))
    raise MeshshardRuntimeError(f"{len(errors)} worker(s) failed:\n{msg}")
