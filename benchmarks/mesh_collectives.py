"""What a collective *inside* a compiled program costs on this machine, per mesh axis.

The sharding solver prices XLA's own collectives (``ClusterSpec.mesh_collective_latency``
and ``mesh_collective_bandwidth``), which on the local cluster are not the transport's
messages: across host-actors they run over gloo between JAX processes joined by
``jax.distributed``, within one over emulated devices of one process.  This times a
``psum`` over 2 participants of each kind (median of ``--reps`` calls) and the same
program without the collective, and prints the difference and an alpha-beta fit.

    .venv/bin/python benchmarks/mesh_collectives.py [--reps 30] [--json OUT.json]

The "host" figures come from two child processes (``jax.distributed`` with gloo on
127.0.0.1), the "device" ones from this process with 2 emulated CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)


def _time_program(devices, nbytes: int, reps: int, collective: bool) -> float:
    """Median seconds of one call: a psum over ``devices`` (or a multiply without it)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("a",))
    body = (lambda x: jax.lax.psum(x, "a")) if collective else (lambda x: x * 2.0)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a")))
    n = nbytes // 4
    x = jax.make_array_from_callback(
        (n * len(devices),), NamedSharding(mesh, P("a")), lambda idx: np.ones((n,), np.float32)
    )
    fn(x).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(devices, reps: int) -> dict[int, dict[str, float]]:
    """bytes -> {psum, base, collective} seconds over ``devices``."""
    out = {}
    for nbytes in SIZES:
        psum = _time_program(devices, nbytes, reps, True)
        base = _time_program(devices, nbytes, reps, False)
        out[nbytes] = {"psum": psum, "base": base, "collective": max(psum - base, 0.0)}
    return out


def _child(rank: int, port: int, reps: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    got = measure([first[0], first[1]], reps)
    if rank == 0:
        print("RESULT " + json.dumps({str(k): v for k, v in got.items()}))


def across_processes(reps: int) -> dict[int, dict[str, float]]:
    """The host axis: two child processes joined by jax.distributed (gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--port", str(port)]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r), "--reps", str(reps)], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    line = next(ln for o in outs for ln in o.splitlines() if ln.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}


def fit(rows: dict[int, dict[str, float]]) -> tuple[float, float]:
    """(alpha seconds, bytes/s) by least squares over the sizes, both kept positive."""
    import numpy as np

    x = np.array(sorted(rows), float)
    y = np.array([rows[int(b)]["collective"] for b in x])
    a = np.vstack([np.ones_like(x), x]).T
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    return max(float(alpha), 0.0), (1.0 / beta if beta > 0 else float("inf"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.rank, args.port, args.reps)
        return 0
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    device = measure(jax.devices()[:2], args.reps)
    host = across_processes(args.reps)
    print(
        f"{'bytes':>9} | {'device psum':>11} {'no-op':>8} {'diff':>8} | {'host psum':>10} {'no-op':>8} {'diff':>8}  (us)"
    )
    for b in SIZES:
        d, h = device[b], host[b]
        print(
            f"{b:9d} | {d['psum'] * 1e6:11.1f} {d['base'] * 1e6:8.1f} {d['collective'] * 1e6:8.1f} | "
            f"{h['psum'] * 1e6:10.1f} {h['base'] * 1e6:8.1f} {h['collective'] * 1e6:8.1f}"
        )
    fits = {"device": fit(device), "host": fit(host)}
    for axis, (alpha, bw) in fits.items():
        print(f"{axis} axis fit: alpha {alpha * 1e6:.0f} us, {bw / 1e9:.3g} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "host": host, "fit": fits}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
