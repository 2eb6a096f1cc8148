"""Run one cross-mesh transfer on its own, on per-device NumPy tiles.

Each source worker holds the tiles its devices own; each destination worker ends with
the tile every one of its devices must hold.  Used to test resharding plans for real
across processes (bytes and values checked against NumPy) and to benchmark them,
independently of JAX meshes and models.
"""

from __future__ import annotations

import numpy as np

from meshshard.plan import Plan, TransferSpec
from meshshard.runtime.interpreter import StreamInterpreter
from meshshard.runtime.transport import CountingTransport, Transport
from meshshard.tiles import device_blocks, intersect

Tiles = dict[int, tuple[tuple[tuple[int, int], ...], np.ndarray]]  # local device -> (index, data)


def source_tiles(full: np.ndarray, plan: Plan, worker: int) -> Tiles:
    """The tiles of ``full`` that ``worker``'s devices hold on the transfer's source mesh."""
    t = plan.transfers[0]
    mesh = plan.meshes[t.src_mesh]
    return _tiles_of(full, mesh, t.tensor.spec, worker)


def expected_tiles(full: np.ndarray, plan: Plan, worker: int) -> Tiles:
    """What ``worker``'s devices must hold after the transfer (the NumPy reference)."""
    t = plan.transfers[0]
    return _tiles_of(full, plan.meshes[t.dst_mesh], t.dst_spec, worker)


def _tiles_of(full, mesh, spec, worker) -> Tiles:
    blocks = device_blocks(mesh.axis_shape, spec, full.shape)
    h = mesh.hosts.index(worker)
    out = {}
    for d in range(mesh.shape[1]):
        idx = blocks[h * mesh.shape[1] + d]
        out[d] = (idx, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in idx)]))
    return out


class TileBlocks:
    """Values are per-device tiles (see module docstring)."""

    def __init__(self, plan: Plan, worker: int):
        self.plan = plan
        self.worker = worker

    def read(self, value: Tiles, index) -> np.ndarray:
        for idx, data in value.values():
            if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(index, idx, strict=True)):
                sl = tuple(
                    slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(index, idx, strict=True)
                )
                return np.ascontiguousarray(data[sl])
        raise ValueError(f"w{self.worker} holds no tile containing block {index}")

    def assemble(self, t: TransferSpec, parts) -> Tiles:
        mesh = self.plan.meshes[t.dst_mesh]
        blocks = device_blocks(mesh.axis_shape, t.dst_spec, t.tensor.shape)
        h = mesh.hosts.index(self.worker)
        dtype = np.dtype(t.tensor.dtype)
        out: Tiles = {}
        for d in range(mesh.shape[1]):
            idx = blocks[h * mesh.shape[1] + d]
            tile = np.zeros(tuple(b - a for a, b in idx), dtype)
            for msg, raw in parts:
                part = intersect(idx, msg.index)
                if part is None:
                    continue
                block = raw.view(dtype).reshape(tuple(b - a for a, b in msg.index))
                src = tuple(
                    slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, msg.index, strict=True)
                )
                dst = tuple(
                    slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, idx, strict=True)
                )
                tile[dst] = block[src]
            out[d] = (idx, tile)
        return out


def run_transfer(
    plan: Plan, worker: int, transport: Transport, tiles: Tiles | None
) -> tuple[Tiles | None, int]:
    """Run ``worker``'s stream of a transfer-only plan; a source passes its tiles, a
    destination gets its devices' tiles back.  Also returns the bytes it received."""
    stream = next(s for s in plan.streams if s.worker == worker)
    counting = CountingTransport(transport)
    interp = StreamInterpreter(stream, plan, {}, None, counting, blocks=TileBlocks(plan, worker))
    buffer = plan.transfers[0].name.buffer(0)
    buffers = {buffer: (tiles,)} if tiles is not None else {}
    buffers = interp.run(buffers, load=None)
    value = buffers.get(buffer)
    return (value[0] if value is not None else None), counting.bytes_received


def expected_bytes_received(plan: Plan, worker: int) -> int:
    """Bytes the plan says ``worker`` receives (every message it is a receiver of)."""
    return sum(m.nbytes for m in plan.transfers[0].messages if worker in m.receivers)


def run_transfer_threads(plan: Plan, full: np.ndarray) -> tuple[dict[int, Tiles], dict[int, int]]:
    """Run a transfer-only plan with every worker a thread of this process; returns each
    destination worker's tiles and every worker's received bytes."""
    from meshshard.runtime.executable import run_in_threads
    from meshshard.runtime.transport import QueueTransport

    workers = [s.worker for s in plan.streams]
    transports = QueueTransport.group(workers)
    src = set(plan.meshes[plan.transfers[0].src_mesh].workers)

    def one(w: int):
        tiles = source_tiles(full, plan, w) if w in src else None
        return run_transfer(plan, w, transports[w], tiles)

    out = run_in_threads(workers, one)
    results = {w: tiles for w, (tiles, _) in out.items() if tiles is not None}
    received = {w: nbytes for w, (_, nbytes) in out.items()}
    return results, received
