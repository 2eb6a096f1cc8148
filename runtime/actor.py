"""The Ray host-actor: one process per host, owning that host's devices.

A thin wrapper: all the work is in :class:`~meshshard.runtime.worker.Worker`.  The
actor sets up the process (emulated device count, ``jax.distributed`` for meshes that
span hosts, the torch.distributed group for cross-mesh transfers) and forwards calls.
"""

from __future__ import annotations

import os
import socket
import time

#: Lines of connection chatter dropped from an actor's output unless MESHSHARD_VERBOSE=1.
CHATTER = (b"[Gloo] Rank ", b"Gloo connected", b"Gloo rank")


def filter_output(drop: tuple[bytes, ...], fds: tuple[int, ...] = (1, 2)) -> None:
    """Route this process's stdout and stderr (the file descriptors C++ libraries write
    to) through threads that drop lines starting with any of ``drop``."""
    for fd in fds:
        _filter_fd(fd, drop)


def _filter_fd(fd: int, drop: tuple[bytes, ...]) -> None:
    import threading

    read_fd, write_fd = os.pipe()
    original = os.dup(fd)
    os.dup2(write_fd, fd)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as src:
            for line in src:
                if not line.lstrip().startswith(drop):
                    os.write(original, line)

    threading.Thread(target=pump, daemon=True, name="meshshard-stderr").start()


class HostActor:
    """Owns one host's devices; wrapped with ``ray.remote`` by the cluster."""

    def __init__(
        self,
        host: int,
        devices_per_host: int,
        platform: str = "cpu",
        verbose: bool = False,
        cpus: tuple[int, ...] | None = None,
    ):
        if not verbose:
            filter_output(CHATTER)
        if platform == "cpu":
            flags = os.environ.get("XLA_FLAGS", "")
            flags = " ".join(
                f for f in flags.split() if "force_host_platform_device_count" not in f
            )
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={devices_per_host}".strip()
            )
            os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo's per-connection chatter
        self.host = host
        self.devices_per_host = devices_per_host
        self.platform = platform
        self.workers: dict[str, object] = {}
        self.store: dict = {}
        self.torch_groups: dict = {}
        self.jax_group: tuple[int, ...] | None = None
        self.writer = None  # checkpoint writes in progress (runtime.checkpoint_io)
        #: the cores to create JAX's backend on at first use (runtime.cpu_shares); None
        #: when none were asked for, or once the backend exists
        self._backend_cpus = cpus if platform == "cpu" else None

    def ping(self) -> int:
        """This actor's process id (tests kill it to simulate a crash)."""
        return os.getpid()

    def identity(self) -> tuple[int, str]:
        """(process id, host name): the driver waits for local actors to exit."""
        return os.getpid(), socket.gethostname()

    def open_step_channel(self, token: bytes) -> tuple[str, int]:
        """Serve ``run_step`` on a new connection from the driver that presents ``token``
        (``runtime.step_channel``); returns the address to connect to."""
        import ray

        from meshshard.runtime.step_channel import ChannelServer

        if getattr(self, "_channel", None) is not None:
            self._channel.close()
        self._channel = ChannelServer(token, self.run_step, ray.util.get_node_ip_address())
        return self._channel.address

    def free_port(self) -> tuple[str, int]:
        """An address other processes can reach this one on, with a port free now."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_jax_distributed(
        self, coordinator: str, num_processes: int, process_id: int, group
    ) -> None:
        """Join the SPMD group of a mesh that spans several hosts (before any JAX use)."""
        import jax

        if self.platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
        self.jax_group = tuple(group)

    def init_transport(
        self, init_method: str, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """(Re)join the torch.distributed group used for cross-mesh transfers."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.torch_groups = {}
        backend = "gloo" if self.platform == "cpu" else "nccl"
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def create_groups(self, keys) -> None:
        """Create broadcast channels; every actor calls this with the same list."""
        from meshshard.runtime.transport import TorchTransport

        self.torch_groups.update(TorchTransport.create_groups(list(keys)))

    def run_transfer(self, plan_json: str, full_or_none, repeat: int = 1):
        """Run a transfer-only plan ``repeat`` times; returns (tiles, seconds per run,
        bytes received in the last run)."""
        from meshshard.plan import Plan
        from meshshard.runtime.transfer_run import run_transfer, source_tiles
        from meshshard.runtime.transport import TorchTransport

        self._start_backend()
        plan = Plan.from_json(plan_json)
        transport = TorchTransport(self.host, self.torch_groups)
        tiles = source_tiles(full_or_none, plan, self.host) if full_or_none is not None else None
        times, out, received = [], None, 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            out, received = run_transfer(plan, self.host, transport, tiles)
            times.append(time.perf_counter() - t0)
        return out, times, received

    def _start_backend(self) -> None:
        """Create JAX's backend on this actor's share of the cores (once; after
        ``init_jax_distributed``, which must come before it)."""
        if self._backend_cpus is not None:
            from meshshard.runtime.cpu_shares import start_backend_on

            start_backend_on(self._backend_cpus)
            self._backend_cpus = None

    def compile(
        self,
        plan_id: str,
        fn,
        abstract_args,
        batch_argnums,
        plan_json: str,
        jax_settings: dict | None = None,
    ) -> float:
        """Trace and build plan ``plan_id``'s programs for this actor's worker, first taking
        the driver's JAX settings (``meshshard.jax_config``: x64, matmul precision, PRNG)."""
        import jax

        from meshshard.jax_config import take_trace_settings
        from meshshard.plan import Plan
        from meshshard.runtime.transport import TorchTransport
        from meshshard.runtime.worker import Worker

        if jax_settings:
            take_trace_settings(jax_settings)
        self._start_backend()

        plan = Plan.from_json(plan_json)
        mesh = next(m for m in plan.meshes if self.host in m.workers)
        h, d = mesh.shape
        if h > 1:
            devs = sorted(jax.devices(), key=lambda x: (x.process_index, x.id))
            per = len(devs) // h
            devices = [devs[i * per + j] for i in range(h) for j in range(d)]
        else:
            devices = jax.local_devices()[:d]
        # the transport's data path is fixed here, at compile time: NCCL with host
        # arrays raises now instead of hanging at the first message
        transport = TorchTransport(self.host, self.torch_groups, devices=devices)
        worker = Worker(self.host, devices, transport, store=self.store)
        seconds = worker.compile(fn, abstract_args, batch_argnums, plan)
        self.workers[plan_id] = worker
        return seconds

    def run_step(self, plan_id: str, batch, state, base, free, seq=None, after=None):
        """Run one step: (by-value results, seconds, the step's WorkerTrace or None);
        arguments as in ``Worker.run_step`` (``runtime.step_wire`` says their order)."""
        t0 = time.perf_counter()
        worker = self.workers[plan_id]
        result = worker.run_step(batch, state, base, free, seq, after)
        return result, time.perf_counter() - t0, worker.last_trace

    def set_trace(self, plan_id: str, on: bool, sync: bool = False) -> None:
        """Record (or stop recording) a compiled step's per-instruction timeline."""
        self.workers[plan_id].record(on, sync)

    def clock(self) -> int:
        """This process's ``perf_counter_ns`` (the driver aligns trace clocks with it)."""
        return time.perf_counter_ns()

    def fetch(self, key: int) -> list[tuple[tuple, object]]:
        """The local shards of stored array ``key`` as (index, data) pairs."""
        import numpy as np

        from meshshard.errors import MeshshardRuntimeError

        arr = self.store.get(key)
        if arr is None:
            raise MeshshardRuntimeError(
                f"host-actor w{self.host} holds no array {key} (freed, or the actor restarted)"
            )
        return [
            (tuple((s.start, s.stop) for s in sh.index), np.asarray(sh.data))
            for sh in arr.addressable_shards
        ]

    def runtime_options(self, plan_id: str, opts: dict):
        """Set a compiled step's interpreter options (``overlap``, ``timeline``,
        ``recv_ahead``, ``prefetch``); returns its last step's
        :class:`~meshshard.runtime.overlap.Timeline` (None if unrecorded)."""
        interp = self.workers[plan_id].interp
        interp.set_options(**opts)
        return interp.last_timeline

    def release(self, plan_id: str) -> None:
        """Drop a step's compiled programs (its arrays stay in the store)."""
        self.workers.pop(plan_id, None)

    def stats(self) -> dict:
        """What this host holds: stored arrays, live device buffers, compiled steps, RSS."""
        import jax
        import psutil

        self._start_backend()
        return {
            "store": len(self.store),
            "live_buffers": sum(len(a.addressable_shards) for a in jax.live_arrays()),
            "compiled": len(self.workers),
            "rss": psutil.Process().memory_info().rss,
        }

    def free(self, keys) -> None:
        for k in keys:
            self.store.pop(k, None)

    # --- checkpoints (runtime.checkpoint_io) ---------------------------------------
    def begin_save(self, parts: list[tuple[str, dict[str, int]]]) -> int:
        """Snapshot stored arrays and start writing each part; returns bytes to write."""
        from meshshard.runtime.checkpoint_io import ShardWriter

        if self.writer is None:
            self.writer = ShardWriter()
        return sum(self.writer.begin(self.store, d, arrays) for d, arrays in parts)

    def finish_save(self, directories: list[str]) -> None:
        """Wait until the parts started by :meth:`begin_save` are on disk."""
        for d in directories:
            self.writer.finish(d)

    def restore_shards(self, plan_id: str, requests) -> int:
        """Read this host's shards of saved arrays into the store (see ``read_shards``)."""
        from meshshard.runtime.checkpoint_io import read_shards

        worker = self.workers.get(plan_id)
        return read_shards(self.store, getattr(worker, "mesh", None), requests)
