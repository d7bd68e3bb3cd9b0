"""Steps told by a trainer's callbacks (Hugging Face ``Trainer``, Lightning): the torch
producer's DataLoader queue, memory and op capture, with the step marks taken from the
trainer's callback events instead of model and optimizer hooks.

A trainer fetches a step's batches before it calls the step's first hook, and evaluates,
logs and saves between steps; so the marks are:

- S: the first batch request of the training DataLoader after the previous step ended
  (without one, the previous step's end);
- F: the step's first hook, right before its first forward;
- B: the hook before ``optimizer.step()``, after backward (and gradient clipping);
- E: the step's last hook; memory is sampled there;
- queue ``dataloader``: the prefetch queue of a multi-worker DataLoader at each batch
  request, counted in the step the request belongs to;
- ops: torch.profiler from S to E of the steps of the window.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from profstream.config import ConfigError, callback_options, option_given
from profstream.integrations.torch import (
    QUEUE_NAME,
    TORCH_OPTIONS,
    TorchInstrumentation,
    close_at_exit,
    split_options,
)

_time_ns = time.time_ns

# Queue samples held from a step's first batch request until the step begins (a trainer
# fetches all the batches of a step, gradient accumulation included, before its first hook).
MAX_WAITING_SAMPLES = 64


def with_trainer_defaults(options: dict[str, Any], rank: int, world_size: int, run_name: str | None,
                          log: logging.Logger) -> dict[str, Any]:
    """``options`` with the rank, world size and run id the trainer knows, where the user
    set none (argument, PROFSTREAM_* variable or PROFSTREAM_OPTIONS)."""
    out = dict(options)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not option_given(name, out, os.environ):
            out[name] = value
    if not option_given("run_id", out, os.environ):
        run_id = _as_run_id(run_name)
        if run_id is not None:
            out["run_id"] = run_id
        elif world_size > 1:
            log.warning("profstream: no run id is shared by the %d ranks, so they are reported as separate runs: "
                        "set the trainer's run name, run_id= or PROFSTREAM_RUN_ID", world_size)
    return out


def _as_run_id(name: str | None) -> str | None:
    """A trainer's run name as a run id (letters, digits and . _ : = + @ -), None if empty."""
    if not name:
        return None
    cleaned = re.sub(r"[^A-Za-z0-9._:=+@-]+", "-", str(name)).lstrip("._:=+@-")[:128]
    return cleaned or None


class StepsCallback:
    """What the trainers' ``ProfstreamCallback`` classes share: one ``TrainerSteps`` from
    train start to train end. ``options``: Monitor options (run_id, bootstrap, topic_prefix,
    start_step... see ``profstream.config``) plus ``capture_ops`` and ``compiled_walk``; else
    ``PROFSTREAM_*`` variables, and the mindformers-style profile options. An unknown option
    name raises here, at start-up; a bad value or an unreachable broker logs one warning and
    training goes on."""

    log = logging.getLogger("profstream.integrations")

    def __init__(self, **options: Any) -> None:
        checked = callback_options(options, "ProfstreamCallback", self.log, extra=TORCH_OPTIONS)
        self.enabled = checked is not None
        self.options = checked or {}
        self.steps: TrainerSteps | None = None

    def start_steps(self, rank: int, world_size: int, run_name: str | None, next_step: int) -> TrainerSteps | None:
        """The run's ``TrainerSteps`` (None, with one warning, when it cannot start)."""
        if not self.enabled or self.steps is not None:
            return None
        options = with_trainer_defaults(self.options, rank, world_size, run_name, self.log)
        try:
            self.steps = TrainerSteps(options)
        except (ConfigError, ImportError, OSError) as e:
            self.log.warning("profstream: ProfstreamCallback is off, training goes on without it: %s", e)
            return None
        self.steps.next_step = next_step
        return self.steps

    def close_steps(self, ended: bool = True) -> None:
        """Close the producer (``ended=False`` when training failed: no end mark)."""
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.close(ended=ended)


class TrainerSteps(TorchInstrumentation):
    """The torch producer driven by a trainer's callbacks: ``begin(step)``,
    ``backward_end()``, ``end()``; the training DataLoader hooked with ``attach_loader``.
    ``options``: Monitor options plus ``capture_ops`` and ``compiled_walk``."""

    def __init__(self, options: dict[str, Any]) -> None:
        torch_options, monitor_options = split_options(options)
        super().__init__(None, monitor_options, torch_options["capture_ops"], mark_steps=False,
                         compiled_walk=torch_options["compiled_walk"], work_figures=torch_options["work_figures"],
                         count_flops=torch_options["count_flops"])
        if torch_options["work_figures"]:  # the trainer tells the steps' batches (work_batch)
            from profstream.integrations.torch_work import StepWork

            self.work = StepWork(self._torch, torch_options["count_flops"])
        self.listening = True  # batch requests are the training loop's (off while it evaluates)
        self.next_step: int | None = None  # the step the next batch request begins, once known
        self._asked_ns: int | None = None  # the first batch request since the last step ended
        self._waiting: list[tuple[int, int, int]] = []  # (ts, size, capacity) of the requests since
        self._capture_step: int | None = None  # the step op capture was moved on to
        close_at_exit(self)

    @property
    def in_step(self) -> bool:
        return self._in_step

    # -- told by the callbacks (training thread) ---------------------------------------

    def begin(self, step: int) -> None:
        """The trainer's step ``step`` begins: its first forward comes next."""
        if self.active:
            self._guard(self._begin, step)

    def backward_end(self) -> None:
        """``optimizer.step()`` is about to run (the first time in the step counts)."""
        if self.active and self._in_step and not self._bp_marked:
            self._guard(self._mark_backward_end)

    def work_batch(self, batch: Any) -> None:
        """A micro-batch of the open step is trained on now (its forward comes next): its
        tokens and samples, and the region of its FLOP count."""
        if self.active and self._in_step and self.work is not None:
            self._guard(self.work.batch, batch)

    def end(self) -> None:
        """The trainer's step is over."""
        if self.active and self._in_step:
            self._guard(self._end, _time_ns())

    def _begin(self, step: int) -> None:
        now = _time_ns()
        if self._in_step:  # the trainer never ended the previous one
            self._end(now)
        start = next((t for t in (self._asked_ns, self._prev_end) if t is not None), now)
        monitor = self.monitor
        self._step = monitor.begin_step(step, ts_ns=start)
        monitor.mark_fp_start(now)
        for ts, size, capacity in self._waiting:
            monitor.queue(QUEUE_NAME, size, capacity, ts_ns=ts, step=step)
        self._waiting.clear()
        self._asked_ns = None
        self._in_step, self._bp_marked, self._fp_ns = True, False, now
        if self.capture is not None and self._capture_step != step:
            self.capture.advance(None, step)  # no batch request seen for it: recorded from F on
            self._capture_step = step

    def _mark_backward_end(self) -> None:
        self._bp_marked = True
        self.monitor.mark_bp_end()

    def _end(self, now: int) -> None:
        ended = self._end_step(now)
        self.next_step = ended + 1
        if self.capture is not None:
            self.capture.advance(ended, None, self._ended_fp_ns)
            self._capture_step = None

    # -- the DataLoader's requests (TimedIterator) -------------------------------------

    def _on_batch_request(self, it: Any) -> int | None:
        if not self.listening:
            return None
        now = _time_ns()
        if not self._in_step and self._asked_ns is None:
            self._asked_ns = now
            if self.capture is not None and self.next_step is not None:
                self.capture.advance(None, self.next_step)  # record the step from its S
                self._capture_step = self.next_step
        return now

    def _on_batch_ready(self, s_ns: int, queued: int, capacity: int) -> None:
        if queued < 0:
            return
        if self._in_step:
            self.monitor.queue(QUEUE_NAME, queued, capacity, ts_ns=s_ns)
        elif len(self._waiting) < MAX_WAITING_SAMPLES:
            self._waiting.append((s_ns, queued, capacity))

    def _finish_run(self) -> None:
        if self._in_step:
            self._end(_time_ns())
        if self.capture is not None:
            self.capture.stop()
