"""Telling a dead host-actor from a failed program, and saying what to do about it.

When a call on several host-actors fails, the driver must not wait for the others: a
peer of a dead actor blocks in a receive until the transfer timeout.  :func:`gather`
collects results as they arrive; at the first failure it gives the others a short
grace period, asks Ray which actors are gone, and raises one
:class:`~meshshard.errors.MeshshardRuntimeError` that names the host, the cause, the
arrays that are still fetchable and how to recover (``meshshard.recover()``).
"""

from __future__ import annotations

import dataclasses
import re
import time

from meshshard.errors import MeshshardRuntimeError

#: Seconds the other actors of a failed call get to finish before they count as blocked.
GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class Failure:
    """What went wrong in one call on the host-actors.

    ``dead``: hosts whose process is gone, with the cause Ray gave; ``failed``: hosts
    whose call raised (the process lives), with the message; ``blocked``: hosts still
    inside the call (waiting on a dead or failed peer)."""

    what: str
    dead: tuple[tuple[int, str], ...]
    failed: tuple[tuple[int, str], ...]
    blocked: tuple[int, ...]
    seconds: float

    def __str__(self) -> str:
        lines = [f"{self.what} failed after {self.seconds:.1f}s:"]
        lines += [f"  host-actor w{h} died: {cause}" for h, cause in self.dead]
        lines += [f"  w{h} raised: {msg}" for h, msg in self.failed]
        if self.blocked:
            names = ", ".join(f"w{h}" for h in self.blocked)
            lines.append(f"  {names} did not finish (blocked waiting on a failed peer)")
        return "\n".join(lines)


def is_actor_death(exc: BaseException) -> bool:
    """True if ``exc`` says the actor's process is gone (not that its code raised)."""
    import ray.exceptions as rex

    return isinstance(exc, rex.RayActorError | rex.WorkerCrashedError)


def death_cause(exc: BaseException) -> str:
    """A one-line cause from Ray's long actor-death message: its first sentence and the
    process id."""
    text = " ".join(str(exc).split())
    first = re.search(r"The (actor|worker)[^.]*\.", text)
    pid = re.search(r"\bpid: (\d+)", text)
    cause = first.group(0).rstrip(".") if first else (text[:160] or type(exc).__name__)
    return f"process {pid.group(1)}: {cause}" if pid else cause


def raised_message(exc: BaseException) -> str:
    """The message of an exception raised inside an actor's method (Ray wraps it)."""
    cause = getattr(exc, "cause", None)
    cause = cause if cause is not None else exc
    if isinstance(cause, MeshshardRuntimeError):
        return str(cause)  # already says where and why
    return f"{type(cause).__name__}: {cause}"  # e.g. a bare KeyError prints only its key


def gather(
    refs: dict[int, object],
    what: str,
    grace_s: float = GRACE_S,
    timeout_s: float | None = None,
) -> dict[int, object]:
    """``{host: ray.get(ref)}``; on any failure raise :class:`WorkerFault` without waiting
    for the blocked peers of a dead or failed actor (see module docstring).  With
    ``timeout_s``, hosts that have not answered by then count as blocked."""
    import ray

    t0 = time.perf_counter()
    by_ref = {r: h for h, r in refs.items()}
    pending, results = list(refs.values()), {}
    dead: dict[int, str] = {}
    failed: dict[int, str] = {}
    until = None if timeout_s is None else t0 + timeout_s
    t_fail = t0
    while pending:
        if dead or failed:
            until = min(until or float("inf"), t_fail + grace_s)
        wait = None if until is None else max(0.0, until - time.perf_counter())
        done, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if not done:  # out of time: the rest are blocked
            break
        h = by_ref[done[0]]
        try:
            results[h] = ray.get(done[0])
        except Exception as exc:
            t_fail = time.perf_counter() if not (dead or failed) else t_fail
            if is_actor_death(exc):
                dead[h] = death_cause(exc)
            else:
                failed[h] = raised_message(exc)
    if dead or failed or pending:
        blocked = tuple(sorted(by_ref[r] for r in pending))
        raise WorkerFault(
            Failure(
                what,
                tuple(sorted(dead.items())),
                tuple(sorted(failed.items())),
                blocked,
                time.perf_counter() - t0,
            )
        )
    return results


class WorkerFault(MeshshardRuntimeError):
    """A call on the host-actors failed; ``failure`` says which hosts and why."""

    def __init__(self, failure: Failure, advice: str = ""):
        self.failure = failure
        super().__init__(f"{failure}\n{advice}".rstrip())

    def with_advice(self, advice: str) -> WorkerFault:
        """The same fault with the recovery advice appended to its message."""
        return WorkerFault(self.failure, advice)
