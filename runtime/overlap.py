"""Concurrency pieces of the overlapping runtime: a worker's compute and communication
proceed at once.

The interpreter's thread dispatches ``RUN``s in stream order and never waits for
communication a program does not read.  Next to it, per step:

:class:`CommQueue`
    one thread that issues this worker's sends and collectives.  Issuing a send first
    reads its block off the device, which waits for the program that produced it, so
    this is done here rather than on the dispatching thread.  Ops are issued in
    priority order (the instruction's ``priority`` slot, higher first; ties in stream
    order), and collectives of one channel always in stream order, since every member
    of a channel must issue its operations in the same order.
:class:`Prefetcher`
    one thread that completes posted receives in posting order (waits for the bytes
    and rebuilds the array) ahead of the ``RUN`` that reads them: for the replicas'
    gradient all-reduces, for recording steps (so an arrival is stamped when it
    happens), and for every receive when the interpreter's ``prefetch`` switch is on
    (off by default: each ``WAIT`` stands just before its reader, so the thread rarely
    got there first).  A ``RUN`` that needs a receive nobody has completed completes
    it itself (:class:`Lazy`), so a slow message never holds up another.

Both threads only wait for local compute or for messages, never for the dispatching
thread, so they cannot deadlock with it.

Closing either thread lets it finish what was handed to it before.  A comm queue
refuses ops submitted after it was closed (:class:`~meshshard.errors.MeshshardRuntimeError`):
its thread may have ended, and an op nobody issues leaves its receivers and the
``WAITALL`` of its own step waiting for good.  So a step whose helpers are stopped under
it fails at its next send, with an error that says so, instead of stalling.

With a :class:`~meshshard.admission.InFlight` table (a plan scheduled with the
``topology`` switch) the comm thread is also topology-aware: an op is issued only when
:func:`~meshshard.admission.admit` lets it onto its links (no strictly higher-priority
op in flight there, the simulator's rule) and, for an op of a channel, when the
channel's previous op has finished, so the chunks of a large all-reduce go out one at a
time and higher-priority traffic passes between them.  Each issued op stays in the
table until its handle completes (a watcher thread per op waits for it; the handle
keeps the result for its real reader).  Refused ops never block the thread: it takes
the best admitted op, else waits briefly and looks again.  A higher-priority op never
waits for a lower one, so the waits cannot form a cycle.

    >>> q = CommQueue("doc")
    >>> issued = []
    >>> futs = [q.submit(p, lambda p=p: issued.append(p) or p) for p in (0, 0, 0)]
    >>> [f.result() for f in futs], q.close()
    ([0, 0, 0], None)
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshshard.errors import MeshshardRuntimeError

__all__ = ["Lazy", "CommQueue", "Prefetcher", "Timeline", "Tracked", "overtakes", "stop_helpers"]

#: Seconds a comm thread with only refused ops waits before it looks again.
ADMISSION_POLL_S = 0.0005


class Lazy:
    """A value computed once, by whichever thread asks first (:meth:`get`); a thread
    that asks while another computes it waits for that result.

    >>> calls = []
    >>> lz = Lazy(lambda: calls.append(1) or 42)
    >>> lz.get(), lz.get(), len(calls)
    (42, 42, 1)
    """

    __slots__ = ("_fn", "_lock", "_pending", "_value", "_exc", "_claimed", "at_ns")

    def __init__(self, fn: Callable[[], object]):
        self._fn = fn
        self._lock = threading.Lock()
        # held until the value is there: a plain lock, not an Event (a Condition and a
        # lock per object, and a lock per wait), as a step makes one per transfer
        self._pending = threading.Lock()
        self._pending.acquire()
        self._value = self._exc = None
        self._claimed = False
        self.at_ns = 0  # perf_counter_ns when the value was there

    def run(self) -> None:
        """Compute the value here unless another thread already claimed it."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to whoever waits for the value
            self._exc = exc
        finally:
            self.at_ns = time.perf_counter_ns()
            self._fn = None
            self._pending.release()

    def result(self):
        """Wait for the value without computing it here (raises what computing raised)."""
        if self._pending.locked():  # wait for the release, then pass it on to other waiters
            with self._pending:
                pass
        if self._exc is not None:
            raise self._exc
        return self._value

    def get(self):
        """The value: computed here if nobody has started it, else waited for."""
        self.run()
        return self.result()

    @property
    def done(self) -> bool:
        """True once the value (or its error) is there."""
        return not self._pending.locked()


class Tracked:
    """A communication handle whose ``wait()`` runs once (by whichever thread asks
    first); later calls return the same result.

    >>> class H:
    ...     n = 0
    ...     def wait(self):
    ...         H.n += 1
    ...         return "bytes"
    >>> t = Tracked(H())
    >>> t.wait(), t.wait(), H.n
    ('bytes', 'bytes', 1)
    """

    __slots__ = ("_lazy",)

    def __init__(self, handle):
        self._lazy = Lazy(handle.wait)

    def wait(self):
        return self._lazy.get()


@dataclass(order=True)
class _Op:
    key: tuple[int, int]  # (-priority, submission order)
    channel: str | None = field(compare=False)
    chan_seq: int = field(compare=False)
    lazy: Lazy = field(compare=False)
    links: tuple[str, ...] = field(default=(), compare=False)


class CommQueue:
    """Issues communication ops from one thread, highest ``priority`` first (ties in
    submission order), ops of one channel in submission order (module docstring).

    Args:
        name: the thread's name (shows in stack dumps).
        table: the in-flight table to admit ops against (module docstring); None
            issues by priority alone.
    """

    def __init__(self, name: str, table=None):
        self._cv = threading.Condition()
        self._ops: list[_Op] = []
        self._seq = 0
        self._chan_next: dict[str, int] = {}
        self._chan_count: dict[str, int] = {}
        self._closed = False
        self._why_closed = ""
        self.issued: list[int] = []  # submission numbers in issue order (tests, traces)
        self.error: BaseException | None = None  # the first op that raised
        self.table = table
        self._chan_busy: set[str] = set()  # channels whose last op is in flight
        self.refused = 0  # times an op was held back by admission (tests, traces)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _register(self)

    def submit(
        self,
        priority: int,
        fn: Callable[[], object],
        channel: str | None = None,
        links: tuple[str, ...] = (),
    ) -> Lazy:
        """Queue ``fn`` (it issues one op and returns its handle); returns its future.
        ``links``: what the op uses, for admission (module docstring).

        Raises MeshshardRuntimeError once the queue is closed: its thread issues what it
        holds and ends, so a later op would never be issued."""
        lazy = Lazy(fn if self.table is None else lambda: Tracked(fn()))
        with self._cv:
            if self._closed:
                raise MeshshardRuntimeError(
                    f"the comm thread {self._thread.name} was stopped ({self._why_closed}); "
                    "an op queued now would never be issued, so the step cannot finish"
                )
            chan_seq = 0
            if channel is not None:
                chan_seq = self._chan_count.get(channel, 0)
                self._chan_count[channel] = chan_seq + 1
            self._ops.append(_Op((-priority, self._seq), channel, chan_seq, lazy, links))
            self._seq += 1
            self._cv.notify()
        return lazy

    def _pick(self) -> _Op | None:
        ready = [
            op
            for op in self._ops
            if op.channel is None
            or (
                op.chan_seq == self._chan_next.get(op.channel, 0)
                and op.channel not in self._chan_busy
            )
        ]
        if self.table is not None:
            admitted = [op for op in ready if self.table.admits(-op.key[0], op.links)]
            self.refused += len(ready) - len(admitted)
            ready = admitted
        return min(ready) if ready else None

    def _track(self, op: _Op) -> None:
        """Keep issued ``op`` in the in-flight table (and its channel busy) until its
        handle completes."""
        handle = op.lazy._value
        if op.lazy._exc is not None or not isinstance(handle, Tracked):
            return
        token = self.table.add(-op.key[0], op.links)
        if op.channel is not None:
            self._chan_busy.add(op.channel)

        def watch():
            try:
                handle.wait()
            except BaseException:  # the reader of the handle reports it
                pass
            self.table.remove(token)
            with self._cv:
                self._chan_busy.discard(op.channel)
                self._cv.notify_all()

        threading.Thread(target=watch, name="comm-watch", daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                op = self._pick()
                while op is None and not (self._closed and not self._ops):
                    held = self.table is not None and self._ops
                    self._cv.wait(ADMISSION_POLL_S if held else None)
                    op = self._pick()
                if op is None:
                    return
                self._ops.remove(op)
                self.issued.append(op.key[1])
            op.lazy.run()
            if self.table is not None:
                with self._cv:
                    self._track(op)
            if op.lazy._exc is not None and self.error is None:
                self.error = op.lazy._exc
            if op.channel is not None:
                with self._cv:
                    self._chan_next[op.channel] = op.chan_seq + 1
                    self._cv.notify_all()

    def close(self, reason: str = "its interpreter was dropped") -> None:
        """Stop the thread once every queued op is issued (returns at once); later
        :meth:`submit` calls raise, naming ``reason``."""
        with self._cv:
            if not self._closed:
                self._why_closed = reason
            self._closed = True
            self._cv.notify_all()


class Prefetcher:
    """Completes :class:`Lazy` receives in the order they were added, on one thread."""

    def __init__(self, name: str):
        self._cv = threading.Condition()
        self._queue: deque[Lazy | None] = deque()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _register(self)

    def add(self, lazy: Lazy) -> None:
        """Complete ``lazy`` in the background (unless someone needs it first)."""
        with self._cv:
            self._queue.append(lazy)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                lazy = self._queue.popleft()
            if lazy is None:
                return
            lazy.run()

    def close(self, reason: str = "") -> None:
        """Stop after the receives added so far (returns at once).  A receive added later
        is not prefetched: its reader completes it (:meth:`Lazy.get`)."""
        with self._cv:
            self._queue.append(None)
            self._cv.notify()


# --- stopping the helper threads at interpreter exit ----------------------------------
_HELPERS: weakref.WeakSet = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_hooked = False


def _register(helper) -> None:
    """Track a comm or prefetch thread so :func:`stop_helpers` ends it at exit."""
    _HELPERS.add(helper)
    hook_exit()


def hook_exit() -> None:
    """Register :func:`stop_helpers` at interpreter exit (once).  ``meshshard.init``
    calls it before registering its own shutdown, so the shutdown (which waits for the
    steps still running) runs first: exit hooks run last-registered first, and a step
    whose comm thread was already stopped could not finish (it fails at its next send).
    Nothing else may stop the helpers at exit before that shutdown: the interpreters'
    own finalizers are not run at exit for that reason (``weakref.finalize``'s exit hook
    is registered with the first finalizer, after ``meshshard.init``)."""
    global _hooked
    with _HOOK_LOCK:
        if not _hooked:
            import jax  # noqa: F401  (its exit hook first, so stop_helpers runs before it)

            atexit.register(stop_helpers)
            _hooked = True


def stop_helpers(timeout_s: float = 5.0) -> None:
    """Close every live comm and prefetch thread and wait (at most ``timeout_s`` in all)
    for them to end.  Runs at interpreter exit before JAX's own exit hook: a helper still
    alive while the process tears JAX down (a step object kept to the end of a script
    with data-parallel replicas) could abort it with ``terminate called ...``."""
    helpers = list(_HELPERS)
    for h in helpers:
        h.close("the interpreter is exiting")
    end = time.monotonic() + timeout_s
    for h in helpers:
        h._thread.join(max(0.0, end - time.monotonic()))


@dataclass
class Timeline:
    """What one worker's last step did, in ``perf_counter_ns`` (shared by the processes
    of one machine): compute spans of its programs and the issue and arrival of every
    message, keyed by (transfer or channel, micro-batch, message).

    ``runs``: (instruction index, dispatched, finished) per ``RUN``; ``sent``: key ->
    time the bytes were handed to the transport; ``arrived``: key -> time the
    receiver had them; ``issues``: (instruction index, traffic kind, priority, time
    queued, time issued) per op of the comm thread (:func:`overtakes` reads them).
    """

    worker: int
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    sent: dict[tuple, int] = field(default_factory=dict)
    arrived: dict[tuple, int] = field(default_factory=dict)
    issues: list[list] = field(default_factory=list)

    def compute_spans(self) -> list[tuple[int, int]]:
        """Busy intervals of the devices: a program starts when dispatched or when the
        one before it finished, whichever is later (programs of a mesh run in order)."""
        spans, prev = [], 0
        for _, dispatched, finished in sorted(self.runs, key=lambda r: r[0]):
            start = max(dispatched, prev)
            spans.append((start, max(start, finished)))
            prev = max(prev, finished)
        return spans

    def busy_ns(self) -> int:
        """Total device busy time of the step."""
        return sum(b - a for a, b in self.compute_spans())


def overtakes(issues: list[list], fast: str = "p2p", slow: str = "allreduce") -> list[tuple]:
    """Pairs (``fast`` op, ``slow`` op) of a :class:`Timeline`'s ``issues`` where the
    ``fast`` one was queued after the ``slow`` one but issued before it: priorities at
    work (a point-to-point transfer passing a queued all-reduce chunk)."""
    done = [x for x in issues if x[4]]
    return [
        (tuple(a), tuple(b))
        for a in done
        if a[1] == fast
        for b in done
        if b[1] == slow and a[3] > b[3] and a[4] < b[4]
    ]
