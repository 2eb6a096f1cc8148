"""Give memory back promptly: a driver thread that frees dropped arrays and released steps.

A :class:`~meshshard.runtime.executable.RemoteArray` that Python drops, or a compiled step
that is garbage-collected, must be freed on the workers soon, not at the next call of
the step (which may never come).  Finalizers (``__del__``) run at arbitrary points, even
inside another Ray call, so they only put a note on a queue (``queue.SimpleQueue`` is
safe to use from a finalizer); this module's one daemon thread does the freeing.  A
delayed call (:meth:`Releaser.call_later`) lets the next step carry the frees of the
state it replaced instead of a separate message per worker.

    >>> done = []
    >>> RELEASER.call_later(60.0, lambda: done.append("later"))
    >>> RELEASER.call(lambda: done.append("now"))
    >>> RELEASER.flush()
    >>> done
    ['now', 'later']
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("meshshard.runtime")


class Releaser:
    """Runs cleanup callables on a daemon thread: at once in order, or after a delay
    (see module docstring); :meth:`flush` runs the delayed ones too."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._busy = threading.Lock()  # held while a call runs
        self._closed = False
        self._seq = itertools.count()
        self._waiting: list = []  # heap of (deadline, seq, fn); touched under _busy only
        self._orphans: list = []  # calls the thread held when closed: never dropped by it

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` soon on the releaser thread; safe to call from ``__del__``."""
        self.call_later(0.0, fn)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the releaser thread ``delay_s`` seconds from now (or at the
        next :meth:`flush`); safe to call from ``__del__``.  Dropped at interpreter exit:
        the process is ending, and freeing device arrays then can abort it."""
        if self._closed or sys.is_finalizing():
            return
        self._queue.put((time.monotonic() + delay_s, next(self._seq), fn))
        if self._thread is None:
            self.start()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until everything queued before this call has run, delayed calls
        included (tests, benchmarks)."""
        if self._closed:
            return
        done = threading.Event()
        self.call_later(float("-inf"), done.set)  # before every delayed call
        done.wait(timeout)

    def start(self) -> None:
        """Start the thread if it is not running (a compiled step does, so a finalizer
        never has to); not at interpreter exit, when a new thread would never start and
        the process is about to drop everything anyway."""
        if self._closed or sys.is_finalizing():
            return
        with self._start_lock:
            if self._thread is None:
                import jax  # noqa: F401  (its exit hook first, so :meth:`close` runs before it)

                self._thread = threading.Thread(
                    target=self._run, name="meshshard-releaser", daemon=True
                )
                self._thread.start()
                atexit.register(self.close)

    def close(self, timeout: float = 30.0) -> None:
        """Stop running calls, after the one in progress (if any) ends; later calls are
        dropped, and so are the delayed calls still waiting, here and now.  Runs at
        interpreter exit before JAX's own exit hook, which frees the backends: a call
        (or a waiting call's closure) that drops device arrays after that aborts the
        process, so the releaser thread must hold no reference once this returns."""
        idle = self._busy.acquire(timeout=timeout)
        self._closed = True
        if not idle:
            log.warning("meshshard: a cleanup call still runs at exit; exiting anyway")
            return
        try:
            pending = self._waiting
            self._waiting = []
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            pending.clear()  # dropped on this thread, while JAX is alive
        finally:
            self._busy.release()

    def _run(self) -> None:
        item = None
        while True:
            with self._busy:  # every reference to a call is dropped under the lock
                if item is not None:
                    if self._closed:  # taken off the queue as close() drained it
                        self._orphans.append(item)  # dropped by the main thread's teardown
                    else:
                        heapq.heappush(self._waiting, item)
                    item = None
                if self._closed:
                    return
                self._run_due()
                waiting = self._waiting
                timeout = max(0.0, waiting[0][0] - time.monotonic()) if waiting else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None

    def _run_due(self) -> None:
        """Run the calls whose time has come (a flush marker, deadline minus infinity,
        brings every waiting call forward)."""
        waiting = self._waiting
        if any(d == float("-inf") for d, _, _ in waiting):
            waiting[:] = [(float("-inf"), s, fn) for _, s, fn in waiting]
            heapq.heapify(waiting)
        now = time.monotonic()
        while waiting and waiting[0][0] <= now and not self._closed:
            fn = heapq.heappop(waiting)[2]
            self._run_one(fn)
            fn = None

    def _run_one(self, fn: Callable[[], None]) -> None:
        if self._closed or sys.is_finalizing():
            return
        try:
            fn()
        except Exception as exc:  # the cluster may be gone: nothing left to free
            log.debug("meshshard: cleanup skipped: %s", exc)


#: The driver process's releaser.
RELEASER = Releaser()
