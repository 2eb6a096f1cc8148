"""One worker (host): compiles its mesh's programs once and runs its stream every step.

Plain Python with no Ray: the Ray host-actor and the in-process runner both hold one.
State (parameters, optimizer state) stays here between steps in ``store``, keyed by
ids the driver hands out; only small results travel back by value.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from meshshard.errors import MeshshardRuntimeError
from meshshard.passes.trace import trace_step
from meshshard.plan import Plan
from meshshard.refs import BufferRef
from meshshard.runtime.interpreter import StreamInterpreter, array_from_host
from meshshard.runtime.overlap import Lazy
from meshshard.runtime.programs import build_programs, make_mesh, sharding
from meshshard.runtime.step_wire import EMPTY_LAYOUT, StepLayout
from meshshard.runtime.trace_record import clock_ns
from meshshard.runtime.transport import Transport

#: Results up to this many bytes come back to the driver by value (losses, counters),
#: when replicated (a split one, from inferred sharding, is kept like a large one).
BY_VALUE_BYTES = 64

#: Seconds a pipelined step waits for the previous step's outputs (its state inputs).
PIPELINE_WAIT_S = 600.0


class StartOrder:
    """The order in which pipelined steps start on one worker.

    Step ``seq`` names the step that must start before it (``after``; None when no step
    was in flight when the driver submitted it).  Calls of a threaded Ray actor (and the
    threads backend's) may arrive out of order, so a step waits here for its
    predecessor's start rather than trusting arrival order.

    >>> order = StartOrder(threading.Condition())
    >>> order.wait(None); order.started(0); order.wait(0); order.started(1)
    >>> order.last
    1
    """

    def __init__(self, cv: threading.Condition):
        self._cv = cv
        self.last: int | None = None  # the highest step number started here
        self.failed: BaseException | None = None  # a pipelined step that raised

    def wait(self, after: int | None, timeout_s: float = PIPELINE_WAIT_S) -> None:
        """Return once step ``after`` started here (at once for None, or after a failure:
        the step then fails on its missing inputs with a clear message)."""
        if after is None:
            return
        with self._cv:
            ok = self._cv.wait_for(
                lambda: (self.last is not None and self.last >= after) or self.failed is not None,
                timeout=timeout_s,
            )
        if not ok:
            raise MeshshardRuntimeError(
                f"pipelined step {after + 1} waited {timeout_s:.0f}s for step {after} to "
                "start on this worker; the driver's call of that step never arrived"
            )

    def started(self, seq: int) -> None:
        """Note that step ``seq`` started (its state inputs are claimed)."""
        with self._cv:
            self.last = seq if self.last is None else max(self.last, seq)
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        """A pipelined step raised: wake every step waiting on this worker."""
        with self._cv:
            self.failed = exc
            self._cv.notify_all()


class StoreKey(int):
    """An id of an array kept in a worker's store between steps."""


class Worker:
    """Compiles and runs one worker's share of a plan.

    Args:
        worker: worker id (== host index in the cluster).
        devices: the devices of this worker's mesh, host-major (all hosts for a
            multi-host mesh; this process's own for a single-host one).
        transport: point-to-point transport to the other workers.
        store: arrays kept between steps, shared by the workers of one process.
    """

    def __init__(
        self, worker: int, devices: Sequence, transport: Transport, store: dict | None = None
    ):
        self.worker = worker
        self.devices = list(devices)
        self.transport = transport
        self.store: dict[int, jax.Array] = {} if store is None else store
        self.plan: Plan | None = None
        self.interp: StreamInterpreter | None = None
        self.last_trace = None  # the last step's WorkerTrace while recording
        # pipelined steps (2BW without flushes): in-order starts, outputs announced
        self._cv = threading.Condition()
        self.order = StartOrder(self._cv)

    # --- compile -----------------------------------------------------------------
    def compile(
        self, fn: Callable, abstract_args, batch_argnums: Sequence[int], plan: Plan
    ) -> float:
        """Trace ``fn`` as the planner did, check it is the same program, build programs."""
        import time

        t0 = time.perf_counter()
        traced = trace_step(
            fn,
            abstract_args,
            batch_argnums=tuple(batch_argnums),
            num_micro_batches=plan.num_micro_batches,
            fingerprint=plan.fingerprint,
        )
        if traced.fingerprint != plan.fingerprint:
            raise MeshshardRuntimeError(
                f"worker w{self.worker} traced a different program (fingerprint "
                f"{traced.fingerprint}) than the plan's ({plan.fingerprint}); the workers must "
                "run the same jax/flax versions, the same code and the same JAX settings "
                "(meshshard.jax_config.TRACE_SETTINGS are sent; a step that reads other "
                "global state, such as an environment variable, must read it alike) as "
                "the driver"
            )
        mesh_spec = next(m for m in plan.meshes if self.worker in m.workers)
        self.mesh = make_mesh(self.devices, mesh_spec.axis_shape)
        #: (group, index) -> whether that step output is small enough to return by value
        #: (its shape and dtype are the plan's, so this is asked once, not every step)
        self._small: dict = {}
        # interleaved 1F1B: logical meshes that view this same mesh run here too
        views = {
            m.id
            for m in plan.meshes
            if (m.hosts, m.shape, m.view) == (mesh_spec.hosts, mesh_spec.shape, mesh_spec.view)
        }
        programs = {}
        for mesh_id in sorted(views):
            programs.update(build_programs(traced, plan, mesh_id, self.mesh))
        stream = next(s for s in plan.streams if s.worker == self.worker)
        self.plan = plan
        self.traced = traced
        self.mesh_spec = mesh_spec
        self.interp = StreamInterpreter(stream, plan, programs, self.mesh, self.transport)
        self._groups = {b.name: b for b in plan.buffers if b.mesh in views}
        self.layout = StepLayout.of_plan(plan).workers.get(self.worker, EMPTY_LAYOUT)
        self._leaf_slot = {}
        for i in plan.inputs:
            for g, idx in i.slots:
                if g in self._groups:
                    self._leaf_slot.setdefault(g, {})[idx] = i.leaf
        return time.perf_counter() - t0

    # --- run ---------------------------------------------------------------------
    def run_step(
        self,
        batch: Sequence[np.ndarray],
        state: Sequence[int | np.ndarray],
        base: int,
        free: Sequence[int] = (),
        seq: int | None = None,
        after: int | None = None,
    ) -> dict[int, np.ndarray]:
        """Run one step; keeps each output slot under ``base + offset`` and returns the
        small ones by value (``{offset: value}``).

        ``batch`` and ``state`` follow this worker's :class:`StepLayout` order; a state
        entry is a store key (int) or a host value.  ``free``: store keys of arrays the
        driver dropped (the state the last step replaced), freed before the step runs,
        so they are not held beside its inputs and outputs.  ``seq`` (pipelined steps, 2BW
        without flushes): the step's number; it may run while step ``after`` (the one in
        flight when it was submitted, or None) still runs here, and starts only after
        that one started; a state input that step has not stored yet is waited for when
        first read, and every output is kept in the store (none returned by value).
        """
        if self.interp is None:
            raise MeshshardRuntimeError(f"worker w{self.worker} has no compiled plan")
        layout = self.layout
        batch_by_leaf = dict(zip(layout.batch_leaves, batch, strict=True))
        state_by_leaf = {
            leaf: StoreKey(v) if isinstance(v, int) else v
            for leaf, v in zip(layout.state_leaves, state, strict=True)
        }
        pipelined = seq is not None
        if not pipelined:  # alone on this worker: nothing still reads what the driver dropped
            self.free(free)  # before this step's outputs exist: one state fewer at its peak
        try:
            if pipelined:
                self.order.wait(after)
            buffers = self._persistent(state_by_leaf, pipelined)
            if pipelined:
                self.order.started(seq)
            buffers = self.interp.run(buffers, self._loader(batch_by_leaf), seq)
        except BaseException as exc:
            if pipelined:
                self.order.fail(exc)
            raise
        by_value = []  # (offset, the array on one device) of the small outputs
        with self._cv:
            for group, idx, off in layout.out_slots:
                arr = buffers[group][idx]
                small = self._small.get((group, idx))
                if small is None:
                    small = self._small[(group, idx)] = arr.nbytes <= BY_VALUE_BYTES
                if small and arr.sharding.is_fully_replicated and not pipelined:
                    by_value.append((off, arr.addressable_shards[0].data))
                # kept by value or not: a small state result the next step reads back is
                # then read in place (the driver's jax.Array remembers the key)
                self.store[base + off] = arr
            self._cv.notify_all()
        result = {}
        if by_value:  # one fetch for all of them: their copies to the host overlap
            values = jax.device_get([data for _, data in by_value])
            result = {off: np.asarray(v) for (off, _), v in zip(by_value, values, strict=True)}
        if self.interp.recorder is not None:  # finished: the small outputs are in hand
            self.last_trace = self.interp.recorder.snapshot(self.worker, clock_ns())
        if pipelined:  # the step before may still read them: freed once this one has run
            self.free(free)
        return result

    def _persistent(self, state: dict[int, object], pipelined: bool) -> dict:
        """The persistent groups (P, S) of this step; pipelined, a group whose stored
        arrays the previous step has not written yet is a :class:`Lazy` that waits."""
        buffers: dict = {}
        for name, spec in self._groups.items():
            if name.kind.persistent:
                slots = self._leaf_slot[name]
                values = [state[slots[i]] for i in range(len(spec.tensors))]
                if pipelined and any(
                    isinstance(v, StoreKey) and int(v) not in self.store for v in values
                ):
                    buffers[name] = Lazy(
                        lambda values=values, spec=spec: self._await_group(values, spec)
                    )
                    continue
                buffers[name] = tuple(
                    self._state_array(v, t) for v, t in zip(values, spec.tensors, strict=True)
                )
        return buffers

    def _await_group(self, values: list, spec) -> tuple:
        """One persistent group once the step before has stored its arrays."""

        def stored() -> bool:
            return self.order.failed is not None or all(
                int(v) in self.store for v in values if isinstance(v, StoreKey)
            )

        with self._cv:
            if not self._cv.wait_for(stored, timeout=PIPELINE_WAIT_S):
                raise MeshshardRuntimeError(
                    f"worker w{self.worker}: the previous pipelined step did not store this "
                    f"step's state inputs within {PIPELINE_WAIT_S:.0f}s"
                )
            if self.order.failed is not None:
                raise MeshshardRuntimeError(
                    f"worker w{self.worker}: the previous pipelined step failed, so this "
                    f"step has no state inputs: {self.order.failed}"
                )
        return tuple(self._state_array(v, t) for v, t in zip(values, spec.tensors, strict=True))

    def _loader(self, batch: dict[int, np.ndarray]) -> Callable[[BufferRef, int], tuple]:
        """``load(group, mb)``: micro-batch ``mb`` of a batch group on this mesh."""
        m = self.plan.num_micro_batches

        def load(group: BufferRef, mb: int) -> tuple:
            spec = self._groups[group]
            slots = self._leaf_slot[group]
            arrays = []
            for i, t in enumerate(spec.tensors):
                full = np.asarray(batch[slots[i]], dtype=t.dtype)
                rows = full.shape[0] // m
                part = np.ascontiguousarray(full[mb * rows : (mb + 1) * rows])
                arrays.append(array_from_host(part, sharding(self.mesh, t.spec)))
            return tuple(arrays)

        return load

    def record(self, on: bool, sync: bool = False) -> None:
        """Record each step's per-instruction timeline (``last_trace``) from now on;
        ``sync``: each RUN waits for its outputs (profiling program times)."""
        if self.interp is None:
            raise MeshshardRuntimeError(f"worker w{self.worker} has no compiled plan")
        self.interp.record(on, sync)
        self.last_trace = None

    def _state_array(self, value, tensor) -> jax.Array:
        want = sharding(self.mesh, tensor.spec)
        if isinstance(value, StoreKey):
            try:
                arr = self.store[int(value)]
            except KeyError:
                raise MeshshardRuntimeError(
                    f"worker w{self.worker} no longer holds array {int(value)}; it was donated "
                    "to an earlier step or freed. Pass the state the last step returned"
                ) from None
            if arr.sharding == want or len(self.mesh_spec.workers) > 1:
                return arr  # a mesh of several workers holds its own part: kept as stored
            return self._respec(arr, want)
        return array_from_host(np.asarray(value, dtype=tensor.dtype), want)

    @staticmethod
    def _respec(arr: jax.Array, want) -> jax.Array:
        """A kept array that another plan (or this plan's output spec of a state leaf it
        did not tie to its input) laid out otherwise on this worker's mesh: moved to the
        layout this step's programs read."""
        if arr.sharding.is_equivalent_to(want, arr.ndim):
            return arr
        return jax.device_put(arr, want)

    def fetch(self, key: int) -> list[tuple[tuple, np.ndarray]]:
        """The local shards of stored array ``key`` as (index, data) pairs."""
        arr = self.store[key]
        return [
            (tuple((s.start, s.stop) for s in sh.index), np.asarray(sh.data))
            for sh in arr.addressable_shards
        ]

    def free(self, keys: Sequence[int]) -> None:
        """Drop stored arrays."""
        for k in keys:
            self.store.pop(k, None)
