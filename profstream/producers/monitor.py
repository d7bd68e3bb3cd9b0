"""``Monitor``: the device-side producer that lives in each training process.

Every call made on the training thread appends one tuple to a bounded in-memory buffer
and returns: no I/O, no lock, no exception into user code. A background ``Sender``
thread turns the buffer into columnar ``EventBatch`` messages and sends them to Kafka.
When the buffer is full, op events are dropped first and counted; step marks, memory and
queue samples have a reserve of their own. The drop counts travel in the next batch
header.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from profstream.config import MONITOR_OPTIONS, resolve
from profstream.kafka.topics import Topics
from profstream.schema.batch import NO_VALUE

log = logging.getLogger("profstream.monitor")

# Rough in-memory cost of one buffered event (tuple + ints + deque slot), used to turn
# buffer_bytes into counts. Measured with tracemalloc on CPython 3.11: ~200 B per op tuple.
OP_BYTES = 224
SAMPLE_BYTES = 200
# Share of buffer_bytes kept for encoded batches that wait for the broker's acknowledgement.
INFLIGHT_SHARE = 0.25
# Share of the remaining buffer reserved for step marks, memory, queue and host samples.
SAMPLE_SHARE = 0.05

_time_ns = time.time_ns

_live_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for monitor in list(_live_monitors):
        monitor.close(timeout=5.0)


class _StepContext:
    __slots__ = ("_monitor", "_step")

    def __init__(self, monitor: Monitor, step: int | None) -> None:
        self._monitor = monitor
        self._step = step

    def __enter__(self) -> int:
        return self._monitor.begin_step(self._step)

    def __exit__(self, *exc: object) -> None:
        self._monitor.end_step()


class Monitor:
    """Records op, memory, queue and step events of one rank and streams them to Kafka.

    Options (see ``profstream.config.MONITOR_OPTIONS``) come from keyword arguments, then
    ``PROFSTREAM_*`` environment variables, then ``PROFSTREAM_OPTIONS`` JSON. A bad option
    raises ``ConfigError`` here, at construction; after that no method raises.

    >>> mon = Monitor(run_id="r1", bootstrap="127.0.0.1:9092")
    >>> with mon.step():
    ...     mon.op("matmul", start_ns, dur_ns)
    >>> mon.close()
    """

    def __init__(self, sender_factory: Any = None, **options: Any) -> None:
        self.options = opts = resolve(MONITOR_OPTIONS, options)
        self.run_id: str = opts["run_id"]
        self.rank: int = opts["rank"]
        self.topics = Topics(opts["topic_prefix"])
        self.producer_id = uuid.uuid4().hex
        self.key = f"{self.run_id}/{self.rank}".encode()
        self._enabled: bool = opts["enabled"]

        budget = opts["buffer_bytes"] * (1 - INFLIGHT_SHARE)
        self.inflight_limit_bytes = int(opts["buffer_bytes"] * INFLIGHT_SHARE)
        self._max_ops = max(1, int(budget * (1 - SAMPLE_SHARE) / OP_BYTES))
        self._max_samples = max(64, int(budget * SAMPLE_SHARE / SAMPLE_BYTES))
        self._batch_max_ops: int = opts["batch_max_ops"]

        # Buffers: appended on the training thread, drained by the sender thread.
        self._ops: deque = deque()  # one tuple per op() call
        self._op_chunks: deque = deque()  # one OpChunk per ops() call
        self._chunk_ops_in = 0  # ops put into chunks (recording thread)
        self._chunk_ops_out = 0  # ops taken out of chunks (sender thread)
        self._tuple_limit = self._max_ops  # room for op() tuples: max_ops less the chunk backlog
        self._marks: deque = deque()
        self._memory: deque = deque()
        self._queues: deque = deque()
        # Monotonic counters, written by the recording thread only.
        self.dropped_ops = 0
        self.dropped_samples = 0
        self.recorded_ops = 0  # ops accepted into the buffer, updated by the sender

        # Step state.
        self._step: int = -1
        self._next_step = 0
        self._step_start: int | None = None
        self._fp_start = NO_VALUE
        self._bp_end = NO_VALUE
        self._watermark: int | None = None
        self._auto_watermark: bool = opts["auto_watermark"]
        self._start_step = opts["start_step"]
        self._stop_step = opts["stop_step"]
        self._every_n = opts["every_n_steps"]
        self._capturing = self._enabled and self._start_step is None
        self._closed = False

        self._wake = threading.Event()
        self._sender = None
        if self._enabled:
            from profstream.producers.sender import Sender

            self._sender = (sender_factory or Sender)(self)
            self._sender.start()
            _live_monitors.add(self)

    # -- hot path ---------------------------------------------------------------------

    def op(self, name: str, start_ns: int, dur_ns: int, kind: int | str = 0,
           op_type: str | None = None, stream: int = 0, step: int | None = None) -> None:
        """Record one op (kernel, collective, copy...) that ran for ``dur_ns`` from ``start_ns``.

        ``kind`` is a code from ``profstream.schema`` (COMPUTE, COMMUNICATION, ...) or its
        name; ``op_type`` defaults to ``name``; ``step`` defaults to the current step."""
        if self._capturing:
            ops = self._ops
            if len(ops) < self._tuple_limit:
                ops.append((name, op_type, kind, stream, self._step if step is None else step, start_ns, dur_ns))
                if len(ops) == self._batch_max_ops:
                    self._wake.set()
            else:
                self.dropped_ops += 1

    def ops(self, names, start_ns, dur_ns, kinds=0, op_types=None, streams=0, step: int | None = None) -> None:
        """Record many ops at once: equal-length sequences (lists or numpy arrays); a scalar
        ``kinds``, ``op_types`` or ``streams`` applies to all. The columns are copied, so the
        caller may reuse them. Used by integrations that get a step's ops in bulk."""
        if not self._capturing:
            return
        n = len(names)
        room = self._max_ops - self.buffered_ops
        if n > room:
            room = max(room, 0)
            self.dropped_ops += n - room
            n = room
            if not n:
                return
        self._op_chunks.append(OpChunk(n, _copy(names, n), _copy(op_types, n), _copy(kinds, n), _copy(streams, n),
                                       self._step if step is None else step, _copy(start_ns, n), _copy(dur_ns, n)))
        self._chunk_ops_in += n
        self.update_tuple_limit()
        if self.buffered_ops >= self._batch_max_ops:
            self._wake.set()

    # -- steps ------------------------------------------------------------------------

    def begin_step(self, step: int | None = None, ts_ns: int | None = None) -> int:
        """Mark the start of a step (the loop asks for its next batch). Returns its number."""
        if not self._enabled:
            return -1
        if self._step_start is not None:  # begin without end: close the open step first
            self.end_step(ts_ns)
        if step is None or not isinstance(step, int):
            step = self._next_step
        self._step = step
        self._next_step = step + 1
        self._step_start = _time_ns() if ts_ns is None else ts_ns
        self._fp_start = self._bp_end = NO_VALUE
        self._capturing = self._in_window(step)
        return step

    def end_step(self, ts_ns: int | None = None) -> None:
        """Mark the end of the current step."""
        if self._step_start is None:
            return
        marks = self._marks
        if len(marks) < self._max_samples:
            marks.append((self._step, self._step_start, _time_ns() if ts_ns is None else ts_ns,
                          self._fp_start, self._bp_end))
        else:
            self.dropped_samples += 1
        self._step_start = None
        if self._auto_watermark:
            self._watermark = self._step
            self._wake.set()  # the step is complete: send it now rather than at the next interval

    def step(self, step: int | None = None) -> _StepContext:
        """``with monitor.step(): ...`` marks the start and end of one step."""
        return _StepContext(self, step)

    def mark_fp_start(self, ts_ns: int | None = None) -> None:
        """Forward pass of the current step starts now (or at ``ts_ns``)."""
        if self._step_start is not None:
            self._fp_start = _time_ns() if ts_ns is None else ts_ns

    def mark_bp_end(self, ts_ns: int | None = None) -> None:
        """Backward pass of the current step ends now (or at ``ts_ns``)."""
        if self._step_start is not None:
            self._bp_end = _time_ns() if ts_ns is None else ts_ns

    def complete_through(self, step: int) -> None:
        """Watermark: every event of every step <= ``step`` has been recorded.

        Only needed with ``auto_watermark=False``, when a step's ops are recorded after
        the step ended (for example from a profiler's buffer)."""
        self._watermark = step

    def defer_ops(self) -> None:
        """For producers that record a step's ops after the step ended (from a profiler's
        buffer): ops are no longer gated by the step window of the step being recorded now,
        and step ends no longer move the watermark. The caller applies the window itself and
        calls ``complete_through(step)`` once a step's ops are recorded."""
        self._start_step = self._stop_step = self._every_n = None
        self._capturing = self._enabled and not self._closed
        self._auto_watermark = False

    @property
    def current_step(self) -> int:
        return self._step

    def _in_window(self, step: int) -> bool:
        start, stop, every = self._start_step, self._stop_step, self._every_n
        if start is not None and step < start:
            return False
        if stop is not None and step > stop:
            return False
        if every is not None and (step - (start or 0)) % every:
            return False
        return True

    # -- samples ----------------------------------------------------------------------

    def memory(self, allocated: int, reserved: int = NO_VALUE, peak: int = NO_VALUE,
               ts_ns: int | None = None, step: int | None = None) -> None:
        """Record device memory in bytes: allocated, and reserved / peak when known."""
        if not self._enabled:
            return
        if len(self._memory) < self._max_samples:
            self._memory.append((_time_ns() if ts_ns is None else ts_ns, self._step if step is None else step,
                                 allocated, reserved, peak))
        else:
            self.dropped_samples += 1

    def queue(self, name: str, size: int, capacity: int = NO_VALUE,
              ts_ns: int | None = None, step: int | None = None) -> None:
        """Record the size of a data queue (batches prefetched and waiting for the device)."""
        if not self._enabled:
            return
        if len(self._queues) < self._max_samples:
            self._queues.append((name, _time_ns() if ts_ns is None else ts_ns,
                                 self._step if step is None else step, size, capacity))
        else:
            self.dropped_samples += 1

    # -- lifecycle --------------------------------------------------------------------

    def update_tuple_limit(self) -> None:
        """Keep op() tuples and ops() chunks together under the buffer bound (called when
        the chunk backlog changes, on either thread: a value at most one change stale)."""
        self._tuple_limit = self._max_ops - (self._chunk_ops_in - self._chunk_ops_out)

    @property
    def buffered_ops(self) -> int:
        return len(self._ops) + self._chunk_ops_in - self._chunk_ops_out

    @property
    def buffer_fill_ratio(self) -> float:
        return self.buffered_ops / self._max_ops

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything recorded so far and wait for the broker's acknowledgement.

        Returns False if that did not happen within ``timeout`` seconds. Never raises."""
        if self._sender is None or self._closed:
            return self._sender is None
        return self._sender.flush(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Flush (within ``timeout``), stop the background thread and the Kafka producer."""
        if self._closed:
            return True
        if self._step_start is not None:
            self.end_step()
        self._closed = True
        self._capturing = False
        _live_monitors.discard(self)
        if self._sender is None:
            return True
        return self._sender.stop(timeout)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Producer health: drops, buffer fill, batches sent, send latency."""
        out = {"dropped_ops": self.dropped_ops, "dropped_samples": self.dropped_samples,
               "buffered_ops": self.buffered_ops, "buffer_fill_ratio": self.buffer_fill_ratio,
               "buffered_samples": len(self._marks) + len(self._memory) + len(self._queues)}
        if self._sender is not None:
            out.update(self._sender.stats())
            # dropped: by the full buffer, and what never reached Kafka (purged at close, refused)
            out["dropped_ops"] += out["undelivered_ops"]
            out["dropped_samples"] += out["undelivered_samples"]
        return out


class OpChunk(NamedTuple):
    """The columns of one ops() call; scalar columns stay scalars."""

    n: int
    names: Any
    op_types: Any
    kinds: Any
    streams: Any
    step: Any
    start_ns: Any
    dur_ns: Any


def _copy(value: Any, n: int) -> Any:
    """The first n values of a column, copied; a scalar (or None) as it is."""
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, np.ndarray):
        return value[:n].copy()
    return list(value[:n])
