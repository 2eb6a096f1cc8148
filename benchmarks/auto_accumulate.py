"""Collectives per step of ``sharding="auto"`` plans with gradient accumulation, beside
the data-parallel plan of the same mesh.

    python benchmarks/auto_accumulate.py [--micro-batches 2 4] [--json OUT.json]
        [--repo PATH]

With several micro-batches, local accumulation holds each gradient contribution as
per-device partial sums and the update reduces it once per step
(``passes/shard_accumulate.py``).  The sharding solver prices that (a gradient's reduce
at ``1 / M``), but its plans used to leave some contributions outside it, reduced once
per micro-batch: a scatter-add whose indices the solver keeps whole (every embedding
table), a contraction it splits over the sequence rather than the batch, and a value it
splits between the contraction and the gradient.

With one micro-batch, a gradient summed from several contractions (a tied embedding's
lookup and output head) was all-reduced once per contraction, as ``jax.jit`` does.

For each model (the tied embedding of Alpa's ``test_embedding_2d_mesh``, the BERT and
GPT examples) and micro-batch count, this compiles the ``DataParallel`` and
``ShardParallel(sharding="auto")`` plans of 4 devices, one host's or (``--mesh 2x2``)
two hosts' (``--models gpt_shard_real``: ``benchmarks/shard_real.py``'s GPT) (no run: XLA's HLO of
every program, ``meshshard.hlo_collectives``) and counts what one step runs: each
program's collectives times its runs per step.  Deterministic, so one run suffices;
``--repo`` plans with the meshshard checked out there (a worktree of an older commit)
for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _models():
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard
    from examples import bert, gpt

    class TiedEmbedding(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(1024, 8)
            return embed.attend(embed(ids))

    def tied_step(state, ids, labels):
        def loss_fn(params):
            logits = state.apply_fn(params, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

        return state.apply_gradients(grads=meshshard.grad(loss_fn)(state.params))

    def tied():
        rng = np.random.default_rng(0)
        ids, labels = (rng.integers(0, 1024, (16, 8)).astype(np.int32) for _ in range(2))
        model = TiedEmbedding()
        params = model.init(jax.random.PRNGKey(0), ids)
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        return tied_step, (state, ids, labels), (1, 2)

    def bert_case():
        batch = bert.make_batch(batch_size=16)
        state = bert.make_state(bert.Encoder(num_layers=2, dropout=0.0), batch)
        return bert.train_step, (state.replace(key=jax.random.key_data(state.key)), batch), (1,)

    def gpt_case():
        batch = gpt.make_batch(batch_size=16)
        state = gpt.make_state(gpt.GPT(num_layers=2), batch["inputs"])
        return gpt.train_step, (state, batch), (1,)

    def gpt_shard_real():  # benchmarks/shard_real.py's GPT
        batch = gpt.make_batch(16, seq_len=32)
        model = gpt.GPT(vocab=64, d_model=64, num_heads=4, num_layers=4, max_len=32)
        return gpt.train_step, (gpt.make_state(model, batch["inputs"]), batch), (1,)

    return {
        "tied_embedding": tied,
        "bert": bert_case,
        "gpt": gpt_case,
        "gpt_shard_real": gpt_shard_real,
    }


def per_step(plan, traced) -> dict[str, list[int]]:
    """kind -> [count, bytes] of the collectives one step of ``plan`` runs on mesh 0."""
    import jax

    from meshshard.hlo_collectives import program_collectives
    from meshshard.instructions import Run

    devices = jax.devices()[: plan.meshes[0].num_devices]
    got = program_collectives(plan, traced, 0, devices)
    stream = next(s for s in plan.streams if s.worker == plan.meshes[0].workers[0])
    out: dict[str, list[int]] = {}
    for p in plan.programs_run():
        runs = sum(isinstance(i, Run) and i.program == p.name for i in stream.instructions)
        for c in got[str(p.name)]:
            entry = out.setdefault(c.kind, [0, 0])
            entry[0] += runs
            entry[1] += runs * int(c.nbytes)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", default=["tied_embedding", "bert", "gpt"])
    ap.add_argument(
        "--mesh", default="1x4", choices=["1x4", "2x2"], help="one host of 4, or 2 hosts of 2"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--repo", default=ROOT, help="the meshshard checkout to plan with")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    sys.path.insert(0, os.path.abspath(args.repo))
    import meshshard
    from meshshard.cluster import ClusterSpec
    from meshshard.passes.pipeline import plan_step

    hosts = int(args.mesh[0])
    cluster = ClusterSpec(num_hosts=hosts, devices_per_host=4 // hosts)
    shape = (hosts, 4 // hosts)
    rows = []
    print(f"planned with {meshshard.__file__}")
    print(
        f"{'model':16} {'M':>2} {'plan':14} {'all-reduces':>11} {'reduced KiB':>11} {'other':>24}"
    )
    cases = _models()
    for name in args.models:
        fn, call_args, batch_argnums = cases[name]()
        for m in args.micro_batches:
            methods = {
                "data_parallel": meshshard.DataParallel(shape, num_micro_batches=m),
                "auto": meshshard.ShardParallel(shape, num_micro_batches=m),
            }
            for label, method in methods.items():
                plan, traced = plan_step(
                    fn, call_args, method=method, cluster=cluster, batch_argnums=batch_argnums
                )
                found = per_step(plan, traced)
                ar = found.pop("all-reduce", [0, 0])
                other = ", ".join(f"{k} x{n} {b / 1024:.1f} KiB" for k, (n, b) in found.items())
                print(f"{name:16} {m:>2} {label:14} {ar[0]:>11} {ar[1] / 1024:>11.1f} {other:>24}")
                rows.append(
                    {"model": name, "mesh": args.mesh, "micro_batches": m, "plan": label}
                    | {"all_reduce": ar}
                    | {k: v for k, v in found.items()}
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repo": os.path.abspath(args.repo), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
