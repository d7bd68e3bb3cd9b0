"""Device memory of one step: peak, and allocated and reserved at the step's end."""

from __future__ import annotations

import numpy as np

from profstream import compiled
from profstream.processors.model import StepEvents


def memory_figures(ev: StepEvents) -> dict[str, int] | None:
    """``{peak, allocated, reserved}`` in bytes from the samples with ts in [S, E].

    peak is the largest reported peak (values >= 0) of those samples, else the largest
    allocated. allocated and reserved are those of the last sample at or before E (ties
    in ts: the last one received); reserved is -1 when that sample has none. None when
    no sample lies in the step.
    """
    ts = ev.mem_ts_ns
    if compiled.NATIVE is not None:
        got = compiled.NATIVE.memory_at(ts, ev.mem_peak, ev.mem_allocated, ev.mem_reserved, ev.start_ns, ev.end_ns)
        if got is not None:
            return {"peak": got[0], "allocated": got[1], "reserved": got[2]} if got else None
    inside = np.flatnonzero((ts >= ev.start_ns) & (ts <= ev.end_ns))
    if len(inside) == 0:
        return None
    reported = ev.mem_peak[inside]
    reported = reported[reported >= 0]
    peak = reported.max() if len(reported) else ev.mem_allocated[inside].max()
    # last sample: greatest ts, and of equal ts the one that came last
    last = inside[len(inside) - 1 - np.argmax(ts[inside][::-1])]
    return {
        "peak": int(peak),
        "allocated": int(ev.mem_allocated[last]),
        "reserved": int(ev.mem_reserved[last]),
    }
