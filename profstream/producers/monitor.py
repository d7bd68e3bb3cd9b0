"""``Monitor``: the device-side producer that lives in each training process.

Every call made on the training thread records into a bounded in-memory buffer and
returns: no I/O, no lock, no exception into user code. A background sender thread turns
the buffer into columnar ``EventBatch`` messages and sends them to Kafka. When the buffer
is full, op events are dropped first and counted; step marks, memory and queue samples
have a reserve of their own. The drop counts travel in the next batch header.

Two implementations of the buffer and sender write the same bytes: the compiled one
(``native.NativeBuffer``, whose ``op()`` is a single C call, and ``native_sender``, which
builds and sends with the GIL released) where the extension loads, else the pure-Python
``buffer.EventBuffer`` and ``sender.Sender``. The first Monitor of a process says which.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import sys
import time
import uuid
import weakref
from collections import deque
from typing import Any

from profstream.config import MONITOR_OPTIONS, check_monitor_options, option_given, resolve
from profstream.devices.backend import DeviceSample
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.producers.buffer import EventBuffer
from profstream.schema.batch import (
    END_MARK,
    FLOPS_COUNTED,
    FLOPS_GIVEN,
    FLOPS_OPS,
    NO_VALUE,
    WORK_ROW,
)

log = logging.getLogger("profstream.monitor")

_time_ns = time.time_ns

_MAX_STEP = 2**63

_live_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
_said: set[str] = set()


def _say_once(what: str, level: int, message: str, *args: Any) -> None:
    if what not in _said:
        _said.add(what)
        log.log(level, message, *args)


def _make_buffer(opts: dict[str, Any]) -> tuple[Any, str]:
    """(the Monitor's buffer, "native" or "python"): compiled where it loads and is wanted."""
    if opts["enabled"] and opts["native"]:
        from profstream.producers import native

        module, why = native.load()
        if module is not None:
            _say_once("native", logging.INFO, "profstream: the Monitor records, encodes and sends in native code "
                      "(%s), its sender thread without the GIL", native.describe())
            return native.make_buffer(opts["buffer_bytes"], opts["batch_max_ops"]), "native"
        _say_once("python", logging.WARNING, "profstream: the Monitor runs in Python, its sender thread holding "
                  "the GIL for its per-batch work: %s", why)
    elif opts["enabled"]:
        _say_once("python-chosen", logging.INFO, "profstream: the Monitor runs in Python (native=false)")
    return EventBuffer(opts["buffer_bytes"], opts["batch_max_ops"]), "python"


def exiting_on_error() -> bool:
    """Whether the interpreter is exiting on an uncaught exception (it printed one): in an
    exit hook, a run that did not end normally."""
    return getattr(sys, "last_value", None) is not None


def live_monitors() -> list[Monitor]:
    """The Monitors of this process not closed yet."""
    return list(_live_monitors)


@atexit.register
def _close_all_at_exit() -> None:
    ended = not exiting_on_error()
    for monitor in list(_live_monitors):
        monitor.close(timeout=5.0, ended=ended)


_NAN = float("nan")
STEP_HISTORY = 4096  # step starts kept for step_at(): a reader of calls this many steps late finds their step


def _count(value: Any) -> int | None:
    """A token or sample count as the mark's i64, None when it is not one (never raises)."""
    if type(value) is int:  # the usual case: one check
        return value if value >= 0 else None
    try:
        n = int(value)  # numpy integers, a 0-d tensor
    except (TypeError, ValueError, OverflowError):
        return None
    return n if 0 <= n == value and n < 2**62 else None


_INF = float("inf")


def _amount(value: Any) -> float | None:
    """A FLOP count as the mark's f64, None when it is not a finite number >= 0."""
    if type(value) is not float:
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError):
            return None
    return value if 0 <= value < _INF else None


def _share(value: Any) -> float:
    """A FLOP count of a category as the mark's f64, NaN (unknown) when it is not one."""
    x = _amount(value)
    return _NAN if x is None else x


class _StepContext:
    __slots__ = ("_monitor", "_step", "_work")

    def __init__(self, monitor: Monitor, step: int | None, work: tuple) -> None:
        self._monitor = monitor
        self._step = step
        self._work = work

    def __enter__(self) -> int:
        step = self._monitor.begin_step(self._step)
        if self._work != (None, None, None):
            self._monitor.work(*self._work)
        return step

    def __exit__(self, *exc: object) -> None:
        self._monitor.end_step()


class _CountingOps:
    """The op() deque while a capture request records: counts what is appended."""

    __slots__ = ("_ops", "n")

    def __init__(self, ops) -> None:
        self._ops = ops
        self.n = 0

    def append(self, row: tuple) -> None:
        self.n += 1
        self._ops.append(row)

    def __len__(self) -> int:
        return len(self._ops)


class _CountingRecorder:
    """What _CountingOps counts, for the native Monitor: the ops rows its recorder took
    since the count was last set (op() and ops() alike; rows dropped or invalid are not)."""

    __slots__ = ("_buffer", "_base")

    def __init__(self, buffer) -> None:
        self._buffer = buffer
        self._base = buffer.recorded_rows(buffer.ops_section)

    @property
    def n(self) -> int:
        return self._buffer.recorded_rows(self._buffer.ops_section) - self._base

    @n.setter
    def n(self, value: int) -> None:
        self._base = self._buffer.recorded_rows(self._buffer.ops_section) - value


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

    def __init__(self, sender_factory: Any = None, connection: Connection | None = None, **options: Any) -> None:
        self.options = opts = resolve(MONITOR_OPTIONS, options, keywords=True)
        check_monitor_options(opts)
        # every Kafka client of this Monitor (sender, capture requests) uses this one connection:
        # ``connection`` (a command's, built once), else the options' (bootstrap, kafka_config...)
        self.connection = connection or Connection.from_options(
            opts, bootstrap_given=option_given("bootstrap", options, os.environ))
        self.run_id: str = opts["run_id"]
        self.rank: int = opts["rank"]
        self.topics = Topics(opts["topic_prefix"])
        self.producer_id = uuid.uuid4().hex
        self.key = f"{self.run_id}/{self.rank}".encode()
        self._enabled: bool = opts["enabled"]

        # Appended on the training thread, drained by the sender thread.
        buf, self.recording = _make_buffer(opts)
        self.buffer = buf
        self._native = self.recording == "native"
        self.inflight_limit_bytes = buf.inflight_limit_bytes
        if self._native:
            self.op = buf.op  # the compiled op(): one C call, no Python frame
        else:  # bound once: op() saves an attribute lookup on each of them
            self._ops = buf.ops
        self._batch_max_ops: int = buf.batch_max_ops
        self._wake = buf.wake

        # Step state.
        self._step: int = -1
        self._step_before = -1  # the step before the open one (cancel_step goes back to it)
        self._next_step = 0
        self._step_start: int | None = None
        self._fp_start = NO_VALUE
        self._bp_end = NO_VALUE
        self._drops_at_start = (0, 0)  # the buffer's drop counts when the open step began
        self._began: deque[tuple[int, int]] = deque(maxlen=STEP_HISTORY)  # (start_ns, step) of the latest steps
        self._through: int | None = None  # the watermark of the steps and ops (auto, or complete_through)
        self._held: dict[str, int | None] = {}  # watermarks of other sources (hold_watermark)
        self.collective_reader: Any = None  # the producer's reader of always-on collectives, if any
        self._end_signal = 0  # the signal that ends this process, once one arrived (its end mark says so)
        self.partial_steps = 0  # steps whose mark says they lost events
        # The open step's work (docs/figures.md, "Throughput and MFU"): what the user gave,
        # what an integration counted, and the device's peak FLOP/s (NaN: unknown).
        self._tokens: int | None = None
        self._samples: int | None = None
        self._flops: float | None = None  # given
        self._counted: tuple[float, float, float, float] | None = None  # flops, matmul, attention, conv
        self._flops_per_token: float | None = opts["flops_per_token"]
        self.peak_flops: float = _NAN
        self._peak_unknown: str | None = None  # the one line to say when a step has FLOPs and no peak
        self._resolve_peak(opts)
        self._auto_watermark: bool = opts["auto_watermark"]
        self._start_step = opts["start_step"]
        self._stop_step = opts["stop_step"]
        self._every_n = opts["every_n_steps"]
        self._scheduled: bool = opts["scheduled_capture"]
        self._capturing = self._enabled and self._scheduled and self._start_step is None
        self._closed = False
        self._sync_recorder()

        # Capture requests (docs/capture.md): read by a thread of their own, taken up at
        # step boundaries by the Monitor's gate, or by an integration after defer_ops().
        self.capture_plan = self._plan_gate = self._control = self._counting = None
        if self._enabled and opts["control"] and not opts["record_only"]:  # record_only: no broker to read
            from profstream.producers.control import start_control

            self.capture_plan, self._control = start_control(self)
            self._plan_gate = self.capture_plan

        self._sender = None
        self._device_sampler = None
        if self._enabled:
            if self._native:
                from profstream.producers.native_sender import NativeSender as sender_type
            else:
                from profstream.producers.sender import Sender as sender_type
            self.sender_type = sender_type
            self._sender = (sender_factory or sender_type)(self)
            self._sender.start()
            _live_monitors.add(self)
            from profstream.producers import shutdown

            shutdown.watch(live_monitors)  # SIGTERM: flush, and the end mark says so (producers/shutdown.py)
            from profstream.devices.sampler import start_sampler

            # on a thread of its own; None (one information line) where no counters can be read
            self._device_sampler = start_sampler(opts, self.device_sample)

    # -- hot path ---------------------------------------------------------------------

    def op(self, name: str, start_ns: int, dur_ns: int, kind: int | str = 0,
           op_type: str | None = None, stream: int = 0, step: int | None = None) -> None:
        """Record one op (kernel, collective, copy...) that ran for ``dur_ns`` from ``start_ns``.

        ``kind`` is a code from ``profstream.schema`` (COMPUTE, COMMUNICATION, ...) or its
        name; ``op_type`` defaults to ``name``; ``step`` defaults to the current step."""
        if self._capturing:
            ops = self._ops
            if len(ops) < self.buffer.tuple_limit:
                ops.append((name, op_type, kind, stream, self._step if step is None else step, start_ns, dur_ns))
                if len(ops) == self._batch_max_ops:
                    self._wake.set()
            else:
                self.buffer.dropped_ops += 1

    def ops(self, names, start_ns, dur_ns, kinds=0, op_types=None, streams=0, step: int | None = None,
            launch_ns=None) -> None:
        """Record many ops at once: equal-length sequences (lists or numpy arrays); a scalar
        ``kinds``, ``op_types`` or ``streams`` applies to all. The columns are copied, so the
        caller may reuse them. Used by integrations that get a step's ops in bulk.

        ``launch_ns``: for device ops, the host time of the call that launched each (the
        profiler's launch correlation resolved), -1 where there is none; the processors then
        count a device op in the step that launched it (``step``), whenever it ran."""
        if self._capturing:
            buf = self.buffer
            other_step = step is not None and (step != self._step or self._step_start is None)
            if other_step:  # ops of a step already ended (a deferring integration)
                before = buf.drop_counts()
            buf.add_ops(names, start_ns, dur_ns, kinds, op_types, streams, self._step if step is None else step,
                        launch_ns=launch_ns)
            if other_step:  # what the buffer dropped of them is not the open step's loss (the totals count it)
                ops, samples = self._drops_at_start
                self._drops_at_start = (ops + buf.drop_counts()[0] - before[0], samples)
            if self._counting is not None and not self._native:  # the native count is the recorder's
                self._counting.n += len(names)

    # -- steps ------------------------------------------------------------------------

    def begin_step(self, step: int | None = None, ts_ns: int | None = None) -> int:
        """Mark the start of a step (the loop asks for its next batch). Returns its number."""
        if not self._enabled:
            return -1
        if self._step_start is not None:  # begin without end: close the open step first
            self.end_step(ts_ns)
        if step is None or not isinstance(step, int) or step < 0:  # negative: END_MARK's
            step = self._next_step
        self._step_before = self._step
        self._step = step
        self._next_step = step + 1
        self._step_start = _time_ns() if ts_ns is None else ts_ns
        self._began.append((self._step_start, step))
        self._fp_start = self._bp_end = NO_VALUE
        self._drops_at_start = self.buffer.drop_counts()
        self._tokens = self._samples = self._flops = self._counted = None
        self._capturing = self._in_window(step)
        if self._plan_gate is not None and self._plan_gate.claim(step) is not None:
            self._capture_requested()
        if self._native:
            self.buffer.set_state(step, self._capturing)
        return step

    def end_step(self, ts_ns: int | None = None) -> None:
        """Mark the end of the current step."""
        if self._step_start is None:
            return
        buf = self.buffer
        end_ns = _time_ns() if ts_ns is None else ts_ns
        # what the step lost on this thread (the buffer was full) travels with its mark: the
        # processors then say it is partial, and leave it out of the rolling figures
        ops, samples = buf.drop_counts()
        lost_ops, lost_samples = ops - self._drops_at_start[0], samples - self._drops_at_start[1]
        if lost_ops or lost_samples:
            self.partial_steps += 1
        mark = (self._step, self._step_start, end_ns, self._fp_start, self._bp_end, lost_ops, lost_samples, 0)
        if self._tokens is None and self._samples is None and self._flops is None and self._counted is None:
            buf.add_mark(mark)
        else:
            buf.add_mark(mark + self._work_columns())
        self._step_start = None
        if self._counting is not None:
            self._requested_step_ended(end_ns)
        if self._auto_watermark:
            self._through = self._step
            self._set_watermark()
        # the step is complete (or its ops follow and complete_through rings): send it at the
        # end of the batch interval rather than wait for more (producers/sender.py: IDLE_SEND_S)
        self._wake.set()

    def where(self) -> tuple[int | None, int | None, int | None]:
        """(open step, when it began, last step begun before it) as another thread reads
        them now, without a lock: (None, None, last step) between steps. The training
        thread writes the step before its start and clears the start first, so one start
        read twice around the step is a consistent pair."""
        start = self._step_start
        step, before = self._step, self._step_before
        if start is None or self._step_start != start:
            return None, None, step if step >= 0 else None
        return step, start, before if before >= 0 else None

    def cancel_step(self) -> None:
        """Forget the step begun and not ended: no mark of it is sent (a loop that fetched a
        batch it then did not train on), and the next step takes its number. Its ops and
        samples, if any, belong to no step (the processors discard them)."""
        if self._step_start is None:
            return
        self._step_start = None
        if self._began and self._began[-1][1] == self._step:
            self._began.pop()
        self._step, self._next_step = self._step_before, self._step
        self._sync_recorder()

    def step(self, step: int | None = None, *, tokens: int | None = None, samples: int | None = None,
             flops: float | None = None) -> _StepContext:
        """``with monitor.step(): ...`` marks the start and end of one step; ``tokens``,
        ``samples``, ``flops``: its work, as ``work()`` takes it."""
        return _StepContext(self, step, (tokens, samples, flops))

    # -- work: throughput and MFU ------------------------------------------------------

    def work(self, tokens: int | None = None, samples: int | None = None, flops: float | None = None) -> None:
        """Add to the open step's work: tokens and samples trained on, model FLOPs (forward
        and backward). Called once per micro-batch, it sums them. FLOPs given here win over
        ``flops_per_token`` and over an integration's count. A value that is not a count
        (negative, not a number) is left out; no step open: nothing."""
        if self._step_start is None:
            return
        if tokens is not None and (n := _count(tokens)) is not None:
            self._tokens = n if self._tokens is None else self._tokens + n
        if samples is not None and (n := _count(samples)) is not None:
            self._samples = n if self._samples is None else self._samples + n
        if flops is not None and (x := _amount(flops)) is not None:
            self._flops = x if self._flops is None else self._flops + x

    def counted_flops(self, flops: float, matmul: float = _NAN, attention: float = _NAN, conv: float = _NAN) -> None:
        """The open step's model FLOPs as an integration counted them (torch's
        FlopCounterMode, once per input shape), and those of its matrix multiplications,
        attention and convolutions: used unless the user gave FLOPs (``work``,
        ``flops_per_token``)."""
        if self._step_start is not None and (x := _amount(flops)) is not None:
            self._counted = (x, _share(matmul), _share(attention), _share(conv))

    def ops_flops(self, step: int, flops: float, matmul: float = _NAN, attention: float = _NAN,
                  conv: float = _NAN) -> None:
        """The FLOPs the profiler counted for the captured ops of ``step``, read after the
        step ended (torch.profiler ``with_flops``): sent as a work row, used where the step
        has no FLOPs given or counted. Call it before ``complete_through(step)``."""
        if self._enabled and (x := _amount(flops)) is not None:
            # a row of the steps section: counted with the marks (their reserve, dropped_marks)
            self.buffer.add_mark((step, WORK_ROW, WORK_ROW, NO_VALUE, NO_VALUE, 0, 0, 0,
                                  NO_VALUE, NO_VALUE, x, FLOPS_OPS, self.peak_flops,
                                  _share(matmul), _share(attention), _share(conv)))

    def set_device_peak(self, device_name: str, dtype: Any) -> float:
        """The peak FLOP/s of ``device_name`` in ``dtype`` from profstream's table, for the
        steps from now on, unless ``peak_tflops`` gave it; NaN (MFU absent, one line said
        at the first step with FLOPs) where the table does not know them."""
        if self.options["peak_tflops"] is None:
            from profstream.devices.peaks import find_peak, how_to_set

            _entry, peak = find_peak(device_name, dtype)
            self.peak_flops = _NAN if peak is None else peak
            self._peak_unknown = how_to_set(device_name, dtype) if peak is None and device_name != "cpu" else None
        return self.peak_flops

    def _resolve_peak(self, opts: dict[str, Any]) -> None:
        """The peak from ``peak_tflops``, else from the table for the CUDA device and
        ``compute_dtype`` when both are known here; else unknown until an integration
        says (``set_device_peak``)."""
        if opts["peak_tflops"] is not None:
            self.peak_flops = opts["peak_tflops"] * 1e12
            return
        device, dtype = opts["device"], opts["compute_dtype"]
        name = None
        if dtype is not None and device.startswith("cuda") and self._enabled:
            from profstream.devices.peaks import cuda_device_name

            ordinal = device.partition(":")[2]
            name = cuda_device_name(int(ordinal) if ordinal.isdigit() else 0)
        if name is not None:
            self.set_device_peak(name, dtype)
        elif device != "cpu":  # a CPU has no table entry and says nothing: peak_tflops gives one
            from profstream.devices.peaks import how_to_set

            self._peak_unknown = how_to_set(device, dtype)

    def _work_columns(self) -> tuple:
        """The step mark's v8 columns (schema.batch.WORK_COLUMNS) of the open step."""
        tokens = NO_VALUE if self._tokens is None else self._tokens
        samples = NO_VALUE if self._samples is None else self._samples
        split = (_NAN, _NAN, _NAN)
        if self._flops is not None:
            flops, source = self._flops, FLOPS_GIVEN
        elif self._flops_per_token is not None and self._tokens is not None:
            flops, source = self._flops_per_token * self._tokens, FLOPS_GIVEN
        elif self._counted is not None:
            flops, source, split = self._counted[0], FLOPS_COUNTED, self._counted[1:]
        else:
            return (tokens, samples)
        peak = self.peak_flops
        if peak != peak and self._peak_unknown is not None:
            log.warning("%s", self._peak_unknown)
            self._peak_unknown = None  # said once
        return (tokens, samples, flops, source, peak, *split)

    def mark_fp_start(self, ts_ns: int | None = None) -> None:
        """Forward pass of the current step starts now (or at ``ts_ns``)."""
        if self._step_start is not None:
            self._fp_start = _time_ns() if ts_ns is None else ts_ns

    def mark_bp_end(self, ts_ns: int | None = None) -> None:
        """Backward pass of the current step ends now (or at ``ts_ns``)."""
        if self._step_start is not None:
            self._bp_end = _time_ns() if ts_ns is None else ts_ns

    def complete_through(self, step: int, source: str | None = None) -> None:
        """Watermark: every event of every step <= ``step`` has been recorded.

        Only needed with ``auto_watermark=False``, when a step's ops are recorded after
        the step ended (for example from a profiler's buffer), or for a ``source`` that
        holds the watermark (``hold_watermark``): the watermark sent is the lowest of all."""
        if source is None:
            self._through = step
        elif source in self._held:
            self._held[source] = step
        self._set_watermark()
        self._wake.set()

    def hold_watermark(self, source: str) -> None:
        """A second writer of steps' events (a reader of collectives, on a thread of its
        own): the watermark moves no further than ``complete_through(step, source)`` says."""
        self._held[source] = None

    def release_watermark(self, source: str) -> None:
        """``source`` has nothing more to record: it holds the watermark no longer."""
        if self._held.pop(source, 0) != 0:
            self._set_watermark()
            self._wake.set()

    def _set_watermark(self) -> None:
        through = self._through
        for held in list(self._held.values()):
            if held is None:
                return  # a source that has said nothing yet
            through = held if through is None else min(through, held)
        if through is not None:
            self.buffer.watermark = through

    def step_at(self, ts_ns: int) -> int | None:
        """The step open (or last begun) at ``ts_ns``; None before the first step kept."""
        return self.steps_at([ts_ns])[0]

    def steps_at(self, times_ns: list[int]) -> list[int | None]:
        """``step_at`` of each time, the kept step starts copied once (a reader's batch of
        calls: up to STEP_HISTORY entries copied per read, not per call)."""
        began = list(self._began)
        out: list[int | None] = []
        for ts_ns in times_ns:
            i = bisect.bisect_right(began, (ts_ns, _MAX_STEP))
            out.append(began[i - 1][1] if i else None)
        return out

    def complete_before(self, ts_ns: int) -> int | None:
        """The last step of those followed by a step begun at or before ``ts_ns``: a step
        whose events were all issued before ``ts_ns``; None where there is none."""
        began = list(self._began)
        i = bisect.bisect_right(began, (ts_ns, _MAX_STEP))
        return began[i - 2][1] if i >= 2 else None

    def open_collective(self) -> Any:
        """The collective this rank sits in now (``torch_flight.OpenCall``), None where
        none is or no reader of collectives runs (read by the control thread)."""
        reader = self.collective_reader
        return None if reader is None else reader.open_call

    def defer_ops(self) -> None:
        """For producers that record a step's ops after the step ended (from a profiler's
        buffer): ops are no longer gated by the step window of the step being recorded now,
        and step ends no longer move the watermark. The caller applies the window itself and
        calls ``complete_through(step)`` once a step's ops are recorded."""
        self._start_step = self._stop_step = self._every_n = None
        self._scheduled = True
        self._capturing = self._enabled and not self._closed
        self._auto_watermark = False
        self._plan_gate = None  # the integration takes capture requests up itself (capture_plan)
        self._sync_recorder()

    @property
    def current_step(self) -> int:
        return self._step

    def _sync_recorder(self) -> None:
        """The compiled op() reads the current step and window from the recorder."""
        if self._native:
            self.buffer.set_state(self._step, self._capturing)

    def _in_window(self, step: int) -> bool:
        if not self._scheduled:
            return False
        start, stop, every = self._start_step, self._stop_step, self._every_n
        if start is not None and step < start:
            return False
        if stop is not None and step > stop:
            return False
        if every is not None and (step - (start or 0)) % every:
            return False
        return True

    def _capture_requested(self) -> None:
        """The step that begins is one a capture request asks for: record its ops, and
        count them for the request's status (``op()`` goes through a counting deque
        while a request captures, and only then)."""
        self._capturing = True
        if self._counting is None:
            if self._native:  # op() is the recorder's: its rows are counted there
                self._counting = _CountingRecorder(self.buffer)
            else:
                self._ops = self._counting = _CountingOps(self.buffer.ops)

    def _requested_step_ended(self, end_ns: int) -> None:
        plan, counting = self.capture_plan, self._counting
        plan.ended(self._step, end_ns)
        n, counting.n = counting.n, 0
        current = plan.current
        plan.captured(self._step, n)
        if plan.current is not current or current is None:  # the request is over
            if not self._native:
                self._ops = self.buffer.ops
            self._counting = None

    # -- samples ----------------------------------------------------------------------

    def memory(self, allocated: int, reserved: int = NO_VALUE, peak: int = NO_VALUE,
               ts_ns: int | None = None, step: int | None = None) -> None:
        """Record device memory in bytes: allocated, and reserved / peak when known."""
        if self._enabled:
            self.buffer.add_sample(self.buffer.memory, (_time_ns() if ts_ns is None else ts_ns,
                                                        self._step if step is None else step, allocated, reserved, peak))

    def queue(self, name: str, size: int, capacity: int = NO_VALUE,
              ts_ns: int | None = None, step: int | None = None) -> None:
        """Record the size of a data queue (batches prefetched and waiting for the device)."""
        if self._enabled:
            self.buffer.add_sample(self.buffer.queues, (name, _time_ns() if ts_ns is None else ts_ns,
                                                        self._step if step is None else step, size, capacity))

    def collective(self, collective: str, group: str, seq: int, start_ns: int, dur_ns: int, group_size: int,
                   in_bytes: int = NO_VALUE, out_bytes: int = NO_VALUE, dtype: str = "",
                   step: int | None = None) -> None:
        """Record this rank's part in a collective call (all_reduce, all_gather...): its
        process group, the call's sequence number in that group, and its message sizes.
        The processors match the call across the run's ranks by (group, seq); record the
        op itself with ``op``/``ops`` as usual (kind communication). Recorded whether ops
        are captured or not (any thread; ``dur_ns`` -1: the end is not known)."""
        if self._enabled and not self._closed:
            self.buffer.add_collective((
                collective, group, dtype, self._step if step is None else step, seq, start_ns, dur_ns, in_bytes,
                out_bytes, group_size))

    def device_sample(self, sample: DeviceSample, ts_ns: int | None = None, step: int | None = None) -> None:
        """Record one reading of a device's counters (``profstream.devices.DeviceSample``).

        The device sampler calls this from its thread every ``device_interval_ms``; a
        backend of one's own, or a simulator, may too. ``step`` defaults to the step open
        now, else the next one."""
        if self._enabled:
            self.buffer.add_device_sample((_time_ns() if ts_ns is None else ts_ns,
                                           self.sample_step if step is None else step, *sample))

    def host_sample(self, cpu_user: float, cpu_system: float, cpu_idle: float, cpu_iowait: float,
                    process_cpu: float, rss_bytes: int, ts_ns: int | None = None) -> None:
        """Record one host reading of one's own (a simulator's): the machine's CPU shares,
        this process's CPU (of one core) and RSS. The Monitor reads them itself every
        ``host_sample_interval_s``."""
        if self._enabled:
            buf = self.buffer
            buf.add_sample(buf.host, (_time_ns() if ts_ns is None else ts_ns, cpu_user, cpu_system, cpu_idle,
                                      cpu_iowait, process_cpu, rss_bytes))

    def loader_sample(self, row: tuple, ts_ns: int | None = None, step: int | None = None) -> None:
        """Record one reading of a data-loader worker or of the machine: the columns of
        ``schema.batch.LOADER_COLUMNS`` after ts_ns and step (worker, pid, interval_s, cpu,
        runnable, batches, ctx_switches_per_s, cpu_count). The torch producer's loader
        sampler calls this from its thread; they travel in the Monitor's own batches (v8)."""
        if self._enabled:
            self.buffer.add_loader_sample((_time_ns() if ts_ns is None else ts_ns,
                                           self.sample_step if step is None else step, *row))

    @property
    def sample_step(self) -> int:
        """The step a sample taken now belongs to: the open step, else the next one."""
        return self._step if self._step_start is not None else self._next_step

    # -- lifecycle --------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False for a Monitor made with ``enabled=False`` (``PROFSTREAM_ENABLED=0``): every
        call is a no-op, and the framework hooks stand aside."""
        return self._enabled

    @property
    def dropped_ops(self) -> int:
        return self.buffer.dropped_ops

    @property
    def dropped_samples(self) -> int:
        return self.buffer.drop_counts()[1] + self.buffer.dropped_device_samples

    @property
    def buffered_ops(self) -> int:
        return self.buffer.buffered_ops

    @property
    def buffer_fill_ratio(self) -> float:
        return self.buffer.fill_ratio

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything recorded so far and wait for the broker's acknowledgement.

        Returns False if that did not happen within ``timeout`` seconds. Never raises."""
        if self._sender is None or self._closed:
            return self._sender is None
        return self._sender.flush(timeout)

    def close(self, timeout: float = 10.0, ended: bool = True) -> bool:
        """Flush (within ``timeout``), stop the background thread and the Kafka producer.

        ``ended``: the rank ended normally (its last step is done): the Monitor sends its end
        mark after the last step, and the processors say the rank ended (RunSilent does not
        fire for a run whose ranks all did). False for a run that failed: the exit hook and
        ``with Monitor(...)`` on an exception pass it."""
        if self._closed:
            return True
        deadline = time.monotonic() + timeout  # one timeout for all that waits below

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._step_start is not None:
            self.end_step()
        if self.collective_reader is not None:  # its last calls before the end mark
            self.collective_reader.stop(min(left(), 5.0))
        if ended and self._enabled:
            now = _time_ns()
            self.buffer.add_mark((END_MARK, now, now, NO_VALUE, NO_VALUE, 0, 0, self._end_signal))
            self._wake.set()
        self._closed = True
        self._capturing = False
        self._sync_recorder()
        _live_monitors.discard(self)
        if self._device_sampler is not None:  # its last samples go with the final flush
            self._device_sampler.stop(min(left(), 5.0))
        if self._control is not None:
            self.capture_plan.close("the Monitor closed")
            self._control.stop(left())
        if self._sender is None:
            return True
        stopped = self._sender.stop(left())
        self._say_dropped()
        return stopped

    def _say_dropped(self) -> None:
        """At close, one warning of what the full buffer dropped (what never reached Kafka
        the sender says itself)."""
        buf = self.buffer
        ops, samples, marks = buf.dropped_ops, self.dropped_samples, buf.dropped_marks
        if ops or samples:
            log.warning("profstream: %s rank %d: the full buffer dropped %d ops and %d samples, %d of them step "
                        "marks (those steps are lost whole); %d steps lost some events (sent marked partial). "
                        "A larger buffer_bytes or a spool_dir keeps more", self.run_id, self.rank, ops, samples,
                        marks, self.partial_steps)

    def ending_on(self, signum: int) -> None:
        """The process got signal ``signum`` and ends on it: the end mark will say so (the
        processors' RankEnd then gives it as the reason). ``producers/shutdown.py`` calls it."""
        self._end_signal = signum

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(ended=exc_type is None)

    def stats(self) -> dict[str, Any]:
        """Producer health: drops, buffer fill, batches sent, send latency."""
        out = {"recording": self.recording, "dropped_ops": self.dropped_ops, "dropped_samples": self.dropped_samples,
               "dropped_marks": self.buffer.dropped_marks, "partial_steps": self.partial_steps,
               "buffered_ops": self.buffered_ops, "buffer_fill_ratio": self.buffer_fill_ratio,
               "buffered_samples": self.buffer.buffered_samples}
        if self._device_sampler is not None:
            out.update(self._device_sampler.stats())
        if self.collective_reader is not None:
            out.update(self.collective_reader.stats())
        if self._control is not None:
            out.update(self._control.stats())
        if self._sender is not None:
            out.update(self._sender.stats())
            # dropped: by the full buffer, and what never reached Kafka (purged at close, refused)
            out["dropped_ops"] += out["undelivered_ops"]
            out["dropped_samples"] += out["undelivered_samples"]
        return out

