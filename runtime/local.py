"""An in-process backend: every worker is a thread over its own slice of local devices.

Same interpreter, same streams, same programs as on Ray, with an in-memory transport:
fast tests of the whole runtime path without starting processes.  Each worker's mesh
takes ``devices_per_host`` consecutive local devices per host, so this process needs
``num_hosts * devices_per_host`` devices (``--xla_force_host_platform_device_count``).
Meshes spanning several hosts need real processes (the Ray backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.plan import Plan
from meshshard.runtime.executable import CLOSED_STEP, ThreadsStep, run_in_threads
from meshshard.runtime.transport import QueueTransport
from meshshard.runtime.worker import Worker


class LocalBackend:
    """Workers as threads of this process (see module docstring)."""

    workers_share_process = True  # one process's CPU time for every worker

    def __init__(self, devices_per_host: int, stores: dict[int, dict], cluster=None):
        self.devices_per_host = devices_per_host
        self.stores = stores
        self.cluster = cluster
        self.workers: dict[int, Worker] = {}
        self.transports: dict[int, QueueTransport] = {}
        self.layout = ()  # host-actor blocks of the compiled plan (ClusterSpec.worker_blocks)

    @property
    def closed(self) -> bool:
        """True once the cluster this backend ran on was shut down."""
        return bool(getattr(self.cluster, "closed", False))

    def ensure_ready(self, recompile) -> None:
        if self.closed:
            raise MeshshardRuntimeError(CLOSED_STEP)

    def track(self, arrays) -> None:
        pass  # threads never restart: nothing to move

    def compile(self, fn, abstract_args, batch_argnums, plan: Plan) -> dict[int, float]:
        devices = jax.local_devices()
        # a plan whose meshes share hosts runs on the hosts' worker view: worker w takes
        # its block (host, first, devices) of the host's devices, with its own stores
        blocks = plan.cluster.worker_blocks
        self.layout = blocks
        if self.cluster is not None and hasattr(self.cluster, "stores_for"):
            self.stores = self.cluster.stores_for(blocks)
        D = self.devices_per_host

        def first_device(w: int) -> int:
            return blocks[w][0] * D + blocks[w][1] if blocks else w * D

        need = max(first_device(w) + m.shape[1] for m in plan.meshes for w in m.workers)
        if need > len(devices):
            raise MeshshardInputError(
                f"the in-process backend needs {need} local devices "
                f"for this plan but has {len(devices)}; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={need}"
            )
        transports = QueueTransport.group(plan.workers)
        self.transports = transports
        times = {}
        for m in plan.meshes:
            if m.shape[0] != 1:
                raise MeshshardInputError(
                    f"mesh{m.id} spans {m.shape[0]} hosts (shape {m.shape}); the in-process "
                    "backend runs single-host meshes only: give the method a mesh of one "
                    f"host, e.g. mesh_shape=(1, {m.shape[1]}) or stages=[(1, {m.shape[1]}), "
                    "...], or use meshshard.init() (Ray) for multi-host meshes"
                )
            w = m.workers[0]
            start = first_device(w)
            store = self.stores.setdefault(w, {})
            worker = Worker(w, devices[start : start + m.shape[1]], transports[w], store=store)
            times[w] = worker.compile(fn, abstract_args, batch_argnums, plan)
            self.workers[w] = worker
        return times

    def run_step(self, per_worker: dict[int, tuple]) -> dict[int, dict]:
        return self.submit_step(per_worker).result()

    def submit_step(self, per_worker: dict[int, tuple]) -> ThreadsStep:
        """Start a step in the workers' threads without waiting (pipelined 2BW).  A worker
        that fails abandons the step: the others stop waiting for its messages."""
        workers = dict(self.workers)  # a later recompile does not change this step's
        transport = next(iter(self.transports.values()), None)
        if transport is not None:
            transport.reset()  # messages an abandoned step left behind

        def abandon(w: int, exc: BaseException) -> None:
            if transport is not None:
                transport.abandon(f"w{w} failed ({type(exc).__name__})")

        step = ThreadsStep(
            per_worker,
            lambda w: workers[w].run_step(*per_worker[w]),
            abandon,
            cancel=None if transport is None else transport.abandon,
            progress=lambda: sum(workers[w].interp.progress for w in per_worker),
        )
        if hasattr(self.cluster, "inflight"):  # close() waits for it
            self.cluster.inflight.add(step)
        return step

    def runtime_options(self, **opts) -> dict:
        """Set every worker's interpreter options (``overlap=``, ``timeline=``,
        ``recv_ahead=``, ``prefetch=``; none: just read); returns each worker's last
        recorded timeline."""
        for w in self.workers.values():
            w.interp.set_options(**opts)
        return {k: w.interp.last_timeline for k, w in self.workers.items()}

    def set_trace(self, workers, on: bool, sync: bool = False) -> None:
        """Make ``workers`` record (or stop recording) their per-instruction timelines;
        ``sync``: RUNs wait for their outputs (profiling)."""
        for w in workers:
            self.workers[w].record(on, sync)

    @property
    def last_traces(self) -> dict:
        """The last step's WorkerTrace of every recording worker."""
        return {w: wk.last_trace for w, wk in self.workers.items() if wk.last_trace is not None}

    def clock_offsets(self, workers) -> dict[int, tuple[int, int]]:
        """Threads share this process's clock: offset 0, round trip 0."""
        return {w: (0, 0) for w in workers}

    def fetch(self, worker: int, key: int) -> list:
        arr = self.stores[worker][key]
        return [
            (tuple((s.start, s.stop) for s in sh.index), np.asarray(sh.data))
            for sh in arr.addressable_shards
        ]

    def free(self, worker: int, keys: Sequence[int]) -> None:
        store = self.stores.get(worker, {})
        for k in keys:
            store.pop(k, None)

    def release(self) -> None:
        """Drop this plan's compiled workers (the stores keep their arrays)."""
        self.workers.clear()

    # --- checkpoints (runtime.checkpoint_io) ---------------------------------------
    def begin_save(self, per_worker: dict[int, list[tuple[str, dict[str, int]]]]) -> dict:
        """Snapshot stored arrays and start writing them (see ``ShardWriter.begin``)."""
        from meshshard.runtime.checkpoint_io import ShardWriter

        if not hasattr(self, "writer"):
            self.writer = ShardWriter()
        return {
            w: sum(self.writer.begin(self.stores[w], d, arrays) for d, arrays in parts)
            for w, parts in per_worker.items()
        }

    def finish_save(self, per_worker: dict[int, list[str]]) -> None:
        """Wait until every part started by :meth:`begin_save` is on disk."""
        for dirs in per_worker.values():
            for d in dirs:
                self.writer.finish(d)

    def restore_shards(self, per_worker: dict[int, dict]) -> dict[int, int]:
        """Each worker reads its shards of saved arrays into its store, in parallel."""
        from meshshard.runtime.checkpoint_io import read_shards

        def one(w):
            mesh = getattr(self.workers.get(w), "mesh", None)
            return read_shards(self.stores.setdefault(w, {}), mesh, per_worker[w])

        return run_in_threads(per_worker, one)
