"""A direct connection from the driver to each host-actor for step calls.

A step is one call per host-actor every iteration.  Through Ray's actor-call path the
driver pays about a millisecond per actor to submit it and the round trip takes about
2.5 ms more on a two-core machine (``benchmarks/runtime_overhead.py``): a large share
of a short step.  So ``run_step`` travels over one TCP connection per actor instead,
as length-prefixed pickles; Ray still starts, compiles, fetches, frees and watches the
actors.  The connection opens with a random token, so nothing but this driver can call
the actor through it.

Faults keep the meaning :mod:`meshshard.runtime.faults` gives them: a closed connection
or an actor that Ray reports dead is a death, an error the step raised is a failure,
and the peers still inside the call a grace period after the first fault are blocked.

    >>> server = ChannelServer(b"secret", lambda x: x + 1, "127.0.0.1")
    >>> ch = StepChannel(server.address, b"secret")
    >>> ch.send((41,))
    >>> ch.recv()
    (True, 42)
    >>> ch.close(); server.close()
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from meshshard.runtime.faults import GRACE_S, Failure, WorkerFault, raised_message

_HEADER = struct.Struct("!Q")

#: Seconds between liveness checks (through Ray) while a step call is outstanding.
LIVENESS_S = 5.0

#: Seconds to wait for Ray's verdict on an actor whose connection closed mid-step (its
#: process most likely exited; Ray notices within a second or two).
CLOSED_VERDICT_S = 10.0


#: Array buffers at least this large travel out of band, sent from where they lie;
#: smaller ones go inside the pickle (a step's batch and by-value results are small).
OUT_OF_BAND_BYTES = 64 << 10


def send_msg(sock: socket.socket, obj) -> None:
    """Send ``obj`` pickled: the lengths, the pickle, then the large array buffers it
    refers to out of band (sent from where they lie: a large batch or state is not
    copied into the pickle first).  A message without large buffers goes out in one
    ``sendall``: one segment, so the peer wakes once to read it."""
    buffers: list = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:  # False: out of band
        if buf.raw().nbytes < OUT_OF_BAND_BYTES:
            return True
        buffers.append(buf)
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    raws = [b.raw() for b in buffers]
    sizes = [len(data), *(r.nbytes for r in raws)]
    head = _HEADER.pack(len(sizes)) + struct.pack(f"!{len(sizes)}Q", *sizes)
    if not raws:
        sock.sendall(head + data)
        return
    sock.sendall(head)
    sock.sendall(data)
    for r in raws:
        sock.sendall(r)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; EOFError if the peer closed the connection first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the connection was closed")
        got += k
    return buf


def recv_msg(sock: socket.socket):
    """The next object :func:`send_msg` sent (its arrays backed by the received bytes)."""
    (count,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    sizes = struct.unpack(f"!{count}Q", recv_exact(sock, 8 * count))
    data = recv_exact(sock, sizes[0])
    buffers = [recv_exact(sock, n) for n in sizes[1:]]
    return pickle.loads(data, buffers=buffers)


class ChannelServer:
    """Actor side: answers ``handler(*args)`` for each message on a connection that
    presented ``token``, one connection at a time, on a daemon thread.  Each reply is
    ``(True, result)`` or ``(False, message)`` when the handler raised."""

    def __init__(self, token: bytes, handler: Callable, host: str):
        self._token, self._handler = token, handler
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="meshshard-step-channel").start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    if bytes(recv_exact(conn, len(self._token))) != self._token:
                        continue
                    while True:
                        args = recv_msg(conn)
                        try:
                            reply = (True, self._handler(*args))
                        except BaseException as exc:  # the driver reports it
                            reply = (False, raised_message(exc))
                        send_msg(conn, reply)
                except (OSError, EOFError):  # the driver closed it: wait for the next
                    continue

    def close(self) -> None:
        """Stop accepting connections."""
        self._closed = True
        self._listener.close()


class StepChannel:
    """Driver side of one actor's connection."""

    def __init__(self, address: tuple[str, int], token: bytes, timeout_s: float = 30.0):
        self.sock = socket.create_connection(tuple(address), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(token)

    def send(self, args: tuple) -> None:
        """Start ``handler(*args)`` on the actor."""
        send_msg(self.sock, args)

    def recv(self):
        """The reply to the oldest call not yet answered: ``(ok, result or message)``."""
        return recv_msg(self.sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def gather_channels(
    channels: dict[int, StepChannel],
    what: str,
    deaths: Callable[..., dict[int, str]],
    grace_s: float = GRACE_S,
) -> dict[int, object]:
    """``{host: result}`` of the calls just sent on ``channels``; on any fault raise a
    :class:`WorkerFault` as :func:`meshshard.runtime.faults.gather` does.
    ``deaths(hosts, timeout_s)`` asks Ray which of ``hosts`` are gone: ``{host: cause}``."""
    t0 = time.perf_counter()
    pending = dict(channels)
    results: dict[int, object] = {}
    dead: dict[int, str] = {}
    failed: dict[int, str] = {}
    t_fail: float | None = None
    next_check = t0 + LIVENESS_S
    while pending:
        now = time.perf_counter()
        if t_fail is not None and now >= t_fail + grace_s:
            break
        until = next_check if t_fail is None else min(next_check, t_fail + grace_s)
        ready, _, _ = select.select(list(pending.values()), [], [], max(0.0, until - now))
        for ch in ready:
            h = next(h for h, c in pending.items() if c is ch)
            del pending[h]
            try:
                ok, value = ch.recv()
            except (OSError, EOFError):
                ok, value = None, None
            if ok:
                results[h] = value
                continue
            if ok is None:  # the connection broke: ask Ray whether the process is gone
                cause = deaths([h], CLOSED_VERDICT_S).get(h)
                if cause is not None:
                    dead[h] = cause
                else:
                    failed[h] = "its step connection closed while the step ran"
            else:
                failed[h] = value
            t_fail = time.perf_counter() if t_fail is None else t_fail
        if pending and time.perf_counter() >= next_check:
            for h, cause in deaths(sorted(pending), GRACE_S).items():
                del pending[h]
                dead[h] = cause
                t_fail = time.perf_counter() if t_fail is None else t_fail
            next_check = time.perf_counter() + LIVENESS_S
    if dead or failed or pending:
        raise WorkerFault(
            Failure(
                what,
                tuple(sorted(dead.items())),
                tuple(sorted(failed.items())),
                tuple(sorted(pending)),
                time.perf_counter() - t0,
            )
        )
    return results
