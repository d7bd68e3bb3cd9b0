"""A large Chrome trace parsed in several processes, with the result of one.

The ``traceEvents`` array is cut where one event ends and the next begins (``}``, a comma,
``{``, with any whitespace between), one chunk per worker. Each forked worker reads its
chunk (from the file; from the parent's bytes for a gzip file), decodes it as a JSON array
of its own, makes its ``EventColumns`` and sends them back; the parent merges them in file
order, so codes, tables and metadata are those of one pass over the whole array.

A cut can land inside a nested value or a string (``"args": [{...}, {...}]``). Such a
chunk is not a JSON array of events, so it fails to decode; any chunk that fails sends
the file back to the one-process path. When every chunk decodes, each cut was between two
events of the array: the first chunk starts at the array's first event, and a chunk that
starts between two events and decodes as an array of complete events ends between two
events of the same array.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from profstream.integrations.ingest.trace_events import (
    EventColumns,
    TraceEvent,
    TraceFile,
    gc_paused,
    merge_columns,
    scan_events,
)

log = logging.getLogger("profstream.ingest")

MIN_CHUNK_BYTES = 8 << 20  # below this a chunk saves less than a process costs to start
_WINDOW = 1 << 20  # bytes searched for the array's start, and for each cut
_OBJECT_KEY = b'"traceEvents"'
_OBJECT_START = re.compile(rb'"traceEvents"[ \t\n\r]*:[ \t\n\r]*\[')  # JSON's whitespace, no other
_ARRAY_START = re.compile(rb"[ \t\n\r]*\[")
_BETWEEN_EVENTS = re.compile(rb"\}[ \t\n\r]*,[ \t\n\r]*\{")

# the header fields of TraceFile, UNSET where the part of the file does not hold them
_HEADER = [f for f in msgspec.structs.fields(TraceFile) if f.name != "traceEvents"]
_TracePart = msgspec.defstruct("_TracePart", [("traceEvents", list[TraceEvent])] +
                               [(f.name, f.type | UnsetType, UNSET) for f in _HEADER], gc=False)
_PART = msgspec.json.Decoder(_TracePart)
_EVENTS = msgspec.json.Decoder(list[TraceEvent])


@dataclass(frozen=True)
class _Chunk:
    start: int  # first byte of its first event
    end: int | None  # one past the closing brace of its last event; None: the last chunk, to the end of the file
    header_end: int  # an object trace's first chunk: its header is raw[:header_end] (up to the '['); else 0
    in_object: bool  # the array is an object's traceEvents, not the whole file


def default_workers() -> int:
    """One per CPU this process may run on; 1 in a process with other threads (a lock that
    one of them holds while this one forks would stay held in the worker), native ones
    included: a Kafka client's or torch's threads are not in ``threading``'s count."""
    if threading.active_count() > 1 or _threads() > _THREADS_AT_IMPORT:
        return 1
    return len(os.sched_getaffinity(0))


def _threads() -> int:
    """The threads of this process, as the kernel counts them (Python's own where there is
    no /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# The threads already there when this module is imported: numpy's BLAS pool (which
# re-creates itself in a forked child) in a process that started with the command.
_THREADS_AT_IMPORT = _threads()


def columns_in_chunks(path: Path, raw: bytes | None, workers: int | None) -> tuple[EventColumns, dict] | None:
    """The columns and header fields of the trace at ``path`` (``raw``: its JSON text when
    it had to be decompressed; None: each worker reads its own chunk of the file) parsed in
    ``workers`` processes (default: ``default_workers()``). None where that is not worth it
    or not possible: less than two chunks of ``MIN_CHUNK_BYTES``, not Linux (fork), or a
    chunk that failed."""
    text = _Text(path, raw)
    workers = default_workers() if workers is None else workers
    parts = min(workers, text.size // MIN_CHUNK_BYTES)
    if (parts < 2 or sys.platform != "linux"  # macOS's system libraries are not safe to fork
            or multiprocessing.current_process().daemon):  # a daemon process may not start workers
        return None
    chunks = _cut(text, parts)
    if chunks is None:
        return None
    results = _run(path, text, chunks)
    if isinstance(results, str):
        log.info("%s: parsed in one process: %s", path, results)
        return None
    meta: dict[str, Any] = {}
    if chunks[0].in_object:  # its fields before the array, then those after it
        meta = {f.name: None for f in _HEADER}
        for _, fields in (results[0], results[-1]):
            meta.update(fields)
    return merge_columns([cols for cols, _ in results]), meta


class _Text:
    """The JSON text of a trace: the bytes of a decompressed file, or a plain file that each
    worker maps (so that no process reads or holds all of it)."""

    def __init__(self, path: Path, raw: bytes | None):
        self.path, self.raw = path, raw
        self._map: mmap.mmap | None = None
        try:
            self.size = len(raw) if raw is not None else path.stat().st_size
        except OSError:  # the one-process path says why
            self.size = 0

    def read(self, start: int, end: int) -> bytes:
        """A copy of bytes ``start`` to ``end``."""
        if self.raw is not None:
            return self.raw[start:end]
        with self.path.open("rb") as f:
            f.seek(start)
            return f.read(end - start)

    def span(self, start: int, end: int | None, before: bytes = b"", after: bytes = b"") -> bytes | memoryview:
        """Bytes ``start`` to ``end`` (None: to the end) between ``before`` and ``after``, to
        decode. From a file, ``before`` and ``after`` are written over the bytes around the
        span in a private mapping (copy on write: neither the file nor another process sees
        it), so the span itself is not copied; the bytes overwritten are not this chunk's."""
        if self.raw is not None:
            return b"".join((before, memoryview(self.raw)[start:end], after))
        text = self._mapping()
        end = len(text) if end is None else end
        first, last = start - len(before), end + len(after)
        if first < 0 or last > len(text):
            raise ValueError("the file changed since it was cut")
        text[first:start] = before
        text[end:last] = after
        return memoryview(text)[first:last]

    def find(self, sub: bytes, start: int) -> int:
        return (self.raw if self.raw is not None else self._mapping()).find(sub, start)

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return self._map


def _cut(text: _Text, parts: int) -> list[_Chunk] | None:
    """``parts`` chunks of about equal size, each cut between two events (if the cut is
    right: the workers find out)."""
    head = text.read(0, min(_WINDOW, text.size))
    first_key = head.find(_OBJECT_KEY)
    array = _ARRAY_START.match(head)
    if array is not None:
        first, header_end = array.end(), 0
    elif first_key >= 0 and (start := _OBJECT_START.match(head, first_key)) is not None:
        first = header_end = start.end()  # the header is checked by the first worker
    else:  # not a trace, or a header longer than the window
        return None
    in_object = header_end > 0
    chunks, start = [], first
    for k in range(1, parts):
        at = first + k * (text.size - first) // parts
        between = _BETWEEN_EVENTS.search(text.read(at, min(at + _WINDOW, text.size)))
        if between is None or at + between.start() <= start:  # an event longer than the window
            continue
        chunks.append(_Chunk(start, at + between.start() + 1, header_end if not chunks else 0, in_object))
        start = at + between.end() - 1
    if not chunks:
        return None
    chunks.append(_Chunk(start, None, 0, in_object))
    return chunks


def _run(path: Path, text: _Text, chunks: list[_Chunk]) -> list[tuple[EventColumns, dict]] | str:
    """Each chunk's columns and header fields, from one forked worker per chunk; the first
    failure's reason instead when a chunk fails."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        # The GC off across the forks, whoever calls: a child that collected right after
        # the fork (threading's after-fork hook allocates) crashed in a test process whose
        # other threads had been busy (a segfault, once in three full test runs).
        with gc_paused():
            for chunk in chunks:
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(send, path, text, chunk), daemon=True)
                proc.start()
                send.close()
                procs.append(proc)
                conns.append(receive)
        results = []
        for i, conn in enumerate(conns):
            try:
                got = conn.recv()
            except EOFError:  # killed, out of memory
                procs[i].join()
                got = f"its worker exited with code {procs[i].exitcode} and no result"
            if isinstance(got, str):
                return f"chunk {i + 1} of {len(chunks)}: {got}"
            results.append(got)
        return results
    finally:
        for proc in procs:
            if proc.is_alive():  # after a failure: the rest are not needed
                proc.terminate()
            proc.join()
        for conn in conns:
            conn.close()


def _worker(send, path: Path, text: _Text, chunk: _Chunk) -> None:
    try:
        events, fields = _decode(text, chunk)
        result: tuple | str = scan_events(path, events), fields
    except Exception as e:  # any failure is the parent's cue to parse in one process
        result = f"{type(e).__name__}: {e}"
    send.send(result)
    send.close()
    # exit without freeing the chunk's decoded events one by one (~0.1 s a million): the
    # OS takes the pages back at once; nothing else in this forked copy needs cleaning up
    os._exit(0)


def _decode(text: _Text, chunk: _Chunk) -> tuple[list[TraceEvent], dict[str, Any]]:
    fields: dict[str, Any] = {}
    if chunk.header_end:  # the header fields before the array
        fields = _fields(_PART.decode(text.read(0, chunk.header_end) + b"]}"))
    if chunk.end is not None:
        return _EVENTS.decode(text.span(chunk.start, chunk.end, b"[", b"]")), fields
    if not chunk.in_object:  # the rest of the file's array
        return _EVENTS.decode(text.span(chunk.start, None, b"[")), fields
    if text.find(_OBJECT_KEY, chunk.start) >= 0:  # a second traceEvents, or one in an event's args
        raise ValueError("traceEvents again after the cut")
    part = _PART.decode(text.span(chunk.start, None, b'{"traceEvents":['))  # events, then the fields after
    return part.traceEvents, _fields(part)


def _fields(part) -> dict[str, Any]:
    return {f: v for f in part.__struct_fields__ if f != "traceEvents" and (v := getattr(part, f)) is not UNSET}
