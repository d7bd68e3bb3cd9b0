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


RankWork = tuple  # (tokens_per_s, samples_per_s, flops_per_s, mfu) of one rank's step, None where absent


def run_work_figures(work: Mapping[int, RankWork]) -> dict | None:
    """RunStepMetrics ``work`` from ``{rank: (tokens_per_s, samples_per_s, flops_per_s, mfu)}``
    of the ranks whose step had work figures (None when none had): throughputs summed over
    the ranks that have them, MFU's mean and minimum and the rank with the lowest (the
    lowest rank on ties). A figure no rank had is None."""
    if not work:
        return None
    ranks = sorted(work)

    def total(i: int) -> float | None:
        values = [work[r][i] for r in ranks if work[r][i] is not None]
        return float(sum(values)) if values else None

    mfus = [(work[r][3], r) for r in ranks if work[r][3] is not None]
    low = min(mfus) if mfus else None
    return {"ranks": len(ranks), "tokens_per_s": total(0), "samples_per_s": total(1), "flops_per_s": total(2),
            "mean_mfu": sum(m for m, _ in mfus) / len(mfus) if mfus else None,
            "min_mfu": low[0] if low else None, "min_mfu_rank": low[1] if low else None, "mfu_ranks": len(mfus)}
