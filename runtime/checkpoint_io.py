"""Worker side of checkpoints: write and read this host's shards with orbax.

Plain Python with no Ray, like :mod:`~meshshard.runtime.worker`: the Ray host-actor and
the in-process backend each hold one :class:`ShardWriter` over their store.  A save is
two calls: :meth:`ShardWriter.begin` takes the arrays out of the store at once (so a
later step may free or replace them) and writes them in a background thread;
:meth:`ShardWriter.finish` waits for the write.  The driver never sees the data.

A restore reads, for every array this host needs, only the slices its devices hold in
the *new* layout: orbax opens the saved array (tensorstore) and reads those boxes,
whatever layout the array was saved from.  That is resharding on load.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: How a restored array is laid out: like the stored array ``key`` (``("key", key)``) or
#: by a plan spec on the worker's mesh (``("spec", spec)``).
Layout = tuple


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer()


def write_tree(directory: str, tree: Mapping[str, object]) -> None:
    """Write ``{name: array}`` as one orbax checkpoint at ``directory`` (blocking)."""
    _checkpointer().save(directory, dict(tree))


class ShardWriter:
    """Background orbax writes of stored arrays, one per checkpoint part directory."""

    def __init__(self):
        self._pending: dict[str, tuple[threading.Thread, list]] = {}
        self._lock = threading.Lock()

    def begin(self, store: Mapping[int, jax.Array], directory: str, arrays: dict[str, int]) -> int:
        """Snapshot ``{name: key}`` from ``store`` and start writing them to ``directory``;
        returns the bytes this host will write."""
        try:
            tree = {name: store[key] for name, key in arrays.items()}
        except KeyError as e:
            raise KeyError(
                f"array {e.args[0]} is no longer stored on this host (freed or donated); "
                "save the state the last step returned"
            ) from None
        errors: list[BaseException] = []

        def run() -> None:
            try:
                write_tree(directory, tree)
            except BaseException as exc:  # reported by finish()
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"meshshard-save {directory}", daemon=True)
        with self._lock:
            if directory in self._pending:
                raise ValueError(f"a save into {directory} is already in progress")
            self._pending[directory] = (thread, errors)
        thread.start()
        return sum(_local_nbytes(a) for a in tree.values())

    def finish(self, directory: str) -> None:
        """Wait until the write into ``directory`` is on disk; re-raise its error."""
        with self._lock:
            thread, errors = self._pending.pop(directory)
        thread.join()
        if errors:
            raise errors[0]

    def finish_all(self) -> None:
        """Wait for every write in progress (before the process goes away)."""
        for directory in list(self._pending):
            try:
                self.finish(directory)
            except BaseException:  # reported to whoever waits on that save
                pass


def _local_nbytes(a) -> int:
    if isinstance(a, jax.Array):
        return sum(s.data.nbytes for s in a.addressable_shards if s.replica_id == 0)
    return int(np.asarray(a).nbytes)


def target_sharding(store: Mapping[int, jax.Array], mesh: Mesh | None, layout: Layout):
    """The sharding a restored array takes on this worker (see :data:`Layout`)."""
    kind, value = layout
    if kind == "key":
        return store[value].sharding
    if mesh is None:
        raise ValueError("restoring by plan spec needs the worker's compiled mesh")
    return NamedSharding(mesh, PartitionSpec(*value))


def read_shards(
    store: dict[int, jax.Array],
    mesh: Mesh | None,
    requests: Mapping[str, Mapping[str, tuple]],
) -> int:
    """Restore into ``store``: ``requests[part][name] = (key, shape, dtype, layout)`` reads
    array ``name`` of checkpoint part ``part`` with this worker's shards of ``layout``
    and stores it under ``key``; returns the bytes read by this host."""
    import orbax.checkpoint as ocp

    total = 0
    for part, leaves in requests.items():
        target = {
            name: jax.ShapeDtypeStruct(
                tuple(shape), np.dtype(dtype), sharding=target_sharding(store, mesh, layout)
            )
            for name, (_, shape, dtype, layout) in leaves.items()
        }
        args = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
        out = _checkpointer().restore(part, args=args)
        for name, (key, *_rest) in leaves.items():
            store[key] = out[name]
            total += _local_nbytes(out[name])
    return total


def read_host(part: str, names: list[str]) -> dict[str, np.ndarray]:
    """Arrays ``names`` of checkpoint part ``part`` as whole host (numpy) arrays."""
    import orbax.checkpoint as ocp

    item = {n: np.zeros(()) for n in names}  # structure only: restore_type says numpy
    args = ocp.args.PyTreeRestore(
        item=item,
        restore_args={n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names},
        partial_restore=True,
    )
    return dict(_checkpointer().restore(part, args=args))
