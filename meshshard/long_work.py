"""Progress of long work on stderr: planning and compiling a step, starting a cluster.

Work that ends within :data:`NOTICE_AFTER_S` seconds prints nothing.  Past that, it says
what it is doing, then each phase it enters (a compiler pass, the compile on the
host-actors), and how long it took when it ends: a first call that plans for a minute
is not mistaken for a hang.  ``MESHSHARD_QUIET=1`` silences it;
``MESHSHARD_PROGRESS_AFTER=<seconds>`` moves the threshold.

>>> import io, re
>>> out = io.StringIO()
>>> with LongWork("compiling train_step", after_s=0.0, stream=out):
...     phase("tracing")
>>> print(re.sub(r"[0-9.]+s$", "<seconds>", out.getvalue(), flags=re.M), end="")
meshshard: compiling train_step: tracing ...
meshshard: compiling train_step: done in <seconds>
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["NOTICE_AFTER_S", "LongWork", "phase"]

#: Seconds of work before progress shows.
NOTICE_AFTER_S = 5.0

_ACTIVE = threading.local()  # the innermost LongWork of each thread (each links its outer)


class LongWork:
    """A context for work that may take long: silent when short; past ``after_s`` it
    names the current :func:`phase` and each later one, and its duration at the end."""

    def __init__(self, what: str, after_s: float | None = None, stream=None):
        self.what = what
        if after_s is None:
            after_s = float(os.environ.get("MESHSHARD_PROGRESS_AFTER", NOTICE_AFTER_S))
        self.after_s = after_s
        self.stream = stream
        self.quiet = os.environ.get("MESHSHARD_QUIET", "") not in ("", "0")
        self.current = "starting"
        self.shown = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._outer: LongWork | None = None

    def __enter__(self) -> LongWork:
        self._t0 = time.perf_counter()
        self._outer = getattr(_ACTIVE, "work", None)
        _ACTIVE.work = self
        if not self.quiet and self._outer is None:  # nested work reports through the outer
            if self.after_s <= 0:
                self.shown = True
            else:
                self._timer = threading.Timer(self.after_s, self._notice)
                self._timer.daemon = True
                self._timer.start()
        return self

    def __exit__(self, kind, value, tb) -> None:
        _ACTIVE.work = self._outer
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self.shown:
                took = time.perf_counter() - self._t0
                end = "done" if kind is None else "stopped (error)"
                self._print(f"{end} in {took:.1f}s")

    def phase(self, name: str) -> None:
        """Enter phase ``name`` (printed once progress shows)."""
        with self._lock:
            self.current = name
            if self.shown:
                self._print(f"{name} ...")

    def _notice(self) -> None:
        with self._lock:
            if not self.shown:
                self.shown = True
                self._print(f"{self.current} ... (running for {self.after_s:.0f}s)")

    def _print(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"meshshard: {self.what}: {text}", file=stream, flush=True)


def phase(name: str) -> None:
    """Tell the long work running in this thread (the outermost, which reports) that it
    entered phase ``name``; nothing when none is running."""
    work = getattr(_ACTIVE, "work", None)
    while work is not None and work._outer is not None:
        work = work._outer
    if work is not None:
        work.phase(name)
