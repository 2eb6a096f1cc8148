"""Time a train step's calls the way the real-cluster benchmarks do (shared helper)."""

from __future__ import annotations

import time


def blocked_times(step, state, batch, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``step`` on the same arguments, each until all
    its results are ready (for steps that return no loss to wait on)."""
    import jax

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return times


def time_calls(step, state, batches) -> tuple[float, list[float]]:
    """Seconds of the first call on ``batches[0]`` (planning, compiling, and any actor
    restart) and of each later call, each until its loss is on the driver; asserts the
    last loss is finite."""
    import numpy as np

    t0 = time.perf_counter()
    s, loss = step(state, batches[0])
    float(loss)
    first = time.perf_counter() - t0
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        s, loss = step(s, b)
        float(loss)
        times.append(time.perf_counter() - t0)
    assert np.isfinite(float(loss)), "the loss is not finite"
    return first, times


def timed_steps(step, state, batch, n: int) -> tuple[object, list[float]]:
    """``n`` calls of ``step`` on ``batch`` from ``state``, each until its loss is on the
    driver: the last state and each call's seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, loss = step(state, batch)
        float(loss)
        times.append(time.perf_counter() - t0)
    return state, times


def progress(i: int, n: int, name: str, first_label: str, first_s: float, step_s: float) -> None:
    """One progress line on stderr: config ``i`` of ``n``, its first call and its step."""
    import sys

    print(
        f"[{i + 1}/{n}] {name}: {first_label} {first_s:.1f} s, step {1e3 * step_s:.1f} ms",
        file=sys.stderr,
        flush=True,
    )
