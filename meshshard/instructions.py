"""Per-worker instruction IR: what each host-actor runs every step.

One IR serves the runtime (which executes it), the verifier (which checks it) and the
simulator (which predicts its timeline).  Every instruction names the buffers it reads
and writes, so data dependencies are explicit edges.  Communication is *issued* by one
instruction (``SEND``, ``RECV``, ``COLL``) and *completed* by a later one (``WAIT`` for a
buffer being received, ``WAITALL`` for outstanding sends), so the same stream can run
blocking or overlapped.  Each instruction carries a ``priority`` slot for communication
scheduling; it prints as ``!N`` when non-zero.

Buffer names follow one convention (``@k`` marks micro-batch ``k``):

``P{s}``
    parameters read by stage ``s``            ``A{s}``  gradient accumulators of stage ``s``
``X{s}@k``
    batch inputs of stage ``s``                ``R{s}@k`` residuals kept from F to B
``t{n}@k``
    the array moved by cross-mesh transfer ``n``
``S{m}`` / ``O{m}``
    apply-gradient state inputs / step outputs of mesh ``m``

Every instruction prints as one compact token and :func:`parse_instruction` reads it back::

    >>> str(Run(program="s1.F", mb=2, inputs=("P1", "t0@2"), outputs=("R1@2", "t1@2")))
    'RUN s1.F mb2 (P1 t0@2) -> (R1@2 t1@2)'
    >>> parse_instruction("SEND t0@2 #1 -> w3")
    Send(priority=0, buffer='t0@2', transfer='t0', message=1, peer=3)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Instruction",
    "Load",
    "Zeros",
    "Run",
    "Send",
    "Recv",
    "Collective",
    "Wait",
    "WaitAll",
    "Free",
    "WorkerStream",
    "parse_instruction",
    "COLLECTIVE_KINDS",
]

COLLECTIVE_KINDS = ("broadcast", "allreduce", "allgather", "reducescatter", "alltoall")


def _prio(p: int) -> str:
    return f" !{p}" if p else ""


def _names(names: tuple[str, ...]) -> str:
    return "(" + " ".join(names) + ")"


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """Base of all instructions; ``priority`` is the communication-scheduling slot."""

    priority: int = 0

    @property
    def reads(self) -> tuple[str, ...]:
        """Buffers this instruction reads."""
        return ()

    @property
    def writes(self) -> tuple[str, ...]:
        """Buffers this instruction (or its completion) writes."""
        return ()

    @property
    def is_comm(self) -> bool:
        """True for instructions that move data between workers."""
        return False


@dataclass(frozen=True, kw_only=True)
class Load(Instruction):
    """Copy micro-batch ``mb`` of this stage's batch inputs into ``buffer`` (``X{s}@k``)."""

    buffer: str
    mb: int

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"LOAD {self.buffer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Zeros(Instruction):
    """Fill the gradient accumulator group ``buffer`` with zeros (start of a step)."""

    buffer: str

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"ZEROS {self.buffer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Run(Instruction):
    """Run compiled program ``program`` (``s1.F``, ``s1.B``, ``m0.apply``) on micro-batch ``mb``."""

    program: str
    mb: int | None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        return self.inputs

    @property
    def writes(self) -> tuple[str, ...]:
        return self.outputs

    def __str__(self) -> str:
        mb = f" mb{self.mb}" if self.mb is not None else ""
        return (
            f"RUN {self.program}{mb} {_names(self.inputs)} -> {_names(self.outputs)}"
            f"{_prio(self.priority)}"
        )


@dataclass(frozen=True, kw_only=True)
class Send(Instruction):
    """Issue the send of message ``message`` of transfer ``transfer`` from ``buffer`` to worker ``peer``."""

    buffer: str
    transfer: str
    message: int
    peer: int

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.buffer,)

    @property
    def is_comm(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"SEND {self.buffer} #{self.message} -> w{self.peer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Recv(Instruction):
    """Issue the receive of message ``message`` of ``transfer`` into ``buffer`` from worker ``peer``.

    The buffer is usable only after a later ``WAIT`` on it.
    """

    buffer: str
    transfer: str
    message: int
    peer: int

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.buffer,)

    @property
    def is_comm(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"RECV {self.buffer} #{self.message} <- w{self.peer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Collective(Instruction):
    """Issue a collective over ``group`` (worker ids); ``root`` for rooted kinds (broadcast).

    ``message`` indexes the transfer's message this collective carries.  Every member of
    ``group`` holds the same instruction, so participants match by construction.
    """

    kind: str
    buffer: str
    transfer: str
    message: int
    group: tuple[int, ...]
    root: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {self.kind!r} is not one of {COLLECTIVE_KINDS}")
        if self.root is not None and self.root not in self.group:
            raise ValueError(f"collective root w{self.root} is not in its group {self.group}")

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.buffer,)

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.buffer,)

    @property
    def is_comm(self) -> bool:
        return True

    def __str__(self) -> str:
        group = ",".join(f"w{w}" for w in self.group)
        root = f" root=w{self.root}" if self.root is not None else ""
        return (
            f"COLL {self.kind} {self.buffer} #{self.message} [{group}]{root}{_prio(self.priority)}"
        )


@dataclass(frozen=True, kw_only=True)
class Wait(Instruction):
    """Complete every communication issued into ``buffer``; after it the buffer is readable."""

    buffer: str

    @property
    def writes(self) -> tuple[str, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"WAIT {self.buffer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class WaitAll(Instruction):
    """Complete every outstanding send of this worker (end of step)."""

    def __str__(self) -> str:
        return f"WAITALL{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Free(Instruction):
    """Release ``buffer``; a buffer with a send still in flight is released when it completes."""

    buffer: str

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"FREE {self.buffer}{_prio(self.priority)}"


_BUF = r"[A-Za-z][\w.]*(?:@\d+)?"
_PRIO = r"(?: !(?P<prio>-?\d+))?$"
_PATTERNS: list[tuple[re.Pattern[str], type]] = [
    (re.compile(rf"^LOAD (?P<buffer>{_BUF}){_PRIO}"), Load),
    (re.compile(rf"^ZEROS (?P<buffer>{_BUF}){_PRIO}"), Zeros),
    (
        re.compile(
            rf"^RUN (?P<program>\S+)(?: mb(?P<mb>\d+))? \((?P<reads>[^)]*)\) -> "
            rf"\((?P<writes>[^)]*)\){_PRIO}"
        ),
        Run,
    ),
    (re.compile(rf"^SEND (?P<buffer>{_BUF}) #(?P<message>\d+) -> w(?P<peer>\d+){_PRIO}"), Send),
    (re.compile(rf"^RECV (?P<buffer>{_BUF}) #(?P<message>\d+) <- w(?P<peer>\d+){_PRIO}"), Recv),
    (
        re.compile(
            rf"^COLL (?P<kind>\w+) (?P<buffer>{_BUF}) #(?P<message>\d+) \[(?P<group>[w\d,]+)\]"
            rf"(?: root=w(?P<root>\d+))?{_PRIO}"
        ),
        Collective,
    ),
    (re.compile(rf"^WAIT (?P<buffer>{_BUF}){_PRIO}"), Wait),
    (re.compile(rf"^WAITALL{_PRIO}"), WaitAll),
    (re.compile(rf"^FREE (?P<buffer>{_BUF}){_PRIO}"), Free),
]


def transfer_of(buffer: str) -> str:
    """The transfer name of a transfer buffer: ``t3@2`` -> ``t3``."""
    return buffer.split("@", 1)[0]


def mb_of(buffer: str) -> int | None:
    """The micro-batch index of a per-micro-batch buffer name, or None for per-step buffers."""
    _, sep, mb = buffer.partition("@")
    return int(mb) if sep else None


def parse_instruction(token: str) -> Instruction:
    """Parse one instruction token (the reverse of ``str(instruction)``).

    A leading worker prefix such as ``w3: `` is accepted and ignored.
    """
    text = re.sub(r"^w\d+:\s*", "", token.strip())
    for pattern, cls in _PATTERNS:
        m = pattern.match(text)
        if not m:
            continue
        g = m.groupdict()
        prio = int(g.pop("prio") or 0)
        if cls is Run:
            return Run(
                program=g["program"],
                mb=int(g["mb"]) if g["mb"] is not None else None,
                inputs=tuple(g["reads"].split()),
                outputs=tuple(g["writes"].split()),
                priority=prio,
            )
        if cls in (Send, Recv):
            return cls(
                buffer=g["buffer"],
                transfer=transfer_of(g["buffer"]),
                message=int(g["message"]),
                peer=int(g["peer"]),
                priority=prio,
            )
        if cls is Collective:
            return Collective(
                kind=g["kind"],
                buffer=g["buffer"],
                transfer=transfer_of(g["buffer"]),
                message=int(g["message"]),
                group=tuple(int(w[1:]) for w in g["group"].split(",")),
                root=int(g["root"]) if g["root"] is not None else None,
                priority=prio,
            )
        if cls is Load:
            mb = mb_of(g["buffer"])
            if mb is None:
                raise ValueError(f"LOAD needs a per-micro-batch buffer (name@k), got {token!r}")
            return Load(buffer=g["buffer"], mb=mb, priority=prio)
        return cls(priority=prio, **g)
    raise ValueError(f"cannot parse instruction token {token!r}")


@dataclass(frozen=True)
class WorkerStream:
    """The static instruction list one worker (host-actor) runs every step."""

    worker: int
    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        return "\n".join(f"w{self.worker}: {ins}" for ins in self.instructions)

    def tokens(self) -> list[str]:
        """The instructions as tokens, without the worker prefix."""
        return [str(ins) for ins in self.instructions]

    @staticmethod
    def parse(worker: int, tokens: list[str]) -> WorkerStream:
        """Rebuild a stream from its tokens."""
        return WorkerStream(worker, tuple(parse_instruction(t) for t in tokens))
