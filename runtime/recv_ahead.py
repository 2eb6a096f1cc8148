"""Where the interpreter posts each receive: ahead of its ``RECV``, one message per peer.

A stream posts a receive at its ``RECV``, and schedules emit that just before the
``WAIT`` and the ``RUN`` that read it.  Point-to-point messages over gloo are a
rendezvous, though: the sender's bytes start to move only once the receiver has posted
its receive.  So a message sent long before it is read still crossed the processes only
when the reader was about to need it, and the reader waited a round trip between the two
processes for it.

So the interpreter posts each peer's next receive early.  A peer's first receive of the
step is posted when the step starts.  Each later one is posted when the ``WAIT`` of that
peer's previous receive runs, or at its own ``RECV`` if that comes first.  A peer's
messages then move while this worker still computes on the previous one.  Beyond what
the stream itself holds, at most one more receive buffer per peer is live at a time.
Posting moves no data and cannot block, so the order of posts cannot deadlock.

    >>> from meshshard.instructions import Recv, Run, Wait
    >>> from meshshard.refs import BufferRef, ProgramRef, TransferRef
    >>> t = [BufferRef.parse(f"t1@{m}") for m in range(3)]
    >>> r = lambda m: Recv(buffer=t[m], transfer=TransferRef.parse("t1"), message=0, peer=1)
    >>> run = lambda m: Run(program=ProgramRef.parse("s0.B"), mb=m, inputs=(t[m],), outputs=())
    >>> stream = [r(0), Wait(buffer=t[0]), run(0), r(1), Wait(buffer=t[1]), run(1),
    ...           r(2), Wait(buffer=t[2]), run(2)]
    >>> receives_ahead(stream)  # RECV 3 is posted at the WAIT at 1, RECV 6 at the WAIT at 4
    {1: (3,), 4: (6,)}
"""

from __future__ import annotations

from collections.abc import Sequence

from meshshard.instructions import Recv, Wait

__all__ = ["receives_ahead"]


def receives_ahead(instructions: Sequence) -> dict[int, tuple[int, ...]]:
    """``{position: indices of RECVs to post just before the instruction at that position
    runs}``, for the RECVs posted ahead of their own position (module docstring); every
    other ``RECV`` is posted where it stands."""
    waits: dict = {}  # buffer -> position of its WAIT
    for i, ins in enumerate(instructions):
        if type(ins) is Wait:
            waits.setdefault(ins.buffer, i)
    ahead: dict[int, list[int]] = {}
    last_wait: dict[int, int] = {}  # peer -> position of the WAIT of its previous receive
    for i, ins in enumerate(instructions):
        if type(ins) is not Recv:
            continue
        post = min(i, last_wait.get(ins.peer, 0))
        if post < i:
            ahead.setdefault(post, []).append(i)
        wait = waits.get(ins.buffer, -1)
        if wait > i:
            last_wait[ins.peer] = wait
    return {p: tuple(js) for p, js in sorted(ahead.items())}
