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

from collections.abc import Iterator, Mapping
from struct import Struct

import numpy as np

_TS: dict = {}  # rows (up to 64) -> the unpack of a Struct of that many little-endian int64


class WireColumns(Mapping):
    """``{column: numpy array}`` of ``count`` rows over ``raw``, one bytes per column of
    ``spec`` ((name, dtype), in the schema's order), each of ``count`` items (checked by the
    caller)."""

    __slots__ = ("spec", "raw", "count", "_index", "_arrays")

    def __init__(self, spec: tuple, raw: tuple[bytes, ...], count: int, index: dict[str, int]) -> None:
        self.spec, self.raw, self.count, self._index = spec, raw, count, index
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, col: str) -> np.ndarray:
        arr = self._arrays.get(col)
        if arr is None:
            i = self._index[col]  # KeyError: no such column
            arr = self._arrays[col] = np.frombuffer(self.raw[i], self.spec[i][1])
        return arr

    def __contains__(self, col: object) -> bool:
        return col in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"WireColumns({dict(self.items())!r})"


def row_count(rows: Mapping) -> int:
    """The rows of a section (of ``WireColumns`` without making a column an array)."""
    return rows.count if type(rows) is WireColumns else len(rows["ts_ns"])


def time_span(rows: Mapping) -> tuple[int, int] | None:
    """(first, last) ``ts_ns`` of a section's rows, None without rows; read from the wire's
    bytes where the rows are ``WireColumns`` (a few readings: no numpy call)."""
    if type(rows) is WireColumns and rows.count <= 64:  # type, not isinstance: an ABC's check costs ~2k instructions
        n = rows.count
        if not n:
            return None
        unpack = _TS.get(n)
        if unpack is None:
            unpack = _TS[n] = Struct(f"<{n}q").unpack
        times = unpack(rows.raw[rows._index["ts_ns"]])
    else:
        ts = rows["ts_ns"]
        if not len(ts):
            return None
        times = ts.tolist()  # a few readings: Python's min and max, not numpy's per-call cost
    return min(times), max(times)
