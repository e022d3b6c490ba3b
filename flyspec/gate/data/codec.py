"""The gate's one codec: any record (a frozen dataclass) to the JSON the store keeps of it, and back.

``to_json`` and ``from_json`` work from a record's fields and type hints. A field's ``stored(...)`` says
where its layout differs from its name and type: another key (``all``, ``from``, a nested
``sampling/seed``), a value written as no key at all (``absent``: None for most optional parts), a value
never written (``written``, e.g. the baseline lane every comparison shares), or a type whose layout its own
module owns (``encode``/``decode``: the sequential plan). flyspec/gate/data/spec.py has the records.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields, is_dataclass
from functools import cache
from typing import Any, TypeVar

Record = TypeVar("Record")
_NOTHING = object()


def stored(
    key: str | None = None,
    *,
    default: object = MISSING,
    absent: object = _NOTHING,
    encode: Callable[[Any], object] | None = None,
    decode: Callable[[Any], object] | None = None,
    written: bool = True,
) -> Any:
    """A record field whose stored layout differs from its name and type: ``key`` (``a/b``: key ``b`` of
    the object at ``a``), ``absent`` (the value written as no key, and read when the key is missing),
    ``encode``/``decode`` (a type whose layout another module owns), ``written`` False (never stored; the
    default is read)."""
    meta = {"key": key, "absent": absent, "encode": encode, "decode": decode, "written": written}
    return field(default=default, metadata=meta)


def to_json(record: object) -> dict[str, object]:
    """The stored JSON of a record (a dataclass), by its fields and their ``stored`` metadata."""
    out: dict[str, object] = {}
    for f in fields(record):  # type: ignore[arg-type]
        value, meta = getattr(record, f.name), f.metadata
        absent = meta.get("absent", _NOTHING)
        if not meta.get("written", True) or (absent is not _NOTHING and value == absent):
            continue
        encode = meta.get("encode")
        _put(out, _key(f), encode(value) if encode is not None and value is not None else _encode(value))
    return out


def from_json(cls: type[Record], data: Mapping[str, object]) -> Record:
    """The record of type ``cls`` stored as ``data`` (ValueError naming a required key that is missing)."""
    hints = _hints(cls)
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        meta = f.metadata
        value = _get(data, _key(f)) if meta.get("written", True) else _NOTHING
        if value is _NOTHING:
            value = meta.get("absent", _NOTHING)
        if value is _NOTHING:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"a stored {cls.__name__} needs the key {_key(f)!r}")
            continue
        decode = meta.get("decode")
        if decode is not None and value is not None:
            values[f.name] = decode(value)
        else:
            values[f.name] = _decode(hints[f.name], value)
    return cls(**values)


def _key(f: Field[object]) -> str:
    return f.metadata.get("key") or f.name


def _put(out: dict[str, object], key: str, value: object) -> None:
    *parents, last = key.split("/")
    for parent in parents:
        out = out.setdefault(parent, {})
    out[last] = value


def _get(data: Mapping[str, object], key: str) -> object:
    value: object = data
    for part in key.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            return _NOTHING
        value = value[part]
    return value


def _encode(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


@cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any) -> object:
    """``value`` as the type ``hint`` names: records, optionals, tuples, mappings and plain scalars."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value)
    if is_dataclass(hint):
        return from_json(hint, value)  # type: ignore[arg-type]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v) for v in value)
    if origin is tuple:
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin in (Mapping, dict):
        return {str(k): _decode(args[1], v) for k, v in value.items()}
    if hint in (int, float, str, bool):
        return hint(value)
    return value
