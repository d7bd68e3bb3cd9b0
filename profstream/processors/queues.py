"""Data-queue health of one step, per queue: sizes over the step and at its start."""

from __future__ import annotations

import numpy as np

from profstream import compiled
from profstream.processors.model import StepEvents


def queue_figures(ev: StepEvents) -> list[dict[str, int | float | str | None]]:
    """``[{queue, min, mean, last, at_start, empty_ratio}]``, one per queue, by name.

    min, mean, last and empty_ratio (share of samples at size 0) are over the queue's
    samples with ts in [S, E]; a queue without such samples is left out. at_start is the
    size of the last sample at or before S among all the step's samples of that queue
    (a sample taken at S counts), None when there is none. Samples of equal ts are taken
    in the order received.
    """
    ts, size, codes = ev.queue_ts_ns, ev.queue_size, ev.queue
    if compiled.NATIVE is not None:
        rows = compiled.NATIVE.queue_sizes(codes, ts, size, ev.start_ns, ev.end_ns)
        if rows is not None:  # the sums are exact: sum / count is numpy's mean to the bit
            figures = [{"queue": ev.queue_names[code], "min": low, "mean": total / n, "last": last,
                        "at_start": at_start, "empty_ratio": zeros / n}
                       for code, low, total, n, last, at_start, zeros in rows]
            figures.sort(key=lambda f: f["queue"])
            return figures
    if not (ts[1:] >= ts[:-1]).all():  # mostly in time order already: then the sort is the identity
        order = np.lexsort((np.arange(len(ts)), ts))  # by time, then as received
        codes, ts, size = codes[order], ts[order], size[order]
    inside = (ts >= ev.start_ns) & (ts <= ev.end_ns)
    figures = []
    present = codes[inside]
    if len(present) and (present == present[0]).all():  # one queue (the common case): no np.unique
        present = present[:1]
    else:
        present = np.unique(present)
    for code in present:  # a handful of queues, not a loop over samples
        mine = codes == code
        sizes = size[mine & inside]
        before = size[mine & (ts <= ev.start_ns)]
        figures.append({
            "queue": ev.queue_names[code],
            "min": int(sizes.min()),
            "mean": float(sizes.mean()),
            "last": int(sizes[-1]),
            "at_start": int(before[-1]) if len(before) else None,
            "empty_ratio": float(np.count_nonzero(sizes == 0) / len(sizes)),
        })
    figures.sort(key=lambda f: f["queue"])
    return figures
