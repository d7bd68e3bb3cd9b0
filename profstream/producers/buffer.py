"""``EventBuffer``: the one buffer between a Monitor and its Sender.

One writer, one reader and no lock: the training thread appends (``deque.append`` is
atomic), the Sender's thread drains (``popleft``). Bounded: ``buffer_bytes`` is turned
into counts of events; when op events would pass theirs they are dropped and counted,
and memory and queue samples have a reserve of their own. Step marks have the largest
reserve: a step without its mark is lost whole, and a mark is small, so a full buffer
drops them last (ops go first, then samples, whose reserves fill a step at a time too).
``Monitor.op`` appends to ``ops`` itself (the hot path); everything else goes through the
methods here.
Device counter samples come from a second writer, the device sampler's thread: they have
a deque and a drop counter of their own.

Order matters for the watermark: ``drain`` reads it first, then takes step marks,
samples and ops. Every event recorded before the watermark moved is then in the drained
lists, so a batch never claims a step complete while its ops are still buffered.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, NamedTuple

import numpy as np

# Rough in-memory cost of one buffered event (tuple + ints + deque slot), used to turn
# buffer_bytes into counts. Measured with tracemalloc on CPython 3.11: ~200 B per op tuple.
OP_BYTES = 224
SAMPLE_BYTES = 200
# Share of buffer_bytes kept for encoded batches that wait for the broker's acknowledgement.
INFLIGHT_SHARE = 0.25
# Share of the remaining buffer reserved for each kind of sample: memory, queue, host.
SAMPLE_SHARE = 0.05
# Share of the remaining buffer reserved for step marks: with one mark a step, 4 times the
# steps any other sample's reserve holds (a 4 MiB buffer keeps 3,145 steps' marks, 3.5 min
# at 15 steps/s, when everything else is dropped; the default 64 MiB, 56 min).
MARK_SHARE = 0.2
MARK_BYTES = 200  # a step mark tuple of eight ints


class OpChunk(NamedTuple):
    """The columns of one ops() call; scalar columns stay scalars (``launch_ns`` None:
    no op of the chunk has a launch time)."""

    n: int
    names: Any
    op_types: Any
    kinds: Any
    streams: Any
    step: Any
    start_ns: Any
    dur_ns: Any
    launch_ns: Any = None


class Drained(NamedTuple):
    """What one batch takes from the buffer (``EventBuffer.drain``)."""

    watermark: int | None  # read before everything else
    marks: list[tuple]
    memory: list[tuple]
    queues: list[tuple]
    ops: list[OpChunk]
    more_ops: bool  # ops beyond ``ops`` are still buffered
    dropped_ops: int  # totals so far
    dropped_samples: int  # device samples included
    devices: list[tuple]
    collectives: list[tuple]  # (name, group, dtype, step, seq, start_ns, dur_ns, in, out, group_size)
    loader: list[tuple]  # data-loader readings (schema.batch.LOADER_COLUMNS), from the loader sampler's thread


class Bounds(NamedTuple):
    """``buffer_bytes`` as counts: the bounds of every Monitor buffer, Python or native."""

    inflight_bytes: int  # encoded batches waiting for their acknowledgement
    ops: int
    samples: int  # of each kind (memory, queues, host, collectives, device samples)
    marks: int


def buffer_bounds(buffer_bytes: int) -> Bounds:
    """``buffer_bytes`` as its bounds (``Bounds``)."""
    budget = buffer_bytes * (1 - INFLIGHT_SHARE)
    return Bounds(int(buffer_bytes * INFLIGHT_SHARE), max(1, int(budget * (1 - SAMPLE_SHARE - MARK_SHARE) / OP_BYTES)),
                  max(64, int(budget * SAMPLE_SHARE / SAMPLE_BYTES)), max(256, int(budget * MARK_SHARE / MARK_BYTES)))


def rows_chunk(rows: list[tuple]) -> OpChunk:
    """op() tuples (name, op_type, kind, stream, step, start_ns, dur_ns), or those and a
    launch_ns each, as one chunk."""
    return OpChunk(len(rows), *zip(*rows))


class EventBuffer:
    """Events recorded on the training thread and not yet taken by the Sender."""

    def __init__(self, buffer_bytes: int, batch_max_ops: int) -> None:
        self.inflight_limit_bytes, self.max_ops, self.max_samples, self.max_marks = buffer_bounds(buffer_bytes)
        self.batch_max_ops = batch_max_ops

        self.ops: deque = deque()  # one tuple per op() call
        self.op_chunks: deque = deque()  # one OpChunk per ops() call
        self._chunk_ops_in = 0  # ops put into chunks (recording thread)
        self._chunk_ops_out = 0  # ops taken out of chunks (sender thread)
        self.tuple_limit = self.max_ops  # room for op() tuples: max_ops less the chunk backlog
        self.marks: deque = deque()
        self.memory: deque = deque()
        self.queues: deque = deque()
        self.devices: deque = deque()  # device counter samples (the device sampler's thread)
        self.collectives: deque = deque()
        self.loader: deque = deque()  # data-loader readings (the loader sampler's thread)
        self.host: deque = deque()  # host readings given to Monitor.host_sample (the Sender samples its own)
        # Monotonic counters, written by the recording thread only.
        self.dropped_ops = 0
        self.dropped_samples = 0  # step marks included
        self.dropped_marks = 0
        self.dropped_device_samples = 0  # written by the device sampler's thread only
        self.watermark: int | None = None  # every event of steps <= watermark is buffered or sent
        self.wake = threading.Event()  # set when a batch is worth sending now

    # -- recording side (the training thread) -----------------------------------------

    def add_ops(self, names, start_ns, dur_ns, kinds, op_types, streams, step: int, launch_ns=None) -> None:
        """Many ops at once (``Monitor.ops``): the columns are copied; what does not fit is
        dropped and counted."""
        n = len(names)
        room = self.max_ops - self.buffered_ops
        if n > room:
            room = max(room, 0)
            self.dropped_ops += n - room
            n = room
            if not n:
                return
        self.op_chunks.append(OpChunk(n, _copy(names, n), _copy(op_types, n), _copy(kinds, n), _copy(streams, n),
                                      step, _copy(start_ns, n), _copy(dur_ns, n), _copy(launch_ns, n)))
        self._chunk_ops_in += n
        self.update_tuple_limit()
        if self.buffered_ops >= self.batch_max_ops:
            self.wake.set()

    def add_sample(self, samples: deque, row: tuple) -> None:
        """One memory, queue or collective sample into ``samples`` (``memory``, ``queues``
        or ``collectives``), or dropped and counted when their reserve is full."""
        if len(samples) < self.max_samples:
            samples.append(row)
        else:
            self.dropped_samples += 1

    def add_mark(self, row: tuple) -> None:
        """One step mark (``SECTIONS["steps"]``' columns), or dropped and counted (as a
        sample and as a mark) when the marks' reserve is full."""
        if len(self.marks) < self.max_marks:
            self.marks.append(row)
        else:
            self.dropped_samples += 1
            self.dropped_marks += 1

    def drop_counts(self) -> tuple[int, int]:
        """(ops, samples) the recording thread has dropped so far: what a step lost is the
        difference between its start and its end."""
        return self.dropped_ops, self.dropped_samples

    def add_collective(self, row: tuple) -> None:
        """One collective call (``Drained.collectives``' columns), or dropped and counted
        when the samples' reserve is full."""
        self.add_sample(self.collectives, row)

    def add_loader_sample(self, row: tuple) -> None:
        """One data-loader reading (``LOADER_COLUMNS``), or dropped and counted when their
        reserve is full: a second writer's, counted with the device samples."""
        if len(self.loader) < self.max_samples:
            self.loader.append(row)
        else:
            self.dropped_device_samples += 1

    def add_device_sample(self, row: tuple) -> None:
        """One device counter sample (ts_ns, step, *DeviceSample), or dropped and counted
        when their reserve is full."""
        if len(self.devices) < self.max_samples:
            self.devices.append(row)
        else:
            self.dropped_device_samples += 1

    # -- draining side (the Sender's thread) -------------------------------------------

    def drain(self, max_ops: int) -> Drained:
        """Everything but ops, and up to ``max_ops`` ops, for one batch (see the module
        docstring for the order)."""
        watermark = self.watermark
        marks = _take(self.marks)
        memory = _take(self.memory)
        queues = _take(self.queues)
        devices = _take(self.devices)
        collectives = _take(self.collectives)
        loader = _take(self.loader)
        ops = self.take_ops(max_ops)
        return Drained(watermark, marks, memory, queues, ops, self.buffered_ops > 0,
                       self.dropped_ops, self.dropped_samples + self.dropped_device_samples, devices, collectives,
                       loader)

    def take_ops(self, limit: int) -> list[OpChunk]:
        """Up to ``limit`` buffered ops, op() tuples first, then ops() chunks (split if needed)."""
        rows = _take(self.ops, limit)
        taken = [rows_chunk(rows)] if rows else []
        room = limit - len(rows)
        chunks = self.op_chunks
        while room > 0 and chunks:
            head = chunks[0]
            if head.n <= room:
                chunks.popleft()
                taken.append(head)
                room -= head.n
                self._chunk_ops_out += head.n
            else:
                taken.append(_slice(head, 0, room))
                chunks[0] = _slice(head, room, head.n)
                self._chunk_ops_out += room
                room = 0
        if len(taken) > bool(rows):
            self.update_tuple_limit()
        return taken

    def give_back(self, chunk: OpChunk) -> None:
        """Ops taken by ``take_ops`` that did not fit their batch, back at the front."""
        self.op_chunks.appendleft(chunk)
        self._chunk_ops_out -= chunk.n
        self.update_tuple_limit()

    # -- both sides ---------------------------------------------------------------------

    def update_tuple_limit(self) -> None:
        """Keep op() tuples and ops() chunks together under the buffer bound (called when
        the chunk backlog changes, on either thread: a value at most one change stale)."""
        self.tuple_limit = self.max_ops - (self._chunk_ops_in - self._chunk_ops_out)

    @property
    def buffered_ops(self) -> int:
        return len(self.ops) + self._chunk_ops_in - self._chunk_ops_out

    @property
    def buffered_samples(self) -> int:
        return (len(self.marks) + len(self.memory) + len(self.queues) + len(self.devices) + len(self.collectives)
                + len(self.loader) + len(self.host))

    @property
    def fill_ratio(self) -> float:
        return self.buffered_ops / self.max_ops

    @property
    def empty(self) -> bool:
        """Whether nothing is waiting for the Sender."""
        return not (self.ops or self.op_chunks or self.marks or self.memory or self.queues or self.devices
                    or self.collectives or self.loader or self.host)


def _take(buf: deque, limit: int | None = None) -> list:
    n = len(buf) if limit is None else min(limit, len(buf))
    pop = buf.popleft
    return [pop() for _ in range(n)]


def _slice(chunk: OpChunk, lo: int, hi: int) -> OpChunk:
    cut = [c[lo:hi] if isinstance(c, (list, tuple, np.ndarray)) else c for c in chunk[1:]]
    return OpChunk(hi - lo, *cut)


def _copy(value: Any, n: int) -> Any:
    """The first n values of a column, copied; a scalar (or None) as it is."""
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, np.ndarray):
        return value[:n].copy()
    return list(value[:n])
