"""Sharded checkpoints of training state with orbax: each host writes and reads its own shards.

``meshshard.save(path, state)`` writes a state whose arrays live on the meshes
(:class:`~meshshard.runtime.executable.RemoteArray`) without gathering them to this
process: every host-actor writes the shards it holds as an orbax checkpoint *part*
(``path/w0``, ``path/w2-3`` for a mesh of hosts 2 and 3), and this process writes only the
leaves it already holds (``path/driver``) and a manifest (``path/meshshard_checkpoint.json``,
written last: a directory without it is an unfinished save and is never restored).

``meshshard.restore(path, like=...)`` reads it back into the layout of ``like``:

* a state of :class:`RemoteArray` (the one a step returned): the same layout;
* ``step.placement(state, batch)``: where that (possibly differently planned)
  step keeps its state; every host reads just the slices its new shards need, from
  whichever parts hold them (resharding on load);
* any other leaf (a NumPy array, ``jax.ShapeDtypeStruct``, a scalar): a host array.

:class:`CheckpointManager` adds what a training loop needs: saves that run while the
next steps do, keep-last-N, and resuming from the latest finished checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import serialization

from meshshard.errors import MeshshardInputError, MeshshardRuntimeError
from meshshard.keys import is_typed_key, key_impl
from meshshard.plan import Spec, spec_str
from meshshard.runtime.checkpoint_io import ShardWriter, read_host
from meshshard.runtime.executable import _KEYS, Executable, RemoteArray, as_result

# Flax's own serialization (``flax.serialization.to_bytes``, ``to_state_dict``) of a state
# the step returned writes host copies of its remote arrays, as of ``jax.Array``s.
serialization.register_serialization_state(
    RemoteArray, lambda array: array.fetch(), lambda _target, state: state, override=True
)

MANIFEST = "meshshard_checkpoint.json"
DRIVER_PART = "driver"
FORMAT = "meshshard-checkpoint"


@dataclass(frozen=True)
class LeafPlacement:
    """Where a compiled step keeps one state leaf: per mesh, its workers and its spec.

    No meshes means the step does not read the leaf; it is restored as a host array.
    """

    shape: tuple[int, ...]
    dtype: str
    meshes: tuple[tuple[tuple[int, ...], Spec], ...]
    executable: Executable | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        where = " ".join(f"{','.join(f'w{w}' for w in ws)}:{spec_str(s)}" for ws, s in self.meshes)
        return f"{self.dtype}{list(self.shape)} on {where or 'host'}"


def placement_of(exe: Executable, args: tuple, argnum: int = 0):
    """A tree like ``args[argnum]`` of :class:`LeafPlacement` for the compiled step ``exe``."""
    if not 0 <= argnum < len(args):
        raise MeshshardInputError(f"placement(argnum={argnum}) but the step got {len(args)} args")
    offset = len(jax.tree.leaves(args[:argnum]))
    leaves, tree = jax.tree.flatten(args[argnum])
    out = []
    for j in range(len(leaves)):
        spec = exe.plan.inputs[offset + j]
        if spec.kind == "batch":
            raise MeshshardInputError(
                f"placement(argnum={argnum}): leaf {spec.path} is a batch argument, split "
                "into micro-batches every step; pass the argnum of the state"
            )
        meshes, seen = [], set()
        for group, idx in spec.slots if spec.kind == "state" else ():
            mesh = exe.plan.buffer(group).mesh
            if mesh not in seen:
                seen.add(mesh)
                meshes.append(
                    (tuple(exe._mesh_workers[mesh]), exe.plan.buffer(group).tensors[idx].spec)
                )
        out.append(LeafPlacement(tuple(spec.shape), spec.dtype, tuple(meshes), exe))
    return jax.tree.unflatten(tree, out)


# --- save ------------------------------------------------------------------------------


class SaveHandle:
    """A save in progress: the hosts write in the background; :meth:`wait` finishes it
    (and writes the manifest that makes the checkpoint restorable)."""

    def __init__(self, path: str, finish: Callable[[], None], on_done=None):
        self.path = path
        self._error: BaseException | None = None

        def run() -> None:
            try:
                finish()
                if on_done is not None:
                    on_done()
            except BaseException as exc:  # re-raised by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"meshshard-save {path}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True once every shard is on disk (or the save failed)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the checkpoint is complete; returns its path or raises the failure."""
        self._thread.join()
        if self._error is not None:
            raise MeshshardRuntimeError(
                f"saving checkpoint {self.path} failed: {self._error}"
            ) from self._error
        return self.path


def save(path: str | os.PathLike, state, *, wait: bool = True, on_done=None) -> SaveHandle:
    """Write ``state`` (any pytree; arrays on the meshes or on this host) to ``path``.

    Each host-actor writes the shards it holds (one replica of each array); nothing is
    gathered here.  With ``wait=False`` this returns once every host has taken its
    arrays (milliseconds), so the next steps run while the shards are written; call
    ``.wait()`` on the returned handle to finish.  ``path`` must not exist.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise MeshshardInputError(
            f"save(path={path!r}): the path exists; pass a new directory (or use "
            "CheckpointManager, which numbers checkpoints by step)"
        )
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    entries, host, per_worker, backend_of = [], {}, {}, {}
    for i, (kp, leaf) in enumerate(leaves):
        name, where = f"leaf{i}", jax.tree_util.keystr(kp)
        if isinstance(leaf, RemoteArray) and leaf.deleted:
            raise MeshshardInputError(
                f"save: state{where} was donated to a later step and no longer exists; "
                "save the state that step returned"
            )
        if isinstance(leaf, RemoteArray):  # a pipelined (2BW) step may still write it
            leaf.block_until_ready()
        group = _writer_group(leaf) if isinstance(leaf, RemoteArray) else None
        impl = None
        if group is not None:
            part = "w" + "-".join(map(str, group))
            for w in group:
                per_worker.setdefault(w, {}).setdefault(part, {})[name] = leaf.keys[w]
                backend_of.setdefault(w, leaf._backend)
            shape, dtype = leaf.shape, leaf.dtype
        else:  # a host value (or an array moved to the driver when its hosts restarted)
            if isinstance(leaf, int | float | complex) and not isinstance(leaf, bool):
                leaf = jax.numpy.asarray(leaf)  # what a step takes it as: a weak float32
            impl = key_impl(leaf) if is_typed_key(leaf) else None
            host[name] = np.asarray(leaf if impl is None else jax.random.key_data(leaf))
            part, shape, dtype = DRIVER_PART, host[name].shape, host[name].dtype
        entry = {
            "path": where,
            "name": name,
            "part": part,
            "shape": list(shape),
            "dtype": str(dtype),
        }
        if impl is not None:  # a typed key: its data saved, and how to wrap it back
            entry.update(key_impl=impl, key_shape=list(np.shape(leaf)))
        if getattr(leaf, "weak_type", False):  # restored weak, so it promotes as before
            entry["weak_type"] = True
        entries.append(entry)
    os.makedirs(path)
    by_backend: dict[int, tuple[object, dict]] = {}
    for w, parts in per_worker.items():
        b = backend_of[w]
        by_backend.setdefault(id(b), (b, {}))[1][w] = [
            (os.path.join(path, p), arrays) for p, arrays in parts.items()
        ]
    for b, requests in by_backend.values():
        b.begin_save(requests)
    writer = ShardWriter()
    if host:
        writer.begin(host, os.path.join(path, DRIVER_PART), {n: n for n in host})

    def finish() -> None:
        for b, requests in by_backend.values():
            b.finish_save({w: [d for d, _ in parts] for w, parts in requests.items()})
        if host:
            writer.finish(os.path.join(path, DRIVER_PART))
        manifest = {"format": FORMAT, "version": 1, "leaves": entries}
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(path, MANIFEST))

    handle = SaveHandle(path, finish, on_done)
    if wait:
        handle.wait()
    return handle


def _writer_group(leaf: RemoteArray) -> tuple[int, ...] | None:
    """The workers of one mesh holding all of ``leaf``: they write its single copy
    (None if no mesh holds it whole any more: it was moved to the driver)."""
    if leaf.key_on(leaf._backend, next(iter(leaf.keys), -1)) is None:
        return None
    for g in leaf.groups or (tuple(leaf.keys),):
        if g and all(w in leaf.keys for w in g):
            return tuple(g)
    return None


# --- restore ---------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the finished checkpoint at ``path`` (a clear error if unfinished)."""
    file = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.isfile(file):
        raise MeshshardInputError(
            f"restore(path={os.fspath(path)!r}): no finished meshshard checkpoint there (no "
            f"{MANIFEST}: the save did not finish, or the path is wrong); "
            "CheckpointManager.latest_step() names the newest finished one"
        )
    with open(file) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise MeshshardInputError(f"{file} is not a meshshard checkpoint manifest")
    return manifest


def restore(path: str | os.PathLike, like):
    """Read the checkpoint at ``path`` into the structure and layout of ``like``.

    ``like`` is a pytree with the saved structure whose leaves are :class:`RemoteArray`
    (restore into the same layout), :class:`LeafPlacement` from ``step.placement(...)``
    (restore into that step's layout, which may differ from the saved one) or anything
    else (a host NumPy array).  Values are bit-exact copies of what was saved.
    """
    path = os.path.abspath(os.fspath(path))
    entries = read_manifest(path)["leaves"]
    leaves, tree = jax.tree_util.tree_flatten_with_path(like)
    _check_structure(path, entries, leaves)
    out: list = [None] * len(entries)
    host: dict[str, list[tuple[int, str]]] = {}
    batches: dict[int, tuple[object, dict]] = {}
    made: list[tuple[int, Executable, dict, tuple, list]] = []
    for i, ((_, leaf), e) in enumerate(zip(leaves, entries, strict=True)):
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        targets = _targets(leaf)
        if not targets or "key_impl" in e:  # a typed key is a host value, as a step returns it
            host.setdefault(e["part"], []).append((i, e["name"]))
            continue
        owner, backend, per_mesh = targets
        reqs = batches.setdefault(id(backend), (backend, {}))[1]
        keys, groups = {}, []
        for workers, layouts in per_mesh:
            key = next(_KEYS)
            groups.append(workers)
            for w, layout in zip(workers, layouts, strict=True):
                part_dir = os.path.join(path, e["part"])
                reqs.setdefault(w, {}).setdefault(part_dir, {})[e["name"]] = (
                    key,
                    shape,
                    str(dtype),
                    layout,
                )
                keys[w] = key
        made.append((i, owner, keys, (shape, dtype), groups))
    for backend, reqs in batches.values():
        backend.restore_shards(reqs)
    for i, owner, keys, (shape, dtype), groups in made:
        out[i] = RemoteArray(owner, keys, shape, dtype, groups)
        if entries[i].get("weak_type"):
            out[i].weak_type = True
        owner.backend.track([out[i]])  # moved, not lost, if its hosts restart later
    for part, names in host.items():
        arrays = read_host(os.path.join(path, part), [n for _, n in names])
        for i, n in names:
            impl = entries[i].get("key_impl")
            if impl is not None:
                out[i] = jax.random.wrap_key_data(arrays[n], impl=impl)
            elif entries[i].get("weak_type"):  # a learning rate saved weak comes back weak
                out[i] = as_result(arrays[n], weak_type=True)
            else:
                out[i] = arrays[n]
    return jax.tree.unflatten(tree, out)


def _targets(leaf):
    """(owner executable, backend, [(workers, layouts)]) for a placed leaf, or None for a
    leaf restored to the host."""
    if isinstance(leaf, RemoteArray):
        if leaf.deleted:
            raise MeshshardInputError(
                "restore(like=...): a like-array was donated to a later step; pass a live state"
            )
        groups = [g for g in leaf.groups or (tuple(leaf.keys),) if set(g) <= set(leaf.keys)]
        if not groups or leaf.key_on(leaf._backend, groups[0][0]) is None:
            return None  # no longer on the meshes (moved to the driver): a host array
        owner = leaf._owner()
        return (
            owner,
            leaf._backend,
            [(tuple(g), [("key", leaf.keys[w]) for w in g]) for g in groups],
        )
    if isinstance(leaf, LeafPlacement) and leaf.meshes:
        exe = leaf.executable
        return (
            exe,
            exe.backend,
            [(ws, [("spec", spec)] * len(ws)) for ws, spec in leaf.meshes],
        )
    return None


def _check_structure(path: str, entries: list[dict], leaves: list) -> None:
    """The saved leaves and ``like``'s leaves match by path, shape and dtype."""
    got = [jax.tree_util.keystr(kp) for kp, _ in leaves]
    want = [e["path"] for e in entries]
    if got != want:
        diff = next(
            (f"saved {w!r} vs like {g!r}" for w, g in zip(want, got, strict=False) if w != g),
            f"saved {len(want)} leaves vs like {len(got)}",
        )
        raise MeshshardInputError(
            f"restore(path={path!r}, like=...): like has another structure than the saved "
            f"state ({diff}); pass a state (or step.placement(...)) of the same tree"
        )
    for (_, leaf), e in zip(leaves, entries, strict=True):
        shape, saved = getattr(leaf, "shape", None), tuple(e.get("key_shape", e["shape"]))
        # a typed key's placement (step.placement) has the shape of its data
        if shape is not None and tuple(shape) not in (saved, tuple(e["shape"])):
            raise MeshshardInputError(
                f"restore: state{e['path']} was saved with shape {saved} but like "
                f"has {tuple(shape)}; restore into a state of the saved shapes"
            )


# --- a training loop's checkpoints -------------------------------------------------------


class CheckpointManager:
    """Numbered checkpoints in ``directory``: async saves, keep-last-N, resume from latest.

        mgr = CheckpointManager("ckpt", max_to_keep=2)
        start = mgr.latest_step() or 0
        if start:
            state = mgr.restore(like=step.placement(template, batch))
        for i in range(start, n):
            state, loss = step(state, batch)
            mgr.save(i + 1, state)   # returns at once; the hosts write while training goes on
        mgr.wait_until_finished()

    One save is in flight at a time (a new save first finishes the previous one).  A
    checkpoint counts once its manifest is written, so a crash mid-save leaves the
    previous one as the latest; the unfinished directory is removed by the next save.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and max_to_keep < 1:
            raise MeshshardInputError(
                f"CheckpointManager(max_to_keep={max_to_keep}): keep at least 1, or None for all"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = max_to_keep
        self._handle: SaveHandle | None = None
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def save(self, step: int, state, *, wait: bool = False) -> SaveHandle:
        """Start saving ``state`` as checkpoint ``step``; older ones beyond
        ``max_to_keep`` are deleted once it is finished."""
        self.wait_until_finished()
        path = self._path(step)
        if os.path.exists(path):
            if os.path.isfile(os.path.join(path, MANIFEST)):
                raise MeshshardInputError(
                    f"CheckpointManager.save(step={step}): checkpoint {path} exists already"
                )
            shutil.rmtree(path)  # an unfinished save (a crash): replace it
        self._handle = save(path, state, wait=False, on_done=self._prune)
        if wait:
            self.wait_until_finished()
        return self._handle

    def wait_until_finished(self) -> None:
        """Finish the save in flight, if any (raises its failure)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait()

    def all_steps(self) -> list[int]:
        """Steps of the finished checkpoints, oldest first."""
        steps = []
        for name in os.listdir(self.directory):
            if name.isdigit() and os.path.isfile(os.path.join(self.directory, name, MANIFEST)):
                steps.append(int(name))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, like, step: int | None = None):
        """Restore checkpoint ``step`` (default: the latest finished) into ``like``."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise MeshshardInputError(
                    f"CheckpointManager.restore: no finished checkpoint in {self.directory}"
                )
        return restore(self._path(step), like)

    def _prune(self) -> None:
        steps = self.all_steps()
        if self.max_to_keep is None:
            return
        for s in steps[: -self.max_to_keep]:
            shutil.rmtree(self._path(s), ignore_errors=True)
