"""Rolling figures of one rank over its last N steps, in fixed-size ring buffers."""

from __future__ import annotations

import numpy as np

WINDOW_STEPS = 100
_NOT_MEASURED = float("nan")


class RollingWindow:
    """Step time, data wait and utilization of the last ``n`` steps (bounded memory); a
    step whose utilization was not measured holds NaN and counts in no utilization mean."""

    def __init__(self, n: int = WINDOW_STEPS) -> None:
        if n < 1:
            raise ValueError("n (window steps) must be >= 1")
        self.n = n
        self._step_time = np.zeros(n, np.int64)
        self._data_wait = np.zeros(n, np.int64)
        self._utilization = np.zeros(n, np.float64)
        self._added = 0

    def __len__(self) -> int:
        return min(self._added, self.n)

    def add(self, step_time_ns: int, data_wait_ns: int, utilization: float | None) -> None:
        i = self._added % self.n
        self._step_time[i] = step_time_ns
        self._data_wait[i] = data_wait_ns
        self._utilization[i] = _NOT_MEASURED if utilization is None else utilization
        self._added += 1

    def to_state(self) -> dict:
        """Everything needed to rebuild this window (for the processor's checkpoint)."""
        return {"added": self._added, "step_time": self._step_time.tobytes(),
                "data_wait": self._data_wait.tobytes(), "utilization": self._utilization.tobytes()}

    @classmethod
    def from_state(cls, n: int, state: dict) -> RollingWindow:
        window = cls(n)
        step_time = np.frombuffer(state["step_time"], np.int64)
        if len(step_time) != n:  # the window size changed: keep the most recent steps
            window._replay(state, step_time)
            return window
        window._added = state["added"]
        window._step_time[:] = step_time
        window._data_wait[:] = np.frombuffer(state["data_wait"], np.int64)
        window._utilization[:] = np.frombuffer(state["utilization"], np.float64)
        return window

    def _replay(self, state: dict, step_time: np.ndarray) -> None:
        old_n, added = len(step_time), state["added"]
        data_wait = np.frombuffer(state["data_wait"], np.int64)
        util = np.frombuffer(state["utilization"], np.float64)
        for i in range(max(0, added - old_n), added):
            j = i % old_n
            self.add(int(step_time[j]), int(data_wait[j]), float(util[j]))  # NaN stays not measured

    def figures(self) -> dict[str, int | float]:
        """``{window, mean/p50/p95_step_time_ns, data_wait_share, mean_utilization}``.

        window is the number of steps held (<= n). Percentiles use numpy's default
        linear interpolation between the closest ranks. data_wait_share is
        sum(data_wait) / sum(step_time). All values are 0 while the window is empty, but
        mean_utilization: the mean over the steps whose utilization was measured, None
        when none was.
        """
        count = len(self)
        if count == 0:
            return {"window": 0, "mean_step_time_ns": 0.0, "p50_step_time_ns": 0.0,
                    "p95_step_time_ns": 0.0, "data_wait_share": 0.0, "mean_utilization": None}
        step_time = self._step_time[:count]
        ordered = np.sort(step_time)
        p50, p95 = _linear_percentile(ordered, 0.50), _linear_percentile(ordered, 0.95)
        step_sum = int(step_time.sum())
        wait_sum = int(self._data_wait[:count].sum())
        util = self._utilization[:count]
        measured = util[util == util]  # NaN: not measured
        return {
            "window": count,
            "mean_step_time_ns": float(step_time.mean()),
            "p50_step_time_ns": float(p50),
            "p95_step_time_ns": float(p95),
            "data_wait_share": wait_sum / step_sum if step_sum > 0 else 0.0,
            "mean_utilization": float(measured.mean()) if len(measured) else None,
        }


def _linear_percentile(ordered: np.ndarray, q: float) -> float:
    """``np.percentile(values, 100 * q)`` (default 'linear' method), bit for bit, of sorted
    int64 values, without numpy's per-call machinery (~50 us, once per step and rank)."""
    index = (len(ordered) - 1) * q
    lo = int(index)
    t = index - lo
    a = int(ordered[lo])
    b = int(ordered[min(lo + 1, len(ordered) - 1)])
    d = b - a
    return float(b) - d * (1 - t) if t >= 0.5 else float(a) + d * t
