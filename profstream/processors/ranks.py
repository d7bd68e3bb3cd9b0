"""Cross-rank figures of one step: spread of step times and the straggler."""

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
    times = np.array([step_times[r] for r in ranks], dtype=np.int64)
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
