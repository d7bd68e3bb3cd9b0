"""A decoded section's columns kept as the wire's little-endian bytes until one is read.

A step batch with host and data-loader readings (EventBatch v8) carries 17 columns of one
to three values each; made into a numpy array apiece when the batch is decoded they cost
more than the host figures computed from them (benchmarks.md, issue #34). ``WireColumns``
is the read-only mapping ``schema/batch.decode_batch`` gives those sections: a column
becomes a numpy array (a read-only view of its bytes, as a decoded column is) the first
time it is read, and a compiled kernel can read the bytes themselves (``raw``, in the
schema's order: ``host_figures`` of csrc/kernels.cpp).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from struct import Struct

import numpy as np

from profstream.schema.codec import DecodeError

_TS: dict = {}  # rows (up to 64) -> the unpack of a Struct of that many little-endian int64


class WireColumns(Mapping):
    """``{column: numpy array}`` of ``count`` rows over ``raw``, one bytes per column of its
    layout, each of ``count`` items (``WireLayout.columns`` makes them)."""

    __slots__ = ("layout", "raw", "count", "_arrays")

    def __getitem__(self, col: str) -> np.ndarray:
        arrays = self._arrays
        if arrays is None:
            arrays = self._arrays = {}
        arr = arrays.get(col)
        if arr is None:
            i = self.layout.index[col]  # KeyError: no such column
            arr = arrays[col] = np.frombuffer(self.raw[i], self.layout.spec[i][1])
        return arr

    def __contains__(self, col: object) -> bool:
        return col in self.layout.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.index)

    def __len__(self) -> int:
        return len(self.layout.index)

    def __repr__(self) -> str:
        return f"WireColumns({dict(self.items())!r})"


_new = object.__new__


class WireLayout:
    """A section's columns ((name, dtype), in the schema's order), read as ``WireColumns``."""

    __slots__ = ("section", "spec", "index", "_values", "_sizes", "_expected")

    def __init__(self, section: str, spec: tuple) -> None:
        self.section, self.spec = section, spec
        self.index = {col: i for i, (col, _) in enumerate(spec)}
        self._values = operator.itemgetter(*self.index)
        self._sizes = tuple(dtype.itemsize for _, dtype in spec)
        self._expected: dict[int, tuple[int, ...]] = {}  # rows (up to 64) -> each column's bytes

    def columns(self, record: dict, count: int) -> WireColumns:
        """The section of a decoded record (``{"count": n, column: bytes, ...}``); DecodeError
        where a column is missing or its bytes are not ``count`` items."""
        try:
            raw = self._values(record)
        except KeyError as e:
            raise DecodeError("malformed", f"{self.section}.{e.args[0]} missing") from None
        expected = self._expected.get(count)
        if expected is None:
            expected = tuple(count * size for size in self._sizes)
            if count <= 64:
                self._expected[count] = expected
        if tuple(map(len, raw)) != expected:
            col, got, size = next((col, len(r), size) for (col, _), r, size, want in
                                  zip(self.spec, raw, self._sizes, expected) if len(r) != want)
            raise DecodeError("malformed", f"{self.section}.{col} holds {got} bytes, expected {count} x {size}")
        cols = _new(WireColumns)  # no __init__ frame: a batch of readings makes two a step
        cols.layout, cols.raw, cols.count, cols._arrays = self, raw, count, None
        return cols


def row_count(rows: Mapping) -> int:
    """The rows of a section (of ``WireColumns`` without making a column an array)."""
    return rows.count if type(rows) is WireColumns else len(rows["ts_ns"])


def time_span(rows: Mapping) -> tuple[int, int] | None:
    """(first, last) ``ts_ns`` of a section's rows, None without rows; read from the wire's
    bytes where the rows are ``WireColumns`` (a few readings: no numpy call, and a loop
    rather than min and max, whose calls cost more than a few comparisons)."""
    if type(rows) is WireColumns and rows.count <= 64:  # type, not isinstance: an ABC's check costs ~2k instructions
        n = rows.count
        if not n:
            return None
        unpack = _TS.get(n)
        if unpack is None:
            unpack = _TS[n] = Struct(f"<{n}q").unpack
        times = unpack(rows.raw[rows.layout.index["ts_ns"]])
    else:
        ts = rows["ts_ns"]
        if not len(ts):
            return None
        times = ts.tolist()  # a few readings: Python's min and max, not numpy's per-call cost
    first = last = times[0]
    for t in times:
        if t < first:
            first = t
        elif t > last:
            last = t
    return first, last
