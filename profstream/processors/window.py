"""The window a step's figures are measured on: the host step [S, E], or the device's.

**Host window** (no op of the step carries a launch time: CPU runs, the simulator,
profiles without launch correlation). Op intervals are clipped to [S, E], and the part
of a compute or communication op that runs past E is carried into the steps after it
(``carry_past_end``, kept by the assembler), so that summed over the steps nothing is
lost at a boundary and nothing counted twice.

**Device window** (some op carries the host time of the call that launched it, as
torch.profiler and Kineto traces give: the producer put each device op in the step that
launched it). The step's device ops (kinds compute, communication, memcpy, memset) count
whole, wherever on the device clock they ran. The window ends at the end of the step's
last device op, D; it starts at the previous step's D when that step (step - 1) had a
device window, as MindSpore's device-side step trace runs from one iteration's end to
the next, else at the step's first device op. When the step's first device op started
before the previous step's D (the two steps' device work interleaved) the window starts
there instead. Device ops without a launch time in such a step are counted by the time
rule (the producer put them in the host step holding their start) and reported
(``uncorrelated_ops``).

**Ascend** (the batch's device is ``npu`` or ``npu:N``): msprof's Overlap Analysis counts
only compute and communication tasks as busy, and spans a step from its first such task to
its last. So on an Ascend device window W and D come from the step's compute and
communication ops (all its device ops where it has none of them), and idle is the time
neither runs: a DMA copy between two kernels is free time there, as in msprof's ``Free``.
Copies and sets still count in ``device_kinds``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profstream.processors.intervals import union
from profstream.processors.model import StepEvents
from profstream.schema.batch import COMMUNICATION, COMPUTE, MEMCPY, MEMSET, NO_VALUE

DEVICE_KINDS = (COMPUTE, COMMUNICATION, MEMCPY, MEMSET)
_I64 = np.int64
_IS_DEVICE_KIND = np.zeros(256, bool)  # by u8 kind code: a lookup, cheaper than np.isin
_IS_DEVICE_KIND[list(DEVICE_KINDS)] = True


@dataclass(frozen=True)
class Window:
    device: bool  # a device window (else the host step [S, E])
    start_ns: int
    end_ns: int

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


def device_ops(ev: StepEvents) -> np.ndarray:
    """Per op: a device op (kind compute, communication, memcpy or memset, or launched)."""
    return _IS_DEVICE_KIND[ev.op_kind] | ev.launched


def is_ascend(ev: StepEvents) -> bool:
    """An Ascend device (``npu``, ``npu:N``): msprof's definitions of busy and of a step's span."""
    return ev.device == "npu" or ev.device.startswith("npu:")


def _bounding_ops(ev: StepEvents) -> np.ndarray:
    """The ops that bound a device window: every device op; on Ascend the compute and
    communication ones where the step has any."""
    dev = device_ops(ev)
    if is_ascend(ev):
        busy = dev & ((ev.op_kind == COMPUTE) | (ev.op_kind == COMMUNICATION))
        if busy.any():
            return busy
    return dev


def step_window(ev: StepEvents) -> Window:
    """The window of ``ev`` (see the module docstring)."""
    launched = ev.launched
    if not launched.any():
        return Window(False, ev.start_ns, ev.end_ns)
    dev = _bounding_ops(ev)
    start = ev.op_start_ns[dev]
    first = int(start.min())
    last = int((start + ev.op_dur_ns[dev]).max())
    prev = ev.prev_device_end_ns
    return Window(True, min(prev, first) if prev != NO_VALUE else first, last)


def intervals(ev: StepEvents, kind: int, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the step's ops of ``kind`` as ``window`` counts them: a device
    window's whole; a host window's clipped to [S, E], with what earlier steps carried."""
    sel = ev.op_kind == kind
    if window.device:
        start = ev.op_start_ns[sel]
        return start, start + ev.op_dur_ns[sel]
    start, end = ev.clipped_ops(kind)
    carried = ev.carried_compute if kind == COMPUTE else ev.carried_comm if kind == COMMUNICATION else None
    if carried is not None and len(carried[0]):
        c_start = np.maximum(carried[0], ev.start_ns)
        c_end = np.minimum(carried[1], ev.end_ns)
        keep = c_end > c_start
        start, end = np.concatenate((start, c_start[keep])), np.concatenate((end, c_end[keep]))
    return start, end


def busy_intervals(ev: StepEvents, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """What keeps the device busy: compute and communication in a host window and on an
    Ascend device; every device op (copies and sets too, as Holistic Trace Analysis counts)
    in another device window."""
    kinds = DEVICE_KINDS if window.device and not is_ascend(ev) else (COMPUTE, COMMUNICATION)
    parts = [intervals(ev, k, window) for k in kinds]
    return union(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def carry_past_end(ev: StepEvents) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(compute, communication) of a host-window step that lies past its E, as unions:
    what the next steps count. Nothing for a device window (its ops count whole)."""
    empty = (np.empty(0, _I64), np.empty(0, _I64))
    if ev.launched.any():
        return empty, empty
    E = ev.end_ns
    past = np.flatnonzero(ev.op_start_ns + ev.op_dur_ns > E)  # usually none: one pass over the ops
    kinds = ev.op_kind[past]
    out = []
    for kind, carried in ((COMPUTE, ev.carried_compute), (COMMUNICATION, ev.carried_comm)):
        mine = past[kinds == kind]
        c_past = carried[1] > E
        if not len(mine) and not c_past.any():
            out.append(empty)
            continue
        start = np.concatenate((ev.op_start_ns[mine], carried[0][c_past]))
        end = np.concatenate((ev.op_start_ns[mine] + ev.op_dur_ns[mine], carried[1][c_past]))
        out.append(union(np.maximum(start, E), end))
    return out[0], out[1]


def uncorrelated_ops(ev: StepEvents, window: Window) -> int:
    """Device ops of a device-window step without a launch time (counted by the time rule)."""
    if not window.device:
        return 0
    return int(np.count_nonzero(_IS_DEVICE_KIND[ev.op_kind] & ~ev.launched))
