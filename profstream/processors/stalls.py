"""Data-queue stalls: is a step starved, the DataQueueStall alert state per rank, and its
Alert records.

A step is starved when the device-side data queue was empty at S, or when its data
wait is at least ``stall_ratio`` of the step time. DataQueueStall fires on the K-th
consecutive starved step and resolves after K consecutive healthy steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

STALL_ALERT = "DataQueueStall"
STALL_RATIO = 0.3
STALL_STEPS = 5

OK = "ok"
FIRING = "firing"
RESOLVED = "resolved"


def is_starved(
    trace: Mapping[str, int],
    queues: Sequence[Mapping[str, Any]],
    stall_ratio: float = STALL_RATIO,
    device_queue: str | None = None,
) -> bool:
    """Whether a step was starved of data.

    ``trace`` is the step's ``step_trace`` and ``queues`` its ``queue_figures``. Only the
    queue named ``device_queue`` counts, any queue when it is None; a queue with no size
    at S does not count. The data-wait test needs a step time > 0.
    """
    for q in queues:
        if (device_queue is None or q["queue"] == device_queue) and q["at_start"] == 0:
            return True
    step_time = trace["step_time_ns"]
    return step_time > 0 and trace["data_wait_ns"] >= stall_ratio * step_time


class StallDetector:
    """DataQueueStall state of one run/rank, fed every closed step in order."""

    def __init__(self, k: int = STALL_STEPS) -> None:
        if k < 1:
            raise ValueError("k (consecutive steps) must be >= 1")
        self.k = k
        self._firing = False
        self._streak = 0  # consecutive starved steps (while ok) or healthy ones (while firing)
        self._streak_start: int | None = None
        self.since_step: int | None = None  # first starved step of the firing stall

    @property
    def state(self) -> Literal["ok", "firing"]:
        return FIRING if self._firing else OK

    def update(self, step: int, starved: bool) -> Literal["firing", "resolved"] | None:
        """Feed one step; returns "firing" or "resolved" when the state changes, else None."""
        if starved != self._firing:  # the step goes against the current state
            if self._streak == 0:
                self._streak_start = step
            self._streak += 1
        else:
            self._streak = 0
        if self._streak < self.k:
            return None
        self._streak = 0
        self._firing = not self._firing
        if self._firing:
            self.since_step = self._streak_start
            return FIRING
        self.since_step = None
        return RESOLVED

    def to_state(self) -> dict:
        """Everything needed to rebuild this detector (for the processor's checkpoint)."""
        return {"firing": self._firing, "streak": self._streak, "streak_start": self._streak_start,
                "since_step": self.since_step}

    @classmethod
    def from_state(cls, k: int, state: dict) -> StallDetector:
        detector = cls(k)
        detector._firing = state["firing"]
        detector._streak = state["streak"]
        detector._streak_start = state["streak_start"]
        detector.since_step = state["since_step"]
        return detector


def advice_text(advice: list) -> str:
    """The advice lines of a step as sentences (processors/advice.py writes them)."""
    return " ".join(f"{a['text'][0].upper()}{a['text'][1:]}." for a in advice)


def stall_alert(step_metrics: Mapping[str, Any], transition: str, stall_steps: int, since_step: int | None,
                starved_steps: int) -> dict:
    """The Alert record of a DataQueueStall ``transition`` ("firing" or "resolved") at the
    step whose StepMetrics record is ``step_metrics``. Its time is that step's end (E, the
    producer's clock): when the state changed in the run, the same live, replayed or in a
    report made days later, not when a processor got to it."""
    m = step_metrics
    run_id, rank = m["run_id"], m["rank"]
    firing = transition == FIRING
    advice = m.get("advice") or [] if firing else []
    evidence = {"data_wait_ns": float(m["data_wait_ns"]), "step_time_ns": float(m["step_time_ns"]),
                "starved_steps_total": float(starved_steps)}
    for a in advice:  # the figures the advice read, under its rule's name
        evidence.update((f"{a['rule']}.{k}", v) for k, v in a["figures"].items())
    return {
        "name": STALL_ALERT, "state": transition, "run_id": run_id, "rank": rank,
        "step": m["step"], "ts_ns": m["end_ns"],
        "summary": (f"run {run_id} rank {rank}: data queue starved for {stall_steps} "
                    f"consecutive steps (since step {since_step})" + (f". {advice_text(advice)}" if advice else "")
                    if firing else f"run {run_id} rank {rank}: data queue healthy for {stall_steps} steps"),
        "evidence": evidence,
    }


def stall_state(alert: Mapping[str, Any]) -> tuple[str, int, bool] | None:
    """(run id, rank, firing) of a DataQueueStall Alert record; None for any other alert."""
    if alert["name"] != STALL_ALERT or alert["rank"] is None:
        return None
    return alert["run_id"], alert["rank"], alert["state"] == FIRING
