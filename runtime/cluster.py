"""Start, join and stop the cluster of host-actors; the backend that runs plans on it.

``meshshard.init()`` makes one :class:`RayCluster` (or, with ``backend="threads"``, a
:class:`ThreadsCluster` in this process) current; ``parallelize``d steps run there.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Sequence

from meshshard.cluster import LOCAL_MESH_COLLECTIVES, ClusterSpec
from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.long_work import LongWork, phase
from meshshard.plan import Plan
from meshshard.runtime import cpu_shares
from meshshard.runtime.executable import CLOSED_STEP
from meshshard.runtime.faults import GRACE_S, Failure, WorkerFault, gather
from meshshard.runtime.live_arrays import LiveArrays
from meshshard.runtime.step_threads import STEP_THREADS

log = logging.getLogger(__name__)

_CURRENT = None

#: Seconds a blocked receive waits before the transfer is declared lost.
TRANSFER_TIMEOUT_S = 300.0
#: How long closing an in-process cluster waits for a step still running that makes no
#: progress (seconds): a step that gets on is waited for (on a loaded machine the last
#: pipelined GPT step of a script took 110 s to end, and threads left inside XLA at
#: exit abort the process); a stalled one is given up after this long.
CLOSE_WAIT_S = 30.0
#: Then, how long it waits for the threads of a step it gave up on to end (seconds).
CANCEL_WAIT_S = 2.0
#: How often closing looks at the progress of the steps it waits for (seconds).
CLOSE_POLL_S = 0.2


def current_cluster():
    """The running cluster, or None."""
    return _CURRENT


def require_cluster():
    """The running cluster; a clear error if there is none."""
    if _CURRENT is None:
        raise MeshshardRuntimeError(
            "no meshshard cluster is running: call meshshard.init() first (or use "
            ".lower(*args, cluster=ClusterSpec(...)) to inspect a plan without one)"
        )
    return _CURRENT


def init(
    address: str | None = None,
    *,
    num_hosts: int | None = None,
    devices_per_host: int | None = None,
    backend: str | None = None,
    name: str | None = None,
):
    """Start (or join) the cluster that parallelized steps run on.

    With no arguments: an embedded local Ray instance with 4 host-actors of 2
    emulated CPU devices each.  ``address=...`` joins an existing Ray cluster and
    uses one host-actor per node (its GPUs, or ``devices_per_host`` CPU devices).
    ``backend="threads"`` (default ``"ray"``) runs the workers as threads of this process instead (fast
    tests; this process must have ``num_hosts * devices_per_host`` devices).

    While a cluster is running, ``init()`` with no arguments, or with arguments it
    already matches, returns that cluster (steps and arrays stay valid); asking for a
    different one raises: call ``meshshard.shutdown()`` first.
    """
    global _CURRENT
    _configure_logging()
    if _CURRENT is not None:
        return _reuse(_CURRENT, address, num_hosts, devices_per_host, backend, name)
    if backend == "threads":
        _CURRENT = ThreadsCluster(num_hosts or 4, devices_per_host or 2)
    elif backend in (None, "ray"):
        with LongWork("starting the Ray cluster"):
            _CURRENT = RayCluster(address, num_hosts, devices_per_host, name)
    else:
        raise MeshshardInputError(f"init(backend={backend!r}): use 'ray' or 'threads'")
    # shut down before the interpreter does (and before Ray's own exit hook, registered
    # earlier): worker threads still inside XLA at interpreter exit abort the process.
    # The helper threads' hook goes first, so it runs after the shutdown waited for
    # the steps in flight (they need their comm threads to finish)
    from meshshard.runtime.overlap import hook_exit

    hook_exit()
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    log.info("meshshard cluster %s started", _CURRENT.spec.name)
    return _CURRENT


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as exc:  # exiting anyway
        log.debug("meshshard: shutdown at exit: %s", exc)


def _reuse(cluster, address, num_hosts, devices_per_host, backend, name):
    kind = "threads" if isinstance(cluster, ThreadsCluster) else "ray"
    spec = cluster.spec
    asked = {
        "backend": (backend, kind),
        "num_hosts": (num_hosts, spec.num_hosts),
        "devices_per_host": (devices_per_host, spec.devices_per_host),
        "name": (name, spec.name),
        "address": (address, getattr(cluster, "address", None)),
    }
    differ = [
        f"{k}={want!r} (running: {have!r})"
        for k, (want, have) in asked.items()
        if want is not None and want != have
    ]
    if differ:
        raise MeshshardRuntimeError(
            f"init({', '.join(differ)}): a different meshshard cluster ({spec.name}) is "
            "running; call meshshard.shutdown() first (its steps and arrays end with it), or "
            "call init() without arguments to keep using it"
        )
    log.info("meshshard.init(): reusing the running cluster %s", spec.name)
    return cluster


def shutdown() -> None:
    """Stop the current cluster's actors (and the embedded Ray instance, if we started it).

    Steps compiled on it and arrays kept on it end with it: using them afterwards raises
    an error that says so.  Returns once the host-actor processes have exited."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


def recover() -> None:
    """Bring the running cluster back after a host-actor died or a step failed.

    Restarts the dead host-actors and the ones left blocked on them (after copying the
    arrays they hold to the driver), rebuilds the transfer group, and keeps every array
    that a surviving host still held.  Steps recompile on their next call, which also
    calls this by itself if needed."""
    require_cluster().recover()


def _configure_logging() -> None:
    """With ``MESHSHARD_VERBOSE=1``, show meshshard's progress (INFO) on stderr."""
    import logging

    root = logging.getLogger("meshshard")
    if verbose() and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def verbose() -> bool:
    """True if ``MESHSHARD_VERBOSE=1``: let Ray's, Gloo's and meshshard's chatter through."""
    return os.environ.get("MESHSHARD_VERBOSE", "") not in ("", "0")


#: Threads clusters made and not closed yet (weak: a dropped one is not kept alive).
_OPEN_THREADS: weakref.WeakSet = weakref.WeakSet()
_THREADS_LOCK = threading.Lock()
_threads_hooked = False


def _close_open_threads_clusters() -> None:
    """Close every threads cluster still open at interpreter exit (one made with
    ``ThreadsCluster(...)`` and used through :func:`use_cluster`, never closed): its
    steps still running would be inside XLA while the interpreter finalizes, which
    aborts the process (exit code 134, ``terminate called after throwing ...``)."""
    for cluster in list(_OPEN_THREADS):
        try:
            cluster.close()
        except Exception as exc:  # exiting anyway
            log.debug("meshshard: closing %s at exit: %s", cluster.spec.name, exc)


def _close_at_exit(cluster) -> None:
    """Have :func:`_close_open_threads_clusters` close ``cluster`` at exit unless it was
    closed before.  Its hook is registered after the helper threads' (and so after JAX's):
    it runs before them, and waits for the steps in flight while they still have their
    comm threads (see :func:`meshshard.runtime.overlap.hook_exit`)."""
    global _threads_hooked
    from meshshard.runtime.overlap import hook_exit

    hook_exit()
    with _THREADS_LOCK:
        _OPEN_THREADS.add(cluster)
        if not _threads_hooked:
            atexit.register(_close_open_threads_clusters)
            _threads_hooked = True


class ThreadsCluster:
    """Workers as threads in this process (see ``runtime.local``).  Closed at interpreter
    exit if it is still open (:meth:`close` is idempotent)."""

    def __init__(self, num_hosts: int, devices_per_host: int):
        self.spec = ClusterSpec(
            f"threads-{num_hosts}x{devices_per_host}",
            num_hosts,
            devices_per_host,
            max_mesh_hosts=1,  # one process: the in-process backend's meshes are one host's
            host_cores=os.cpu_count() or 1,  # every worker shares this machine's cores
            **LOCAL_MESH_COLLECTIVES,
        )
        self.stores: dict[int, dict] = {}  # per host: arrays kept between steps, across plans
        #: the same per worker view (ClusterSpec.worker_blocks; () = whole hosts)
        self._view_stores: dict[tuple, dict[int, dict]] = {(): self.stores}
        self.closed = False
        #: steps started and maybe still running (pipelined 2BW steps return early)
        self.inflight: weakref.WeakSet = weakref.WeakSet()
        _close_at_exit(self)

    def stores_for(self, blocks: tuple) -> dict[int, dict]:
        """The per-worker stores of plans whose meshes share hosts as host-actor
        ``blocks`` (``self.stores`` for whole hosts, ``()``): a worker id means a
        different device block in each view, so each view keeps its own arrays."""
        return self._view_stores.setdefault(blocks, {})

    def backend(self):
        from meshshard.runtime.local import LocalBackend

        return LocalBackend(self.spec.devices_per_host, self.stores, cluster=self)

    def recover(self) -> None:
        """Nothing to do: threads share this process and cannot die alone."""

    def host_stats(self) -> dict[int, dict]:
        """Per host: stored arrays and live device buffers on its devices (for leak tests)."""
        import jax

        d = self.spec.devices_per_host
        counts = [0] * self.spec.num_hosts
        for a in jax.live_arrays():
            for sh in a.addressable_shards:
                if sh.device.id // d < self.spec.num_hosts:
                    counts[sh.device.id // d] += 1
        return {
            h: {"store": len(self.stores.get(h, {})), "live_buffers": counts[h]}
            for h in range(self.spec.num_hosts)
        }

    def close(self) -> None:
        """Wait for the steps still running in worker threads (a pipelined 2BW step
        returns before it ends: threads left inside XLA at interpreter exit abort the
        process) as long as they make progress, give up on them once they made none for
        :data:`CLOSE_WAIT_S` (their waiting receives fail at once; at most
        :data:`CANCEL_WAIT_S` more for their threads to end), then drop every kept
        array.  Runs at interpreter exit for a cluster not closed before; a second call
        does nothing."""
        _OPEN_THREADS.discard(self)
        if self.closed:
            return
        self.closed = True
        steps = list(self.inflight)
        _wait_while_progressing(steps, CLOSE_WAIT_S)
        stuck = [step for step in steps if step.running]
        why = f"the cluster was shut down and this step made no progress for {CLOSE_WAIT_S:.0f}s"
        for step in stuck:
            step.cancel(why)
        if stuck:
            log.warning(
                "meshshard: %d step(s) made no progress for %.0fs after the shutdown "
                "began; abandoned",
                len(stuck),
                CLOSE_WAIT_S,
            )
            end = time.monotonic() + CANCEL_WAIT_S
            for step in stuck:
                step.join(timeout=max(0.0, end - time.monotonic()))
        for stores in self._view_stores.values():
            for store in stores.values():
                store.clear()
        STEP_THREADS.close_idle()  # no step thread outlives the cluster


def _wait_while_progressing(steps: list, idle_s: float) -> None:
    """Wait until every one of ``steps`` (ThreadsSteps) ended, or until none of those
    still running made progress for ``idle_s`` seconds."""
    seen, since = None, time.monotonic()
    while True:
        running = [step for step in steps if step.running]
        if not running:
            return
        now = time.monotonic()
        marks = (len(running), sum(step.progress() for step in running))
        if marks != seen:
            seen, since = marks, now
        elif now - since >= idle_s:
            return
        running[0].join(timeout=min(CLOSE_POLL_S, max(0.0, since + idle_s - now)))


class RayCluster:
    """Host-actors on Ray, one per host; owns the embedded Ray instance if it started it.

    Keeps what the driver knows about each actor: its JAX process group (``fresh``,
    ``local``, or the hosts of the multi-host mesh it joined), whether it died or is
    blocked after a failed call, and every live :class:`RemoteArray` kept on it, so a
    restart moves those arrays instead of losing them.
    """

    def __init__(self, address, num_hosts, devices_per_host, name):
        import ray

        self._started_ray = False
        self.address = address
        if not ray.is_initialized():
            phase("starting Ray" if address is None else f"joining Ray at {address}")
            _ray_init(address)
            self._started_ray = address is None
        if address is not None:
            num_hosts, devices_per_host, self.platform, self._nodes = discover_hosts(
                ray.nodes(), num_hosts, devices_per_host
            )
        else:
            self.platform, self._nodes = "cpu", None
            num_hosts, devices_per_host = num_hosts or 4, devices_per_host or 2
        local = LOCAL_MESH_COLLECTIVES if self.platform == "cpu" else {}
        if self._nodes is None:  # every host-actor on this machine: they share its cores
            local = {**local, "host_cores": os.cpu_count() or 1}
        self.spec = ClusterSpec(
            name or f"ray-{num_hosts}x{devices_per_host}", num_hosts, devices_per_host, **local
        )
        self._actors: list = [None] * num_hosts
        self.pids: list[int | None] = [None] * num_hosts
        self._groups: list = ["fresh"] * num_hosts
        self._transport_ready = False
        self._groups_made: set = set()
        self._cleanups: list = []  # refs of free/release calls in flight
        self.generation = 0  # bumped when actors restart or the transfer group is rebuilt
        self.dead: set[int] = set()  # hosts whose actor process is gone
        self.blocked: set[int] = set()  # hosts left inside a failed call
        self.closed = False
        self.arrays = LiveArrays()  # live RemoteArrays kept here
        #: the actors' layout now: () = one per host; a plan whose meshes share hosts
        #: runs on ClusterSpec.split(blocks), one actor per (host, first, devices) block
        self.blocks: tuple = ()
        #: step calls over direct connections (runtime.step_channel); off: Ray calls
        self.use_step_channel = os.environ.get("MESHSHARD_STEP_CHANNEL", "1") != "0"
        self._channels: dict = {}  # host -> StepChannel, for this generation
        self._channel_generation = -1
        self.channel_lock = threading.Lock()  # one step on the channels at a time
        phase(f"starting {num_hosts} host-actors")
        self._start(range(num_hosts))

    # --- actors ------------------------------------------------------------------
    def _start(self, hosts) -> None:
        """Start actors for ``hosts`` and wait until each answers (records its pid)."""
        import ray

        from meshshard.runtime.actor import HostActor

        hosts = list(hosts)
        shares = self._core_shares()
        for h in hosts:
            host, _, devices = self.blocks[h] if self.blocks else (h, 0, self.spec.devices_per_host)
            opts = dict(num_cpus=0, max_concurrency=4)
            if self.platform == "gpu":
                opts["num_gpus"] = devices
            if self._nodes is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    self._nodes[host], soft=False
                )
            self._actors[h] = (
                ray.remote(HostActor)
                .options(**opts)
                .remote(h, devices, self.platform, verbose(), shares[h] if shares else None)
            )
            self._groups[h] = "fresh"
        self._transport_ready = False
        ids = self._call({h: self._actors[h].identity.remote() for h in hosts}, "starting actors")
        here = socket.gethostname()
        for h, (pid, node) in ids.items():
            self.pids[h] = pid if node == here else None  # only local processes are awaited

    def _core_shares(self) -> list[tuple[int, ...]] | None:
        """Each actor's cores for XLA's threads when all of them share this machine's
        CPU (``runtime.cpu_shares``); None on a real cluster, on GPUs, or when off."""
        local_cpu = self._nodes is None and self.platform == "cpu"
        if not (local_cpu and cpu_shares.enabled() and hasattr(os, "sched_getaffinity")):
            return None
        devices = [b[2] for b in self.blocks] or [self.spec.devices_per_host] * len(self._actors)
        return cpu_shares.core_shares(devices, os.sched_getaffinity(0))

    def _restart(self, hosts, reason: str) -> None:
        """Move live arrays off ``hosts`` (and the peers of their JAX groups), then
        restart those actors."""
        import ray

        hosts = self._with_group_peers(hosts)
        moved, lost = 0, 0
        for a in list(self.arrays):
            if a.evacuate(hosts, self.dead):
                moved += a.nbytes
            lost += bool(a._lost)
        log.warning(
            "restarting host-actors %s (%s); copied %.1f KiB of live arrays to the driver%s",
            ", ".join(f"w{h}" for h in hosts),
            reason,
            moved / 2**10,
            f"; {lost} arrays were only on dead hosts and are lost" if lost else "",
        )
        self.generation += 1
        for h in hosts:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self._actors[h], no_restart=True)
        _wait_exit([self.pids[h] for h in hosts])
        self.dead -= set(hosts)
        self.blocked -= set(hosts)
        self._start(hosts)

    def _relayout(self, blocks: tuple) -> None:
        """Run the hosts as one host-actor per ``(host, first device, devices)`` block, or
        back as one per host (``()``): every actor restarts (its live arrays copied to
        the driver first), so steps compiled for the other layout recompile on their
        next call.  Plans whose meshes share hosts need this (``ClusterSpec.split``)."""
        import ray

        everyone = [h for h, a in enumerate(self._actors) if a is not None]
        moved = sum(a.nbytes for a in list(self.arrays) if a.evacuate(everyone, self.dead))
        n = len(blocks) or self.spec.num_hosts
        log.warning(
            "restarting the %d host-actors as %d (%s); copied %.1f KiB of live arrays to "
            "the driver",
            len(everyone),
            n,
            "one per mesh block: a plan's meshes share hosts" if blocks else "one per host",
            moved / 2**10,
        )
        self.generation += 1
        for h in everyone:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self._actors[h], no_restart=True)
        _wait_exit([self.pids[h] for h in everyone])
        self.blocks = blocks
        self._actors, self.pids, self._groups = [None] * n, [None] * n, ["fresh"] * n
        self.dead, self.blocked = set(), set()
        self._transport_ready = False
        self._start(range(n))

    def _with_group_peers(self, hosts) -> list[int]:
        """``hosts`` plus every member of a multi-host JAX group one of them is in: a
        process joins one such group for life, and its peers cannot continue without it."""
        out = set(hosts)
        for h in list(out):
            if isinstance(self._groups[h], tuple):
                out.update(self._groups[h])
        return sorted(out)

    @property
    def broken(self) -> bool:
        """True if some actor died or was left blocked: :meth:`recover` is needed."""
        return bool(self.dead or self.blocked)

    def recover(self) -> None:
        """Restart dead and blocked actors (moving the arrays of the living ones to the
        driver first) and rebuild the transfer group; see ``meshshard.recover``."""
        if self.closed:
            raise MeshshardRuntimeError(CLOSED_STEP)
        t0 = time.perf_counter()
        try:  # find deaths nobody has seen yet
            self._call({h: a.ping.remote() for h, a in enumerate(self._actors)}, "ping", 10.0)
        except WorkerFault:
            pass  # noted by _call
        if self.broken:
            self._restart(sorted(self.dead | self.blocked), "recovering from a failure")
        self.prepare_transport()
        log.warning("meshshard cluster recovered in %.1fs", time.perf_counter() - t0)

    def _call(self, refs: dict, what: str, timeout_s: float | None = None) -> dict:
        """Results of one call on several actors; on failure note dead/blocked actors and
        raise a :class:`WorkerFault` that says what survives and how to recover."""
        try:
            return gather(refs, what, timeout_s=timeout_s)
        except WorkerFault as fault:
            raise self._noted(fault) from None

    def _noted(self, fault: WorkerFault) -> WorkerFault:
        """Note a failed call's dead and blocked actors; the fault with recovery advice."""
        f = fault.failure
        self.dead.update(h for h, _ in f.dead)
        self.blocked.update(f.blocked)
        self._transport_ready = False  # messages of the failed call may be in flight
        return fault.with_advice(self._advice())

    def _advice(self) -> str:
        if not self.broken:
            return (
                "The host-actors are alive; the next call rebuilds the transfer group and "
                "recompiles the step."
            )
        alive = [f"w{h}" for h in range(len(self._actors)) if h not in self.dead]
        dead = ", ".join(f"w{h}" for h in sorted(self.dead)) or "none"
        return (
            f"Arrays kept on the surviving host-actors ({', '.join(alive) or 'none'}) are "
            f"still fetchable (np.asarray(x), meshshard.fetch(tree)); arrays kept only on "
            f"dead ones ({dead}) are lost. Call meshshard.recover() to restart the dead and "
            f"blocked actors ({', '.join(f'w{h}' for h in sorted(self.dead | self.blocked))})"
            " and keep the surviving arrays; the next call of a parallelized step also "
            "recovers first."
        )

    def prepare(self, plan: Plan) -> None:
        """Make every actor's process layout match ``plan`` (restarting actors if needed)."""
        blocks = plan.cluster.worker_blocks
        if blocks != self.blocks:
            try:
                self.spec.split(blocks) if blocks else None
            except ValueError as exc:
                raise MeshshardInputError(
                    f"the plan's host-actor blocks do not fit this cluster ({exc}); compile "
                    "the step for this cluster"
                ) from None
            self._relayout(blocks)
        need: dict[int, object] = {}
        for m in plan.meshes:
            for h in m.hosts:
                need[h] = tuple(m.hosts) if len(m.hosts) > 1 else "local"
        conflict = [h for h, g in need.items() if self._groups[h] not in ("fresh", g)]
        if conflict:
            self._restart(conflict, "a plan groups them differently")
        self.prepare_transport()
        for m in plan.meshes:
            if len(m.hosts) > 1 and self._groups[m.hosts[0]] == "fresh":
                addr = self._call({0: self._actors[m.hosts[0]].free_port.remote()}, "free_port")
                host, port = addr[0]
                coord = f"{host}:{port}"
                self._call(
                    {
                        h: self._actors[h].init_jax_distributed.remote(
                            coord, len(m.hosts), i, m.hosts
                        )
                        for i, h in enumerate(m.hosts)
                    },
                    f"joining mesh{m.id}'s JAX group",
                )
        for h, g in need.items():
            self._groups[h] = g

    def prepare_transport(self) -> None:
        """(Re)build the torch.distributed group over all actors if it is stale."""
        if self._transport_ready:
            return
        host, port = self._call({0: self._actors[0].free_port.remote()}, "free_port")[0]
        addr = f"tcp://{host}:{port}"
        n = len(self._actors)
        self._call(
            {
                r: a.init_transport.remote(addr, n, r, TRANSFER_TIMEOUT_S)
                for r, a in enumerate(self._actors)
            },
            "building the transfer group",
        )
        self._transport_ready = True
        self._groups_made = set()
        self.generation += 1

    def ensure_groups(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        """Create the broadcast channels not made yet, on every actor in the same order."""
        new = [k for k in keys if k not in self._groups_made]
        if new:
            self._call(
                {h: a.create_groups.remote(new) for h, a in enumerate(self._actors)},
                "creating broadcast groups",
            )
            self._groups_made.update(new)

    def run_transfer(self, plan: Plan, full, repeat: int = 1):
        """Run a transfer-only plan on the actors; returns (destination tiles per worker,
        per-run seconds of the slowest worker, bytes received per worker)."""
        import ray

        from meshshard.runtime.interpreter import broadcast_groups

        self.prepare_transport()  # transfer-only runs use no JAX: any actor layout will do
        self.ensure_groups(broadcast_groups(plan))
        t = plan.transfers[0]
        src = set(plan.meshes[t.src_mesh].workers)
        full_ref = ray.put(full)
        plan_json = plan.to_json()
        out = self._call(
            {
                s.worker: self._actors[s.worker].run_transfer.remote(
                    plan_json, full_ref if s.worker in src else None, repeat
                )
                for s in plan.streams
            },
            "transfer",
        )
        tiles = {w: r[0] for w, r in out.items() if r[0] is not None}
        per_run = [max(r[1][i] for r in out.values()) for i in range(repeat)]
        return tiles, per_run, {w: r[2] for w, r in out.items()}

    def backend(self):
        return RayBackend(self)

    # --- step channels (runtime.step_channel) --------------------------------------
    def step_channels(self, hosts) -> dict | None:
        """Open connections to ``hosts`` for step calls (reused until the actors restart
        or a call fails); None when switched off."""
        if not self.use_step_channel or self.closed:
            return None
        if self._channel_generation != self.generation:
            self.close_channels()
            self._channel_generation = self.generation
        missing = [h for h in hosts if h not in self._channels]
        if missing:
            import secrets

            from meshshard.runtime.step_channel import StepChannel

            token = secrets.token_bytes(16)
            refs = {h: self._actors[h].open_step_channel.remote(token) for h in missing}
            for h, address in self._call(refs, "opening step connections").items():
                try:
                    self._channels[h] = StepChannel(address, token)
                except OSError as exc:  # e.g. a firewall between the nodes
                    log.warning(
                        "cannot connect to host-actor w%d at %s:%d (%s); step calls go "
                        "through Ray from now on",
                        h,
                        *address,
                        exc,
                    )
                    self.use_step_channel = False
                    self.close_channels()
                    return None
        return {h: self._channels[h] for h in hosts}

    def close_channels(self) -> None:
        """Close every step connection (the actors wait for new ones)."""
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            ch.close()

    def channel_call(self, channels: dict, what: str) -> dict:
        """Results of the step calls just sent on ``channels``; a failure is noted and
        raised like :meth:`_call`'s, and the connections are dropped (a blocked actor
        would answer a later call with this one's result)."""
        from meshshard.runtime.step_channel import gather_channels

        try:
            return gather_channels(channels, what, self.deaths)
        except WorkerFault as fault:
            raise self._channel_fault(fault) from None
        except BaseException:  # interrupted: replies still due would confuse a later call
            self.close_channels()
            raise

    def channel_send_failed(self, host: int, sent: list[int], what: str) -> WorkerFault:
        """The fault when a step could not be sent to ``host``: dead if Ray says so; the
        hosts in ``sent`` already run the step and will wait for it: blocked."""
        from meshshard.runtime.step_channel import CLOSED_VERDICT_S

        cause = self.deaths([host], CLOSED_VERDICT_S).get(host)
        dead = ((host, cause),) if cause else ()
        failed = () if cause else ((host, "its step connection closed"),)
        return self._channel_fault(WorkerFault(Failure(what, dead, failed, tuple(sent), 0.0)))

    def _channel_fault(self, fault: WorkerFault) -> WorkerFault:
        self.close_channels()
        return self._noted(fault)

    def deaths(self, hosts, timeout_s: float = GRACE_S) -> dict[int, str]:
        """Which of ``hosts`` Ray reports gone, with the cause: a ping each, answered at
        once by a live actor, failed by Ray once it has noticed a dead one (a second or
        so after the process exits) or still pending after ``timeout_s``."""
        import ray

        from meshshard.runtime.faults import death_cause, is_actor_death

        refs = {h: self._actors[h].ping.remote() for h in hosts}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for h, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:
                if is_actor_death(exc):
                    out[h] = death_cause(exc)
        return out

    def note_cleanup(self, ref) -> None:
        """Remember a fire-and-forget free/release call (``host_stats`` waits for them)."""
        self._cleanups.append(ref)
        if len(self._cleanups) > 256:  # forget the finished ones
            import ray

            done, rest = ray.wait(self._cleanups, num_returns=len(self._cleanups), timeout=0)
            self._cleanups = rest

    def host_stats(self) -> dict[int, dict]:
        """Per host-actor: stored arrays, live device buffers, compiled steps and RSS,
        after every free and release issued so far has been done."""
        import ray

        pending, self._cleanups = self._cleanups, []
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=30)
        refs = {h: a.stats.remote() for h, a in enumerate(self._actors) if h not in self.dead}
        return dict(sorted(self._call(refs, "host stats").items()))

    def close(self) -> None:
        """Kill the actors, wait for their processes to exit, stop Ray if we started it."""
        import ray

        self.closed = True
        self.close_channels()
        for a in self._actors:
            if a is not None:
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(a, no_restart=True)
        self._actors = []
        helpers = _ray_helpers() if self._started_ray else []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        _wait_exit(self.pids)
        _reap(helpers)


def _ray_init(address) -> None:
    """``ray.init`` with the actors' import path; Ray's notices and the actors' output
    reach this terminal only with ``MESHSHARD_VERBOSE=1``.

    The actors import meshshard from this process's ``sys.path``.  An embedded instance
    (``address=None``) gets it as ``PYTHONPATH`` in the environment its daemons start
    with, which the workers they spawn inherit; a joined cluster's workers get it in a
    ``runtime_env``.  A runtime_env makes Ray start every worker through
    ``setup_worker.py``, a second Python that imports Ray only to exec the worker (about
    a second of CPU per host-actor start and restart), and leaves unused the idle
    workers it prestarted without one."""
    import ray

    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    kwargs = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
    if address is None:
        kwargs["num_cpus"] = max(os.cpu_count() or 1, 1)
    else:
        kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
    quiet = logging.getLogger("ray._private.authentication")
    level = quiet.level
    if not verbose():
        quiet.setLevel(logging.ERROR)  # "Token authentication is enabled ..." notices
    try:
        with warnings.catch_warnings(), _environ(PYTHONPATH=path if address is None else None):
            if not verbose():  # Ray starts its processes with fork+exec: harmless here
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            # address=None: always our own embedded instance, never another process's
            # local Ray (which ray.init() would otherwise join, e.g. a test session's)
            ray.init(address=address or "local", **kwargs)
    finally:
        quiet.setLevel(level)


@contextlib.contextmanager
def _environ(**values):
    """Set the environment variables in ``values`` that are not ``None`` for the block,
    then put back what was there."""
    before = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_exit(pids, timeout_s: float = 10.0) -> None:
    """Wait until the local processes ``pids`` have exited (Ray kills asynchronously)."""
    import psutil

    procs = []
    for pid in pids:
        if pid is None:
            continue
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    if alive:
        log.warning("host-actor processes %s still running after %ss", alive, timeout_s)


def _ray_helpers() -> list:
    """The embedded Ray instance's processes among this process's descendants (its
    GCS, raylet, agents and workers), not any other child the user started."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.cmdline())
            if p.name().startswith("ray::") or f"{os.sep}ray{os.sep}" in cmd:
                out.append(p)
    return out


def _reap(procs, timeout_s: float = 3.0) -> None:
    """Let the embedded Ray's processes exit after ``ray.shutdown()``; stop the ones
    still running after ``timeout_s`` (a runtime-env agent slow to notice, on a loaded
    machine), so no process of ours outlives ``shutdown()``."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=1.0)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if alive:
        psutil.wait_procs(alive, timeout=1.0)
        log.warning("stopped Ray processes that outlived ray.shutdown(): %s", alive)


def discover_hosts(nodes: list[dict], num_hosts: int | None, devices_per_host: int | None):
    """(hosts, devices per host, platform, node ids) for a running Ray cluster.

    One host per alive node.  If every node has GPUs the platform is ``gpu`` and a host's
    devices are its GPUs (the smallest count unless given); otherwise ``cpu`` with
    ``devices_per_host`` emulated devices (default 2).
    """
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise MeshshardRuntimeError("the Ray cluster reports no alive nodes")
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    platform = "gpu" if all(g > 0 for g in gpus) else "cpu"
    if platform == "gpu":
        devices_per_host = devices_per_host or min(gpus)
    hosts = num_hosts or len(alive)
    if hosts > len(alive):
        raise MeshshardInputError(
            f"init(num_hosts={hosts}) but the Ray cluster has {len(alive)} alive nodes; "
            "ask for at most that many hosts"
        )
    return hosts, devices_per_host or 2, platform, [n["NodeID"] for n in alive][:hosts]


class RayBackend:
    """Runs a plan's workers on the cluster's host-actors."""

    def __init__(self, cluster: RayCluster):
        self.cluster = cluster
        self.plan_id = uuid.uuid4().hex[:8]
        self.worker_seconds: dict[int, float] = {}
        self.last_traces: dict = {}  # the last step's WorkerTrace per recording worker
        self.generation = -1  # the cluster generation this plan was compiled in
        self.layout = ()  # host-actor blocks of the compiled plan (ClusterSpec.worker_blocks)

    @property
    def closed(self) -> bool:
        """True once the cluster this backend ran on was shut down."""
        return self.cluster.closed

    def _actor(self, w: int):
        if self.cluster.closed:
            raise MeshshardRuntimeError(CLOSED_STEP)
        return self.cluster._actors[w]

    def compile(self, fn, abstract_args, batch_argnums, plan: Plan) -> dict[int, float]:
        from meshshard.jax_config import trace_settings
        from meshshard.runtime.interpreter import broadcast_groups

        self.ensure_ready(lambda: None)
        self.cluster.prepare(plan)
        self.layout = plan.cluster.worker_blocks  # the worker view its arrays are kept in
        self.cluster.ensure_groups(broadcast_groups(plan))
        plan_json = plan.to_json()
        settings = trace_settings()  # the actors trace and lower as this process does
        refs = {
            w: self._actor(w).compile.remote(
                self.plan_id, fn, abstract_args, batch_argnums, plan_json, settings
            )
            for w in plan.workers
        }
        times = self.cluster._call(refs, f"compiling plan {self.plan_id}")
        self.workers = tuple(plan.workers)
        self.generation = self.cluster.generation
        return times

    def ensure_ready(self, recompile) -> None:
        if self.cluster.closed:
            raise MeshshardRuntimeError(CLOSED_STEP)
        if self.cluster.broken:
            log.warning("a host-actor failed earlier: recovering the cluster before this call")
            self.cluster.recover()
        if self.generation != self.cluster.generation or not self.cluster._transport_ready:
            recompile()

    def track(self, arrays) -> None:
        self.cluster.arrays.add_all(arrays)

    def run_step(self, per_worker: dict[int, tuple]) -> dict[int, dict]:
        return self.submit_step(per_worker).result()

    def submit_step(self, per_worker: dict[int, tuple]) -> RayStep | ChannelStep:
        """Send the step to every host-actor now; ``result()`` waits.  Over the step
        connections when this thread has them to itself and the step is not pipelined
        (two pipelined steps run at once on an actor: Ray's threads do that)."""
        cluster = self.cluster
        pipelined = any(len(req) > 4 and req[4] is not None for req in per_worker.values())
        if not pipelined and cluster.channel_lock.acquire(blocking=False):
            try:
                channels = cluster.step_channels(list(per_worker))
                if channels is not None:
                    sent = []
                    for w, req in per_worker.items():
                        try:
                            channels[w].send((self.plan_id, *req))
                        except OSError:
                            what = f"step of plan {self.plan_id}"
                            raise cluster.channel_send_failed(w, sent, what) from None
                        sent.append(w)
                    return ChannelStep(self, channels)
            except BaseException:
                cluster.channel_lock.release()
                raise
            cluster.channel_lock.release()
        refs = {
            w: self._actor(w).run_step.remote(self.plan_id, *req) for w, req in per_worker.items()
        }
        return RayStep(self, refs)

    def _results(self, out: dict) -> dict[int, dict]:
        """The workers' by-value results (their seconds and traces kept)."""
        results = {}
        self.last_traces = {}
        for w, (result, seconds, trace) in out.items():
            results[w], self.worker_seconds[w] = result, seconds
            if trace is not None:
                self.last_traces[w] = trace
        return results

    def collect(self, refs: dict) -> dict[int, dict]:
        """The workers' results of a submitted step (their seconds and traces kept)."""
        return self._results(self.cluster._call(refs, f"step of plan {self.plan_id}"))

    def runtime_options(self, **opts) -> dict:
        """Set every worker's interpreter options (``overlap=``, ``timeline=``,
        ``recv_ahead=``, ``prefetch=``; none: just read); returns each worker's last
        recorded timeline."""
        refs = {w: self._actor(w).runtime_options.remote(self.plan_id, opts) for w in self.workers}
        return self.cluster._call(refs, "runtime options")

    def set_trace(self, workers, on: bool, sync: bool = False) -> None:
        """Make ``workers`` record (or stop recording) their per-instruction timelines;
        ``sync``: RUNs wait for their outputs (profiling)."""
        refs = {w: self._actor(w).set_trace.remote(self.plan_id, on, sync) for w in workers}
        self.cluster._call(refs, "switching trace recording")

    def clock_offsets(self, workers) -> dict[int, tuple[int, int]]:
        """Each worker's (clock offset, round trip) against this process, ns, by ping."""
        import ray

        from meshshard.runtime.trace_record import estimate_offset

        return {
            w: estimate_offset(lambda w=w: ray.get(self._actor(w).clock.remote())) for w in workers
        }

    def fetch(self, worker: int, key: int) -> list:
        ref = self._actor(worker).fetch.remote(key)
        try:
            return gather({worker: ref}, f"fetch from w{worker}")[worker]
        except WorkerFault as fault:
            if fault.failure.dead:
                self.cluster.dead.add(worker)
            raise

    def free(self, worker: int, keys: Sequence[int]) -> None:
        if not self.cluster.closed and worker not in self.cluster.dead:
            self.cluster.note_cleanup(self._actor(worker).free.remote(list(keys)))

    def release(self) -> None:
        """Drop this plan's compiled programs on every live actor (fire and forget)."""
        if self.cluster.closed:
            return
        for h, a in enumerate(self.cluster._actors):
            if a is not None and h not in self.cluster.dead:
                self.cluster.note_cleanup(a.release.remote(self.plan_id))

    # --- checkpoints (runtime.checkpoint_io) ---------------------------------------
    def begin_save(self, per_worker: dict[int, list[tuple[str, dict[str, int]]]]) -> dict:
        """Every actor snapshots its arrays and starts writing them; returns at once."""
        refs = {w: self._actor(w).begin_save.remote(parts) for w, parts in per_worker.items()}
        return self.cluster._call(refs, "checkpoint save")

    def finish_save(self, per_worker: dict[int, list[str]]) -> None:
        """Wait until every actor's parts are on disk."""
        refs = {w: self._actor(w).finish_save.remote(dirs) for w, dirs in per_worker.items()}
        self.cluster._call(refs, "checkpoint save")

    def restore_shards(self, per_worker: dict[int, dict]) -> dict[int, int]:
        """Every actor reads its shards of saved arrays into its store, in parallel."""
        refs = {
            w: self._actor(w).restore_shards.remote(self.plan_id, req)
            for w, req in per_worker.items()
        }
        return self.cluster._call(refs, "checkpoint restore")


class RayStep:
    """A step sent to the host-actors (:meth:`RayBackend.submit_step`)."""

    def __init__(self, backend: RayBackend, refs: dict):
        self.backend, self.refs = backend, refs

    def result(self) -> dict[int, dict]:
        """Wait for every host-actor; their results (raises their failures)."""
        return self.backend.collect(self.refs)


class ChannelStep:
    """A step sent over the step connections (:meth:`RayBackend.submit_step`); holds the
    cluster's channel lock until :meth:`result` has every reply."""

    def __init__(self, backend: RayBackend, channels: dict):
        self.backend, self.channels = backend, channels

    def result(self) -> dict[int, dict]:
        """Wait for every host-actor; their results (raises their failures)."""
        backend = self.backend
        try:
            out = backend.cluster.channel_call(self.channels, f"step of plan {backend.plan_id}")
        finally:
            backend.cluster.channel_lock.release()
        return backend._results(out)


@contextlib.contextmanager
def use_cluster(cluster):
    """Make ``cluster`` current inside a ``with`` block, then restore the previous one
    (without closing either): lets tests switch between a Ray and a threads cluster."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, cluster
    try:
        yield cluster
    finally:
        _CURRENT = previous
