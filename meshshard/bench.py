"""Time a parallelized step, optionally recording its measured timeline (``meshshard bench``).

A *step script* is a Python file that defines ``setup()`` returning ``(step, args)``:
``step`` a :func:`meshshard.parallelize`\\ d function and ``args`` the arguments of its
first call.  After each call the next arguments are ``advance(args, out)`` if the
script defines ``advance``, else the train-step convention ``(out[0], *args[1:])``
(the new state replaces the old, the batch stays).  The script may call
``meshshard.init(...)`` itself; otherwise :func:`run_script` starts the cluster asked for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["BenchResult", "bench_step", "load_script", "run_script"]


@dataclass(frozen=True)
class BenchResult:
    """Wall-clock seconds of each timed call (warm-up calls excluded)."""

    times: tuple[float, ...]
    warmup: int

    @property
    def median(self) -> float:
        """Median seconds per step."""
        return statistics.median(self.times)

    def __str__(self) -> str:
        t = sorted(self.times)
        return (
            f"{len(t)} steps after {self.warmup} warm-up: median {self.median * 1e3:.2f} ms, "
            f"min {t[0] * 1e3:.2f} ms, max {t[-1] * 1e3:.2f} ms"
        )


def _next_args(args, out):
    return (out[0], *args[1:])


def bench_step(
    step: Callable,
    args: tuple,
    steps: int = 15,
    warmup: int = 2,
    advance: Callable | None = None,
    after_warmup: Callable[[], None] | None = None,
) -> BenchResult:
    """Call ``step`` ``warmup + steps`` times, threading state with ``advance``; time each.

    The first call compiles; warm-up calls are not timed.  ``after_warmup()`` runs once
    between the warm-up and the timed calls (e.g. to start recording a trace).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    advance = advance or _next_args
    times = []
    for i in range(warmup + steps):
        if i == warmup and after_warmup is not None:
            after_warmup()
        t0 = time.perf_counter()
        out = step(*args)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        args = advance(args, out)
    return BenchResult(tuple(times), warmup)


def load_script(path: str):
    """Import a step script as a module (it must define ``setup()``)."""
    spec = importlib.util.spec_from_file_location("meshshard_step_script", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"STEP_SCRIPT {path!r} is not a Python file; pass a .py file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "setup", None)):
        raise ValueError(
            f"STEP_SCRIPT {path!r} defines no setup(); define setup() returning "
            "(parallelized_step, args)"
        )
    return module


@contextlib.contextmanager
def script_on_cluster(
    path: str, backend: str, num_hosts: int | None, devices_per_host: int | None
) -> Iterator:
    """The step script at ``path`` as a module, on the cluster already running or on one
    started for it (``backend``, sizes) and shut down when the block ends."""
    import meshshard
    from meshshard.runtime.cluster import current_cluster

    module = load_script(path)
    started = current_cluster() is None
    if started:
        meshshard.init(backend=backend, num_hosts=num_hosts, devices_per_host=devices_per_host)
    try:
        yield module
    finally:
        if started:
            meshshard.shutdown()


def run_script(
    path: str,
    steps: int = 15,
    warmup: int = 2,
    trace: str | None = None,
    backend: str = "ray",
    num_hosts: int | None = None,
    devices_per_host: int | None = None,
) -> tuple[BenchResult, Callable]:
    """Run a step script's step ``steps`` times (after ``warmup``), recording the timeline
    of the timed steps to ``trace`` when given; returns (the timings, the step)."""
    with script_on_cluster(path, backend, num_hosts, devices_per_host) as module:
        step, args = module.setup()
        advance = getattr(module, "advance", None)
        start = (lambda: step.record(trace)) if trace else None
        result = bench_step(step, args, steps, warmup, advance=advance, after_warmup=start)
        if trace:
            step.write_trace()
        return result, step
