"""Transferred blocks that stay on the devices (the transport's ``device`` data path).

With NCCL and GPU arrays (:func:`meshshard.runtime.transport.data_path`), a worker
sends a block as a JAX array sliced from the shard that holds it, on that shard's
device, and the transport hands it to torch by DLPack.  Received blocks arrive as JAX
``uint8`` arrays on the worker's first device; :meth:`DeviceBlocks.assemble`
reinterprets their bytes, writes them into the value on that device and reshards it
onto the mesh (device-to-device copies).  Nothing goes through host memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshshard.errors import MeshshardRuntimeError
from meshshard.plan import TransferSpec
from meshshard.runtime.programs import sharding

Index = tuple[tuple[int, int], ...]


def shard_block(arr: jax.Array, index: Index) -> jax.Array:
    """Block ``index`` of global array ``arr``, sliced on the device of a local shard
    that holds all of it (a JAX array; no host copy)."""
    for shard in arr.addressable_shards:
        starts = [s.start or 0 for s in shard.index] + [0] * (arr.ndim - len(shard.index))
        stops = [
            s.stop if s.stop is not None else n
            for s, n in zip(shard.index, arr.shape, strict=False)
        ] + list(arr.shape[len(shard.index) :])
        if all(a <= lo and hi <= b for (lo, hi), a, b in zip(index, starts, stops, strict=True)):
            sl = tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(index, starts, strict=True))
            return shard.data[sl]
    raise MeshshardRuntimeError(f"no local shard of {arr.shape} holds block {index}")


def from_bytes(raw: jax.Array, dtype, shape: tuple[int, ...]) -> jax.Array:
    """The ``uint8`` array ``raw`` reinterpreted as ``dtype`` of ``shape``, on its device."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return (raw != 0).reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype).reshape(shape)


class DeviceBlocks:
    """The interpreter's block adapter for the device path (module docstring)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def read(self, value: jax.Array, index: Index) -> jax.Array:
        """The block to send: a slice of the local shard, still on its device."""
        return shard_block(value, index)

    def assemble(self, transfer: TransferSpec, parts) -> jax.Array:
        """The received value: blocks written on this process's first device of the
        mesh, then each local shard copied device-to-device onto its device."""
        shape, dtype = transfer.tensor.shape, transfer.tensor.dtype
        local = local_devices(self.mesh.devices.flat)
        full = jnp.zeros(shape, dtype, device=local[0])
        for msg, raw in parts:
            raw = jax.device_put(raw, local[0])  # a no-op where the transport received it
            block = from_bytes(raw, dtype, tuple(b - a for a, b in msg.index))
            full = full.at[tuple(slice(a, b) for a, b in msg.index)].set(block)
        target = sharding(self.mesh, transfer.dst_spec)
        shards = [
            jax.device_put(full[idx], d)
            for d, idx in target.addressable_devices_indices_map(shape).items()
        ]
        return jax.make_array_from_single_device_arrays(shape, target, shards)


def local_devices(devices) -> list:
    """The devices of ``devices`` this process drives, in order (a mesh may span hosts)."""
    me = jax.process_index()
    return [d for d in devices if getattr(d, "process_index", me) == me]
