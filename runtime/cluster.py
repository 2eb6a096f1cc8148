"""Start, join and stop the cluster of host-actors; the backend that runs plans on it.

``meshshard.init()`` makes one :class:`RayCluster` (or, with ``backend="threads"``, a
:class:`ThreadsCluster` in this process) current; ``parallelize``d steps run there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.plan import Plan
from meshshard.runtime.executable import raise_worker_errors

_CURRENT = None

#: Seconds a blocked receive waits before the transfer is declared lost.
TRANSFER_TIMEOUT_S = 300.0


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
    backend: str = "ray",
    name: str | None = None,
):
    """Start (or join) the cluster that parallelized steps run on.

    With no arguments: an embedded local Ray instance with 4 host-actors of 2
    emulated CPU devices each.  ``address=...`` joins an existing Ray cluster and
    uses one host-actor per node (its GPUs, or ``devices_per_host`` CPU devices).
    ``backend="threads"`` runs the workers as threads of this process instead (fast
    tests; this process must have ``num_hosts * devices_per_host`` devices).
    """
    global _CURRENT
    if _CURRENT is not None:
        shutdown()
    if backend == "threads":
        _CURRENT = ThreadsCluster(num_hosts or 4, devices_per_host or 2)
    elif backend == "ray":
        _CURRENT = RayCluster(address, num_hosts, devices_per_host, name)
    else:
        raise MeshshardInputError(f"init(backend={backend!r}): use 'ray' or 'threads'")
    return _CURRENT


def shutdown() -> None:
    """Stop the current cluster's actors (and the embedded Ray instance, if we started it)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


class ThreadsCluster:
    """Workers as threads in this process (see ``runtime.local``)."""

    def __init__(self, num_hosts: int, devices_per_host: int):
        self.spec = ClusterSpec(
            f"threads-{num_hosts}x{devices_per_host}", num_hosts, devices_per_host
        )
        self.stores: dict[int, dict] = {}  # per host: arrays kept between steps, across plans

    def backend(self):
        from meshshard.runtime.local import LocalBackend

        return LocalBackend(self.spec.devices_per_host, self.stores)

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
        pass


class RayCluster:
    """Host-actors on Ray, one per host; owns the embedded Ray instance if it started it."""

    def __init__(self, address, num_hosts, devices_per_host, name):
        import ray

        self._started_ray = False
        if not ray.is_initialized():
            env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
            kwargs = dict(
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
                runtime_env={"env_vars": env},
            )
            if address is None:
                kwargs["num_cpus"] = max(os.cpu_count() or 1, 1)
            # address=None: always our own embedded instance, never another process's
            # local Ray (which ray.init() would otherwise join, e.g. a test session's)
            ray.init(address=address or "local", **kwargs)
            self._started_ray = address is None
        if address is not None:
            num_hosts, devices_per_host, self.platform, self._nodes = discover_hosts(
                ray.nodes(), num_hosts, devices_per_host
            )
        else:
            self.platform, self._nodes = "cpu", None
            num_hosts, devices_per_host = num_hosts or 4, devices_per_host or 2
        self.spec = ClusterSpec(
            name or f"ray-{num_hosts}x{devices_per_host}", num_hosts, devices_per_host
        )
        self._actors: list = [None] * num_hosts
        self._groups: list = ["fresh"] * num_hosts
        self._transport_ready = False
        self._groups_made: set = set()
        self._cleanups: list = []  # refs of free/release calls in flight
        self.generation = 0  # bumped whenever actors restart (compiled steps die with them)
        for h in range(num_hosts):
            self._start_actor(h)
        import ray as _ray

        _ray.get([a.ping.remote() for a in self._actors])

    # --- actors ------------------------------------------------------------------
    def _start_actor(self, h: int) -> None:
        import ray

        from meshshard.runtime.actor import HostActor

        opts = dict(num_cpus=0, max_concurrency=4)
        if self.platform == "gpu":
            opts["num_gpus"] = self.spec.devices_per_host
        if self._nodes is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._nodes[h], soft=False)
        self._actors[h] = (
            ray.remote(HostActor)
            .options(**opts)
            .remote(h, self.spec.devices_per_host, self.platform)
        )
        self._groups[h] = "fresh"
        self._transport_ready = False

    def _restart(self, hosts: Sequence[int]) -> None:
        import ray

        self.generation += 1
        for h in hosts:
            ray.kill(self._actors[h], no_restart=True)
        for h in hosts:
            self._start_actor(h)

    def prepare(self, plan: Plan) -> None:
        """Make every actor's process layout match ``plan`` (restarting actors if needed)."""
        import ray

        need: dict[int, object] = {}
        for m in plan.meshes:
            for h in m.hosts:
                need[h] = tuple(m.hosts) if len(m.hosts) > 1 else "local"
        conflict = [h for h, g in need.items() if self._groups[h] not in ("fresh", g)]
        if conflict:
            self._restart(conflict)
        self.prepare_transport()
        for m in plan.meshes:
            if len(m.hosts) > 1 and self._groups[m.hosts[0]] == "fresh":
                host, port = ray.get(self._actors[m.hosts[0]].free_port.remote())
                coord = f"{host}:{port}"
                _get(
                    [
                        self._actors[h].init_jax_distributed.remote(coord, len(m.hosts), i, m.hosts)
                        for i, h in enumerate(m.hosts)
                    ]
                )
        for h, g in need.items():
            self._groups[h] = g

    def prepare_transport(self) -> None:
        """(Re)build the torch.distributed group over all actors if it is stale."""
        import ray

        if self._transport_ready:
            return
        host, port = ray.get(self._actors[0].free_port.remote())
        addr = f"tcp://{host}:{port}"
        n = self.spec.num_hosts
        _get(
            [
                a.init_transport.remote(addr, n, r, TRANSFER_TIMEOUT_S)
                for r, a in enumerate(self._actors)
            ]
        )
        self._transport_ready = True
        self._groups_made = set()

    def ensure_groups(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        """Create the broadcast channels not made yet, on every actor in the same order."""
        new = [k for k in keys if k not in self._groups_made]
        if new:
            _get([a.create_groups.remote(new) for a in self._actors])
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
        refs = {
            s.worker: self._actors[s.worker].run_transfer.remote(
                plan_json, full_ref if s.worker in src else None, repeat
            )
            for s in plan.streams
        }
        out = dict(zip(refs, _get(list(refs.values())), strict=True))
        tiles = {w: r[0] for w, r in out.items() if r[0] is not None}
        per_run = [max(r[1][i] for r in out.values()) for i in range(repeat)]
        return tiles, per_run, {w: r[2] for w, r in out.items()}

    def backend(self):
        return RayBackend(self)

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
        return dict(enumerate(_get([a.stats.remote() for a in self._actors])))

    def close(self) -> None:
        import ray

        for a in self._actors:
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # already gone
                    pass
        self._actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


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

    def _actor(self, w: int):
        return self.cluster._actors[w]

    def compile(self, fn, abstract_args, batch_argnums, plan: Plan) -> dict[int, float]:
        from meshshard.runtime.interpreter import broadcast_groups

        self.cluster.prepare(plan)
        self.cluster.ensure_groups(broadcast_groups(plan))
        self.generation = self.cluster.generation
        plan_json = plan.to_json()
        refs = {
            w: self._actor(w).compile.remote(
                self.plan_id, fn, abstract_args, batch_argnums, plan_json
            )
            for w in plan.workers
        }
        return dict(zip(refs, _get(list(refs.values())), strict=True))

    def run_step(self, per_worker: dict[int, tuple]) -> dict[int, dict]:
        import ray

        if self.generation != self.cluster.generation:
            raise MeshshardRuntimeError(
                "the host-actors were restarted (to run a plan with another mesh layout, or "
                "after a failure), so this step's compiled programs and the arrays it kept "
                "are gone; call meshshard.parallelize again and pass host (numpy) copies of "
                "the state"
            )
        refs = {
            w: self._actor(w).run_step.remote(self.plan_id, *req) for w, req in per_worker.items()
        }
        pending = list(refs.values())
        errors: dict[int, BaseException] = {}
        results = {}
        by_ref = {r: w for w, r in refs.items()}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            w = by_ref[done[0]]
            try:
                results[w], self.worker_seconds[w] = ray.get(done[0])
            except Exception as exc:  # a failed worker leaves its peers blocked: reset them
                errors[w] = _unwrap(exc)
                self.cluster._restart(range(self.cluster.spec.num_hosts))
                break
        raise_worker_errors(errors)
        return results

    def fetch(self, worker: int, key: int) -> list:
        return _get([self._actor(worker).fetch.remote(key)])[0]

    def free(self, worker: int, keys: Sequence[int]) -> None:
        self.cluster.note_cleanup(self._actor(worker).free.remote(list(keys)))

    def release(self) -> None:
        """Drop this plan's compiled programs on every actor (fire and forget)."""
        for a in self.cluster._actors:
            if a is not None:
                self.cluster.note_cleanup(a.release.remote(self.plan_id))

    # --- checkpoints (runtime.checkpoint_io) ---------------------------------------
    def begin_save(self, per_worker: dict[int, list[tuple[str, dict[str, int]]]]) -> dict:
        """Every actor snapshots its arrays and starts writing them; returns at once."""
        refs = {w: self._actor(w).begin_save.remote(parts) for w, parts in per_worker.items()}
        return dict(zip(refs, _get(list(refs.values())), strict=True))

    def finish_save(self, per_worker: dict[int, list[str]]) -> None:
        """Wait until every actor's parts are on disk."""
        _get([self._actor(w).finish_save.remote(dirs) for w, dirs in per_worker.items()])

    def restore_shards(self, per_worker: dict[int, dict]) -> dict[int, int]:
        """Every actor reads its shards of saved arrays into its store, in parallel."""
        refs = {
            w: self._actor(w).restore_shards.remote(self.plan_id, req)
            for w, req in per_worker.items()
        }
        return dict(zip(refs, _get(list(refs.values())), strict=True))


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if cause is not None else exc


def _get(refs: list):
    import ray

    try:
        return ray.get(refs)
    except Exception as exc:
        raise MeshshardRuntimeError(f"a host-actor failed: {_unwrap(exc)}") from None


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
