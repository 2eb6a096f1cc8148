"""Typed references: what a buffer, program, transfer or schedule task *is*, as fields.

Every module reads a reference's kind, owner, micro-batch or phase from its fields;
the short text tokens (``P1``, ``t0@2``, ``s1.F``, ``m0.apply``) exist only where a
plan is printed or parsed, and :meth:`BufferRef.parse` / :meth:`ProgramRef.parse`
read them back exactly::

    >>> ref = BufferRef(BufferKind.RESIDUALS, 1, mb=3)
    >>> str(ref), ref.kind.per_micro_batch, ref.group
    ('R1@3', True, BufferRef(kind=<BufferKind.RESIDUALS: 'R'>, owner=1, mb=None, virtual=None, version=None))
    >>> BufferRef.parse("t4@0").transfer
    TransferRef(index=4)
    >>> str(ProgramRef(Phase.BACKWARD, 2)), ProgramRef.parse("m0.apply").phase
    ('s2.B', <Phase.APPLY: 'apply'>)

The ``virtual`` (virtual pipeline stage) and ``version`` (weight version) slots are
empty today; schedules that need them print them as ``P1v2`` / ``P1~3``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from enum import Enum, StrEnum

__all__ = [
    "BufferKind",
    "Phase",
    "TaskKind",
    "BufferRef",
    "ProgramRef",
    "TransferRef",
    "BufferGroup",
    "LeafKind",
    "OutputSource",
    "Opcode",
    "CollectiveKind",
]


class BufferKind(StrEnum):
    """What a buffer group holds; the value is its one-letter print prefix."""

    PARAMS = "P"  #: state a stage reads (per step), owner = stage
    BATCH = "X"  #: batch inputs of a stage (per micro-batch), owner = stage
    RESIDUALS = "R"  #: values a stage's forward keeps for its backward, owner = stage
    ACCUMULATORS = "A"  #: gradient accumulators of a stage, owner = stage
    APPLY_STATE = "S"  #: other state the update of a mesh reads, owner = mesh
    APPLY_OUTPUTS = "O"  #: step results the update of a mesh makes, owner = mesh
    TRANSFER = "t"  #: the array a cross-mesh transfer moves, owner = transfer index
    CARRY = "K"  #: update values one phase hands to a later one on a mesh, owner = mesh
    REDUCTION = "r"  #: the value of a cross-mesh all-reduce, owner = reduction index
    BACKWARD_CARRY = (
        "D"  #: values a split backward's B hands its W (per micro-batch), owner = stage
    )

    @property
    def per_micro_batch(self) -> bool:
        """True for kinds with one instance per micro-batch (``X``, ``R``, ``t``, ``D``)."""
        return self in (
            BufferKind.BATCH,
            BufferKind.RESIDUALS,
            BufferKind.TRANSFER,
            BufferKind.BACKWARD_CARRY,
        )

    @property
    def persistent(self) -> bool:
        """True for kinds held across steps and written by nobody in a step (``P``, ``S``)."""
        return self in (BufferKind.PARAMS, BufferKind.APPLY_STATE)


class Phase(StrEnum):
    """The phase of a compiled program."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT_GRAD = "W"  #: the weight-gradient half of a split backward (zero-bubble)
    #: a forward and the backward of the same micro-batch as one program (fused pass)
    FORWARD_BACKWARD = "FB"
    #: a one-micro-batch step's forward, backward and update as one program (fused pass)
    STEP = "step"
    APPLY = "apply"  #: the once-per-step update of a mesh
    GATHER = "gather"  #: a worker-local all-gather (resharding simulation)


class TaskKind(StrEnum):
    """The kind of a schedule cell; each maps to the program phase it runs."""

    F = "F"
    B = "B"
    W = "W"  #: the weight-gradient half of a split backward (zero-bubble schedules)

    @property
    def phase(self) -> Phase:
        """The program phase a task of this kind runs."""
        return Phase(self.value)


_BUFFER = re.compile(
    r"^(?P<kind>[A-Za-z])(?P<owner>\d+)(?:v(?P<virtual>\d+))?(?:~(?P<version>\d+))?"
    r"(?:@(?P<mb>\d+))?$"
)
BUFFER_TOKEN = r"[A-Za-z]\d+(?:v\d+)?(?:~\d+)?(?:@\d+)?"


def _opt(text: str | None) -> int | None:
    return int(text) if text is not None else None


_INTERNED: dict[tuple, object] = {}
"""Every buffer, program and transfer reference made in this process, by class and fields
(a few thousand per plan)."""


def _interned(cls, values: tuple):
    """The one object of ``cls`` with these field values (made on first use).  The types
    are part of the key: ``1 == 1.0 == True`` must not share a reference."""
    key = (cls, *values, *map(type, values))
    ref = _INTERNED.get(key)
    if ref is None:  # set once here: the classes have no __init__ to set them per call
        ref = object.__new__(cls)
        for f, value in zip(fields(cls), values, strict=True):
            object.__setattr__(ref, f.name, value)
        # atomic: two threads making the same reference at once get one object
        ref = _INTERNED.setdefault(key, ref)
    return ref


class _Ref:
    """A reference interned by its fields (:func:`_interned`): equal references are one
    object, so identity is equality and the hot dicts the simulator and the verifier key
    by them hash and compare in C, without a Python call per lookup."""

    __slots__ = ()
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __reduce__(self):
        # Rebuild from the fields in the receiving process, interned there (an identity
        # hash means nothing in another process).
        return (self.__class__, tuple(getattr(self, f.name) for f in fields(self)))


@dataclass(frozen=True, eq=False, init=False)
class TransferRef(_Ref):
    """Cross-mesh transfer number ``index`` of a plan (prints as ``t{index}``)."""

    index: int

    def __new__(cls, index):
        return _interned(cls, (index,))

    def __str__(self) -> str:
        return f"t{self.index}"

    def buffer(self, mb: int | None = None) -> BufferRef:
        """The transfer's buffer for micro-batch ``mb``."""
        return BufferRef(BufferKind.TRANSFER, self.index, mb)

    @staticmethod
    def parse(token: str) -> TransferRef:
        """Read ``t3`` back (the inverse of ``str``)."""
        ref = BufferRef.parse(token)
        if ref.kind is not BufferKind.TRANSFER or ref.mb is not None:
            raise ValueError(f"not a transfer token (want t<n>): {token!r}")
        return ref.transfer

    @staticmethod
    def of(value: TransferRef | str) -> TransferRef:
        """``value`` as a TransferRef (a token string is parsed)."""
        return value if isinstance(value, TransferRef) else TransferRef.parse(value)


@dataclass(frozen=True, eq=False, init=False)
class BufferRef(_Ref):
    """One buffer group (``mb=None``) or its instance for micro-batch ``mb``.

    ``owner`` is the stage (``P X R A``), the mesh (``S O``) or the transfer index
    (``t``).  ``virtual``/``version`` are slots for virtual stages and weight versions.
    """

    kind: BufferKind
    owner: int
    mb: int | None = None
    virtual: int | None = None
    version: int | None = None

    def __new__(cls, kind, owner, mb=None, virtual=None, version=None):
        return _interned(cls, (kind, owner, mb, virtual, version))

    def __str__(self) -> str:
        v = f"v{self.virtual}" if self.virtual is not None else ""
        ver = f"~{self.version}" if self.version is not None else ""
        mb = f"@{self.mb}" if self.mb is not None else ""
        return f"{self.kind.value}{self.owner}{v}{ver}{mb}"

    @property
    def group(self) -> BufferRef:
        """The buffer group this instance belongs to (the reference without ``mb``)."""
        if self.mb is None:
            return self
        group = self.__dict__.get("_group")
        if group is None:
            group = BufferRef(self.kind, self.owner, None, self.virtual, self.version)
            object.__setattr__(self, "_group", group)
        return group

    def at(self, mb: int) -> BufferRef:
        """This group's instance for micro-batch ``mb`` (per-step kinds are returned as is)."""
        if not self.kind.per_micro_batch:
            return self
        return BufferRef(self.kind, self.owner, mb, self.virtual, self.version)

    @property
    def transfer(self) -> TransferRef:
        """The transfer a ``t`` buffer carries."""
        if self.kind is not BufferKind.TRANSFER:
            raise ValueError(f"buffer {self} is not a transfer buffer")
        return TransferRef(self.owner)

    @staticmethod
    def parse(token: str) -> BufferRef:
        """Read a buffer token back (the inverse of ``str``)."""
        m = _BUFFER.match(token)
        if m is None:
            raise ValueError(f"cannot parse buffer token {token!r} (want e.g. P1, R0@2, t3@1)")
        try:
            kind = BufferKind(m["kind"])
        except ValueError:
            kinds = "".join(k.value for k in BufferKind)
            raise ValueError(f"buffer token {token!r}: kind must be one of {kinds}") from None
        return BufferRef(
            kind, int(m["owner"]), _opt(m["mb"]), _opt(m["virtual"]), _opt(m["version"])
        )

    @staticmethod
    def of(value: BufferRef | str) -> BufferRef:
        """``value`` as a BufferRef (a token string is parsed)."""
        return value if isinstance(value, BufferRef) else BufferRef.parse(value)


_PROGRAM = re.compile(
    r"^(?:s(?P<stage>\d+)(?:v(?P<virtual>\d+))?\.(?P<phase>FB|step|[FBW])"
    r"|m(?P<mesh>\d+)\.apply(?P<part>\d+)?|gather\.w(?P<worker>\d+))$"
)
PROGRAM_TOKEN = r"(?:s\d+(?:v\d+)?\.(?:FB|step|[FBW])|m\d+\.apply\d*|gather\.w\d+)"


@dataclass(frozen=True, eq=False, init=False)
class ProgramRef(_Ref):
    """A compiled program: ``s{stage}.F``/``.B``/``.W``/``.FB``/``.step``, ``m{mesh}.apply``,
    ``gather.w{worker}``.

    An update split into phases by cross-mesh communication has one program per phase,
    ``m{mesh}.apply{part}``.
    """

    phase: Phase
    owner: int
    virtual: int | None = None
    part: int | None = None

    def __new__(cls, phase, owner, virtual=None, part=None):
        return _interned(cls, (phase, owner, virtual, part))

    def __str__(self) -> str:
        if self.phase is Phase.APPLY:
            return f"m{self.owner}.apply{'' if self.part is None else self.part}"
        if self.phase is Phase.GATHER:
            return f"gather.w{self.owner}"
        v = f"v{self.virtual}" if self.virtual is not None else ""
        return f"s{self.owner}{v}.{self.phase.value}"

    @property
    def sort_key(self) -> tuple[int, str]:
        """(owner, phase token): the order programs are listed and read in."""
        return self.owner, self.phase.value

    @staticmethod
    def parse(token: str) -> ProgramRef:
        """Read a program token back (the inverse of ``str``)."""
        m = _PROGRAM.match(token)
        if m is None:
            raise ValueError(
                f"cannot parse program token {token!r} (want s<stage>.F|B|W|FB|step, m<mesh>.apply "
                "or gather.w<worker>)"
            )
        if m["mesh"] is not None:
            return ProgramRef(Phase.APPLY, int(m["mesh"]), part=_opt(m["part"]))
        if m["worker"] is not None:
            return ProgramRef(Phase.GATHER, int(m["worker"]))
        return ProgramRef(Phase(m["phase"]), int(m["stage"]), _opt(m["virtual"]))

    @staticmethod
    def of(value: ProgramRef | str) -> ProgramRef:
        """``value`` as a ProgramRef (a token string is parsed)."""
        return value if isinstance(value, ProgramRef) else ProgramRef.parse(value)


class LeafKind(StrEnum):
    """Where a step-argument leaf goes."""

    BATCH = "batch"
    STATE = "state"
    UNUSED = "unused"


class OutputSource(StrEnum):
    """Where a step-output leaf comes from."""

    BUFFER = "buffer"
    INPUT = "input"
    LITERAL = "literal"


class Opcode(Enum):
    """Instruction kinds; the value is the token's leading word."""

    LOAD = "LOAD"
    ZEROS = "ZEROS"
    RUN = "RUN"
    SEND = "SEND"
    RECV = "RECV"
    COLL = "COLL"
    WAIT = "WAIT"
    WAITALL = "WAITALL"
    FREE = "FREE"


class CollectiveKind(StrEnum):
    """The collective a ``COLL`` instruction runs."""

    BROADCAST = "broadcast"
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"
    ALLTOALL = "alltoall"


@dataclass(frozen=True)
class BufferGroup:
    """A buffer group and the traced values (var ids) it holds, in order."""

    ref: BufferRef
    vars: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.ref}[{' '.join(f'%{v}' for v in self.vars)}]"
