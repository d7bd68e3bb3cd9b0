"""Cross-rank figures of one step: spread of step times and the straggler; throughput and
MFU across the ranks."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def rank_figures(step_times: Mapping[int, int]) -> dict[str, int | float]:
    """Figures of one step from ``{rank: step_time_ns}`` of the ranks that reported it.

    skew = (max - min) / median (0 when the median is 0); the median of an even count is
    the mean of the middle two. straggler_rank is the rank with the longest step, the
    lowest such rank on ties.
    """
    if not step_times:
        raise ValueError("rank_figures needs the step time of at least one rank")
    ranks = sorted(step_times)
    return rank_figures_of(np.array(ranks, np.int64), np.array([step_times[r] for r in ranks], dtype=np.int64))


def rank_figures_of(ranks: np.ndarray, times: np.ndarray) -> dict[str, int | float]:
    """``rank_figures`` of ``ranks`` (sorted, each once) and their step times, as arrays."""
    if not len(ranks):
        raise ValueError("rank_figures needs the step time of at least one rank")
    times = times.astype(np.int64, copy=False)
    lo, hi = int(times.min()), int(times.max())
    median = float(np.median(times))
    return {
        "ranks_reported": len(ranks),
        "min_step_time_ns": lo,
        "median_step_time_ns": median,
        "max_step_time_ns": hi,
        "skew": (hi - lo) / median if median != 0 else 0.0,
        "straggler_rank": int(ranks[np.argmax(times)]),
    }


def run_work_of(ranks: np.ndarray, values: np.ndarray, present: np.ndarray) -> dict | None:
    """RunStepMetrics ``work`` of the ranks whose step had work figures, ``ranks`` (sorted,
    each once; None when none had): ``values`` and ``present`` (not None) are rows x
    (tokens_per_s, samples_per_s, flops_per_s, mfu). Throughputs summed over the ranks
    that have them (in rank order, as Python's ``sum``), MFU's mean and minimum and the rank
    with the lowest (the lowest rank on ties). A figure no rank had is None."""
    if not len(ranks):
        return None

    def total(i: int) -> float | None:
        v = values[present[:, i], i]
        return float(np.cumsum(v)[-1]) if len(v) else None  # cumsum adds one by one: sum()'s bits

    has_mfu = present[:, 3]
    mfus, mfu_ranks = values[has_mfu, 3], ranks[has_mfu]
    low = np.lexsort((mfu_ranks, mfus))[0] if len(mfus) else None
    return {"ranks": len(ranks), "tokens_per_s": total(0), "samples_per_s": total(1), "flops_per_s": total(2),
            "mean_mfu": float(np.cumsum(mfus)[-1]) / len(mfus) if len(mfus) else None,
            "min_mfu": float(mfus[low]) if low is not None else None,
            "min_mfu_rank": int(mfu_ranks[low]) if low is not None else None, "mfu_ranks": len(mfus)}
