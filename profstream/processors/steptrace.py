"""Step trace: where one step's time went between the data wait, forward/backward and tail.

On the host window (``window.py``), S and E come from the step mark; F and B come from
the producer's marks when it has them, else F is the start of the first compute op in
[S, E] (S if none) and B the end of the last compute op in [S, E] (E if none).

    step_time = E - S    data_wait = F - S    fp_bp = B - F    tail = E - B

On a device window [W, D] the phases follow MindSpore's device-side step trace, on the
step's compute ops as far as they ran inside the window (a compute op the step launched
early that ran in the previous step's window counted there): F is the start of the first
(W if none), B the end of the last (D if none). W is the previous step's window end, so
data_wait is the device's iteration interval (from the previous step's last device op to
this step's forward).

    step_time = D - W    data_wait = F - W    fp_bp = B - F    tail = D - B
"""

from __future__ import annotations

import numpy as np

from profstream.processors.model import StepEvents
from profstream.processors.window import Window, step_window
from profstream.schema.batch import COMPUTE


def step_trace(ev: StepEvents, window: Window | None = None) -> dict[str, int]:
    """The four phase figures of ``ev`` on ``window`` (default: ``step_window(ev)``)."""
    w = window or step_window(ev)
    if w.device:
        sel = ev.op_kind == COMPUTE
        W, D = w.start_ns, w.end_ns
        start = ev.op_start_ns[sel]
        end = np.minimum(start + ev.op_dur_ns[sel], D)
        start = np.maximum(start, W)
        inside = end > start
        F = int(start[inside].min()) if inside.any() else W
        B = int(end[inside].max()) if inside.any() else D
        return {"step_time_ns": D - W, "data_wait_ns": F - W, "fp_bp_ns": B - F, "tail_ns": D - B}
    S, E = ev.start_ns, ev.end_ns
    # the compute ops only where a mark is missing (the Monitor's marks carry both: ~6 us of
    # numpy calls a step saved)
    start, end = ev.clipped_ops(COMPUTE) if ev.fp_start_ns < 0 or ev.bp_end_ns < 0 else (None, None)
    if ev.fp_start_ns >= 0:
        F = min(max(ev.fp_start_ns, S), E)
    else:
        F = int(start.min()) if len(start) else S
    if ev.bp_end_ns >= 0:
        B = min(max(ev.bp_end_ns, F), E)
    else:
        B = int(end.max()) if len(end) else E
    return {
        "step_time_ns": E - S,
        "data_wait_ns": F - S,
        "fp_bp_ns": B - F,
        "tail_ns": E - B,
    }
