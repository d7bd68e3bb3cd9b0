"""MindSpore: ``ProfstreamCallback``, a ``mindspore.train.Callback`` that streams the steps
of ``Model.train`` to profstream: step marks, the device data queue, memory, and the ops
MindSpore's own Profiler records on capture windows.

    from profstream.mindspore import ProfstreamCallback
    model.train(epochs, dataset, callbacks=[ProfstreamCallback(run_id="my-run", start_step=100, stop_step=110)])

Where the marks come from (``Model.train``'s loop fetches a batch, then calls
``on_train_step_begin``, runs the network, then ``on_train_step_end``):

- S (the loop asks for its next batch): the previous step's end, or the epoch's start for
  its first step; so data_wait = F - S is the time spent getting the batch;
- F (forward starts): ``on_train_step_begin``;
- B and E: ``on_train_step_end``. The train network runs forward, backward and the
  optimizer in one call, so a callback cannot see the end of backward: tail is 0 and
  fp_bp holds the whole network call.

Ops (``capture_ops``, on by default): ``start_step`` / ``stop_step`` / ``every_n_steps``
(or a mindformers profile section) are the steps whose ops MindSpore's Profiler captures,
and capture requests (docs/capture.md) add windows of their own (``mindspore_capture``);
every step is marked. With ``capture_ops=False`` no op is captured, requests are refused
with ``CAPTURE_UNAVAILABLE``, and the window options limit the steps marked instead.

Steps are MindSpore's ``cur_step_num`` (1-based; in sink mode one step per sink). In
dataset sink mode the device queue (``DatasetHelper.get_mbuf_queue_size``, batches waiting
in the device channel) is sampled at each step begin and stamped at S; without sink mode
MindSpore exposes no queue size and none is sent. Memory
(``mindspore.runtime.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated``)
is sampled at each step end.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

try:
    import mindspore as ms
    from mindspore.train import Callback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("profstream.mindspore needs MindSpore: pip install 'profstream[mindspore]'") from e

from profstream.config import Option, callback_options, option_given, resolve
from profstream.integrations.mindspore_capture import MindSporeCapture, Window
from profstream.producers.monitor import Monitor

log = logging.getLogger("profstream.mindspore")

DEVICE_QUEUE = "device_queue"
CAPTURE_UNAVAILABLE = ("op capture is off in this MindSpore callback (capture_ops=False): it streams step marks, "
                       "the data queue and memory only")
MINDSPORE_OPTIONS = (
    Option("capture_ops", "bool", True,
           "run MindSpore's Profiler on the step window's steps and on capture requests, and stream their ops; "
           "false: no ops, and the window limits the steps marked"),
)


class ProfstreamCallback(Callback):
    """Marks every training step of ``Model.train`` (within ``start_step``..``stop_step``)
    on a profstream ``Monitor``: the one given, else one built from ``options`` (run_id,
    bootstrap, rank... see ``profstream.config``, and the mindformers-style ``profile``,
    ``profile_start_step``, ``profile_stop_step``... that set the window) and closed at
    train end. An unknown option name raises here; a bad value logs one warning and
    training goes on without profstream."""

    def __init__(self, monitor: Monitor | None = None, start_step: int | None = None,
                 stop_step: int | None = None, queue_name: str = DEVICE_QUEUE, **options: Any) -> None:
        super().__init__()
        self._owns_monitor = monitor is None
        self.monitor: Monitor | None = monitor
        self.start_step = self.stop_step = None
        self.capture: MindSporeCapture | None = None
        checked = callback_options({"start_step": start_step, "stop_step": stop_step, **options},
                                   "ProfstreamCallback", log, MINDSPORE_OPTIONS)
        if checked is None:  # warned: off, training goes on
            self.monitor = None
        else:
            capture_ops = resolve(MINDSPORE_OPTIONS, {"capture_ops": checked.pop("capture_ops", None)})["capture_ops"]
            target = ms.get_context("device_target")
            if target == "Ascend" and not option_given("device", checked, os.environ):
                checked["device"] = f"npu:{ms.get_context('device_id')}"  # Ascend's figures follow msprof's
            if monitor is None:
                self.monitor = Monitor(**checked)
                checked = self.monitor.options
            window = Window(checked)
            if capture_ops and self.monitor.enabled:
                self.capture = MindSporeCapture(self.monitor, window, target)
            else:
                self.start_step, self.stop_step = checked.get("start_step"), checked.get("stop_step")
                if self.monitor.capture_plan is not None:  # no op is recorded here: say so to requests
                    self.monitor.capture_plan.unavailable = CAPTURE_UNAVAILABLE
        self.queue_name = queue_name
        self.steps_marked = 0
        self.queue_samples = 0
        self._asked_ns: int | None = None  # when the loop asked for the next batch (S)
        self._start_ns = 0  # S of the open step
        self._open = False
        self._memory = self.monitor is not None and self.monitor.enabled and _memory_probe()

    def in_window(self, step: int) -> bool:
        """Whether ``step`` is marked: every step with op capture, else those of the window."""
        return ((self.start_step is None or step >= self.start_step)
                and (self.stop_step is None or step <= self.stop_step))

    # -- MindSpore hooks ----------------------------------------------------------------

    def on_train_epoch_begin(self, run_context) -> None:
        self._asked_ns = time.time_ns()

    def on_train_step_begin(self, run_context) -> None:
        now = time.time_ns()
        cb = run_context.original_args()
        step = int(cb.cur_step_num)
        if self.monitor is None or not self.monitor.enabled or not self.in_window(step):
            self._open = False  # a disabled Monitor: no device query either
            return
        start = self._asked_ns if self._asked_ns is not None else now
        self.monitor.begin_step(step, ts_ns=start)
        self.monitor.mark_fp_start(now)
        self._open = True
        self._start_ns = start
        if self.capture is not None:
            self.capture.begin(step)
        size = _device_queue_size(cb)
        if size is not None:
            self.monitor.queue(self.queue_name, size, ts_ns=start, step=step)
            self.queue_samples += 1

    def on_train_step_end(self, run_context) -> None:
        now = time.time_ns()
        self._asked_ns = now
        if not self._open:
            return
        self._open = False
        if self._memory:
            rt = ms.runtime
            self.monitor.memory(int(rt.memory_allocated()), int(rt.memory_reserved()),
                                int(rt.max_memory_allocated()), ts_ns=now)
        self.monitor.mark_bp_end(now)
        self.monitor.end_step(now)
        self.steps_marked += 1
        if self.capture is not None:
            self.capture.end(self.monitor.current_step, self._start_ns, now)

    def on_train_end(self, run_context) -> None:
        if self.monitor is None:
            return
        if self.capture is not None:  # the last window's ops, then the Monitor
            self.capture.close()
        if self._owns_monitor:
            self.monitor.close()
        else:
            self.monitor.flush()


def _device_queue_size(cb_params) -> int | None:
    """Batches waiting in the device channel, in dataset sink mode; None where MindSpore
    does not expose it (no sink mode, or a device without the mbuf channel)."""
    helper = cb_params.get("dataset_helper")  # cb_params is a dict whose missing attributes raise KeyError
    if helper is None or not cb_params.get("dataset_sink_mode", False):
        return None
    try:
        return int(helper.get_mbuf_queue_size())
    except RuntimeError:  # no device channel on this target (e.g. CPU)
        return None


def _memory_probe() -> bool:
    """Whether mindspore.runtime reports memory on this target (probed once)."""
    rt = getattr(ms, "runtime", None)
    if rt is None or not hasattr(rt, "memory_allocated"):
        return False
    try:
        rt.memory_allocated()
        return True
    except RuntimeError as e:
        log.info("mindspore.runtime memory statistics unavailable here (%s): no memory samples", e)
        return False
