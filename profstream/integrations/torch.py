"""The PyTorch producer: ``instrument()`` hooks a training loop into a ``Monitor``.

Where each mark comes from:

- S (step start): the loop asks a DataLoader iterator for its next batch. Without a
  DataLoader, a step starts where the previous one ended (the first one at the first
  forward call).
- F (forward start): the first forward call of the model (a forward pre-hook on the
  outermost module, or on any module with the global hook) in the step.
- B (backward end): the first ``optimizer.step()`` of the step is about to run.
- E (step end): the last ``optimizer.step()`` of the step has returned (the next batch
  request when the step had none). A batch the loop fetched and then did not train on (no
  forward call, no ``optimizer.step()`` before the next request or the end: a loop that
  breaks after fetching one more) is no step: nothing of it is sent.
- queue: batches fetched by a multi-worker DataLoader and waiting, sampled at S.
- memory: torch.cuda memory statistics at E when CUDA is there, else the process RSS.
- ops: torch.profiler on the window start_step / stop_step / every_n_steps
  (``torch_capture``).
- work: tokens and samples of each DataLoader batch, and the step's model FLOPs counted
  once per input shape with torch's FlopCounterMode (``torch_work``), handed to the
  Monitor before the step's end mark.

Nothing here raises into the training loop: an internal error is logged once with its
traceback and switches the instrumentation off; the training goes on untouched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from profstream.config import ConfigError, Option, resolve
from profstream.integrations.torch_capture import OpCapture, OpWindow
from profstream.integrations.torch_loader import LoaderSampler
from profstream.integrations.torch_sources import RssReader, TimedIterator
from profstream.integrations.torch_work import StepWork
from profstream.integrations.torch_work import send as send_work

log = logging.getLogger("profstream.torch")

_time_ns = time.time_ns

# Options of the torch producer itself (on top of the Monitor's). They are read from
# arguments and PROFSTREAM_<NAME> variables; PROFSTREAM_OPTIONS holds Monitor options only.
TORCH_OPTIONS: tuple[Option, ...] = (
    Option("capture_ops", "bool", True,
           "capture ops with torch.profiler on the steps of start_step / stop_step / every_n_steps"),
    Option("compiled_walk", "bool", True,
           "read captured CPU-only traces with the compiled walk (built in the background at first use)"),
    Option("work_figures", "bool", True,
           "find each step's tokens and samples in its batches and its model FLOPs, for throughput and MFU"),
    Option("collectives_interval_s", "float", 1.0,
           "seconds between two reads of torch's Flight Recorder: every collective of every process group "
           "recorded whether ops are captured or not (integrations/torch_flight.py; 0: off)",
           lambda v: v == 0 or 0.05 <= v <= 60, "0 (off) or 0.05..60"),
    Option("count_flops", "bool", True,
           "count the model FLOPs with torch's FlopCounterMode once per input shape (false: take those torch.profiler "
           "counts on captured steps)"),
)
QUEUE_NAME = "dataloader"


def instrument(model: Any = None, optimizer: Any = None, loader: Any = None, monitor: Any = None,
               *, mark_steps: bool = True, **options: Any) -> TorchInstrumentation:
    """Hook a training loop into profstream; returns a handle with ``.remove()`` / ``.close()``.

    ``model``, ``optimizer``, ``loader``: the outermost module, the optimizer and the
    DataLoader to hook; each one left out is hooked globally (every module, every
    optimizer, every DataLoader). ``monitor``: the Monitor to feed, else one is made from
    ``options`` (Monitor options, see profstream.config, plus ``capture_ops`` and
    ``compiled_walk``).
    ``mark_steps=False``: the loop marks its steps itself with ``monitor.step()``.
    """
    import torch

    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loader is not None and not isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(f"loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    torch_opts, monitor_opts = split_options(options)
    if monitor is not None and monitor_opts:
        raise ConfigError(f"options {', '.join(sorted(monitor_opts))} configure a new Monitor: "
                          "give them to Monitor(...) or leave out monitor=")
    inst = TorchInstrumentation(monitor, monitor_opts, torch_opts["capture_ops"], mark_steps,
                                compiled_walk=torch_opts["compiled_walk"], work_figures=torch_opts["work_figures"],
                                count_flops=torch_opts["count_flops"],
                                collectives_interval_s=torch_opts["collectives_interval_s"])
    if inst.active:  # a disabled Monitor: no hooks at all, the loop runs as without profstream
        inst.attach(model, optimizer, loader)
    close_at_exit(inst)
    return inst


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the torch producer's options resolved, the rest: Monitor options) of instrument()'s
    keyword options."""
    torch_names = {o.name for o in TORCH_OPTIONS}
    torch_opts = resolve(TORCH_OPTIONS, {k: v for k, v in options.items() if k in torch_names},
                         environ={k: v for k, v in os.environ.items() if k != "PROFSTREAM_OPTIONS"}, keywords=True)
    return torch_opts, {k: v for k, v in options.items() if k not in torch_names}


def close_at_exit(inst: TorchInstrumentation) -> None:
    """Close ``inst`` when the interpreter exits, before atexit handlers run: the Kafka
    producer closes itself in one, and the last step's events must be sent before that."""
    import weakref

    from profstream.producers import shutdown

    ref = weakref.ref(inst)

    def close(timeout: float = 5.0) -> None:
        from profstream.producers.monitor import exiting_on_error

        live = ref()
        if live is not None:
            live.close(timeout=timeout, ended=not exiting_on_error())  # a traceback: the run did not end normally

    shutdown.at_signal(close)  # SIGTERM ending the process: its last step first, then the Monitors

    register = getattr(threading, "_register_atexit", None)  # runs before atexit (CPython >= 3.9)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(close)
    except RuntimeError:  # interpreter already shutting down, or another Python
        import atexit

        atexit.register(close)


class TorchInstrumentation:
    """The hooks of one ``instrument()`` call and the step state they share."""

    def __init__(self, monitor: Any, monitor_options: dict, capture_ops: bool, mark_steps: bool,
                 lazy: bool = False, compiled_walk: bool = True, work_figures: bool = True,
                 count_flops: bool = True, collectives_interval_s: float = 0.0) -> None:
        import torch

        self._torch = torch
        # the steps' work: found in the batches the hooks see (loop-marked steps: none, the
        # loop gives it with Monitor.work or step(tokens=...))
        self.work = StepWork(torch, count_flops) if work_figures and mark_steps else None
        self.work_figures = work_figures
        self.count_flops = count_flops
        self.collectives_interval_s = collectives_interval_s
        self._peak_set = False
        self._loader: Any = None  # LoaderSampler of the multi-worker DataLoader (False: readings off)
        self.cuda = torch.cuda.is_available()
        self.capture_ops = capture_ops
        self.compiled_walk = compiled_walk
        self.mark_steps = mark_steps
        self.active = True
        self.error: BaseException | None = None
        self.owns_monitor = monitor is None
        self._monitor_options = dict(monitor_options)
        self._pid = os.getpid()
        self._hooks: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()  # one failure report, one close
        self._closed = False
        self.capture: OpCapture | None = None
        self.monitor: Any = None
        # step state (training thread)
        self._in_step = False
        self._step = -1
        self._fp_marked = False
        self._bp_marked = False
        self._fp_ns: int | None = None
        self._ended_fp_ns: int | None = None
        self._last_opt_end: int | None = None
        self._prev_end: int | None = None
        self._loader_driven = False
        self._seen_step = -1  # mark_steps=False: the monitor's step the hooks saw last
        self._rss: Any = None
        if monitor is not None or not lazy:
            self._setup_monitor(monitor)

    # -- setup ------------------------------------------------------------------------

    def _setup_monitor(self, monitor: Any) -> None:
        if monitor is None:
            opts = dict(self._monitor_options)
            if self.cuda and self._torch.cuda.is_initialized() and not _device_given(opts):
                # the device the loop uses; CUDA is never initialized here for the user
                opts["device"] = f"cuda:{self._torch.cuda.current_device()}"
            if self.capture_ops:
                opts["auto_watermark"] = False  # ops of a step are sent after it ends
            from profstream.producers.monitor import Monitor

            monitor = Monitor(**opts)
        self.monitor = monitor
        if not getattr(monitor, "enabled", True):
            # nothing to record: hooks already installed (the lazy set-up) return at once,
            # and no memory is read or step marked for a Monitor that drops it all
            self.active = False
            return
        if self.capture_ops:
            window = OpWindow.of(monitor.options)
            _hand_op_window_to_producer(monitor)
            self.capture = OpCapture(monitor, window, self.cuda, self._fail, self.compiled_walk,
                                     collective_bytes=monitor.options.get("collective_bytes", False),
                                     with_flops=self.work_figures and not self.count_flops)
        elif getattr(monitor, "capture_plan", None) is not None:
            monitor.capture_plan.unavailable = "op capture is off in this process (capture_ops=False)"
        if self.collectives_interval_s and getattr(monitor, "collective_reader", False) is None:
            from profstream.integrations.torch_flight import start_flight_reader

            # every collective of every process group, captured or not: a thread of its own
            monitor.collective_reader = start_flight_reader(monitor, self.collectives_interval_s)
        if not self.cuda:
            self._rss = RssReader()

    def attach(self, model: Any, optimizer: Any, loader: Any) -> None:
        """Install the hooks; the ones whose target is None are global."""
        torch = self._torch
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._forward_pre_hook))
        else:
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook))
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._optimizer_pre_hook))
            self._hooks.append(optimizer.register_step_post_hook(self._optimizer_post_hook))
        else:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._hooks.append(register_optimizer_step_pre_hook(self._optimizer_pre_hook))
            self._hooks.append(register_optimizer_step_post_hook(self._optimizer_post_hook))
        self.attach_loader(loader)

    def attach_loader(self, loader: Any) -> None:
        """Time the batch requests of ``loader``'s iterators (every DataLoader's if None)."""
        target = loader if loader is not None else self._torch.utils.data.DataLoader
        original = target._get_iterator  # DataLoader.__iter__ gets its iterators here
        inst = self

        def _get_iterator(*args: Any, **kwargs: Any) -> Any:
            return TimedIterator(original(*args, **kwargs), inst)

        if loader is not None:
            loader._get_iterator = _get_iterator
            self._restore.append((loader, "_get_iterator", None))
        else:
            target._get_iterator = _get_iterator
            self._restore.append((target, "_get_iterator", original))

    # -- lifecycle --------------------------------------------------------------------

    def close(self, timeout: float = 10.0, ended: bool = True) -> None:
        """End the open step, send the captured ops, remove the hooks; close the Monitor
        if instrument() made it (``ended``: as ``Monitor.close``'s, the run ended normally)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.active:
            self._guard(self._finish_run)
        self.active = False
        self._remove_hooks()
        if self.work is not None:
            self.work.forget()  # a count still running (a loop that died in a step) is stopped
        if self._loader:
            self._loader.stop()  # its last readings go with the Monitor's close
        if self.capture is not None:
            try:
                self.capture.close(timeout)
            except Exception as e:  # noqa: BLE001 - closing must not raise
                self._fail(e)
        if self.owns_monitor and self.monitor is not None:
            self.monitor.close(timeout, ended=ended)
        if self._rss is not None:
            self._rss.close()

    remove = close

    def __enter__(self) -> TorchInstrumentation:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(ended=exc_type is None)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for obj, name, original in self._restore:
            if original is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, original)
        self._restore.clear()

    def _fail(self, exc: BaseException) -> None:
        """An internal error: report it once and switch profiling off."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = exc
            self.active = False
        if first:
            log.error("profstream: internal error in the torch instrumentation; profiling is off for "
                      "the rest of this run, training goes on", exc_info=exc)
        capture = self.capture
        if capture is not None:
            capture.failed = True
            if capture.plan is not None:
                capture.plan.close(f"profiling is off after an internal error ({exc!r})")
            if threading.current_thread() is not capture.worker:  # else at the next hook
                self._stop_profiler_after_failure()

    def _stop_profiler_after_failure(self) -> None:
        """Stop the profiler on the training thread once profiling is off."""
        try:
            self.capture.stop()
        except Exception:  # noqa: BLE001 - already failing; the first error was logged
            log.debug("stopping the profiler after an error failed", exc_info=True)

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # an internal error never reaches the training loop
            self._fail(e)
            return None

    # -- hooks (training thread) ------------------------------------------------------

    def _forward_pre_hook(self, _module: Any, _args: Any) -> None:
        if self.active and (not self._fp_marked or not self.mark_steps):
            self._guard(self._on_forward)

    def _optimizer_pre_hook(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.active and not self._bp_marked:
            self._guard(self._on_optimizer_pre)

    def _optimizer_post_hook(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.active:
            self._guard(self._on_optimizer_post)
        elif self.capture is not None and self.capture.running:
            self._stop_profiler_after_failure()

    def before_batch(self, it: Any) -> int | None:
        """The loop asks for the next batch: S of the step it begins. Returns S."""
        if not self.active:
            if self.capture is not None and self.capture.running:
                self._stop_profiler_after_failure()
            return None
        return self._guard(self._on_batch_request, it)

    def after_batch(self, s_ns: int, queued: int, capacity: int, batch: Any = None, it: Any = None,
                    worker: int = -1) -> None:
        if self.active:
            self._guard(self._on_batch_ready, s_ns, queued, capacity)
            if capacity > 0 and it is not None and self.active:  # a multi-worker DataLoader: its workers read
                self._guard(self._loader_batch, it, worker)
            if self.work is not None and self.mark_steps and self._in_step and self.active:
                self._guard(self.work.batch, batch)  # trainers tell their steps' batches themselves

    # -- step logic -------------------------------------------------------------------

    def _ensure_monitor(self) -> bool:
        if self.monitor is None:
            if os.getpid() != self._pid:  # a forked worker: never profile it
                return False
            self._setup_monitor(None)
        return self.active

    def _on_batch_request(self, it: Any) -> int | None:
        if not self._ensure_monitor():
            return None
        self._loader_driven = True
        if self.mark_steps:
            ended = self._end_or_cancel_step()
            if self.capture is not None:
                self.capture.advance(ended, self.monitor.current_step + 1, self._ended_fp_ns)
        return _time_ns()

    def _on_batch_ready(self, s_ns: int, queued: int, capacity: int) -> None:
        monitor = self.monitor
        if self.mark_steps:
            self._begin_step(s_ns)
        if queued >= 0:
            monitor.queue(QUEUE_NAME, queued, capacity, ts_ns=s_ns)

    def _on_forward(self) -> None:
        if not self._ensure_monitor():
            return
        if self.mark_steps:
            if not self._in_step:
                if self._loader_driven:
                    return  # a forward outside a loader step (evaluation): not a step of ours
                self._begin_step(self._prev_end if self._prev_end is not None else _time_ns())
                if self.capture is not None:
                    self.capture.advance(None, self._step)  # profiler stepping happens before S in loader mode
        elif not self._follow_monitor_step():
            return
        self._fp_marked = True
        self._fp_ns = now = _time_ns()
        self.monitor.mark_fp_start(now)

    def _on_optimizer_pre(self) -> None:
        if not self._ensure_monitor():
            return
        self._bp_marked = True
        self.monitor.mark_bp_end()

    def _on_optimizer_post(self) -> None:
        if self.monitor is None:
            return
        self._last_opt_end = now = _time_ns()
        if not self.mark_steps:
            self._sample_memory(now)
        elif not self._loader_driven and self._in_step:
            ended = self._end_step(now)
            if self.capture is not None:
                self.capture.advance(ended, None, self._ended_fp_ns)

    def _begin_step(self, s_ns: int) -> None:
        self._step = self.monitor.begin_step(ts_ns=s_ns)
        self._in_step = True
        self._fp_marked = self._bp_marked = False
        self._fp_ns = self._last_opt_end = None

    def _end_or_cancel_step(self) -> int | None:
        """End the open step (at its last optimizer step, else now); a step that trained on
        nothing (its batch fetched, then no forward and no optimizer step) is cancelled
        instead. Returns the number of the step ended, None if none was."""
        if self._in_step and not (self._fp_marked or self._bp_marked or self._last_opt_end is not None):
            self.monitor.cancel_step()
            self._in_step = False
            if self.work is not None:
                self.work.forget()
            return None
        return self._end_step(self._last_opt_end)

    def _end_step(self, e_ns: int | None) -> int | None:
        """End the open step at ``e_ns`` (now if None); returns its number."""
        if not self._in_step:
            return None
        e_ns = _time_ns() if e_ns is None else e_ns
        self._sample_memory(e_ns)
        if self.work is not None:
            self._send_work()
        self.monitor.end_step(e_ns)
        self._in_step = False
        self._prev_end = e_ns
        self._ended_fp_ns = self._fp_ns
        self._fp_marked = self._bp_marked = False
        return self._step

    def _loader_batch(self, it: Any, worker: int) -> None:
        if self._loader is None:
            interval = getattr(self.monitor, "options", {}).get("host_sample_interval_s", 0)
            if not interval:
                self._loader = False  # readings off
                return
            self._loader = LoaderSampler(self.monitor, interval)
        if self._loader:
            self._loader.batch(it, worker)

    def _send_work(self) -> None:
        """The ending step's work to the Monitor, before its end mark; the device's peak
        looked up at the first count, for the dtype it saw."""
        work = self.work.take()
        if work[2] is not None and not self._peak_set:
            self._peak_set = True
            self._set_peak(self.work.dtype)
        send_work(self.monitor, *work)

    def _set_peak(self, counted_dtype: str | None) -> None:
        monitor = self.monitor
        options = getattr(monitor, "options", {})
        if options.get("peak_tflops") is not None or not hasattr(monitor, "set_device_peak"):
            return
        dtype = options.get("compute_dtype") or counted_dtype
        torch = self._torch
        if self.cuda and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name(torch.cuda.current_device())
        else:
            name = str(options.get("device", "cpu"))
        monitor.set_device_peak(name, dtype)

    def _follow_monitor_step(self) -> bool:
        """mark_steps=False: the loop marks steps. On the first forward of a new step, move
        the profiler on; returns whether this forward is that first one."""
        step = self.monitor.current_step
        if step == self._seen_step:
            return False
        ended = self._seen_step if self._seen_step >= 0 else None
        self._seen_step = step
        self._bp_marked = False
        if self.capture is not None:
            self.capture.advance(ended, step)
        return True

    def _finish_run(self) -> None:
        if self.monitor is None:
            return
        ended = self._end_or_cancel_step() if self.mark_steps else (
            self._seen_step if self._seen_step >= 0 else None)
        if self.capture is not None:
            self.capture.advance(ended, None, self._ended_fp_ns if self.mark_steps else None)
            self.capture.stop()

    def _sample_memory(self, ts_ns: int) -> None:
        if self.cuda:
            # one read of the caching allocator's statistics: memory_allocated(),
            # memory_reserved() and max_memory_allocated() each build, flatten and sort all
            # of them, on the thread that launches the kernels
            cuda = self._torch.cuda
            stats = cuda.memory_stats_as_nested_dict()
            allocated = stats.get("allocated_bytes", {}).get("all", {})
            reserved = stats.get("reserved_bytes", {}).get("all", {})
            self.monitor.memory(allocated.get("current", 0), reserved.get("current", 0), allocated.get("peak", 0),
                                ts_ns=ts_ns)
            cuda.reset_peak_memory_stats()
        elif self._rss is not None:
            self.monitor.memory(self._rss(), ts_ns=ts_ns)


def _device_given(options: dict) -> bool:
    from profstream.config import option_given

    return option_given("device", options, os.environ)


def _hand_op_window_to_producer(monitor: Any) -> None:
    """The Monitor gates ops by the step being recorded now; this producer sends a step's
    ops after the step ended, so it applies the window itself and keeps the Monitor's
    gate open, and moves the watermark itself once the ops are sent."""
    monitor.defer_ops()


__all__ = ["TORCH_OPTIONS", "TorchInstrumentation", "instrument", "split_options"]
