"""Step trace: where one step's time went between the data wait, forward/backward and tail.

S and E come from the step mark. F and B come from the producer's marks when it has
them; else F is the start of the first compute op in [S, E] (S if none) and B the end of
the last compute op in [S, E] (E if none).

    step_time = E - S    data_wait = F - S    fp_bp = B - F    tail = E - B
"""

from __future__ import annotations

from profstream.processors.model import StepEvents
from profstream.schema.batch import COMPUTE


def step_trace(ev: StepEvents) -> dict[str, int]:
    S, E = ev.start_ns, ev.end_ns
    start, end = ev.clipped_ops(COMPUTE)
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
