"""A recurrent layer's weight gradient under data parallelism: collectives per step and
step time, beside ``jax.jit`` with ``NamedSharding`` on the same devices.

    python benchmarks/recurrent_grads.py [--model lstm|stacked] [--micro-batches 1 2]
        [--steps 20] [--rounds 3] [--hidden 128] [--length 32] [--batch 64]
        [--json OUT.json] [--repo PATH]

An LSTM's backward is a ``lax.scan`` over time whose carry sums the weight gradient, one
contraction over the batch per time step.  With the batch split over the mesh, XLA
all-reduces that partial sum inside the loop, once per time step; meshshard holds it as
per-device partial sums through the loop and reduces it once per step
(``passes/shard_unreduced.py``).  ``--model stacked``: residual blocks stacked with
``nn.scan``, whose weight gradients are the backward loop's scanned outputs, one layer's
per iteration, all-reduced inside the loop by XLA, per micro-batch.  Under the sharding ILP (``ShardParallel``, "auto")
the loops used to run replicated, every device computing the whole batch; they now
split it as data parallelism does (``passes/shard_loops.py``).  For
``DataParallel((1, 4), num_micro_batches=M)``, ``ShardParallel((1, 4), ...)`` and the peer (one ``jax.jit``, batch split over the 4 devices), this counts what one step
runs (each program's HLO collectives, a loop body's once per iteration, times the
program's runs per step) and times steps on the in-process threads cluster, meshshard and
the peer alternating in rounds in one process.  ``--repo`` plans and runs with the
meshshard checked out there (a worktree of an older commit) for a before/after; loop
trips are counted with this checkout's HLO reader either way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hlo_reader():
    """This checkout's ``meshshard/hlo_collectives.py``, loaded by path (``--repo`` may
    put an older meshshard, without loop trip counts, on the import path)."""
    path = os.path.join(ROOT, "meshshard", "hlo_collectives.py")
    spec = importlib.util.spec_from_file_location("_hlo_collectives_here", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _case(hidden: int, length: int, batch: int, model_name: str = "lstm"):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState

    import meshshard

    class Recurrent(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RNN(nn.LSTMCell(hidden))(x)
            return nn.Dense(1)(h[:, -1])

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(hidden)(jnp.tanh(nn.Dense(hidden)(h))), None

    class Stacked(nn.Module):  # ``length`` residual blocks under nn.scan
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(hidden)(x.reshape(x.shape[0], -1))
            blocks = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=length
            )
            h, _ = blocks()(h, None)
            return nn.Dense(1)(h)

    def step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, length if model_name == "lstm" else 1, 32))
    x = x.astype(np.float32)
    y = rng.standard_normal((batch, 1)).astype(np.float32)
    model = Recurrent() if model_name == "lstm" else Stacked()
    state = TrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.PRNGKey(0), x)["params"],
        tx=optax.adam(1e-3),
    )
    return step, state, x, y


def _count(collectives, runs: int, out: dict) -> None:
    for c in collectives:
        entry = out.setdefault(c.kind, [0, 0])
        entry[0] += runs * c.runs
        entry[1] += runs * c.runs * int(c.nbytes)


def meshshard_per_step(plan, traced, hlo) -> dict:
    """kind -> [count, bytes] one step of ``plan`` runs on mesh 0 (programs compiled as
    the runtime compiles them, by ``hlo.program_collectives``)."""
    import jax

    from meshshard.instructions import Run

    devices = jax.devices()[: plan.meshes[0].num_devices]
    got = hlo.program_collectives(plan, traced, 0, devices)
    stream = next(s for s in plan.streams if s.worker == plan.meshes[0].workers[0])
    out: dict = {}
    for p in plan.programs_run():
        runs = sum(isinstance(i, Run) and i.program == p.name for i in stream.instructions)
        _count(got[str(p.name)], runs, out)
    return out


def peer(step, state, x, y, hlo):
    """The peer: ``jax.jit`` of the step, batch split over the 4 devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    fn = jax.jit(step, in_shardings=(whole, rows, rows), out_shardings=(whole, whole))
    args = (jax.device_put(state, whole), jax.device_put(x, rows), jax.device_put(y, rows))
    found: dict = {}
    _count(hlo.parse_collectives(fn.lower(*args).compile().as_text()), 1, found)
    return (lambda s: fn(s, args[1], args[2])), args[0], found


def _time(call, state, steps: int) -> tuple[float, object]:
    import jax

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = call(state)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def timed_rounds(calls: dict, steps: int, rounds: int, warm: int = 2, swap: bool = False):
    """``{label: [median step seconds per round]}`` of ``calls`` (label -> (call, state),
    ``call(state) -> (state, loss)``): each warmed up with ``warm`` steps, then
    ``rounds`` rounds of ``steps`` steps each, the calls in turn (order reversed every
    other round when ``swap``); also returns the last states."""
    states = {k: s for k, (_, s) in calls.items()}
    for k, (call, _) in calls.items():  # compile and warm up
        _, states[k] = _time(call, states[k], warm)
    times: dict = {k: [] for k in calls}
    for r in range(rounds):
        order = list(calls) if not (swap and r % 2) else list(reversed(calls))
        for k in order:
            t, states[k] = _time(calls[k][0], states[k], steps)
            times[k].append(t)
    return times, states


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--model",
        default="lstm",
        choices=["lstm", "stacked"],
        help="an LSTM over --length time steps, or --length residual blocks under nn.scan",
    )
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repo", default=ROOT, help="the meshshard checkout to plan and run with")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    hlo = _hlo_reader()
    sys.path.insert(0, os.path.abspath(args.repo))
    import jax

    import meshshard
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    step, state, x, y = _case(args.hidden, args.length, args.batch, args.model)
    print(f"planned with {meshshard.__file__}")
    what = "time steps" if args.model == "lstm" else "stacked residual blocks (nn.scan)"
    print(
        f"{args.model}: hidden {args.hidden}, {args.length} {what}, batch {args.batch}, 4 devices"
    )
    calls, counts = {}, {}
    peer_call, peer_state, counts["jax.jit"] = peer(step, state, x, y, hlo)
    calls["jax.jit"] = (peer_call, peer_state)
    with use_cluster(ThreadsCluster(1, 4)):
        methods = {}
        for m in args.micro_batches:
            methods[f"DataParallel M={m}"] = meshshard.DataParallel((1, 4), num_micro_batches=m)
        for m in args.micro_batches:
            methods[f"auto M={m}"] = meshshard.ShardParallel((1, 4), num_micro_batches=m)
        for label, method in methods.items():
            par = meshshard.parallelize(step, method=method, batch_argnums=(1, 2))
            exe = par._executable_for((state, x, y))  # the plan the run uses
            counts[label] = meshshard_per_step(exe.plan, exe.traced, hlo)
            calls[label] = ((lambda s, par=par: par(s, x, y)), state)
        times, states = timed_rounds(calls, args.steps, args.rounds)
    jax.block_until_ready(states)
    base = statistics.median(times["jax.jit"])
    rows = []
    print(
        f"{'plan':20} {'all-reduces':>11} {'reduced KiB':>11} {'other':>8} {'ms / step':>10} "
        f"{'vs jax.jit':>10}"
    )
    for k in calls:
        ar = counts[k].get("all-reduce", [0, 0])
        other = sum(n for kind, (n, _) in counts[k].items() if kind != "all-reduce")
        ms = statistics.median(times[k]) * 1e3
        print(
            f"{k:20} {ar[0]:>11} {ar[1] / 1024:>11.1f} {other:>8} {ms:>10.2f} "
            f"{ms / base / 1e3:>10.2f}"
        )
        rows.append({"plan": k, "all_reduce": ar, "ms": times[k], "counts": counts[k]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repo": os.path.abspath(args.repo), "args": vars(args), "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
