"""Facade: every figure of one closed step, as a StepMetrics record.

Each figure family lives in its own module; this one only calls them in order and keeps
the per-rank state they need between steps (rolling window, stall detector).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from profstream.processors.advice import HOST_MAX_AGE_NS, step_advice
from profstream.processors.collectives import NO_CALLS, pack_calls
from profstream.processors.devices import device_figures
from profstream.processors.host import host_figures
from profstream.processors.memory import memory_figures
from profstream.processors.model import StepEvents
from profstream.processors.optypes import device_kind_costs, kernel_type_costs, op_type_costs
from profstream.processors.queues import queue_figures
from profstream.processors.rolling import RollingWindow
from profstream.processors.stalls import StallDetector, is_starved
from profstream.processors.steptrace import step_trace
from profstream.processors.throughput import work_figures
from profstream.processors.utilization import utilization
from profstream.processors.window import step_window, uncorrelated_ops


@dataclass(frozen=True)
class FigureOptions:
    top_k: int = 10
    stall_ratio: float = 0.3
    stall_steps: int = 5
    rolling_steps: int = 100


@dataclass
class RankFigures:
    """Figure state carried from step to step for one (run, rank)."""

    options: FigureOptions
    rolling: RollingWindow = field(init=False)
    stall: StallDetector = field(init=False)
    starved_steps: int = 0
    # the latest host figures and the end of their step, for the advice of steps without
    # readings of their own (not checkpointed: a restarted processor has none until the next)
    last_host: tuple[int, dict] | None = None

    def __post_init__(self) -> None:
        self.rolling = RollingWindow(self.options.rolling_steps)
        self.stall = StallDetector(self.options.stall_steps)

    def snapshot(self) -> dict:
        """The RankCheckpoint fields this figure state owns."""
        return {"starved_steps": self.starved_steps, "rolling": self.rolling.to_state(),
                "stall": self.stall.to_state()}

    @classmethod
    def restore(cls, options: FigureOptions, checkpoint: dict) -> RankFigures:
        figures = cls(options)
        figures.starved_steps = checkpoint["starved_steps"]
        figures.rolling = RollingWindow.from_state(options.rolling_steps, checkpoint["rolling"])
        figures.stall = StallDetector.from_state(options.stall_steps, checkpoint["stall"])
        return figures

    def step_metrics(self, ev: StepEvents, closed_by: str, late_events: int) -> tuple[dict, str | None]:
        """(StepMetrics record, stall alert transition or None) of a closed step."""
        opts = self.options
        window = step_window(ev)
        trace = step_trace(ev, window)
        util = utilization(ev, window)
        queues = queue_figures(ev)
        starved = is_starved(trace, queues, opts.stall_ratio)
        self.starved_steps += starved
        transition = self.stall.update(ev.step, starved)
        work = work_figures(ev, trace["step_time_ns"], window)
        if not ev.partial:  # a step that lost events would pass for a whole one in the rolling figures
            self.rolling.add(trace["step_time_ns"], trace["data_wait_ns"], util["utilization"], work)
        record = {
            "run_id": ev.run_id, "rank": ev.rank, "world_size": ev.world_size, "host": ev.host,
            "device": ev.device,
            "step": ev.step, "start_ns": ev.start_ns, "end_ns": ev.end_ns,
            **trace, **util,
            "host_step_time_ns": ev.step_time_ns,
            "device_start_ns": window.start_ns if window.device else None,
            "device_end_ns": window.end_ns if window.device else None,
            "op_count": len(ev.op_kind),
            "op_types": op_type_costs(ev, opts.top_k, window),
            "kernel_types": kernel_type_costs(ev, opts.top_k, window),
            "device_kinds": device_kind_costs(ev, window),
            "uncorrelated_ops": uncorrelated_ops(ev, window),
            "memory": memory_figures(ev),
            "queues": queues,
            "starved": bool(starved),
            "rolling": self.rolling.figures(),
            "closed_by": closed_by,
            "late_events": late_events,
            "closed_ns": time.time_ns(),
            "collectives": pack_calls(ev.collectives) if ev.collectives is not None else NO_CALLS,
            "devices": device_figures(ev),
            "dropped_ops": ev.dropped_ops, "dropped_samples": ev.dropped_samples,
            "work": work,
            "resources": host_figures(ev),
        }
        host = record["resources"]
        if host is not None:
            self.last_host = (ev.end_ns, host)
        elif self.last_host is not None and ev.end_ns - self.last_host[0] <= HOST_MAX_AGE_NS:
            host = self.last_host[1]
        record["advice"] = step_advice(record, ev, host)
        return record, transition
