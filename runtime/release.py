"""Give memory back promptly: a driver thread that frees dropped arrays and released steps.

A :class:`~meshshard.runtime.executable.RemoteArray` that Python drops, or a compiled step
that is garbage-collected, must be freed on the workers soon, not at the next call of
the step (which may never come).  Finalizers (``__del__``) run at arbitrary points, even
inside another Ray call, so they only put a note on a queue (``queue.SimpleQueue`` is
safe to use from a finalizer); this module's one daemon thread does the freeing.

    >>> done = []
    >>> RELEASER.call(lambda: done.append(1))
    >>> RELEASER.flush()
    >>> done
    [1]
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("meshshard.runtime")


class Releaser:
    """Runs cleanup callables in order on a daemon thread (see module docstring)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` soon on the releaser thread; safe to call from ``__del__``."""
        self._queue.put(fn)
        if self._thread is None:
            self._start()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until everything queued before this call has run (tests, benchmarks)."""
        done = threading.Event()
        self.call(done.set)
        done.wait(timeout)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="meshshard-releaser", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception as exc:  # the cluster may be gone: nothing left to free
                log.debug("meshshard: cleanup skipped: %s", exc)


#: The driver process's releaser.
RELEASER = Releaser()
