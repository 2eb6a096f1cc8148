"""Payloads of host-level messages: several blocks sent back to back as one byte string.

A :class:`~meshshard.plan.Message` with ``blocks`` carries each block's bytes in
order (C order within a block).  The sender reads every block from the shard that
holds it and concatenates their bytes (:func:`read_message`); the receiver cuts the
payload back into ``(block, bytes)`` parts (:func:`received_parts`), which the
worker's :class:`~meshshard.runtime.interpreter.Blocks` adapter writes into its
devices' shards like the blocks of single-block messages.

    >>> from meshshard.plan import Block, Message
    >>> m = Message(0, 1, ((0, 2),), 16, (0, 1), 0, ((0,),),
    ...             blocks=(Block(((0, 2),), 0, ((0,),)), Block(((4, 6),), 1, ((0,),))))
    >>> [(b.index, raw.tolist()) for b, raw in received_parts(m, np.arange(16, dtype=np.uint8), 4)]
    [(((0, 2),), [0, 1, 2, 3, 4, 5, 6, 7]), (((4, 6),), [8, 9, 10, 11, 12, 13, 14, 15])]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshshard.plan import Message

__all__ = ["read_message", "received_parts"]


def _device_bytes(block: jax.Array, device) -> jax.Array:
    """A device block's bytes as a flat ``uint8`` array on ``device`` (no host copy)."""
    block = jax.device_put(block, device)
    if block.dtype == jnp.bool_:
        return block.astype(jnp.uint8).reshape(-1)
    return jax.lax.bitcast_convert_type(block, jnp.uint8).reshape(-1)


def read_message(blocks, value, msg: Message):
    """What the sender of ``msg`` sends: its block, or its blocks' bytes back to back
    (a NumPy ``uint8`` array, or on the device path a JAX one on the first block's
    device)."""
    if not msg.blocks:
        return blocks.read(value, msg.index)
    parts = [blocks.read(value, b.index) for b in msg.blocks]
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts])
    device = next(iter(parts[0].devices()))
    return jnp.concatenate([_device_bytes(p, device) for p in parts])


def received_parts(msg: Message, raw, itemsize: int) -> list[tuple[object, object]]:
    """``(block, raw bytes)`` of each block of a received ``msg`` (anything with an
    ``index``: the message itself when it carries one block)."""
    if not msg.blocks:
        return [(msg, raw)]
    out, at = [], 0
    for b in msg.blocks:
        n = math.prod(hi - lo for lo, hi in b.index) * itemsize
        out.append((b, raw[at : at + n]))
        at += n
    if at != len(raw):
        raise ValueError(f"message {msg} delivered {len(raw)} bytes, its blocks hold {at}")
    return out
