"""Rolling figures of one rank over its last N steps, in fixed-size ring buffers."""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from profstream import compiled

WINDOW_STEPS = 100
_NOT_MEASURED = float("nan")
_NO_WORK = {f"{q}_{name}": None for name in ("tokens_per_s", "samples_per_s", "mfu") for q in ("p50", "p95")}


# The work figures the window keeps (StepMetrics ``work``), their p50 and p95 reported
WORK_FIGURES = ("tokens_per_s", "samples_per_s", "mfu")


class RollingWindow:
    """Step time, data wait, utilization and the work figures (tokens/s, samples/s, MFU)
    of the last ``n`` steps (bounded memory); a step whose utilization or work figure was
    not measured holds NaN there and counts in no mean or percentile of it."""

    def __init__(self, n: int = WINDOW_STEPS) -> None:
        if n < 1:
            raise ValueError("n (window steps) must be >= 1")
        self.n = n
        self._step_time = np.zeros(n, np.int64)
        self._data_wait = np.zeros(n, np.int64)
        self._utilization = np.zeros(n, np.float64)
        # per work figure: its value in each slot (None: the step had none), and the window's
        # values sorted (their percentiles in O(1); a step adds and removes one in O(n) memmove)
        self._work: dict[str, list[float | None]] = {name: [None] * n for name in WORK_FIGURES}
        self._sorted: dict[str, list[float]] = {name: [] for name in WORK_FIGURES}
        self._added = 0

    def __len__(self) -> int:
        return min(self._added, self.n)

    def add(self, step_time_ns: int, data_wait_ns: int, utilization: float | None,
            work: dict | None = None) -> None:
        """One step; ``work``: its StepMetrics work figures (None: it had none)."""
        i = self._added % self.n
        self._step_time[i] = step_time_ns
        self._data_wait[i] = data_wait_ns
        self._utilization[i] = _NOT_MEASURED if utilization is None else utilization
        if work is not None or self._has_work:  # a run without work figures never touches them
            for name, ring in self._work.items():
                ordered = self._sorted[name]
                old = ring[i]
                if old is not None:
                    del ordered[bisect_left(ordered, old)]
                value = ring[i] = None if work is None else work.get(name)
                if value is not None:
                    insort(ordered, value)
        self._added += 1

    @property
    def _has_work(self) -> bool:
        """Whether a step of the window had a work figure."""
        return any(self._sorted.values())

    def to_state(self) -> dict:
        """Everything needed to rebuild this window (for the processor's checkpoint)."""
        return {"added": self._added, "step_time": self._step_time.tobytes(),
                "data_wait": self._data_wait.tobytes(), "utilization": self._utilization.tobytes(),
                **{name: np.array([_NOT_MEASURED if v is None else v for v in ring]).tobytes() if self._has_work
                   else b"" for name, ring in self._work.items()}}

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
        for name in WORK_FIGURES:
            saved = state.get(name) or b""  # empty: no step of the window had work figures (or v2)
            if saved:
                ring = window._work[name] = [v if v == v else None for v in np.frombuffer(saved, np.float64).tolist()]
                window._sorted[name] = sorted(v for v in ring if v is not None)
        return window

    def _replay(self, state: dict, step_time: np.ndarray) -> None:
        old_n, added = len(step_time), state["added"]
        data_wait = np.frombuffer(state["data_wait"], np.int64)
        util = np.frombuffer(state["utilization"], np.float64)
        work = {name: np.frombuffer(state[name], np.float64) for name in WORK_FIGURES if state.get(name)}
        for i in range(max(0, added - old_n), added):
            j = i % old_n
            values = {name: float(ring[j]) for name, ring in work.items() if ring[j] == ring[j]}
            self.add(int(step_time[j]), int(data_wait[j]), float(util[j]),  # NaN stays not measured
                     values or None)

    def figures(self) -> dict[str, int | float]:
        """``{window, mean/p50/p95_step_time_ns, data_wait_share, mean_utilization}``.

        window is the number of steps held (<= n). Percentiles use numpy's default
        linear interpolation between the closest ranks. data_wait_share is
        sum(data_wait) / sum(step_time). All values are 0 while the window is empty, but
        mean_utilization: the mean over the steps whose utilization was measured, None
        when none was; the p50 and p95 of each work figure over the steps that had it,
        None when none did.
        """
        count = len(self)
        if count == 0:
            return {"window": 0, "mean_step_time_ns": 0.0, "p50_step_time_ns": 0.0,
                    "p95_step_time_ns": 0.0, "data_wait_share": 0.0, "mean_utilization": None, **_NO_WORK}
        p50_ranks, p95_ranks = _ranks(count, 0.50), _ranks(count, 0.95)
        sums = (compiled.NATIVE.rolling_sums(self._step_time, self._data_wait, count, (*p50_ranks[:2], *p95_ranks[:2]))
                if compiled.NATIVE is not None else None)
        if sums is not None:  # integer sums, exact in a double: sum / count is numpy's mean to the bit
            step_sum, wait_sum, at = sums
            p50, p95 = _interpolate(at[0], at[1], p50_ranks[2]), _interpolate(at[2], at[3], p95_ranks[2])
            mean_step_time = step_sum / count
        else:
            step_time = self._step_time[:count]
            ordered = np.sort(step_time)
            p50, p95 = _linear_percentile(ordered, 0.50), _linear_percentile(ordered, 0.95)
            step_sum = int(step_time.sum())
            wait_sum = int(self._data_wait[:count].sum())
            mean_step_time = float(step_time.mean())
        util = self._utilization[:count]
        measured = util[util == util]  # NaN: not measured
        return {
            "window": count,
            "mean_step_time_ns": mean_step_time,
            "p50_step_time_ns": float(p50),
            "p95_step_time_ns": float(p95),
            "data_wait_share": wait_sum / step_sum if step_sum > 0 else 0.0,
            # numpy's mean to the bit (its pairwise sum over the count) without its per-call machinery
            "mean_utilization": float(np.add.reduce(measured)) / len(measured) if len(measured) else None,
            **(self._work_figures() if self._has_work else _NO_WORK),
        }

    def _work_figures(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, ordered in self._sorted.items():
            out[f"p50_{name}"] = _linear_percentile(ordered, 0.50, float) if ordered else None
            out[f"p95_{name}"] = _linear_percentile(ordered, 0.95, float) if ordered else None
        return out


def _linear_percentile(ordered, q: float, cast=int) -> float:
    """``np.percentile(values, 100 * q)`` (default 'linear' method), bit for bit, of sorted
    int64 values (``cast=float``: floats), without numpy's per-call machinery (~50 us,
    once per step and rank)."""
    lo, hi, t = _ranks(len(ordered), q)
    return _interpolate(cast(ordered[lo]), cast(ordered[hi]), t)


def _ranks(n: int, q: float) -> tuple[int, int, float]:
    """The two ranks of n sorted values that the q-quantile lies between, and how far."""
    index = (n - 1) * q
    lo = int(index)
    return lo, min(lo + 1, n - 1), index - lo


def _interpolate(a, b, t: float) -> float:
    """numpy's linear interpolation between a and b (the values at the two ranks)."""
    d = b - a
    return float(b) - d * (1 - t) if t >= 0.5 else float(a) + d * t

