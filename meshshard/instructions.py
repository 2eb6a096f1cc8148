"""Per-worker instruction IR: what each host-actor runs every step.

One IR serves the runtime (which executes it), the verifier (which checks it) and the
simulator (which predicts its timeline).  Every instruction names the buffers it reads
and writes (typed :class:`~meshshard.refs.BufferRef`), so data dependencies are
explicit edges.  Communication is *issued* by one instruction (``SEND``, ``RECV``,
``COLL``) and *completed* by a later one (``WAIT`` for a buffer being received,
``WAITALL`` for outstanding sends), so the same stream can run blocking or overlapped.
Each instruction carries a ``priority`` slot for communication scheduling; it prints
as ``!N`` when non-zero.  Each class names its kind in ``opcode``.

Buffers print by one convention (``@k`` marks micro-batch ``k``; see
:class:`~meshshard.refs.BufferKind`):

``P{s}``
    parameters read by stage ``s``            ``A{s}``  gradient accumulators of stage ``s``
``X{s}@k``
    batch inputs of stage ``s``                ``R{s}@k`` residuals kept from F to B
``t{n}@k``
    the array moved by cross-mesh transfer ``n``
``S{m}`` / ``O{m}``
    apply-gradient state inputs / step outputs of mesh ``m``

Constructors accept the token form of a reference (``"t0@2"``) as well as the typed
one; the fields always hold typed references.  Every instruction prints as one
compact token and :func:`parse_instruction` reads it back::

    >>> str(Run(program="s1.F", mb=2, inputs=("P1", "t0@2"), outputs=("R1@2", "t1@2")))
    'RUN s1.F mb2 (P1 t0@2) -> (R1@2 t1@2)'
    >>> ins = parse_instruction("SEND t0@2 #1 -> w3")
    >>> ins.buffer.kind, ins.buffer.mb, ins.transfer, ins.peer
    (<BufferKind.TRANSFER: 't'>, 2, TransferRef(index=0), 3)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from meshshard.refs import (
    BUFFER_TOKEN,
    PROGRAM_TOKEN,
    BufferKind,
    BufferRef,
    CollectiveKind,
    Opcode,
    ProgramRef,
    TransferRef,
)

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
    "BufferKind",
    "BufferRef",
    "ProgramRef",
    "TransferRef",
    "Opcode",
]

COLLECTIVE_KINDS = tuple(k.value for k in CollectiveKind)


def _prio(p: int) -> str:
    return f" !{p}" if p else ""


def _names(names: tuple[BufferRef, ...]) -> str:
    return "(" + " ".join(map(str, names)) + ")"


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """Base of all instructions; ``priority`` is the communication-scheduling slot."""

    opcode: ClassVar[Opcode]
    #: True for instructions that move data between workers (a class constant: the
    #: simulator and the runtime read it per instruction)
    is_comm: ClassVar[bool] = False
    priority: int = 0

    @cached_property
    def label(self) -> str:
        """``str(self)``, made once: the simulator names a span and a flow by it."""
        return str(self)

    @property
    def reads(self) -> tuple[BufferRef, ...]:
        """Buffers this instruction reads."""
        return ()

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        """Buffers this instruction (or its completion) writes."""
        return ()


@dataclass(frozen=True, kw_only=True)
class _OneBuffer(Instruction):
    """An instruction about one buffer (accepts its token form)."""

    buffer: BufferRef

    def __post_init__(self) -> None:
        _set(self, "buffer", BufferRef.of(self.buffer))

    def __str__(self) -> str:
        return f"{self.opcode.value} {self.buffer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Load(_OneBuffer):
    """Copy micro-batch ``mb`` of this stage's batch inputs into ``buffer`` (``X{s}@k``)."""

    opcode: ClassVar[Opcode] = Opcode.LOAD
    mb: int

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)


@dataclass(frozen=True, kw_only=True)
class Zeros(_OneBuffer):
    """Fill the gradient accumulator group ``buffer`` with zeros (start of a step)."""

    opcode: ClassVar[Opcode] = Opcode.ZEROS

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)


@dataclass(frozen=True, kw_only=True)
class Wait(_OneBuffer):
    """Complete every communication issued into ``buffer``; after it the buffer is readable."""

    opcode: ClassVar[Opcode] = Opcode.WAIT

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)


@dataclass(frozen=True, kw_only=True)
class Free(_OneBuffer):
    """Release ``buffer``; a buffer with a send still in flight is released when it completes."""

    opcode: ClassVar[Opcode] = Opcode.FREE

    @property
    def reads(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)


@dataclass(frozen=True, kw_only=True)
class Run(Instruction):
    """Run compiled program ``program`` (``s1.F``, ``s1.B``, ``m0.apply``) on micro-batch ``mb``."""

    opcode: ClassVar[Opcode] = Opcode.RUN
    program: ProgramRef
    mb: int | None
    inputs: tuple[BufferRef, ...] = ()
    outputs: tuple[BufferRef, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "program", ProgramRef.of(self.program))
        _set(self, "inputs", tuple(BufferRef.of(b) for b in self.inputs))
        _set(self, "outputs", tuple(BufferRef.of(b) for b in self.outputs))

    @property
    def reads(self) -> tuple[BufferRef, ...]:
        return self.inputs

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return self.outputs

    def __str__(self) -> str:
        mb = f" mb{self.mb}" if self.mb is not None else ""
        return (
            f"RUN {self.program}{mb} {_names(self.inputs)} -> {_names(self.outputs)}"
            f"{_prio(self.priority)}"
        )


@dataclass(frozen=True, kw_only=True)
class _Comm(Instruction):
    """Communication of message ``message`` of ``transfer`` through ``buffer``."""

    is_comm: ClassVar[bool] = True
    buffer: BufferRef
    transfer: TransferRef | None
    message: int

    def __post_init__(self) -> None:
        _set(self, "buffer", BufferRef.of(self.buffer))
        if self.transfer is not None:  # None for an all-reduce (it carries no transfer)
            _set(self, "transfer", TransferRef.of(self.transfer))


@dataclass(frozen=True, kw_only=True)
class Send(_Comm):
    """Issue the send of message ``message`` of transfer ``transfer`` from ``buffer`` to worker ``peer``."""

    opcode: ClassVar[Opcode] = Opcode.SEND
    peer: int

    @property
    def reads(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"SEND {self.buffer} #{self.message} -> w{self.peer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Recv(_Comm):
    """Issue the receive of message ``message`` of ``transfer`` into ``buffer`` from worker ``peer``.

    The buffer is usable only after a later ``WAIT`` on it.
    """

    opcode: ClassVar[Opcode] = Opcode.RECV
    peer: int

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        return f"RECV {self.buffer} #{self.message} <- w{self.peer}{_prio(self.priority)}"


@dataclass(frozen=True, kw_only=True)
class Collective(_Comm):
    """Issue a collective over ``group`` (worker ids); ``root`` for rooted kinds (broadcast).

    ``message`` indexes the transfer's message this collective carries.  Every member of
    ``group`` holds the same instruction, so participants match by construction.
    """

    opcode: ClassVar[Opcode] = Opcode.COLL
    kind: CollectiveKind
    group: tuple[int, ...]
    root: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {self.kind!r} is not one of {COLLECTIVE_KINDS}")
        _set(self, "kind", CollectiveKind(self.kind))
        if self.root is not None and self.root not in self.group:
            raise ValueError(f"collective root w{self.root} is not in its group {self.group}")

    @property
    def reads(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)

    @property
    def writes(self) -> tuple[BufferRef, ...]:
        return (self.buffer,)

    def __str__(self) -> str:
        group = ",".join(f"w{w}" for w in self.group)
        root = f" root=w{self.root}" if self.root is not None else ""
        return (
            f"COLL {self.kind.value} {self.buffer} #{self.message} [{group}]{root}"
            f"{_prio(self.priority)}"
        )


@dataclass(frozen=True, kw_only=True)
class WaitAll(Instruction):
    """Complete every outstanding send of this worker (end of step)."""

    opcode: ClassVar[Opcode] = Opcode.WAITALL

    def __str__(self) -> str:
        return f"WAITALL{_prio(self.priority)}"


_BUF = BUFFER_TOKEN
_PRIO = r"(?: !(?P<prio>-?\d+))?$"
_ONE_BUFFER = {Opcode.LOAD: Load, Opcode.ZEROS: Zeros, Opcode.WAIT: Wait, Opcode.FREE: Free}
_PATTERNS: list[tuple[re.Pattern[str], type]] = [
    (re.compile(rf"^(?P<op>LOAD|ZEROS|WAIT|FREE) (?P<buffer>{_BUF}){_PRIO}"), _OneBuffer),
    (
        re.compile(
            rf"^RUN (?P<program>{PROGRAM_TOKEN})(?: mb(?P<mb>\d+))? \((?P<reads>[^)]*)\) -> "
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
    (re.compile(rf"^WAITALL{_PRIO}"), WaitAll),
]


def _build(cls: type, g: dict, prio: int, token: str) -> Instruction:
    """One instruction from the named groups of its token's pattern."""
    if cls is _OneBuffer:
        buffer = BufferRef.parse(g["buffer"])
        op = _ONE_BUFFER[Opcode(g["op"])]
        if op is Load:
            if buffer.mb is None:
                raise ValueError(f"LOAD needs a per-micro-batch buffer (name@k), got {token!r}")
            return Load(buffer=buffer, mb=buffer.mb, priority=prio)
        return op(buffer=buffer, priority=prio)
    if cls is Run:
        return Run(
            program=ProgramRef.parse(g["program"]),
            mb=int(g["mb"]) if g["mb"] is not None else None,
            inputs=tuple(BufferRef.parse(b) for b in g["reads"].split()),
            outputs=tuple(BufferRef.parse(b) for b in g["writes"].split()),
            priority=prio,
        )
    buffer = BufferRef.parse(g["buffer"])
    if cls in (Send, Recv):
        return cls(
            buffer=buffer,
            transfer=buffer.transfer,
            message=int(g["message"]),
            peer=int(g["peer"]),
            priority=prio,
        )
    return Collective(
        kind=g["kind"],
        buffer=buffer,
        transfer=buffer.transfer if buffer.kind is BufferKind.TRANSFER else None,
        message=int(g["message"]),
        group=tuple(int(w.removeprefix("w")) for w in g["group"].split(",")),
        root=int(g["root"]) if g["root"] is not None else None,
        priority=prio,
    )


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
        if cls is WaitAll:
            return WaitAll(priority=prio)
        try:
            return _build(cls, g, prio, token)
        except ValueError as exc:
            if "per-micro-batch" in str(exc):
                raise
            raise ValueError(f"cannot parse instruction token {token!r}: {exc}") from None
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
