"""Sharded checkpoint throughput vs a plain ``np.save`` of the same bytes.

    python benchmarks/checkpoint.py [--hidden 4800] [--json OUT.json]

On the embedded local Ray cluster (4 host-actors x 2 CPU devices): a 6-layer MLP with
Adam, pipelined over 4 single-device meshes, holds about 1 GB of state (parameters and
both Adam moments) on the actors.  Measured in one run: ``meshshard.save`` (every actor
writes its own shards with orbax), the time until an async save hands control back,
``meshshard.restore`` onto the same layout, and the same bytes written and read by this
process with ``np.save``/``np.load`` (one file per array).  Ratios are meshshard time
over NumPy time (lower is better); the NumPy figures need the arrays in this process
already, which a sharded state does not have.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import meshshard  # noqa: E402
from examples import mlp  # noqa: E402
from meshshard.runtime.executable import RemoteArray  # noqa: E402

METHOD = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 4, schedule="gpipe")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="meshshard-ckpt-", dir=args.dir)
    meshshard.init()
    try:
        batch = mlp.make_batch(batch_size=8)
        state = mlp.make_state(mlp.MLP(hidden=args.hidden, num_layers=6), batch["x"])
        step = meshshard.parallelize(mlp.train_step, method=METHOD)
        state, _ = step(state, batch)
        remote = [x for x in jax.tree.leaves(state) if isinstance(x, RemoteArray)]
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        _, save_s = timed(lambda: meshshard.save(os.path.join(root, "a"), state))
        handle, async_s = timed(lambda: meshshard.save(os.path.join(root, "b"), state, wait=False))
        handle.wait()
        back, restore_s = timed(lambda: meshshard.restore(os.path.join(root, "a"), like=state))
        exact = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True)
        )
        host = [np.asarray(x) for x in jax.tree.leaves(state)]
        del back
        npdir = os.path.join(root, "np")
        os.makedirs(npdir)
        files = [os.path.join(npdir, f"{i}.npy") for i in range(len(host))]

        def np_save():
            for f, a in zip(files, host, strict=True):
                np.save(f, a)

        _, np_save_s = timed(np_save)
        _, np_load_s = timed(lambda: [np.load(f) for f in files])
    finally:
        meshshard.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    rec = {
        "state_bytes": nbytes,
        "arrays_on_actors": len(remote),
        "save_s": save_s,
        "async_save_returns_s": async_s,
        "restore_s": restore_s,
        "np_save_s": np_save_s,
        "np_load_s": np_load_s,
        "save_GBps": gb / save_s,
        "restore_GBps": gb / restore_s,
        "np_save_GBps": gb / np_save_s,
        "np_load_GBps": gb / np_load_s,
        "save_over_np_save": save_s / np_save_s,
        "restore_over_np_load": restore_s / np_load_s,
        "bit_exact": exact,
    }
    print(f"state {gb:.2f} GB in {len(remote)} arrays on the actors; restored bit-exact: {exact}")
    print(f"{'':24}{'seconds':>10}{'GB/s':>8}{'vs numpy':>10}")
    print(f"{'meshshard.save':24}{save_s:10.2f}{gb / save_s:8.2f}{save_s / np_save_s:10.2f}")
    print(f"{'  async save returns':24}{async_s:10.3f}")
    print(
        f"{'meshshard.restore':24}{restore_s:10.2f}{gb / restore_s:8.2f}{restore_s / np_load_s:10.2f}"
    )
    print(f"{'np.save (driver)':24}{np_save_s:10.2f}{gb / np_save_s:8.2f}")
    print(f"{'np.load (driver)':24}{np_load_s:10.2f}{gb / np_load_s:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
