"""How much two programs sharing this machine's cores slow each other, against the
simulator's processor-sharing model (``meshshard/sim/cores.py``).

    python benchmarks/core_contention.py [--seconds 4] [--rounds 2] [--json OUT.json]

The simulator charges a program one core per device of its mesh on a host (XLA:CPU runs
one thread per emulated device) and, while the running programs want more cores than
the machine has, slows them all by ``cores / demand``.  Here one GPT block's loss and
gradient (d_model 96, the fidelity benchmark's held-out size) runs in three forms:

- ``one``: one device, 3 rows;
- ``replicated``: a mesh of 2 devices, 3 rows on each (the batch does not divide: every
  device computes it all, as the runtime's "batch not split" plans do);
- ``split``: a mesh of 2 devices, 6 rows split 3 per device (XLA all-reduces the
  gradient inside the program).

Each form is timed alone (one spawned process) and as a pair (two spawned processes,
started together, the same program in each) for ``--seconds`` each, in ``--rounds``
interleaved rounds.  Reported: the median call, the pair's slow-down (pair / alone), and
the slow-down the model predicts on this machine's cores (``demand`` of the pair over the
cores, at least 1).  The inverse, ``effective demand = cores x slow-down / 2``, is what
the two devices' threads of one program really keep busy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMS = {"one": (1, 3, False), "replicated": (2, 3, False), "split": (2, 6, True)}


def _worker(form: str, seconds: float, barrier, out) -> None:
    """Median seconds per call of ``form`` in this (spawned) process, timed after
    ``barrier`` for ``seconds``."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import time

    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from examples import gpt

    devices, rows, split = FORMS[form]
    model = gpt.GPT(vocab=64, num_heads=4, d_model=96, num_layers=1, max_len=32)
    batch = gpt.make_batch(rows, seq_len=32)
    state = gpt.make_state(model, batch["inputs"])

    def grads(params, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        return jax.value_and_grad(loss_fn)(params)

    mesh = Mesh(jax.devices()[:devices], ("d",))
    whole = NamedSharding(mesh, P())
    rows_sh = NamedSharding(mesh, P("d")) if split else whole
    fn = jax.jit(grads, in_shardings=(whole, rows_sh), out_shardings=whole)
    params, batch = jax.device_put(state.params, whole), jax.device_put(batch, rows_sh)
    for _ in range(5):
        jax.block_until_ready(fn(params, batch))
    barrier.wait()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, batch))
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times))


def timed(form: str, processes: int, seconds: float) -> float:
    """Mean over ``processes`` concurrent spawned processes of their median call."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_worker, args=(form, seconds, barrier, out)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    medians = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return statistics.mean(medians)


def model_slowdown(devices: int, cores: int) -> float:
    """The processor-sharing model's slow-down of a pair of ``devices``-device programs."""
    return max(1.0, 2 * devices / cores)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    runs: dict[str, dict[int, list[float]]] = {f: {1: [], 2: []} for f in FORMS}
    for r in range(args.rounds):
        for form in FORMS:
            for n in (1, 2):
                runs[form][n].append(timed(form, n, args.seconds))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for form, (devices, rows_per_device, _) in FORMS.items():
        alone, pair = (statistics.median(runs[form][n]) for n in (1, 2))
        slow = [p / a for a, p in zip(runs[form][1], runs[form][2], strict=True)]
        rows.append(
            dict(
                form=form,
                devices=devices,
                rows_per_device=rows_per_device,
                alone_s=alone,
                pair_s=pair,
                slowdown_per_round=slow,
                slowdown=statistics.median(slow),
                model_slowdown=model_slowdown(devices, cores),
                effective_demand=cores * statistics.median(slow) / 2,
            )
        )
    print(f"cores: {cores}")
    print(
        f"{'form':<11} {'devices':>7} {'alone ms':>9} {'pair ms':>8} {'slow-down':>9} "
        f"{'per round':>14} {'model':>6} {'eff. demand':>11}"
    )
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["slowdown_per_round"])
        print(
            f"{r['form']:<11} {r['devices']:>7} {r['alone_s'] * 1e3:>9.2f} "
            f"{r['pair_s'] * 1e3:>8.2f} {r['slowdown']:>9.2f} {per:>14} "
            f"{r['model_slowdown']:>6.2f} {r['effective_demand']:>11.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cores=cores, seconds=args.seconds, rounds=args.rounds, rows=rows), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
