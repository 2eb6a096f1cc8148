"""Plan JSON, derived from the dataclass field types (no per-class decoder).

:func:`encode` turns a frozen dataclass tree into JSON data; :func:`decode` walks
``dataclasses.fields`` and ``typing.get_type_hints`` of the expected type and rebuilds
it: tuples (fixed and variadic), ``Optional`` and other unions, enums, nested
dataclasses, and a few *token* types that travel as their printed text (typed
references and instructions, parsed back at this edge).  A malformed document raises
:class:`PlanFormatError` naming the path of the bad field::

    >>> from meshshard.plan import Message
    >>> decode(Message, {"src": 0, "dst": 1, "index": [[0, 2]], "nbytes": 8})
    Message(src=0, dst=1, index=((0, 2),), nbytes=8, group=(), src_device=0, dst_devices=(), round=0, chunk_bytes=0, blocks=())
    >>> decode(Message, {"src": 0, "dst": 1, "index": [], "nbytes": "x"}, "messages[0]")
    Traceback (most recent call last):
    ...
    meshshard.plan_json.PlanFormatError: messages[0].nbytes: expected int, got 'x'
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from enum import Enum
from functools import cache
from typing import Any

from meshshard.cluster import ClusterSpec
from meshshard.instructions import Instruction, parse_instruction
from meshshard.refs import BufferRef, ProgramRef, TransferRef

__all__ = ["PlanFormatError", "encode", "decode"]


class PlanFormatError(ValueError):
    """A plan document does not match the plan's types; the message names the field path."""


def _cluster_from(data: Any) -> ClusterSpec:
    if not isinstance(data, dict):
        raise ValueError(f"expected an object, got {data!r}")
    return ClusterSpec.from_dict(data)


#: Types that travel as text (or their own dict form): type -> (to JSON, from JSON).
_TOKENS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    BufferRef: (str, BufferRef.parse),
    ProgramRef: (str, ProgramRef.parse),
    TransferRef: (str, TransferRef.parse),
    Instruction: (str, parse_instruction),
    ClusterSpec: (lambda c: c.to_dict(), _cluster_from),
}


def _token_codec(tp: type):
    for base, codec in _TOKENS.items():
        if isinstance(tp, type) and issubclass(tp, base):
            return codec
    return None


def encode(obj: Any) -> Any:
    """JSON data for a plan (or any part of it)."""
    codec = _token_codec(type(obj))
    if codec is not None:
        return codec[0](obj)
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj):
        return {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [encode(x) for x in obj]
    return obj


def _fail(path: str, want: str, value: Any) -> PlanFormatError:
    return PlanFormatError(f"{path or '<document>'}: expected {want}, got {value!r}")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


_SCALARS = {int: "int", float: "float", str: "str", bool: "bool"}


def _scalar(tp: type, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if tp is int and isinstance(value, bool):
        raise _fail(path, "int", value)
    if not isinstance(value, tp):
        raise _fail(path, _SCALARS[tp], value)
    return value


def _union(args: tuple, value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    exact = [a for a in args if a in _SCALARS and type(value) is a]
    for alt in exact + [a for a in args if a not in exact and a is not type(None)]:
        try:
            return decode(alt, value, path)
        except PlanFormatError:
            continue
    raise _fail(path, " | ".join(_name(a) for a in args), value)


def _tuple(args: tuple, value: Any, path: str) -> tuple:
    if not isinstance(value, list):
        raise _fail(path, "a list", value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise _fail(path, f"a list of {len(args)}", value)
    return tuple(
        decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
    )


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


#: Fields renamed since plans were first saved: (class name, old name) -> new name, so a
#: plan file written before the rename still loads.
RENAMED_FIELDS = {("Plan", "extremes"): "gathered"}


def _dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise _fail(path, f"a {cls.__name__} object", value)
    value = {RENAMED_FIELDS.get((cls.__name__, k), k): v for k, v in value.items()}
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - known)
    if unknown:
        raise PlanFormatError(
            f"{path or '<document>'}: unknown field {unknown[0]!r} of {cls.__name__}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFormatError(f"{where}: missing")
            continue
        kwargs[f.name] = decode(hints[f.name], value[f.name], where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PlanFormatError(f"{path or '<document>'}: {exc}") from None


def decode(tp: Any, value: Any, path: str = "") -> Any:
    """Rebuild a value of type ``tp`` from JSON data; errors name ``path`` and the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(tp), value, path)
    if origin is tuple:
        return _tuple(typing.get_args(tp), value, path)
    if tp is Any or tp is object:
        return value
    if tp is type(None):
        if value is not None:
            raise _fail(path, "null", value)
        return None
    codec = _token_codec(tp)
    if codec is not None:
        try:
            return codec[1](value)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise PlanFormatError(f"{path}: bad {_name(tp)} {value!r}: {exc}") from None
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in tp)
            raise _fail(path, f"one of {choices}", value) from None
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path)
    if tp in _SCALARS:
        return _scalar(tp, value, path)
    raise TypeError(f"{path}: cannot decode type {tp!r}")
