"""Each local host-actor's share of this machine's cores for XLA:CPU's threads.

An embedded local Ray cluster runs all its host-actors on one machine.  By default
every actor's XLA:CPU client sizes its thread pools to every core it may run on, so N
actors on C cores run N pools of C threads, and a program's parallel loops wait for
threads the other actors' programs keep off the cores.  Here each actor gets its share
instead: ``max(D, C // N)`` cores (D: the actor's devices, each of which may run a
program at once; never more than C), in consecutive blocks round the cores.  So one-device
actors on fewer cores than actors take one core each, round-robin, and an actor whose
devices need every core keeps every core, as before.

XLA:CPU sizes its pools from the cores the creating thread may run on, and the pools'
threads keep that thread's affinity.  So :func:`start_backend_on` narrows the calling
thread to the actor's share while JAX creates its CPU backend, then widens it again:
XLA's compute threads stay on the share, the actor's Python threads (interpreter,
communication, step channel) may still run on any core.  Only affinity is used: no
private JAX or XLA API.

    >>> core_shares([1, 1], [0, 1])
    [(0,), (1,)]
    >>> core_shares([1, 1, 1, 1], [0, 1])
    [(0,), (1,), (0,), (1,)]
    >>> core_shares([2, 2], [0, 1])
    [(0, 1), (0, 1)]
    >>> core_shares([1, 1], range(8))
    [(0, 1, 2, 3), (4, 5, 6, 7)]
    >>> core_shares([2, 2, 2], range(8))
    [(0, 1), (2, 3), (4, 5)]
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

__all__ = ["core_shares", "start_backend_on", "enabled"]


def enabled() -> bool:
    """Whether local host-actors get core shares (``MESHSHARD_CPU_SHARES=0`` turns it
    off: every actor's XLA pools then span every core, as XLA sizes them by default)."""
    return os.environ.get("MESHSHARD_CPU_SHARES", "1") != "0"


def core_shares(devices: Sequence[int], cores: Iterable[int]) -> list[tuple[int, ...]]:
    """The cores of each host-actor sharing ``cores``, given each actor's device count
    (module docstring): ``max(devices, C // actors)`` of them, at most all ``C``, taken
    in turn round the cores."""
    cores = sorted(cores)
    if not devices or not cores or min(devices) < 1:
        raise ValueError(
            f"core_shares needs actors of >= 1 device and some cores, got {devices}, {cores}"
        )
    c, fair = len(cores), len(cores) // len(devices)
    shares, at = [], 0
    for d in devices:
        k = min(c, max(d, fair))
        shares.append(tuple(sorted(cores[(at + j) % c] for j in range(k))))
        at = (at + k) % c
    return shares


def start_backend_on(cpus: Sequence[int]) -> bool:
    """Create this process's JAX CPU backend with its threads on ``cpus`` (module
    docstring); a backend created before stays as it is.  Returns False, changing
    nothing, where thread affinity is not supported (not Linux) or ``cpus`` names no
    core this thread may use."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    before = os.sched_getaffinity(0)
    share = set(cpus) & before
    if not share:
        return False
    import jax

    os.sched_setaffinity(0, share)
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, before)
    return True
