"""Threads kept between steps for the in-process backend's per-worker calls.

Each step of the threads backend runs every worker's part in a thread of its own.
Starting a fresh thread per worker per step cost about 0.2 ms of a 1.3 ms step on a
two-core machine (the driver waits until the new thread has started, while the step's
other threads hold the interpreter lock; ``benchmarks/by_value_results.py`` times both),
so finished threads wait here for the next call instead.  Two pipelined steps may run
on one worker at once, so a call never waits for a busy thread: it takes an idle one or
starts another.  A thread left idle for :data:`IDLE_S` seconds ends, and so do the idle
ones when a cluster closes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Seconds an idle kept thread waits for work before it ends.
IDLE_S = 30.0


class StepThreads:
    """A pool of daemon threads that grows to the number of calls running at once."""

    def __init__(self, idle_s: float = IDLE_S):
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of threads waiting for work
        self._names = itertools.count()

    def start(self, fn: Callable[[], None]) -> threading.Event:
        """Run ``fn()`` in a kept thread now (a new one if none is idle); the event is set
        once it returned.  ``fn`` reports its own failures: one it raises is logged."""
        done = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            name = f"meshshard-step-{next(self._names)}"
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((fn, done))
        return done

    def close_idle(self) -> None:
        """End the threads that wait for work now (a cluster closing: its steps leave no
        thread behind); a later call starts new ones."""
        with self._lock:
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    @property
    def idle(self) -> int:
        """How many kept threads wait for work now."""
        with self._lock:
            return len(self._idle)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                work = inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if any(q is inbox for q in self._idle):
                        self._idle = [q for q in self._idle if q is not inbox]
                        return
                continue  # a caller took this thread just now: its work is on the way
            if work is None:  # close_idle
                return
            self._run(*work)
            # nothing of the call is left in this frame while the thread waits: its
            # closure holds the step's workers, and so their stored arrays
            work = None
            with self._lock:
                self._idle.append(inbox)

    @staticmethod
    def _run(fn: Callable[[], None], done: threading.Event) -> None:
        try:
            fn()
        except BaseException:  # fn reports its own failures; never lose the thread
            log.exception("a step thread's call raised")
        finally:
            done.set()


#: The in-process backend's kept threads (one pool for every step of this process).
STEP_THREADS = StepThreads()
