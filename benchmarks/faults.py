"""The fault matrix: kill host-actor processes and measure what the user sees.

    python benchmarks/faults.py [--cluster local|multinode] [--json OUT.json]

``local``: the embedded Ray cluster (4 host-actors x 2 CPU devices); ``multinode``: a
``ray.cluster_utils.Cluster`` with two nodes, one host-actor each.  The train step is
the MLP of ``examples/mlp.py`` as a two-stage pipeline (stage 0 on w0, stage 1 on w1).
Cases:

- ``eval with another layout``: a ``DataParallel()`` step between two pipeline steps
  regroups the hosts (the actors restart); nothing is killed;
- ``kill w1 between steps`` / ``kill w1 during a step`` / ``kill w0 during compile``:
  ``SIGKILL`` to the actor's own pid (from ``cluster.pids``, actors this script
  started); "during" kills right after the driver submitted that call to the actors.

Per case: seconds from the kill to the error, the error's first lines, how many state
leaves are still fetchable and equal to ``jax.jit``'s, seconds ``meshshard.recover()``
took, and whether the next steps after recovery equal ``jax.jit``.  Each check is also
asserted, so a run that prints a table passed them all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import meshshard  # noqa: E402
from examples import mlp  # noqa: E402

PIPELINE = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def close(a, b) -> bool:
    """Every leaf of ``b`` equals ``a``'s within float32 rounding."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
        for x, y in zip(la, lb, strict=True)
    )


def kept_leaves(state, ref) -> tuple[int, int]:
    """(leaves of ``state`` still fetchable and equal to ``ref``'s, all leaves)."""
    ok = 0
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        with contextlib.suppress(meshshard.MeshshardRuntimeError):
            ok += bool(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6))
    return ok, len(jax.tree.leaves(ref))


@contextlib.contextmanager
def kill_during(cluster, what: str, host: int, when: dict):
    """Kill ``host``'s actor right after the driver submits the first call whose
    description starts with ``what`` (``when["t"]`` gets the kill time), whether it went
    as Ray calls (``_call``) or over the step connections (``channel_call``)."""

    def killing(original):
        def call(calls, description, *args, **kwargs):
            if description.startswith(what) and "t" not in when:
                when["t"] = time.perf_counter()
                os.kill(cluster.pids[host], signal.SIGKILL)
            return original(calls, description, *args, **kwargs)

        return call

    cluster._call = killing(cluster._call)
    cluster.channel_call = killing(cluster.channel_call)
    try:
        yield
    finally:
        del cluster._call
        del cluster.channel_call


def expect_fault(call, host: int, t_kill_of) -> tuple[float, str]:
    """Run ``call``; it must raise an error naming ``host`` and ``recover()``.
    Returns (seconds from the kill to the error, the error text)."""
    try:
        call()
    except meshshard.MeshshardRuntimeError as exc:
        seconds = time.perf_counter() - t_kill_of()
        text = str(exc)
        assert f"w{host} died" in text and "meshshard.recover()" in text, text
        return seconds, text
    raise AssertionError(f"killing w{host} raised no error")


def recovered(train, state, batch) -> tuple[float, bool]:
    """(seconds of meshshard.recover(), whether two steps after it equal jax.jit)."""
    t0 = time.perf_counter()
    meshshard.recover()
    seconds = time.perf_counter() - t0
    ref = jax.jit(mlp.train_step)
    s, r = state, state
    ok = True
    for _ in range(2):
        (s, loss), (r, rloss) = train(s, batch), ref(r, batch)
        ok &= close((r, rloss), (s, loss))
    assert ok, "steps after recovery differ from jax.jit"
    return seconds, ok


def case_other_layout(cluster, st, batch) -> dict:
    train = meshshard.parallelize(mlp.train_step, method=PIPELINE)
    evaluate = meshshard.parallelize(mlp.train_step, method=meshshard.DataParallel())
    ref = jax.jit(mlp.train_step)
    s, _ = train(st, batch)
    r, _ = ref(st, batch)
    t0 = time.perf_counter()
    _, eval_loss = evaluate(s, batch)
    seconds = time.perf_counter() - t0
    s, loss = train(s, batch)
    r2, rloss = ref(r, batch)
    ok = close((r2, rloss), (s, loss)) and close(ref(r, batch)[1], eval_loss)
    assert ok, "train -> DataParallel eval -> train differs from jax.jit"
    kept, total = kept_leaves(s, r2)
    return row("eval with another layout", None, "(none: arrays moved)", kept, total, seconds, ok)


def case_kill(cluster, st, batch, where: str, host: int) -> dict:
    """Train a step, kill ``host`` ``where`` ("between", "step", "compile"), recover."""
    train = meshshard.parallelize(mlp.train_step, method=PIPELINE)
    ref = jax.jit(mlp.train_step)
    s, _ = train(st, batch)
    r, _ = ref(st, batch)
    when: dict = {}
    if where == "between":
        when["t"] = time.perf_counter()
        os.kill(cluster.pids[host], signal.SIGKILL)
        detect, text = expect_fault(lambda: train(s, batch), host, lambda: when["t"])
    elif where == "step":
        with kill_during(cluster, "step of plan", host, when):
            detect, text = expect_fault(lambda: train(s, batch), host, lambda: when["t"])
    else:  # a new batch shape compiles a new plan
        bigger = mlp.make_batch(2 * batch["x"].shape[0])
        with kill_during(cluster, "compiling", host, when):
            detect, text = expect_fault(lambda: train(s, bigger), host, lambda: when["t"])
    kept, total = kept_leaves(s, r)
    seconds, ok = recovered(train, r, batch)
    name = {"between": "between steps", "step": "during a step", "compile": "during compile"}
    return row(f"kill w{host} {name[where]}", detect, text, kept, total, seconds, ok)


def row(case, detect_s, error, kept, total, recover_s, after_ok) -> dict:
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return {
        "case": case,
        "detect_s": detect_s,
        "error": " / ".join(lines[:2])[:220],
        "state_kept": f"{kept}/{total} leaves",
        "recover_s": recover_s,
        "after_recovery_equals_jit": after_ok,
    }


CASES = ("layout", "between", "step", "compile")


def run(kind: str, cases: tuple[str, ...] = CASES) -> list[dict]:
    """Start the cluster, run the chosen cases, shut it down; the rows of the matrix."""
    batch = mlp.make_batch(8)
    st = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    nodes = None
    if kind == "multinode":
        from ray.cluster_utils import Cluster

        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        cluster = meshshard.init(address=nodes.address, devices_per_host=2)
    else:
        cluster = meshshard.init()
    try:
        rows = [case_other_layout(cluster, st, batch)] if "layout" in cases else []
        for where, host in (("between", 1), ("step", 1), ("compile", 0)):
            if where in cases:
                rows.append(case_kill(cluster, st, batch, where, host))
    finally:
        meshshard.shutdown()
        if nodes is not None:
            import ray

            ray.shutdown()
            nodes.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=["local", "multinode"], default="local")
    parser.add_argument("--json")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all)",
    )
    args = parser.parse_args()
    cases = tuple(args.cases.split(","))
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {','.join(CASES)}")
    rows = run(args.cluster, cases)
    print(f"\nfault matrix ({args.cluster})")
    print("| case | detected after s | error (first lines) | state kept | recover s | then = jit |")
    print("|---|---:|---|---|---:|---|")
    for r in rows:
        d = "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
        print(
            f"| {r['case']} | {d} | {r['error']} | {r['state_kept']} | "
            f"{r['recover_s']:.1f} | {r['after_recovery_equals_jit']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": args.cluster, "rows": rows}, f, indent=1)
    print("FAULTS OK")


if __name__ == "__main__":
    main()
