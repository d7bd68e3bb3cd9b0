"""Op capture for the torch producer: torch.profiler on the Monitor's step window.

The profiler records each step of the window (start_step, stop_step, every_n_steps) as
its own trace, started and stopped by the training thread at step boundaries. A finished
trace is turned into op columns (``torch_ops``), sent with ``Monitor.ops``, and then the
watermark (``complete_through``) moves past the step; steps outside the window move it
in the same order, so it never passes a step whose ops are still being converted.

Where the conversion runs: on a CPU-only run, on the training thread at the step boundary
(the event-tree walk: ~0.2 ms a step compiled, columns included, ``torch_native``, built in
the background at first use; 0.7-1 ms in Python until then or where it cannot be built). A worker
thread there would hold the GIL that the training thread needs between its ops (the
training thread waits for about all of the worker's time) and take CPU from the intra-op
threads, so it cost more than converting in place (docs/benchmarks.md section 12). On a
device run a worker thread converts the larger trace while the training thread waits for
the device.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import numpy as np

from profstream.integrations import torch_native
from profstream.integrations.torch_collectives import (
    GroupCount,
    collective_rows,
    default_group_count,
    message_sizes,
)
from profstream.integrations.torch_ops import (
    HostThreads,
    NodeNames,
    OpColumns,
    clock_offset_ns,
    native_op_columns,
    table_from_kineto,
    to_op_columns,
    tree_op_columns,
)
from profstream.processors.throughput import CATEGORIES, op_category

log = logging.getLogger("profstream.torch")

_STOP = object()


class OpWindow:
    """Which steps have their ops captured: start_step..stop_step, every n-th from start."""

    def __init__(self, start: int | None, stop: int | None, every: int | None) -> None:
        self.start, self.stop, self.every = start, stop, every

    @classmethod
    def of(cls, options: dict) -> OpWindow:
        """The window of Monitor options (none with scheduled_capture false)."""
        if not options.get("scheduled_capture", True):
            return cls(None, -1, None)
        return cls(options["start_step"], options["stop_step"], options["every_n_steps"])

    def __contains__(self, step: int) -> bool:
        if self.start is not None and step < self.start:
            return False
        if self.stop is not None and step > self.stop:
            return False
        return not (self.every is not None and (step - (self.start or 0)) % self.every)

    def over(self, step: int) -> bool:
        """No step from ``step`` on will be captured."""
        return self.stop is not None and step > self.stop


# What the profiler records on the steps of the schedule (capture requests bring their own).
SCHEDULED = {"activities": frozenset(("cpu", "cuda")), "record_shapes": False, "profile_memory": False,
             "with_stack": False}
# With with_flops (the step's FLOPs from its captured ops: count_flops off), every capture
# also has torch.profiler count the FLOPs of its matmuls and convolutions.
WITH_FLOPS = {"with_flops": True}


class OpCapture:
    """Drives one torch.profiler through the window and the capture requests of the
    Monitor's ``capture_plan``, and feeds the ops to the Monitor."""

    def __init__(self, monitor: Any, window: OpWindow, run_has_device: bool, on_error: Any,
                 compiled_walk: bool = True, collective_bytes: bool = False, with_flops: bool = False) -> None:
        self.monitor = monitor
        self.window = window
        self.plan = getattr(monitor, "capture_plan", None)
        if self.plan is not None:
            self.plan.activities = frozenset(("cpu", "cuda") if run_has_device else ("cpu",))
        self._settings: dict | None = None  # what the running profiler records
        self._upcoming_settings: dict | None = None  # what the upcoming step records (None: nothing)
        self.run_has_device = run_has_device
        self.on_error = on_error  # called with the exception: on the worker, or out of the profiler's callback
        self.failed = False
        self.steps_captured = 0
        self.steps_compiled = 0  # of them, read by the compiled walk
        self.ops_sent = 0
        self._profiler: Any = None
        self._upcoming: int | None = None  # the step the profiler's schedule is asked about
        self._recording: int | None = None  # the step being recorded now
        self._saving: int | None = None  # the step whose trace is handed over next
        self._saving_fp_ns: int | None = None
        self._saving_count: GroupCount | None = None  # the process group's calls at the saved step's end
        self.collective_bytes = collective_bytes  # record shapes: collectives carry their message sizes
        self.with_flops = with_flops  # the profiler counts FLOPs: a captured step's are sent (Monitor.ops_flops)
        self._threads = HostThreads()
        self._node_names = NodeNames()
        # CPU-only runs read the event tree: compiled once it is built and has read a
        # trace as the Python walk does.
        self.compiled_walk = compiled_walk and not run_has_device
        self._compiled_checked = False
        if self.compiled_walk:
            torch_native.start()
        self._offset_ns: int | None = None
        self._error: Exception | None = None  # of a conversion on the training thread, not reported yet
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self.worker: threading.Thread | None = None  # None: the training thread converts
        if self.converts_on_worker(run_has_device):
            self.worker = threading.Thread(target=self._convert_loop, name="profstream-torch-ops", daemon=True)
            self.worker.start()

    @staticmethod
    def converts_on_worker(run_has_device: bool) -> bool:
        """Device runs convert on a worker thread, CPU-only runs on the training thread."""
        return run_has_device

    # -- training thread --------------------------------------------------------------

    def advance(self, ended: int | None, upcoming: int | None, ended_fp_ns: int | None = None) -> None:
        """Step ``ended`` is over (None: none was open) and ``upcoming`` is about to begin.

        ``ended_fp_ns``: the ended step's forward start; host ops before it load data."""
        # The trace being recorded is handed over only when it is the step that ended (a
        # step asked for at the end of an epoch never begins: its trace is dropped).
        self._saving = ended if ended is not None and ended == self._recording else None
        self._upcoming = upcoming
        self._saving_fp_ns = ended_fp_ns
        self._saving_count = default_group_count() if self._saving is not None else None
        settings = self._settings_for(ended, upcoming)
        self._upcoming_settings = settings
        if self._profiler is None:
            if settings is not None and not self.failed:
                self._start_profiler(settings)
        elif self.failed or (settings is not None and settings != self._settings) or (
                settings is None and upcoming is not None and self.window.over(upcoming)):
            self.stop()  # hands over `ended`; a request with other settings gets a profiler of its own
            if settings is not None and not self.failed:
                self._start_profiler(settings)
        else:
            self._profiler.step()  # saves `ended` if it was recorded, records `upcoming` if in window
        if ended is not None and ended != self._saving:
            self._put((ended, None, None, None))  # not captured: the watermark may pass it
        self._saving = None
        self._report_error()

    def _settings_for(self, ended: int | None, upcoming: int | None) -> dict | None:
        """What the profiler records on step ``upcoming``: a capture request's settings,
        the schedule's, or None (not captured)."""
        plan = self.plan
        if plan is not None:
            if ended is not None:
                plan.ended(ended, time.time_ns())
            if upcoming is not None and not self.failed:
                armed = plan.claim(upcoming)
                if armed is not None:
                    return {**armed.settings, **WITH_FLOPS} if self.with_flops else armed.settings
        if upcoming is None or upcoming not in self.window:
            return None
        settings = {**SCHEDULED, "record_shapes": True} if self.collective_bytes else SCHEDULED
        return {**settings, **WITH_FLOPS} if self.with_flops else settings

    @property
    def running(self) -> bool:
        """The profiler is started (recording or waiting for the next step of the window)."""
        return self._profiler is not None

    def stop(self) -> None:
        """Stop the profiler (handing over the step it was recording)."""
        prof, self._profiler = self._profiler, None
        if prof is not None:
            try:
                prof.stop()
            finally:
                self._recording = None
            self._report_error()

    def drain(self, timeout: float) -> bool:
        """Wait until every handed-over step has been converted and sent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._work.empty() and self._idle.is_set():
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0) -> None:
        self.stop()
        if self.worker is not None:
            self.drain(timeout)
            self._work.put(_STOP)
            self.worker.join(timeout)
        if self.plan is not None:
            self.plan.close("op capture closed (the instrumentation was removed)")

    def _start_profiler(self, settings: dict) -> None:
        import warnings

        from torch.profiler import ProfilerActivity, profile

        # Each step is its own profiler cycle on purpose; torch warns about that once.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
        # Kineto prints two lines on stderr per cycle (profiler_start / profiler_stop, at
        # its highest level): off unless the user chose a level. Read when kineto starts.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        wanted = settings["activities"]
        activities = [ProfilerActivity.CPU] if "cpu" in wanted or not self.run_has_device else []
        if self.run_has_device and "cuda" in wanted:
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._trace_ready,
                                 record_shapes=settings["record_shapes"], profile_memory=settings["profile_memory"],
                                 with_stack=settings["with_stack"], with_flops=settings.get("with_flops", False))
        self._settings = settings
        self._profiler.start()

    def _schedule(self, _profiler_step: int) -> Any:
        from torch.profiler import ProfilerAction

        step = self._upcoming
        if step is not None and self._upcoming_settings is not None:
            self._recording = step
            return ProfilerAction.RECORD_AND_SAVE
        self._recording = None
        return ProfilerAction.NONE

    def _trace_ready(self, prof: Any) -> None:
        step = self._saving
        results = getattr(prof.profiler, "kineto_results", None)
        if step is not None and results is not None:
            self._put((step, results, self._saving_fp_ns, self._saving_count))
            self.steps_captured += 1

    def _put(self, item: tuple) -> None:
        if self.worker is None:
            self._convert(*item)
        else:
            self._idle.clear()
            self._work.put(item)

    def _report_error(self) -> None:
        """Report a failed conversion of the training thread, once out of the profiler's
        callback (the error handler stops the profiler)."""
        error, self._error = self._error, None
        if error is not None:
            self.on_error(error)

    # -- the conversion (training thread, or the worker on device runs) ------------------

    def _convert_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            try:
                self._convert(*item)
            finally:
                if self._work.empty():
                    self._idle.set()

    def _convert(self, step: int, results: Any, fp_ns: int | None, count: GroupCount | None) -> None:
        """Send the ops of a recorded step (``results`` None: not captured) and move the
        watermark past it."""
        try:
            sent = self._send_ops(step, results, fp_ns, count) if results is not None and not self.failed else 0
            self.monitor.complete_through(step)
            if self.plan is not None:
                self.plan.captured(step, sent)
        except Exception as e:  # internal error: capture switches off, training goes on
            self.failed = True
            if self.plan is not None:
                self.plan.close(f"op capture failed: {e!r}")
            if self.worker is None:
                self._error = self._error or e
            else:
                self.on_error(e)

    def _send_ops(self, step: int, results: Any, fp_ns: int | None, count: GroupCount | None) -> int:
        """Send the ops of a recorded step (and its collective calls, numbered by ``count``);
        returns how many ops."""
        cols = None if self.run_has_device else self._tree_columns(results, fp_ns)
        if cols is None:
            table = table_from_kineto(results.events(), self.run_has_device)
            if not len(table):
                return 0
            cols = to_op_columns(table, self.run_has_device, self._offset(int(table.start_ns[0])), self._threads,
                                 fp_ns)
        if len(cols):
            launches = {} if cols.launch_ns is None else {"launch_ns": cols.launch_ns}  # device runs only
            self.monitor.ops(cols.names, cols.start_ns, cols.dur_ns, cols.kinds, cols.op_types, cols.streams,
                             step=step, **launches)
            self.ops_sent += len(cols)
            if count is not None:
                self._send_collectives(step, results, cols, count)
        if self.with_flops:
            self._send_flops(step, results)
        return len(cols)

    def _send_flops(self, step: int, results: Any) -> None:
        """The FLOPs torch.profiler counted for the step's ops (with_flops: its matmuls and
        convolutions, each counted on the op that ran them), by category, as the step's
        FLOPs where it has none given or counted (source ops)."""
        by_category = [0.0] * len(CATEGORIES)
        total = 0.0
        for e in results.events():
            flops = e.flops()
            if flops > 0:
                total += flops
                category = op_category(e.name())
                if category >= 0:
                    by_category[category] += flops
        if total > 0:
            self.monitor.ops_flops(step, total, *by_category)

    def _send_collectives(self, step: int, results: Any, cols: OpColumns, count: GroupCount) -> None:
        """The step's collective calls, numbered in their process group (torch_collectives)."""
        sizes = message_sizes(results.events()) if self.collective_bytes else None
        for row in collective_rows(cols.names, cols.start_ns, cols.dur_ns, count, sizes):
            self.monitor.collective(row.collective, row.group, row.seq, row.start_ns, row.dur_ns, row.group_size,
                                    row.in_bytes, row.out_bytes, row.dtype, step=step)

    def _tree_columns(self, results: Any, fp_ns: int | None) -> OpColumns | None:
        """The ops of a CPU-only step from the profiler's event tree: the outermost ops
        and annotations only are read, at about half the cost of every event (torch_ops);
        by the compiled walk once it has read a trace exactly as the Python walk does."""
        walk = torch_native.walker() if self.compiled_walk else None
        if walk is not None and self._compiled_checked:
            cols = native_op_columns(walk, results, self._offset_ns or 0, self._threads, fp_ns, self._node_names)
            if cols is not None:
                self.steps_compiled += 1
                return cols
        tree = getattr(results, "experimental_event_tree", None)
        roots = tree() if tree is not None else None
        if not roots:
            return None
        cols = tree_op_columns(roots, self._offset(roots[0].start_time_ns), self._threads, fp_ns, self._node_names)
        if walk is not None and cols is not None and not self._compiled_checked:
            self._check_compiled(walk, results, cols, fp_ns)
        return cols

    def _check_compiled(self, walk: Any, results: Any, expected: OpColumns, fp_ns: int | None) -> None:
        """Trust the compiled walk once it reads a trace as the Python walk did."""
        try:
            got = native_op_columns(walk, results, self._offset_ns or 0, self._threads, fp_ns, self._node_names)
        except Exception as e:  # a build that does not fit this torch
            torch_native.disable(f"it failed on a trace: {e!r}")
            return
        if got is not None and _same_ops(got, expected):
            self._compiled_checked = True
        else:
            torch_native.disable("it read a trace differently from the Python walk")

    def _offset(self, profiler_ns: int) -> int:
        """Profiler clock -> epoch, worked out at the first capture."""
        if self._offset_ns is None:
            self._offset_ns = clock_offset_ns(profiler_ns)
        return self._offset_ns


def _same_ops(a: OpColumns, b: OpColumns) -> bool:
    return (a.names == b.names and a.op_types == b.op_types and all(
        np.array_equal(x, y) for x, y in ((a.kinds, b.kinds), (a.streams, b.streams), (a.start_ns, b.start_ns),
                                           (a.dur_ns, b.dur_ns))))
