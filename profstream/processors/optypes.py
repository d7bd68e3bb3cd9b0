"""Operator cost per op type: summed duration and count, top K by time plus "other"."""

from __future__ import annotations

import numpy as np

from profstream.processors.model import StepEvents

OTHER = "other"


def op_type_costs(ev: StepEvents, top_k: int = 10) -> list[dict[str, int | str]]:
    """``[{op_type, total_ns, count}]`` of the step, most expensive first.

    An op belongs to the step when its start lies in [S, E); it counts with its own full
    ``dur_ns`` (not clipped), so the figures are the profiler's op durations. The ``top_k``
    types with the largest total (ties: by name) are listed; the rest, if any, are summed
    into one entry named "other".
    """
    if top_k < 0:
        raise ValueError("top_k must be >= 0")
    sel = (ev.op_start_ns >= ev.start_ns) & (ev.op_start_ns < ev.end_ns)
    codes = ev.op_type[sel]
    n_types = len(ev.type_names)
    totals = np.bincount(codes, weights=ev.op_dur_ns[sel], minlength=n_types)
    counts = np.bincount(codes, minlength=n_types)
    present = np.flatnonzero(counts)
    names = np.array(ev.type_names, dtype=str)[present]
    # bincount weights are float64: exact for sums below 2**53 ns (104 days).
    totals = totals[present].astype(np.int64)
    counts = counts[present]
    order = np.lexsort((names, -totals))
    top, rest = order[:top_k], order[top_k:]
    costs: list[dict[str, int | str]] = [
        {"op_type": str(names[i]), "total_ns": int(totals[i]), "count": int(counts[i])}
        for i in top
    ]
    if len(rest):
        costs.append({"op_type": OTHER, "total_ns": int(totals[rest].sum()),
                      "count": int(counts[rest].sum())})
    return costs
