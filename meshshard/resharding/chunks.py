"""NCCL-like sub-MiB chunks: a broadcast chain pipelines better in smaller chunks.

A chain broadcast through ``E`` edges (NIC hops between hosts, fabric hops inside
one) adds ``E - 1`` chunks of pipeline fill to its time: with the cluster's 1 MiB
chunk a 1 MiB block to four hosts pays three whole extra message times.  NCCL
shrinks its chunk for small messages (halving down to 32 KiB, ``enqueue.cc``) so the
pipeline has enough chunks; :func:`chain_chunk` does the same: it halves the chunk
while the fill would exceed 1/64 of the block, down to
:data:`~meshshard.resharding.bound.MIN_CHUNK_BYTES`.  Large blocks, and messages
with a single edge (nothing to pipeline), keep the cluster's chunk.

    >>> from meshshard.cluster import ClusterSpec
    >>> c = ClusterSpec.preset("aws-p3.8xlarge")
    >>> chain_chunk(1 << 20, 4, c), chain_chunk(64 << 20, 4, c), chain_chunk(1 << 20, 1, c)
    (32768, 262144, 1048576)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshshard.cluster import ClusterSpec
from meshshard.plan import Message
from meshshard.resharding.bound import MIN_CHUNK_BYTES

__all__ = ["chain_edges", "chain_chunk", "with_chunks"]

_FILL_SHARE = 64  # the fill may cost at most 1/64 of the block's own time


def chain_edges(m: Message) -> int:
    """Edges of ``m``'s chain: a hop into each receiving host, a hop per further device."""
    if not m.group:
        return 1
    if not m.dst_devices:
        return len(m.group) - 1
    return sum(len(d) for d in m.dst_devices)


def chain_chunk(nbytes: int, edges: int, cluster: ClusterSpec) -> int:
    """The chunk a chain of ``edges`` edges moves ``nbytes`` in (module docstring)."""
    chunk = cluster.chunk_bytes
    while chunk > MIN_CHUNK_BYTES and (edges - 1) * chunk * _FILL_SHARE > nbytes:
        chunk //= 2
    return max(chunk, min(MIN_CHUNK_BYTES, cluster.chunk_bytes))


def with_chunks(messages: Sequence[Message], cluster: ClusterSpec) -> list[Message]:
    """``messages`` with each broadcast's chunk set where :func:`chain_chunk` picks a
    smaller one than the cluster's (the others keep ``chunk_bytes=0``)."""
    out = []
    for m in messages:
        chunk = chain_chunk(m.nbytes, chain_edges(m), cluster) if m.group else 0
        if m.group and chunk < cluster.chunk_bytes and chunk < m.nbytes:
            m = dataclasses.replace(m, chunk_bytes=chunk)
        out.append(m)
    return out
