"""Device utilization: compute, communication, their overlap and idle time of one step.

Op intervals are clipped to [S, E]; overlapping ops of one kind count once (unions).

    utilization = |compute| / step_time      overlap = |compute ∩ comm|
    pure_comm = |comm| - overlap             idle = step_time - |compute ∪ comm|
    overlap_ratio = overlap / |comm| (0 without communication)
"""

from __future__ import annotations

from profstream.processors.intervals import intersection_length, union
from profstream.processors.model import StepEvents
from profstream.schema.batch import COMMUNICATION, COMPUTE


def utilization(ev: StepEvents) -> dict[str, int | float]:
    """Compute/communication figures of one step (ns, and ratios in [0, 1])."""
    step_time = ev.step_time_ns
    compute = union(*ev.clipped_ops(COMPUTE))
    comm = union(*ev.clipped_ops(COMMUNICATION))
    compute_ns = int((compute[1] - compute[0]).sum())
    comm_ns = int((comm[1] - comm[0]).sum())
    overlap_ns = intersection_length(*compute, *comm)
    busy_ns = compute_ns + comm_ns - overlap_ns  # |compute ∪ comm|
    return {
        "compute_ns": compute_ns,
        "comm_ns": comm_ns,
        "overlap_ns": overlap_ns,
        "pure_comm_ns": comm_ns - overlap_ns,
        "idle_ns": step_time - busy_ns,
        "utilization": compute_ns / step_time if step_time > 0 else 0.0,
        "overlap_ratio": overlap_ns / comm_ns if comm_ns > 0 else 0.0,
    }
