"""A reader of EventBatch bodies that are mostly empty sections (a side batch of data-loader
readings: one section of 11 columns, seven empty ones).

fastavro reads a body field by field, about 0.35 us a field however empty: an EventBatch v8
has 102 fields, so a batch of three loader rows took 35 us to read, as long as a batch of
a step's 50 ops (v4, 51 fields). Here a section (a record of a count and byte columns) with
count 0 and every column empty is exactly one zero byte per field, skipped in one
comparison; the rest is read as fastavro reads it, into the same dict. The reader takes
well-formed bodies only: on anything else it raises, and ``codec.decode_any`` reads the
message again with fastavro, whose error says what is wrong.

Where the compiled Monitor's extension is built, the same reading runs compiled
(``producers/csrc/reader.cpp``, ``BodyReader``): ``body_plan`` describes the schema to it
as nested tuples, and it reads every body (full sections too) into the same dict, about
four times faster than fastavro. ``PROFSTREAM_PURE_PROCESSORS=1`` keeps the Python reader
(``profstream.compiled``).
"""

from __future__ import annotations

from collections.abc import Callable
from struct import unpack_from
from typing import Any

from profstream import compiled as _compiled

Reader = Callable[[bytes, int], tuple[Any, int]]


class NotRead(Exception):
    """A body this reader does not take (fastavro reads it instead)."""


def _long(data: bytes, pos: int) -> tuple[int, int]:
    b = data[pos]
    pos += 1
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos
    n = b & 0x7F
    shift = 7
    while True:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return (n >> 1) ^ -(n & 1), pos
        shift += 7
        if shift > 63:
            raise NotRead("varint longer than 10 bytes")


def _bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise NotRead("bytes past the body's end")
    return data[pos:end], end


def _string(data: bytes, pos: int) -> tuple[str, int]:
    n, pos = _long(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise NotRead("string past the body's end")
    return data[pos:end].decode(), end


def _double(data: bytes, pos: int) -> tuple[float, int]:
    return unpack_from("<d", data, pos)[0], pos + 8


def _array(items: Reader) -> Reader:
    def read(data: bytes, pos: int) -> tuple[list, int]:
        out = []
        while True:
            count, pos = _long(data, pos)
            if not count:
                return out, pos
            if count < 0:  # a block with its size in bytes
                count = -count
                _, pos = _long(data, pos)
            for _ in range(count):
                item, pos = items(data, pos)
                out.append(item)
    return read


def _optional(value: Reader) -> Reader:
    def read(data: bytes, pos: int) -> tuple[Any, int]:
        branch = data[pos]
        if branch == 0:
            return None, pos + 1
        if branch != 2:  # zigzag 1: the second branch
            raise NotRead("union branch")
        return value(data, pos + 1)
    return read


def _record(fields: list[tuple[str, Reader]]) -> Reader:
    def read(data: bytes, pos: int) -> tuple[dict, int]:
        out = {}
        for name, field in fields:
            out[name], pos = field(data, pos)
        return out, pos
    return read


def _section(names: list[str]) -> Reader:
    """A record of an int and byte columns: its empty form is one zero byte a field."""
    zeros = bytes(len(names))
    empty = {name: (0 if i == 0 else b"") for i, name in enumerate(names)}
    first, columns = names[0], names[1:]

    def read(data: bytes, pos: int) -> tuple[dict, int]:
        end = pos + len(zeros)
        if data[pos:end] == zeros:
            return empty.copy(), end
        count, pos = _long(data, pos)
        out = {first: count}
        size = len(data)
        for name in columns:
            b = data[pos]
            if b < 0x80:
                n = (b >> 1) ^ -(b & 1)
                pos += 1
            else:
                n, pos = _long(data, pos)
            end = pos + n
            if n < 0 or end > size:
                raise NotRead("bytes past the body's end")
            out[name] = data[pos:end]
            pos = end
        return out, pos
    return read


# body_plan's codes: csrc/reader.cpp's Kind
PLAN_LONG, PLAN_STRING, PLAN_BYTES, PLAN_DOUBLE, PLAN_OPTIONAL, PLAN_ARRAY, PLAN_RECORD, PLAN_SECTION = range(8)
_PLAN_PRIMITIVES = {"int": PLAN_LONG, "long": PLAN_LONG, "string": PLAN_STRING, "bytes": PLAN_BYTES,
                    "double": PLAN_DOUBLE}
_PRIMITIVES: dict[int, Reader] = {PLAN_LONG: _long, PLAN_STRING: _string, PLAN_BYTES: _bytes, PLAN_DOUBLE: _double}


def body_plan(schema: Any) -> Any:
    """The compiled reader's description of ``schema``, the types ``_reader`` takes: an int
    for a primitive, ``(PLAN_OPTIONAL, plan)``, ``(PLAN_ARRAY, plan)``, ``(PLAN_RECORD,
    names, plans)``, ``(PLAN_SECTION, names)``; NotRead where it has another type."""
    if isinstance(schema, str):
        if schema not in _PLAN_PRIMITIVES:
            raise NotRead(f"type {schema}")
        return _PLAN_PRIMITIVES[schema]
    if isinstance(schema, list):
        if len(schema) != 2 or schema[0] != "null":
            raise NotRead("union other than [null, T]")
        return (PLAN_OPTIONAL, body_plan(schema[1]))
    kind = schema.get("type")
    if kind == "array":
        return (PLAN_ARRAY, body_plan(schema["items"]))
    if kind == "record":
        names = tuple(f["name"] for f in schema["fields"])
        types = [f["type"] for f in schema["fields"]]
        if len(types) > 1 and types[0] == "int" and all(t == "bytes" for t in types[1:]):
            return (PLAN_SECTION, names)
        return (PLAN_RECORD, names, tuple(body_plan(t) for t in types))
    if isinstance(kind, (str, list, dict)):
        return body_plan(kind)
    raise NotRead(f"type {kind}")


def _reader(plan: Any) -> Reader:
    """The Python reader of a body_plan."""
    if isinstance(plan, int):
        return _PRIMITIVES[plan]
    kind = plan[0]
    if kind == PLAN_OPTIONAL:
        return _optional(_reader(plan[1]))
    if kind == PLAN_ARRAY:
        return _array(_reader(plan[1]))
    if kind == PLAN_SECTION:
        return _section(list(plan[1]))
    return _record([(name, _reader(item)) for name, item in zip(plan[1], plan[2])])


def compiled_reader(schema: dict) -> Reader | None:
    """The compiled reader of a body of ``schema`` (``BodyReader.read``), or None where the
    extension is not built (or PROFSTREAM_PURE_PROCESSORS is set) or the schema has a type
    it does not read."""
    if _compiled.NATIVE is None:
        return None
    try:
        return _compiled.NATIVE.BodyReader(body_plan(schema)).read
    except NotRead:
        return None


def sparse_reader(schema: dict, compiled: bool | None = None) -> Reader | None:
    """A reader of a body of ``schema`` (a record: ``(record, position after it)``), or None
    where the schema has a type it does not read: the compiled one where it is built (and
    ``compiled`` is not False), else the Python one."""
    reader = compiled_reader(schema) if compiled is not False else None
    if reader is not None:
        return reader
    try:
        return _reader(body_plan(schema))
    except NotRead:
        return None
