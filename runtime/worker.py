"""One worker (host): compiles its mesh's programs once and runs its stream every step.

Plain Python with no Ray: the Ray host-actor and the in-process runner both hold one.
State (parameters, optimizer state) stays here between steps in ``store``, keyed by
ids the driver hands out; only small results travel back by value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from meshshard.errors import MeshshardRuntimeError
from meshshard.passes.trace import trace_step
from meshshard.plan import Plan
from meshshard.refs import BufferRef
from meshshard.runtime.interpreter import StreamInterpreter, array_from_host
from meshshard.runtime.programs import build_programs, make_mesh, sharding
from meshshard.runtime.transport import Transport

#: Results up to this many bytes come back to the driver by value (losses, counters).
BY_VALUE_BYTES = 64


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
        )
        if traced.fingerprint != plan.fingerprint:
            raise MeshshardRuntimeError(
                f"worker w{self.worker} traced a different program (fingerprint "
                f"{traced.fingerprint}) than the plan's ({plan.fingerprint}); the workers must "
                "run the same jax/flax versions and the same code as the driver"
            )
        mesh_spec = next(m for m in plan.meshes if self.worker in m.workers)
        self.mesh = make_mesh(self.devices, mesh_spec.shape)
        # interleaved 1F1B: logical meshes that view this same mesh run here too
        views = {
            m.id for m in plan.meshes if (m.hosts, m.shape) == (mesh_spec.hosts, mesh_spec.shape)
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
        self._leaf_slot = {}
        for i in plan.inputs:
            for g, idx in i.slots:
                if g in self._groups:
                    self._leaf_slot.setdefault(g, {})[idx] = i.leaf
        return time.perf_counter() - t0

    # --- run ---------------------------------------------------------------------
    def run_step(
        self,
        batch: dict[int, np.ndarray],
        state: dict[int, object],
        out_keys: dict[tuple[BufferRef, int], int],
        free: Sequence[int] = (),
    ) -> dict[tuple[BufferRef, int], object]:
        """Run one step; returns small outputs by value, keeps the rest under ``out_keys``."""
        if self.interp is None:
            raise MeshshardRuntimeError(f"worker w{self.worker} has no compiled plan")
        m = self.plan.num_micro_batches
        buffers: dict[BufferRef, tuple] = {}
        for name, spec in self._groups.items():
            if name.kind.persistent:
                slots = self._leaf_slot[name]
                buffers[name] = tuple(
                    self._state_array(state[slots[i]], t) for i, t in enumerate(spec.tensors)
                )

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

        buffers = self.interp.run(buffers, load)
        if self.interp.recorder is not None:
            self.last_trace = self.interp.recorder.snapshot(self.worker)
        result = {}
        for (group, idx), key in out_keys.items():
            arr = buffers[group][idx]
            if arr.nbytes <= BY_VALUE_BYTES:
                result[(group, idx)] = np.asarray(jax.device_get(arr.addressable_shards[0].data))
            else:
                self.store[key] = arr
                result[(group, idx)] = StoreKey(key)
        for key in free:
            self.store.pop(key, None)
        return result

    def record(self, on: bool, sync: bool = False) -> None:
        """Record each step's per-instruction timeline (``last_trace``) from now on;
        ``sync``: each RUN waits for its outputs (profiling program times)."""
        if self.interp is None:
            raise MeshshardRuntimeError(f"worker w{self.worker} has no compiled plan")
        self.interp.record(on, sync)
        self.last_trace = None

    def _state_array(self, value, tensor) -> jax.Array:
        if isinstance(value, StoreKey):
            try:
                return self.store[int(value)]
            except KeyError:
                raise MeshshardRuntimeError(
                    f"worker w{self.worker} no longer holds array {int(value)}; it was donated "
                    "to an earlier step or freed. Pass the state the last step returned"
                ) from None
        return array_from_host(
            np.asarray(value, dtype=tensor.dtype), sharding(self.mesh, tensor.spec)
        )

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
