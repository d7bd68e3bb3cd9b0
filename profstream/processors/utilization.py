"""Device utilization: compute, communication, their overlap and idle time of one step.

Measured on the step's window (``window.py``): on the host window op intervals are
clipped to [S, E] and include what earlier steps carried past their end; on a device
window the step's device ops count whole. Overlapping ops of one kind count once (unions).

    utilization = |compute| / step_time      overlap = |compute ∩ comm|
    pure_comm = |comm| - overlap             idle = step_time - |busy|
    overlap_ratio = overlap / |comm| (0 without communication)

busy is compute ∪ comm on the host window; on a device window every device op (copies
and sets too), so that idle is the time no device op runs, as in Holistic Trace Analysis.

A step without any op event of its own was not measured (its ops were not captured: op
capture off, or a step between ``every_n_steps`` captures): every figure here is None
then, never 0.
"""

from __future__ import annotations

from profstream import compiled
from profstream.processors.intervals import total, union, union_intersection_length
from profstream.processors.model import StepEvents
from profstream.processors.window import Window, busy_intervals, intervals, step_window
from profstream.schema.batch import COMMUNICATION, COMPUTE
from profstream.schema.codec import OP_FIGURES

NOT_MEASURED: dict[str, None] = dict.fromkeys(OP_FIGURES)


def ops_measured(ev: StepEvents) -> bool:
    """Whether the step's ops were captured: it has op events of its own."""
    return len(ev.op_kind) > 0


def utilization(ev: StepEvents, window: Window | None = None) -> dict[str, int | float | None]:
    """Compute/communication figures of one step (ns, and ratios in [0, 1]) on ``window``
    (default: ``step_window(ev)``); ``NOT_MEASURED`` (all None) for a step without ops."""
    if not ops_measured(ev):
        return NOT_MEASURED
    w = window or step_window(ev)
    step_time = w.length_ns
    lengths = _compiled_lengths(ev, w) if compiled.NATIVE is not None else None
    if lengths is not None:
        compute_ns, comm_ns, overlap_ns = lengths
    else:
        compute = union(*intervals(ev, COMPUTE, w))
        comm = union(*intervals(ev, COMMUNICATION, w))
        compute_ns = int((compute[1] - compute[0]).sum())
        comm_ns = int((comm[1] - comm[0]).sum())
        overlap_ns = union_intersection_length(*compute, *comm)
    if w.device:
        busy_ns = total(*busy_intervals(ev, w))
    else:
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


def _compiled_lengths(ev: StepEvents, w: Window) -> tuple[int, int, int] | None:
    """(|compute|, |comm|, |compute ∩ comm|) of ``intervals`` on ``w``, by the compiled
    kernel (None where it does not take the columns: the numpy path then)."""
    if w.device:  # the ahead ops of each kind, beside the step's own
        extra_compute = (ev.ahead_start_ns[ev.ahead_kind == COMPUTE], ev.ahead_end_ns[ev.ahead_kind == COMPUTE])
        extra_comm = (ev.ahead_start_ns[ev.ahead_kind == COMMUNICATION],
                      ev.ahead_end_ns[ev.ahead_kind == COMMUNICATION])
    else:  # what earlier steps carried past their end
        extra_compute, extra_comm = ev.carried_compute, ev.carried_comm
    return compiled.NATIVE.kind_overlap(ev.op_kind, ev.op_start_ns, ev.op_dur_ns, w.start_ns, w.end_ns, COMPUTE,
                                       COMMUNICATION, *extra_compute, *extra_comm)
