"""Driver side of a compiled step: hand inputs to workers, collect outputs.

Runtime code never plans: an :class:`Executable` takes a finished :class:`Plan` and a
backend (Ray host-actors, or threads in this process) and runs it.  One call of the
step is one message per worker; workers run their whole stream without the driver.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from meshshard._compat import register_array_type
from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.instructions import Collective
from meshshard.plan import Plan, fmt_bytes
from meshshard.plan_checks import require_valid_plan
from meshshard.runtime.release import RELEASER
from meshshard.runtime.step_threads import STEP_THREADS
from meshshard.runtime.step_wire import EMPTY_LAYOUT, KeyCounter, StepLayout
from meshshard.runtime.worker import BY_VALUE_BYTES

log = logging.getLogger(__name__)

#: What calling a step compiled for a cluster that was shut down says.
CLOSED_STEP = (
    "this step was compiled for a meshshard cluster that was shut down (meshshard.shutdown() "
    "or a later meshshard.init()); its programs and the arrays it kept are gone. Call the "
    "parallelized function again (it recompiles on the running cluster) with host copies of "
    "the state (meshshard.fetch(state) before shutting down, or a checkpoint)"
)

#: Seconds a dropped array waits for the next step to carry its free before the
#: releaser thread sends it alone.
FREE_DELAY_S = 0.1

#: Ids of stored arrays; one sequence per driver process, since stores outlive plans.
_KEYS = KeyCounter()

#: id of a ``jax.Array`` a step returned by value -> weak references to it and to the
#: :class:`RemoteArray` of the same result, still stored on its workers (the executable
#: keeps that one for its last :data:`TWIN_STEPS` steps): passed back as state, the
#: array is read in place instead of sent again (:meth:`Executable._inputs`).
_TWINS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: Steps of one executable whose by-value results keep their stored twins (the last:
#: the next step reads them back).
TWIN_STEPS = 1

#: What a :class:`RemoteArray` computes on its (fetched) value, as ``jax.Array`` does.
#: Equality stays identity: arrays are kept in sets and dicts by the runtime.
ARRAY_OPERATORS = tuple(
    f"__{op}__"
    for op in (
        "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod divmod "
        "rdivmod pow rpow matmul rmatmul and rand or ror xor rxor lshift rlshift rshift "
        "rrshift neg pos abs invert lt le gt ge getitem iter round"
    ).split()
)
ARRAY_METHODS = frozenset(
    "T mT real imag at flat all any argmax argmin argpartition argsort astype choose clip "
    "compress conj conjugate copy cumprod cumsum cumulative_sum diagonal dot flatten item "
    "max mean min nonzero prod ptp ravel repeat reshape round searchsorted sort squeeze std "
    "sum swapaxes take tobytes tolist trace transpose var view".split()
)
#: ``jax.Array`` attributes about device placement, which a remote array has not.
PLACEMENT_ATTRIBUTES = frozenset(
    "sharding device devices addressable_shards global_shards addressable_data "
    "is_fully_addressable is_fully_replicated committed on_device_size_in_bytes "
    "unsafe_buffer_pointer copy_to_host_async format".split()
)


class Backend(Protocol):
    """Where workers live: compile once, run steps, fetch and free stored arrays."""

    def compile(self, fn, abstract_args, batch_argnums, plan: Plan) -> dict[int, float]: ...

    def run_step(self, per_worker: dict[int, tuple]) -> dict[int, dict]: ...

    def submit_step(self, per_worker: dict[int, tuple]) -> StepHandle:
        """Start a step without waiting for it (pipelined 2BW steps)."""

    def fetch(self, worker: int, key: int) -> list: ...

    def free(self, worker: int, keys: Sequence[int]) -> None: ...

    def release(self) -> None: ...

    def ensure_ready(self, recompile) -> None:
        """Before a step: raise if the cluster is gone, recover it if a host-actor failed,
        and call ``recompile()`` if the workers lost this plan's programs."""

    def track(self, arrays: Sequence[RemoteArray]) -> None:
        """Remember live arrays, so restarts move them instead of losing them."""

    def set_trace(self, workers, on: bool, sync: bool = False) -> None:
        """Make ``workers`` record their per-instruction timelines (``last_traces``)."""

    def clock_offsets(self, workers) -> dict[int, tuple[int, int]]:
        """Each worker's (clock minus driver clock, ping round trip), ns."""


class StepHandle(Protocol):
    """A step started by :meth:`Backend.submit_step`."""

    def result(self) -> dict[int, dict]:
        """Wait for every worker; their results (raises the workers' failures)."""


class RemoteArray:
    """An array that lives on a mesh's workers between steps.

    ``np.asarray(x)`` fetches it; passing it back into the step uses it in place.
    Elsewhere it computes like the ``jax.Array`` that ``jax.jit`` would have returned:
    arithmetic, indexing, NumPy-style methods (``x.sum()``, ``x.astype(...)``),
    ``jax.numpy`` functions and arguments of other jitted functions (an eval step) use
    a local copy, fetched once.  If
    the host-actors holding it are restarted (a plan with another grouping of hosts, or
    recovery after a failure), the cluster first copies it to the driver: it stays
    usable and the next step that needs it places it again.
    """

    #: ``np.ndarray + remote`` defers to this array's operators, as with ``jax.Array``
    __array_priority__ = 100
    #: True for a result ``jax.jit`` types weakly: passed back, a step traces it weakly too
    weak_type = False
    # per-array state that rarely changes lives on the class until it does: a GPT step
    # makes and drops ~160 of these, so each store saved is paid 160 times a step
    deleted = False
    _host: np.ndarray | None = None  # driver copy, once moved off restarted hosts
    _lost: str | None = None  # why it can no longer be fetched
    _value: jax.Array | None = None  # local copy, once used as an array here
    #: the workers of each mesh that holds a copy (a checkpoint writes one of them)
    groups: tuple[tuple[int, ...], ...] = ()

    def __init__(self, owner: Executable, keys: dict[int, int], shape, dtype, groups=()):
        self._owner = weakref.ref(owner)
        self._backend = owner.backend
        self._drop = owner.drop_keys
        self.keys: dict[int, int] = dict(keys)
        self.shape: tuple = tuple(shape)
        self.dtype: np.dtype = np.dtype(dtype)
        if groups:
            self.groups = tuple(tuple(g) for g in groups)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def key_on(self, backend: Backend, worker: int) -> int | None:
        """The store key of this array on ``worker`` of ``backend``'s cluster, if it is
        kept there; None if the step must send it (by value) instead."""
        if self.deleted or self._lost or worker not in self.keys:
            return None
        if self._backend is not backend and (
            _cluster_of(self._backend) is not _cluster_of(backend)
            or getattr(self._backend, "layout", ()) != getattr(backend, "layout", ())
        ):  # another cluster, or another worker view of it (meshes sharing hosts)
            return None
        return self.keys[worker]

    def fetch(self) -> np.ndarray:
        """Copy the value to this process."""
        if self.deleted:
            raise MeshshardInputError(
                "this array was donated to a later step (donate_argnums) and no longer exists; "
                "use the state that step returned"
            )
        if self._lost:
            raise MeshshardRuntimeError(self._lost)
        if self._host is not None:
            return self._host
        self._settle()
        if getattr(self._backend, "closed", False):
            raise MeshshardRuntimeError(
                f"{self!r} lived on a meshshard cluster that was shut down (meshshard.shutdown() "
                "or a later meshshard.init()), so it is gone; fetch the state you need before "
                "shutting down (meshshard.fetch(state)) or save a checkpoint"
            )
        value = self._gather(skip=())
        if value is None:
            raise MeshshardRuntimeError(
                f"{self!r} cannot be fetched: the host-actors holding it failed (see the "
                "error of the step that failed); if they died it is lost: call "
                "meshshard.recover(), then restore it from a checkpoint or recompute it"
            )
        return value

    def _gather(self, skip) -> np.ndarray | None:
        """The value from the workers not in ``skip``; None if they do not hold all of it."""
        out = np.empty(self.shape, self.dtype)
        filled = np.zeros(self.shape, bool)
        for w, key in self.keys.items():  # replicas: stop once every element is known
            if w in skip:
                continue
            try:
                parts = self._backend.fetch(w, key)
            except MeshshardRuntimeError:  # that host is gone: try the other replicas
                continue
            for index, data in parts:
                sl = tuple(slice(a, b) for a, b in index)
                out[sl] = data
                filled[sl] = True
            if filled.all():
                return out
        return None

    def evacuate(self, hosts, dead) -> bool:
        """Before ``hosts`` restart: copy the value to the driver (from any live holder)
        and forget the keys on ``hosts``; if only ``dead`` hosts held parts of it, mark it
        lost.  True if it was copied."""
        if self.deleted or self._lost or not (set(self.keys) & set(hosts)):
            return False
        copied = False
        if self._host is None:
            self._host = self._gather(skip=set(dead))
            copied = self._host is not None
            if not copied:
                where = ", ".join(f"w{w}" for w in self.keys)
                self._lost = (
                    f"{self!r} is lost: it was kept only on host-actors that died ({where}); "
                    "restore it from a checkpoint or recompute it"
                )
        self.keys = {w: k for w, k in self.keys.items() if w not in set(hosts)}
        return copied

    def value(self) -> jax.Array:
        """The value as a ``jax.Array`` in this process, fetched on first use and kept
        while this array lives: what arithmetic, NumPy-style methods, ``jax.numpy``
        functions and ``jax.jit`` of another function compute on, as on a step's
        result under ``jax.jit``."""
        if self._value is None:  # dropped again when the array is donated or deleted
            self._value = as_result(self.fetch(), self.weak_type)
        return self._value

    def block_until_ready(self) -> RemoteArray:
        """Wait until the step that makes this array has finished (as ``jax.Array``'s)."""
        if not self.deleted:
            self._settle()
        return self

    def _settle(self) -> None:
        owner = self._owner()
        if owner is not None and owner._inflight:  # a pipelined step still writes it
            owner.settle()

    def is_deleted(self) -> bool:
        """True once donated to a later step or deleted."""
        return self.deleted

    def delete(self) -> None:
        """Free the value on the workers now (as ``jax.Array.delete``)."""
        self._release()

    def __jax_array__(self) -> jax.Array:
        return self.value()

    def __float__(self) -> float:
        return float(self.fetch())

    def __int__(self) -> int:
        return int(self.fetch())

    def __index__(self) -> int:
        return self.value().__index__()

    def __complex__(self) -> complex:
        return complex(self.fetch())

    def __bool__(self) -> bool:
        return bool(self.value())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __format__(self, spec: str) -> str:
        return format(self.value(), spec) if spec else repr(self)

    def __array__(self, dtype=None, copy=None):
        a = self.fetch()
        return a.astype(dtype) if dtype is not None else a

    def __getattr__(self, name: str):
        if name in ARRAY_METHODS:  # NumPy-style methods and properties of the value
            return getattr(self.value(), name)
        if name in PLACEMENT_ATTRIBUTES:
            raise AttributeError(
                f"{self!r} has no {name!r}: it lives on meshshard's workers, not on a local "
                "JAX device; step.placement(...) gives its layout, meshshard.fetch(x) a "
                "host copy"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        where = ",".join(f"w{w}" for w in self.keys) or "driver"
        return f"RemoteArray({self.dtype}{list(self.shape)} on {where})"

    def __reduce__(self):
        """Pickled by value, as ``jax.Array`` is: it unpickles as the ``jax.Array`` that
        ``jax.jit`` would have returned, a copy that outlives the cluster (``pickle.dump``
        of a training state, ``copy.deepcopy`` of the best one so far)."""
        return (as_result, (self.fetch(), self.weak_type))

    def __copy__(self) -> RemoteArray:
        return self  # immutable: a shallow copy is the same array, as for a tuple

    def _release(self) -> None:
        if not self.deleted:
            self.deleted = True
            self._host = None
            self._value = None
            self._drop(self.keys)

    def __del__(self):
        try:  # dying: nothing to reset, only the keys to free
            if not self.deleted:
                self._drop(self.keys)
        except Exception:  # interpreter shutdown
            pass


def _computed_on_value(name: str):
    def method(self, *args):
        return getattr(self.value(), name)(*args)

    method.__name__ = name
    return method


for _name in ARRAY_OPERATORS:
    setattr(RemoteArray, _name, _computed_on_value(_name))
register_array_type(RemoteArray, RemoteArray.value)


def _cluster_of(backend):
    return getattr(backend, "cluster", None) or backend


def fetch(tree):
    """Copy every :class:`RemoteArray` in ``tree`` to this process (other leaves as they
    are): a host copy of the training state that outlives the cluster."""
    return jax.tree.map(lambda x: x.fetch() if isinstance(x, RemoteArray) else x, tree)


class Executable:
    """Runs one plan on a backend; call it like the original step function."""

    #: held by the class, which outlives the module's globals at interpreter exit
    _releaser = RELEASER

    def __init__(
        self, plan: Plan, backend: Backend, fn, abstract_args, batch_argnums, donate_argnums=()
    ):
        require_valid_plan(plan)  # an edited or broken plan never reaches the workers
        self.plan = plan
        self.backend = backend
        self.batch_argnums = tuple(batch_argnums)
        self.donate_argnums = tuple(donate_argnums)
        self._pending_free: dict[int, list[int]] = {}
        #: ``{worker: key}`` of dropped arrays, not yet in ``_pending_free`` (appended
        #: without a lock by finalizers: see :meth:`drop_keys`)
        self._dropped: deque = deque()
        self._free_armed = False  # a delayed flush_frees is queued
        self._self_ref = weakref.ref(self)
        RELEASER.start()  # now, not first from a finalizer
        self._lock = threading.RLock()  # re-entered by a finalizer freeing an array
        self.released = False
        self._compile_args = (fn, abstract_args, self.batch_argnums)
        self.compile_seconds = backend.compile(fn, abstract_args, batch_argnums, plan)
        self._mesh_workers = {m.id: m.workers for m in plan.meshes}
        self.layout = StepLayout.of_plan(plan)
        self._out_specs = self._output_specs()
        self._donate_ranges: dict = {}  # argument structure -> donated leaf ranges
        self._leaf_pos = {spec.leaf: pos for pos, spec in enumerate(plan.inputs)}
        #: per worker: (worker, input positions of its batch leaves, of its state leaves)
        self._input_positions = tuple(self._positions(w) for w in plan.workers)
        self._said_moved = False  # the warning on state another step keeps elsewhere
        self._twin_steps: deque = deque()  # per recent step, its by-value results' twins
        self._small_outputs = [  # the program outputs a worker may return by value
            i
            for i, (o, lay) in enumerate(zip(plan.outputs, self.layout.outputs, strict=True))
            if lay is not None
            and np.dtype(o.dtype).itemsize * int(np.prod(o.shape)) <= BY_VALUE_BYTES
        ]
        self.last_worker_seconds: dict[int, float] = {}
        self.trace_log = None  # a runtime.trace_record.TraceLog while recording
        self._sync = False
        self._offsets: tuple = ()
        #: run steps pipelined (set for 2BW's steady step; see :meth:`_submit`)
        self.pipelined = False
        #: the driver's program for the full batch's statistics the step reads as inputs
        #: after the user's leaves (set by ``parallelize``; None: there are none)
        self.statistics = None
        #: the step's trace (set by ``parallelize``), for its compiled collectives
        self.traced = None
        self._inflight: deque = deque()  # _InFlight of submitted pipelined steps
        self._seq = itertools.count()

    def recompile(self) -> None:
        """Compile the plan again on the workers (they were restarted or lost their
        transfer group); the plan itself does not change."""
        self.compile_seconds = self.backend.compile(*self._compile_args, self.plan)
        if self.trace_log is not None:
            self.record(self.trace_log, self._sync)

    def record(self, log, sync: bool = False) -> None:
        """Record every later call's measured timeline into ``log`` (a ``TraceLog``;
        None stops): the workers stamp each instruction, the driver its dispatch, and
        the workers' clock offsets are estimated now.  ``sync`` (profiling): each RUN
        waits for its outputs, so its span is the program's run time."""
        self.trace_log = log
        self._sync = sync
        self.backend.set_trace(self.plan.workers, log is not None, sync)
        if log is not None:
            offsets = self.backend.clock_offsets(self.plan.workers)
            self._offsets = tuple((w, off) for w, (off, _) in sorted(offsets.items()))
            self.clock_rtts = {w: rtt for w, (_, rtt) in offsets.items()}

    def __call__(self, *args):
        return self.call_flat(args)

    def call_flat(self, args: tuple, flat: list | None = None, tree=None):
        """Run the step on ``args``; ``flat`` (their leaves) and ``tree`` (their structure)
        when the caller flattened them already, as ``parallelize`` does."""
        if self.trace_log is None:
            return self._call(args, None, flat, tree)
        from meshshard.runtime.trace_record import StepTrace, clock_ns

        t0 = clock_ns()
        marks: list = []
        out = self._call(args, marks, flat, tree)
        t3 = clock_ns()
        t1, t2 = marks
        driver = (("prepare", t0, t1), ("workers", t1, t2), ("outputs", t2, t3))
        workers = tuple(tr for _, tr in sorted(self.backend.last_traces.items()))
        self.trace_log.add(self.plan.streams, StepTrace(driver, workers, self._offsets))
        return out

    def _call(self, args, marks: list | None = None, flat=None, tree=None):
        if self.released:
            raise MeshshardRuntimeError(
                "this compiled step was released (step.release()); call the parallelized "
                "function again to recompile it"
            )
        plan = self.plan
        self.backend.ensure_ready(self.recompile)
        if flat is None:
            flat, tree = jax.tree.flatten(args)
        if len(flat) != len(plan.inputs):
            raise MeshshardInputError(
                f"the step was compiled for {len(plan.inputs)} input leaves but got {len(flat)}; "
                "call it with arguments of the same structure as when it was compiled"
            )
        base = _KEYS.reserve(self.layout.num_keys)
        donated = self._donated(args, flat, tree)
        with self._lock:
            frees = self._take_frees()
        requests = {
            w: (*inputs, base, frees.get(w, [])) for w, inputs in self._inputs(flat).items()
        }
        if self.pipelined and marks is None and self.can_pipeline:
            return self._submit(args, flat, requests, base)
        self.settle()
        if marks is not None:
            from meshshard.runtime.trace_record import clock_ns

            marks.append(clock_ns())
        handle = self.backend.submit_step(requests)
        leaves = self._output_leaves(flat, base)  # built while the workers run
        results = handle.result()
        if marks is not None:
            marks.append(clock_ns())
        for r in donated:
            r._release()
        return self._by_value(leaves, results)

    def _positions(self, worker: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        lay, pos = self.layout.workers.get(worker, EMPTY_LAYOUT), self._leaf_pos
        batch = tuple(pos[leaf] for leaf in lay.batch_leaves)
        return worker, batch, tuple(pos[leaf] for leaf in lay.state_leaves)

    def _inputs(self, flat) -> dict[int, tuple[list, list]]:
        """Each worker's batch and state entries in its :class:`StepLayout` order: store
        keys for arrays it keeps, host values (one copy per leaf) for the rest."""
        host: dict[int, np.ndarray] = {}

        def value(p: int) -> np.ndarray:
            if p not in host:
                host[p] = np.asarray(flat[p])
            return host[p]

        out = {}
        backend = self.backend
        moved: set[int] = set()  # positions of leaves another step keeps, sent by value
        for w, batch_pos, state_pos in self._input_positions:
            state = []
            for p in state_pos:
                x = flat[p]
                if type(x) is RemoteArray and x._backend is backend and not x.deleted:
                    key = None if x._lost else x.keys.get(w)  # this step's own result
                elif isinstance(x, RemoteArray):
                    if x._owner() is not self:  # another step's result: stored once it ran
                        x._settle()
                    key = x.key_on(backend, w)
                else:  # a recent by-value result is read where it is also kept
                    twin = _twin_of(x) if _TWINS else None
                    key = twin.key_on(backend, w) if isinstance(twin, RemoteArray) else None
                if key is None:
                    if isinstance(x, RemoteArray):
                        moved.add(p)
                    state.append(value(p))
                else:
                    state.append(int(key))
            out[w] = ([value(p) for p in batch_pos], state)
        if moved and not self._said_moved:
            self._say_moved(sorted(moved))
        return out

    def _say_moved(self, positions: list[int]) -> None:
        """Warn, once per compiled step, that state arrays kept on the cluster by another
        step (or another layout) reach this one through the driver: fetched here and sent
        by value.  Once is normal after a layout change (the step's results are then kept
        where it reads them); on every call it is a cost worth knowing (an eval step
        whose stages read parameters where the train step does not keep them)."""
        self._said_moved = True
        specs = [self.plan.inputs[p] for p in positions]
        nbytes = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in specs)
        names = ", ".join(s.path for s in specs[:3]) + (
            f" and {len(specs) - 3} more" if len(specs) > 3 else ""
        )
        log.warning(
            "%d state arrays (%s: %s) are kept by another step on other workers "
            "(or laid out otherwise), so this step fetches them to the driver and sends "
            "them by value; a step's own results are read in place",
            len(specs),
            fmt_bytes(nbytes),
            names,
        )

    @functools.cached_property
    def can_pipeline(self) -> bool:
        """Whether two steps of this plan may run at once: its communication is point to
        point (collectives would need every member to order two steps' ops alike)."""
        plan = self.plan
        broadcasts = any(m.is_broadcast for t in plan.transfers for m in t.messages)
        # data-parallel replicas' gradient all-reduces (passes/replicas.py) are COLLs too
        colls = any(isinstance(i, Collective) for s in plan.streams for i in s.instructions)
        return not broadcasts and not plan.reductions and not colls

    def _submit(self, args, flat, requests, base: int):
        """Pipelined call: start this step, then wait for the one before it, and return
        this step's outputs as arrays still being computed (fetching one waits).

        So step ``k + 1`` (the next call) is submitted while step ``k`` drains: at most two
        steps are in flight, each worker starts a step after the previous one started and
        a step reads the state the previous one writes only when its program needs it
        (2BW: the update; forwards and backwards read the stashed weights).
        """
        seq = next(self._seq)
        # the step it must start after on every worker: the one still in flight, if any
        # (a threaded actor may receive the two calls in either order)
        after = self._inflight[-1].seq if self._inflight else None
        handle = self.backend.submit_step({w: (*r, seq, after) for w, r in requests.items()})
        written = {
            (w, base + off) for w, lay in self.layout.workers.items() for *_, off in lay.out_slots
        }
        with self._lock:  # args stay referenced until the step ends
            self._inflight.append(_InFlight(handle, args, written, seq))
        while len(self._inflight) > 1:
            self._settle_one()
        return jax.tree.unflatten(self._out_tree, self._output_leaves(flat, base))

    def _settle_one(self) -> None:
        step = self._inflight[0]
        try:
            step.handle.result()
        finally:
            with self._lock:
                self._inflight.popleft()
                for w, key in step.deferred:  # dropped before the step stored them
                    self._pending_free.setdefault(w, []).append(key)
            if step.deferred:
                RELEASER.call(self.flush_frees)

    def settle(self) -> None:
        """Wait until every pipelined step submitted so far has finished (raises the
        first failure); a no-op when none is in flight."""
        while self._inflight:
            self._settle_one()

    def drop_keys(self, keys: dict[int, int]) -> None:
        """Free a dropped array's ``{worker: key}`` with the next step, or from the
        releaser thread within :data:`FREE_DELAY_S` if no step takes it first.  Called
        by the finalizer of each array of a state the next step replaced (~160 for a
        GPT), so it only appends to a thread-safe queue: no lock, unless it must arm
        the delayed flush.  The state a step replaces is dropped as it returns, so in a
        training loop the next call carries those frees: no extra message."""
        self._dropped.append(keys)
        if not self._free_armed:
            self._arm_flush()

    def _arm_flush(self) -> None:
        with self._lock:
            if self._free_armed or not (self._pending_free or self._dropped):
                return
            self._free_armed = True
        RELEASER.call_later(FREE_DELAY_S, self.flush_frees)

    def _pend(self, items) -> None:
        """Add ``(worker, key)`` pairs to the frees the next step carries (under the
        lock); a key a pipelined step in flight still writes waits for that step."""
        pending, inflight = self._pending_free, self._inflight
        for worker, key in items:
            if inflight:
                writer = next((s for s in inflight if (worker, key) in s.written), None)
                if writer is not None:  # freed once its step has stored it
                    writer.deferred.append((worker, key))
                    continue
            keys = pending.get(worker)
            if keys is None:
                pending[worker] = [key]
            else:
                keys.append(key)

    def _take_frees(self) -> dict[int, list[int]]:
        """Every free not yet sent, ``{worker: keys}``, taken (under the lock)."""
        dropped, items = self._dropped, []
        while dropped:  # popleft is atomic against a finalizer's append
            try:
                items.extend(dropped.popleft().items())
            except IndexError:
                break
        self._pend(items)
        frees, self._pending_free = self._pending_free, {}
        return frees

    def flush_frees(self) -> None:
        """Free the arrays dropped since the last step now, without waiting for a step."""
        with self._lock:
            # disarmed before the drain: a drop appended after it arms the next flush
            self._free_armed = False
            frees = self._take_frees()
        for w, keys in frees.items():
            self.backend.free(w, keys)

    def release(self) -> None:
        """Drop this step's compiled programs on the workers (the arrays it returned stay
        valid); a released step cannot run again.  Idempotent."""
        if not self.released:
            self.released = True
            self.settle()
            self._drop_twins()
            self.flush_frees()
            self.backend.release()

    def release_soon(self) -> None:
        """Like :meth:`release`, done by the releaser thread (safe from a finalizer, even
        one run while the interpreter tears this module's globals down)."""
        if not getattr(self, "released", True):
            self.released = True
            try:
                self._drop_twins()
            except Exception:  # module globals already torn down at exit: nothing to free
                pass
            self._releaser.call(self.backend.release)

    def _drop_twins(self, keep: int = 0) -> None:
        """Free the stored copies of the by-value results but the last ``keep`` steps'
        (all for a released step: its next call, which would read them, never comes)."""
        steps = getattr(self, "_twin_steps", None)
        while steps and len(steps) > keep:
            for key, stored in steps.popleft():
                entry = _TWINS.get(key)
                if entry is not None and entry[1]() is stored:
                    del _TWINS[key]
                stored._release()

    def __del__(self):
        self.release_soon()

    def _donated(self, args, flat: list, tree) -> list[RemoteArray]:
        """The arrays of the donated arguments (released once the step has them)."""
        if not self.donate_argnums:
            return []
        ranges = self._donate_ranges.get(tree) if tree is not None else None
        if ranges is None:
            sizes = [len(jax.tree.leaves(a)) for a in args]
            starts = list(itertools.accumulate([0, *sizes]))
            ranges = [(starts[i], starts[i + 1]) for i in self.donate_argnums if i < len(args)]
            if tree is not None:
                self._donate_ranges[tree] = ranges
        return [x for a, b in ranges for x in flat[a:b] if isinstance(x, RemoteArray)]

    def _output_leaves(self, flat, base: int) -> list:
        """The step's result leaves: a :class:`RemoteArray` of the keys ``base + offset``
        the workers store each program output under (:meth:`_by_value` replaces those
        that come back by value), literals as ``jax.Array``s, and inputs returned as they
        came, except host values (NumPy arrays, Python scalars), which become
        ``jax.Array``s as under ``jax.jit``."""
        leaves, made = [], []
        owner, backend, drop = self._self_ref, self.backend, self.drop_keys
        new = RemoteArray.__new__
        for kind, what, shape, dtype, groups, weak in self._out_specs:
            if kind == "stored":  # filled in place: ~160 a step (see RemoteArray's defaults)
                array = new(RemoteArray)
                array._owner, array._backend, array._drop = owner, backend, drop
                if len(what) == 1:
                    ((w, off),) = what
                    array.keys = {w: base + off}
                else:
                    array.keys = {w: base + off for w, off in what}
                array.shape, array.dtype = shape, dtype
                if groups:
                    array.groups = groups
                if weak:
                    array.weak_type = True
                made.append(array)
                leaves.append(array)
            elif kind == "input":
                x = flat[what]
                leaves.append(as_result(x) if _is_host_value(x) else x)
            else:  # a literal, made a jax.Array once (immutable, so it can be shared)
                leaves.append(what)
        backend.track(made)
        return leaves

    def _output_specs(self) -> tuple:
        """Per output leaf, what :meth:`_output_leaves` needs, normalised once: ``(kind,
        holders | input leaf | literal, shape, dtype, groups, weak type)``."""
        specs = []
        for o, lay in zip(self.plan.outputs, self.layout.outputs, strict=True):
            shape, dtype, weak = tuple(o.shape), np.dtype(o.dtype), o.weak_type
            if o.source == "literal":
                value = as_result(np.asarray(o.literal, dtype=dtype).reshape(shape), weak)
                specs.append(("literal", value, shape, dtype, (), weak))
            elif o.source == "input":
                specs.append(("input", o.input_leaf, shape, dtype, (), weak))
            else:
                groups = tuple(tuple(g) for g in lay.groups)
                specs.append(("stored", tuple(lay.holders), shape, dtype, groups, weak))
        return tuple(specs)

    def _by_value(self, leaves: list, results: dict[int, dict]):
        """The result tree, with the outputs the workers returned by value as
        ``jax.Array``s: what ``jax.jit`` returns, so a loss has ``block_until_ready``
        and promotes with other results as JAX does (NumPy would make ``float32 /
        int32`` a float64)."""
        got, values, weak = [], [], []
        for i in self._small_outputs:
            o, lay = self.plan.outputs[i], self.layout.outputs[i]
            w0, off0 = lay.holders[0]
            value = results.get(w0, {}).get(off0)
            if value is not None:
                got.append(i)
                values.append(value.reshape(o.shape))
                weak.append(o.weak_type)
        twins = []
        for i, array in zip(got, as_results(values, weak), strict=True):
            stored, leaves[i] = leaves[i], array
            key = id(array)
            gone = functools.partial(_forget_twin, key)
            _TWINS[key] = (weakref.ref(array, gone), weakref.ref(stored))
            twins.append((key, stored))
        self._twin_steps.append(twins)
        self._drop_twins(keep=TWIN_STEPS)  # the stored copies of older steps go
        return jax.tree.unflatten(self._out_tree, leaves)

    def set_out_tree(self, tree) -> None:
        """The pytree structure of the step's results."""
        self._out_tree = tree


def _twin_of(x):
    """The stored :class:`RemoteArray` of ``x``, a by-value result of a recent step, or
    ``x`` itself."""
    twin = _TWINS.get(id(x))
    if twin is None or twin[0]() is not x:
        return x
    stored = twin[1]()
    return x if stored is None else stored


def _forget_twin(key: int, _ref) -> None:
    """Drop the entry of a by-value result that no longer exists."""
    entry = _TWINS.get(key)
    if entry is not None and entry[0]() is None:
        del _TWINS[key]


def as_result(value, weak_type: bool = False) -> jax.Array:
    """A host value the step returns (a worker's by-value output, a literal, a NumPy or
    Python value passed through) as the ``jax.Array`` ``jax.jit`` would return, weakly
    typed where ``jax.jit``'s is (``benchmarks/by_value_results.py`` times it against
    returning the NumPy value)."""
    if weak_type and np.ndim(value) == 0:
        scalar = np.asarray(value).item()  # JAX types a Python scalar weakly
        weak = jax.numpy.asarray(scalar)
        if weak.dtype == np.asarray(value).dtype:
            return weak
    return jax.numpy.asarray(value)


def as_results(values: Sequence, weak_types: Sequence[bool]) -> list[jax.Array]:
    """:func:`as_result` of each of several small host values (a step's by-value
    outputs), made in one call of a compiled identity program: its arguments go to the
    device in one batch, instead of one ``jax.numpy.asarray`` dispatch per value
    (``benchmarks/by_value_results.py`` times the two).  Not for large values: the
    program copies its inputs to its outputs."""
    if not values:
        return []
    args = [_weak_scalar(v) if w else v for v, w in zip(values, weak_types, strict=True)]
    return list(_identity(*args))


@jax.jit
def _identity(*values):
    return values


def _weak_scalar(value):
    """``value`` as the Python scalar JAX types weakly, where that keeps its dtype (so a
    program returns it weakly typed, as ``jax.jit`` of the step did); else ``value``."""
    if np.ndim(value) != 0:
        return value
    scalar = np.asarray(value).item()
    return scalar if jax.numpy.result_type(scalar) == np.asarray(value).dtype else value


def _is_host_value(x) -> bool:
    """A NumPy array or scalar, or a Python number: what ``jax.jit`` returns as a
    ``jax.Array`` when a step passes it through."""
    return isinstance(x, np.ndarray | np.generic | bool | int | float | complex)


class _InFlight:
    """A pipelined step submitted and not yet waited for: its handle, its arguments (kept
    alive until it ends), the (worker, key)s it writes, frees of those deferred, and its
    step number."""

    __slots__ = ("handle", "args", "written", "deferred", "seq")

    def __init__(self, handle: StepHandle, args, written: set, seq: int):
        self.handle, self.args, self.written, self.seq = handle, args, written, seq
        self.deferred: list[tuple[int, int]] = []


def run_in_threads(workers, fn) -> dict:
    """``{w: fn(w)}`` with every worker in its own thread; a failure of any worker is
    raised after all have finished, with every worker's message."""
    return ThreadsStep(workers, fn).result()


class ThreadsStep:
    """``fn(w)`` for every worker, each in a thread of its own, started now (threads kept
    between steps: :mod:`runtime.step_threads`); :meth:`result` waits for all (a
    :class:`StepHandle` of the in-process backend)."""

    def __init__(self, workers, fn, on_error=None, cancel=None, progress=None):
        """``on_error(w, exc)``, if given, runs in the failing worker's thread as soon as
        ``fn(w)`` raises (the in-process backend abandons the step's messages);
        ``cancel(reason)``, if given, makes the workers stop waiting for messages
        (:meth:`cancel`); ``progress()``, if given, a count that moves while the
        workers get on (:meth:`progress`)."""
        self.results: dict = {}
        self.errors: dict[int, BaseException] = {}
        self._cancel = cancel
        self._progress = progress

        def one(w) -> None:
            try:
                self.results[w] = fn(w)
            except BaseException as exc:  # reported by result() with every failure
                self.errors[w] = exc
                if on_error is not None:
                    on_error(w, exc)

        self.done = [STEP_THREADS.start(functools.partial(one, w)) for w in workers]

    def join(self, timeout: float | None = None) -> None:
        """Wait until every worker's call has returned (at most ``timeout`` seconds in
        all)."""
        end = None if timeout is None else time.monotonic() + timeout
        for done in self.done:
            done.wait(None if end is None else max(0.0, end - time.monotonic()))

    @property
    def running(self) -> bool:
        """True while a worker's call has not returned."""
        return not all(done.is_set() for done in self.done)

    def progress(self) -> int:
        """A count that moves while the step gets on (instructions done, messages
        arrived); 0 when unknown."""
        return self._progress() if self._progress is not None else 0

    def cancel(self, reason: str) -> None:
        """Give up on the step: its workers' waiting receives (and later ones) raise
        ``reason``, so their threads end instead of waiting out the transfer timeout."""
        if self._cancel is not None:
            self._cancel(reason)

    def result(self) -> dict:
        """``{w: fn(w)}`` once every thread ended; raises every worker's failure."""
        self.join()
        raise_worker_errors(self.errors)
        return self.results


def raise_worker_errors(errors: dict[int, BaseException]) -> None:
    """Re-raise the first worker failure with every worker's message."""
    if not errors:
        return
    msg = "\n\n".join(f"{e}" for _, e in sorted(errors.items()))
    raise MeshshardRuntimeError(f"{len(errors)} worker(s) failed:\n{msg}")
