"""Gradients of a bfloat16 model: meshshard's pipeline against jax.jit, next to what
micro-batching alone changes, with XLA's excess precision on and off.

    python benchmarks/mixed_precision.py [--json OUT.json]

The model is a 4-layer Llama-style LM (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU; float32 parameters, bfloat16 compute, tied embedding).  Per row:
the largest relative error (norm of the difference over the norm, per leaf) of

- ``jax M=4``: ``jax.jit``'s gradient averaged over four micro-batches, against its
  full-batch gradient (what micro-batching costs in bfloat16 by itself);
- ``pipeline M=1`` / ``pipeline M=4``: meshshard's 1F1B over four stages of one host's
  (1, 2) meshes (threads), against ``jax.jit``'s full-batch gradient.

XLA keeps values in float32 inside one program where it may (``--xla_allow_excess_precision``,
on by default); a pipeline's stages are separate programs whose boundaries are rounded to
bfloat16, so its numbers differ from the one-program ``jax.jit``'s by more than
micro-batching alone does.  Each setting runs in its own process (XLA reads its flags once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
import meshshard
from meshshard.runtime.cluster import ThreadsCluster, use_cluster

D, H, KV, V, T, B, DT = 64, 4, 2, 97, 16, 8, jnp.bfloat16


def rope(x, pos):
    half = x.shape[-1] // 2
    ang = pos[:, None] / (10000 ** (jnp.arange(half) / half))[None]
    sin, cos = jnp.sin(ang)[None, :, None], jnp.cos(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        t, hd = x.shape[1], D // H
        h = nn.RMSNorm(dtype=DT)(x)
        q = nn.DenseGeneral((H, hd), use_bias=False, dtype=DT)(h)
        k = nn.DenseGeneral((KV, hd), use_bias=False, dtype=DT)(h)
        v = nn.DenseGeneral((KV, hd), use_bias=False, dtype=DT)(h)
        pos = jnp.arange(t, dtype=jnp.float32)
        q, k = rope(q, pos), rope(k, pos)
        k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(DT), v)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, dtype=DT)(a)
        h = nn.RMSNorm(dtype=DT)(x)
        g = nn.Dense(128, use_bias=False, dtype=DT)(h)
        u = nn.Dense(128, use_bias=False, dtype=DT)(h)
        return x + nn.Dense(D, use_bias=False, dtype=DT)(nn.silu(g) * u)


class Llama(nn.Module):
    @nn.compact
    def __call__(self, tok):
        emb = nn.Embed(V, D, dtype=DT)
        x = emb(tok)
        for i in range(4):
            x = Block()(x)
            if i < 3:
                meshshard.mark_pipeline_boundary()
        return emb.attend(nn.RMSNorm(dtype=DT)(x)).astype(jnp.float32)


model = Llama()
tok = np.random.default_rng(0).integers(0, V, (B, T + 1)).astype(np.int32)
params = model.init(jax.random.key(0), tok[:, :-1])["params"]


def grads(p, batch):
    def loss_fn(p):
        logits = model.apply({"params": p}, batch["tok"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tok"][:, 1:]).mean()

    return meshshard.grad(loss_fn)(p)


def worst(ref, got):
    errs = []
    for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.linalg.norm(x - y) / np.linalg.norm(x)))
    return max(errs)


batch = {"tok": tok}
full = jax.jit(grads)(params, batch)
quarters = [jax.jit(grads)(params, {"tok": tok[i * 2 : (i + 1) * 2]}) for i in range(4)]
row = {"jax M=4": worst(full, jax.tree.map(lambda *a: sum(a) / 4, *quarters))}
with use_cluster(ThreadsCluster(4, 2)):
    for m in (1, 4):
        method = meshshard.PipeshardParallel(num_micro_batches=m, stages=[(1, 2)] * 4)
        row[f"pipeline M={m}"] = worst(full, meshshard.parallelize(grads, method=method)(params, batch))
print(json.dumps(row))
"""


def run(excess: bool) -> dict:
    """One setting's row, from a fresh process with its XLA flags."""
    flags = "--xla_force_host_platform_device_count=8"
    flags += f" --xla_allow_excess_precision={'true' if excess else 'false'}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ROOT],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print("| excess precision | jax M=4 | pipeline M=1 | pipeline M=4 |")
    print("|---|---:|---:|---:|")
    for excess in (True, False):
        row = {"excess_precision": excess, **run(excess)}
        rows.append(row)
        print(
            f"| {'on' if excess else 'off'} | {row['jax M=4']:.2%} | "
            f"{row['pipeline M=1']:.2%} | {row['pipeline M=4']:.2%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
