"""Op capture for the MindSpore callback: MindSpore's own Profiler on capture windows.

A capture window is a run of consecutive steps: those of the step window (``start_step``,
``stop_step``, ``every_n_steps``) or of a capture request (the Monitor's
``capture_plan``). At the window's first step begin the callback starts a
``mindspore.Profiler`` that writes into a folder of its own; at the window's last step end
it stops it (under a millisecond on the training thread). A worker thread then runs the
Profiler's analysis (MindSpore writes its ``*_ascend_ms`` folder: about a second on CPU),
reads that folder with ingest's reader (``ascend_dirs.read_ascend_output``: the same as
``profstream analyze``), puts each op in the window's step whose [S, E) holds its start,
sends them with ``Monitor.ops`` and removes the folder. The analysis is sent too, as one
host op of type ``ANALYSE_TYPE`` in the step it ran in (the one after the window): a step
slowed by it says why.

The watermark moves past a step once its ops are sent, and past the other steps at their
end, but never past a step while an analysis is running. MindSpore runs one Profiler per
process, so no window starts while an analysis runs: a scheduled step then is not captured
(counted in ``skipped_steps``), and a capture request waits for the analysis to end.
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from profstream.schema.batch import HOST

log = logging.getLogger("profstream.mindspore")

ANALYSE_TYPE = "mindspore.Profiler.analyse"
_STOP = object()
_I64 = np.int64


class Window:
    """The steps of the step window options: start_step..stop_step, every n-th from start;
    none without a start or stop step (MindSpore's Profiler is not run on every step by
    default: each window costs an analysis)."""

    def __init__(self, options: dict) -> None:
        self.start, self.stop, self.every = options.get("start_step"), options.get("stop_step"), \
            options.get("every_n_steps")
        self.any = self.start is not None or self.stop is not None

    def __contains__(self, step: int) -> bool:
        if not self.any or (self.start is not None and step < self.start) or (self.stop is not None and
                                                                               step > self.stop):
            return False
        return not (self.every is not None and (step - (self.start or 0)) % self.every)


class MindSporeCapture:
    """Drives MindSpore's Profiler through the capture windows and sends their ops."""

    def __init__(self, monitor: Any, window: Window, device_target: str, output_dir: str | None = None) -> None:
        self.monitor = monitor
        self.window = window
        self.ascend = device_target == "Ascend"
        self.plan = getattr(monitor, "capture_plan", None)
        if self.plan is not None:
            self.plan.activities = frozenset(("cpu", "cuda") if self.ascend else ("cpu",))
        monitor.defer_ops()
        self.root = Path(output_dir or tempfile.mkdtemp(prefix="profstream-mindspore-"))
        self.failed = False
        self.windows = self.steps_captured = self.skipped_steps = self.ops_sent = 0
        self._profiler: Any = None
        self._folder: Path | None = None
        self._marks: dict[int, tuple[int, int]] = {}  # step -> (S, E) of the open window
        self._lock = threading.Lock()
        self._analysing = False  # set by the training thread, cleared by the worker (under the lock)
        self._last_ended: int | None = None
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self.worker = threading.Thread(target=self._work_loop, name="profstream-mindspore-ops", daemon=True)
        self.worker.start()

    # -- training thread ----------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Step ``step`` began (after ``Monitor.begin_step``)."""
        if self.failed:
            return
        with self._lock:
            busy = self._analysing
        requested = self.plan.claim(step) if self.plan is not None and not busy else None
        if self._profiler is None and (requested is not None or step in self.window):
            if busy:
                self.skipped_steps += 1
            else:
                self._start()

    def end(self, step: int, start_ns: int, end_ns: int) -> None:
        """Step ``step`` ran from ``start_ns`` to ``end_ns`` (after ``Monitor.end_step``)."""
        if self.plan is not None:
            self.plan.ended(step, end_ns)
        self._last_ended = step
        if self._profiler is not None:
            self._marks[step] = (start_ns, end_ns)
            if not self._continues(step + 1):
                self._hand_over(step)
            return
        with self._lock:
            if not self._analysing:
                self.monitor.complete_through(step)

    def close(self, timeout: float = 60.0) -> None:
        """Stop a window still open (its steps are sent), wait for the worker, free the folder."""
        if self._profiler is not None and self._last_ended is not None:
            self._hand_over(self._last_ended)
        self._work.put(_STOP)
        self.worker.join(timeout)
        if self.plan is not None:
            self.plan.close("op capture closed (training ended)")
        shutil.rmtree(self.root, ignore_errors=True)

    def _continues(self, step: int) -> bool:
        cur = self.plan.current if self.plan is not None else None
        requested = cur is not None and cur.first is not None and cur.first <= step <= cur.last
        return requested or step in self.window

    def _start(self) -> None:
        import mindspore as ms
        from mindspore.profiler import ProfilerActivity

        self.windows += 1
        self._folder = self.root / f"window-{self.windows}"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.NPU] if self.ascend else [])
        try:
            self._profiler = ms.Profiler(start_profile=False, output_path=str(self._folder), activities=activities)
            self._profiler.start()
        except Exception as e:  # noqa: BLE001 - MindSpore's own errors: capture off, training goes on
            self._fail(e)
            self._profiler = None
        self._marks = {}

    def _hand_over(self, last: int) -> None:
        """Stop the Profiler after the window's last step; the worker analyses and sends."""
        profiler, self._profiler = self._profiler, None
        try:
            profiler.stop()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return
        with self._lock:
            self._analysing = True
        self.steps_captured += len(self._marks)
        self._work.put((profiler, self._folder, dict(self._marks), last))
        self._marks = {}

    def _fail(self, error: Exception) -> None:
        self.failed = True
        log.warning("profstream: MindSpore op capture is off, training goes on (%r)", error)
        if self.plan is not None:
            self.plan.close(f"op capture failed: {error!r}")

    # -- worker thread ------------------------------------------------------------------

    def _work_loop(self) -> None:
        while True:
            job = self._work.get()
            if job is _STOP:
                return
            try:
                self._analyse(*job)
            except Exception as e:  # noqa: BLE001 - an internal error: capture off, training goes on
                self._fail(e)
            finally:
                with self._lock:
                    self._analysing = False
                    if self._last_ended is not None:
                        self.monitor.complete_through(self._last_ended)

    def _analyse(self, profiler: Any, folder: Path, marks: dict[int, tuple[int, int]], last: int) -> None:
        t0 = time.time_ns()
        profiler.analyse()
        dur = time.time_ns() - t0
        self.monitor.ops(["MindSpore Profiler analyse"], np.array([t0], _I64), np.array([dur], _I64), HOST,
                         ANALYSE_TYPE, 0, step=last + 1)
        sent = self._send_ops(folder, marks)
        for step in sorted(marks):
            if self.plan is not None:
                self.plan.captured(step, sent.get(step, 0))
        shutil.rmtree(folder, ignore_errors=True)

    def _send_ops(self, folder: Path, marks: dict[int, tuple[int, int]]) -> dict[int, int]:
        """The ops MindSpore wrote for the window, sent in its steps; per step how many."""
        from profstream.integrations.ingest.ascend_dirs import read_ascend_output
        from profstream.integrations.ingest.model import set_steps

        written = sorted(folder.glob("*_ascend_ms"))
        if not written:
            log.warning("profstream: MindSpore's Profiler wrote no *_ascend_ms folder in %s: no ops for steps %s-%s",
                        folder, min(marks), max(marks))
            return {}
        profile = read_ascend_output(written[-1])
        steps = sorted(marks)
        set_steps(profile, steps, [marks[s][0] for s in steps], [marks[s][1] for s in steps])
        profile.assign_steps()
        for note in profile.notes:
            log.debug("profstream: %s", note)
        sent: dict[int, int] = {}
        for step in steps:
            idx = np.flatnonzero(profile.op_step == step)
            if not len(idx):
                continue
            launch = profile.op_launch_ns[idx] if len(profile.op_launch_ns) == profile.ops else None
            self.monitor.ops(profile.name_table[profile.op_name[idx]], profile.op_start_ns[idx],
                             profile.op_dur_ns[idx], profile.op_kind[idx], profile.type_table[profile.op_type[idx]],
                             profile.op_stream[idx], step=step,
                             launch_ns=launch if launch is not None and (launch >= 0).any() else None)
            sent[step] = len(idx)
            self.ops_sent += len(idx)
        return sent
