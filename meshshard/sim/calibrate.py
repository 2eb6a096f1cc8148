"""Measure this machine into a ``local`` :class:`ClusterSpec` (``meshshard calibrate``).

The local cluster is emulated: every host-actor is a process on this machine and its
devices are CPU devices.  So we measure what the runtime really uses:

- transport: ``torch.distributed`` with gloo between two local processes (the
  cross-mesh data plane of DESIGN.md): a small-message ping-pong gives the latency, a
  large send acknowledged by a one-element reply gives the bandwidth;
- compute: a timed float32 matmul (torch, all threads);
- memory: a timed large ``numpy`` copy (its copy rate is the intra-host "fabric"
  between emulated devices; reads plus writes give the roofline's memory bandwidth).

All emulated hosts share the machine, so per-device compute and memory bandwidth are
the machine's divided by the number of emulated devices, and the switch is modelled
as oversubscribed ``num_hosts``:1 (all inter-host traffic together gets one measured
stream's bandwidth).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
from dataclasses import dataclass

import numpy as np

from meshshard.cluster import ClusterSpec

__all__ = [
    "Measurements",
    "measure",
    "calibrate",
    "measure_transport",
    "measure_matmul",
    "measure_memcpy",
]


@dataclass(frozen=True)
class Measurements:
    """Raw figures of one calibration run (bytes/s, seconds, FLOP/s)."""

    transport_bandwidth: float
    transport_latency: float
    matmul_flops: float
    memcpy_bandwidth: float
    memory_bytes: float

    def __str__(self) -> str:
        return (
            f"gloo p2p {self.transport_bandwidth / 1e9:.3g} GB/s, {self.transport_latency * 1e6:.3g} us; "
            f"matmul {self.matmul_flops / 1e9:.3g} GFLOP/s; memcpy {self.memcpy_bandwidth / 1e9:.3g} GB/s; "
            f"RAM {self.memory_bytes / 2**30:.3g} GiB"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transport_worker(rank: int, port: int, nbytes: int, iters: int, pings: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        small = torch.zeros(1, dtype=torch.float32)
        big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        peer = 1 - rank

        def ping(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    dist.send(small, peer)
                    dist.recv(small, peer)
                else:
                    dist.recv(small, peer)
                    dist.send(small, peer)
            return time.perf_counter() - t0

        def bulk(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    dist.send(big, peer)
                    dist.recv(small, peer)
                else:
                    dist.recv(big, peer)
                    dist.send(small, peer)
            return time.perf_counter() - t0

        # Best of several batches: on a busy machine the scheduler adds noise, and the
        # transport's own cost is the floor of what we see.
        ping(max(1, pings // 10))  # warm up connections
        batch = max(1, pings // 5)
        latency = min(ping(batch) / (2 * batch) for _ in range(5))
        bulk(1)
        per_iter = sorted(bulk(1) for _ in range(iters))[iters // 2]  # median
        if rank == 0:
            moving = max(per_iter - 2 * latency, 1e-9)
            out.put((big.numel() * 4 / moving, latency))
    finally:
        dist.destroy_process_group()


def measure_transport(
    nbytes: int = 64 << 20, iters: int = 5, pings: int = 200
) -> tuple[float, float]:
    """(bytes/s, seconds): gloo send/recv bandwidth and one-way latency between two local processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_transport_worker, args=(rank, port, nbytes, iters, pings, out))
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        bandwidth, latency = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    return bandwidth, latency


def measure_matmul(n: int = 1024, iters: int = 5) -> float:
    """FLOP/s of a float32 ``n x n`` matmul on this machine's CPU (torch, all threads)."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def measure_memcpy(nbytes: int = 256 << 20, iters: int = 5) -> float:
    """Bytes copied per second by a large memory copy (each byte is read once and written once)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(iters):
        np.copyto(dst, src)
    return src.nbytes * iters / (time.perf_counter() - t0)


def _ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8.0 * 2**30


def measure(quick: bool = False) -> Measurements:
    """Run every measurement; ``quick`` uses small sizes (seconds, for tests)."""
    if quick:
        bw, lat = measure_transport(nbytes=4 << 20, iters=2, pings=20)
        flops = measure_matmul(n=256, iters=2)
        mem = measure_memcpy(nbytes=16 << 20, iters=2)
    else:
        bw, lat = measure_transport()
        flops = measure_matmul()
        mem = measure_memcpy()
    return Measurements(bw, lat, flops, mem, _ram_bytes())


def calibrate(
    num_hosts: int = 4, devices_per_host: int = 2, *, quick: bool = False, name: str = "local"
) -> ClusterSpec:
    """A ClusterSpec of ``num_hosts`` emulated hosts x ``devices_per_host`` CPU devices on this machine."""
    m = measure(quick=quick)
    devices = num_hosts * devices_per_host
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ClusterSpec(
        name=name,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores shared)",
        peak_flops=(("float32", m.matmul_flops / devices),),
        device_memory=m.memory_bytes / devices,
        memory_bandwidth=2
        * m.memcpy_bandwidth
        / devices,  # reads + writes, as bytes_accessed counts
        launch_overhead=ClusterSpec().launch_overhead,
        intra_fabric="memcpy",
        intra_bandwidth=m.memcpy_bandwidth,
        intra_latency=ClusterSpec().intra_latency,
        nics_per_host=1,
        nic_bandwidth=m.transport_bandwidth,
        nic_latency=m.transport_latency,
        oversubscription=float(max(1, num_hosts)),
        source=f"meshshard calibrate on {platform.node()} at {when}{' (quick)' if quick else ''}: {m}",
    )
