"""A reader of EventBatch bodies that are mostly empty sections (a side batch of data-loader
readings: one section of 11 columns, seven empty ones).

fastavro reads a body field by field, about 0.35 us a field however empty: an EventBatch v8
has 102 fields, so a batch of three loader rows took 35 us to read, as long as a batch of
a step's 50 ops (v4, 51 fields). Here a section (a record of a count and byte columns) with
count 0 and every column empty is exactly one zero byte per field, skipped in one
comparison; the rest is read as fastavro reads it, into the same dict. The reader takes
well-formed bodies only: on anything else it raises, and ``codec.decode_any`` reads the
message again with fastavro, whose error says what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from struct import unpack_from
from typing import Any

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


_PRIMITIVES: dict[str, Reader] = {"int": _long, "long": _long, "bytes": _bytes, "string": _string,
                                  "double": _double}


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


def _reader(schema: Any) -> Reader:
    if isinstance(schema, str):
        if schema not in _PRIMITIVES:
            raise NotRead(f"type {schema}")
        return _PRIMITIVES[schema]
    if isinstance(schema, list):
        if len(schema) != 2 or schema[0] != "null":
            raise NotRead("union other than [null, T]")
        return _optional(_reader(schema[1]))
    kind = schema.get("type")
    if kind == "array":
        return _array(_reader(schema["items"]))
    if kind == "record":
        types = [f["type"] for f in schema["fields"]]
        if len(types) > 1 and types[0] == "int" and all(t == "bytes" for t in types[1:]):
            return _section([f["name"] for f in schema["fields"]])
        return _record([(f["name"], _reader(f["type"])) for f in schema["fields"]])
    if isinstance(kind, (str, list, dict)):
        return _reader(kind)
    raise NotRead(f"type {kind}")


def sparse_reader(schema: dict) -> Reader | None:
    """A reader of a body of ``schema`` (a record: ``(record, position after it)``), or None
    where the schema has a type it does not read."""
    try:
        return _reader(schema)
    except NotRead:
        return None
