"""The window a step's figures are measured on: the host step [S, E], or the device's.

**Host window** (no op of the step carries a launch time: CPU runs, the simulator,
profiles without launch correlation). Op intervals are clipped to [S, E], and the part
of a compute or communication op that runs past E is carried into the steps after it
(``carry_past_end``, kept by the assembler), so that summed over the steps nothing is
lost at a boundary and nothing counted twice.

**Device window** (some op carries the host time of the call that launched it, as
torch.profiler and Kineto traces give: the producer put each device op in the step that
launched it). Consecutive device windows tile the device's timeline: a step's window
runs from the previous step's window end (when step - 1 had a device window; else from
the first device op that runs in it) to the end of its own last device op, D, or to the
previous window's end if that is later. Every device op that runs inside the window counts
for the window's time figures, whichever step launched it: the step's own ops, and
*ahead* ops, those that later steps launched early (a prefetch's copies, kernels on
another stream) while this step's work still ran. The parts of the step's own ops that
ran before its window (inside an earlier one) counted there. So each instant of device
time is in exactly one window, and summed over the steps the time figures equal those of
the whole device span. Each op still counts whole, in the step that launched it, in the
op types, kernel types and device kinds.

The assembler closes a device step only when no later step can add an ahead op to its
window: once a closed-ready step M (this one or a later one) has ended on the host at
least ``CLOCK_SKEW_NS`` after the window's end, since a step launches its device ops
after it starts on the host (no earlier than step M's end) and a device op starts after
its launch; or once the producer sent its end mark (no later step comes). Device ops
without a launch time in such a step are counted by the time rule (the producer put them
in the host step holding their start) and reported (``uncorrelated_ops``).

**Ascend** (the batch's device is ``npu`` or ``npu:N``): msprof's Overlap Analysis counts
only compute and communication tasks as busy, and spans a step from its first such task to
its last. So on an Ascend device window the step's own D, and a first window's W, come
from compute and communication ops (all its device ops where the step has none of them),
and idle is the time neither runs: a DMA copy between two kernels is free time there, as
in msprof's ``Free``. The windows still tile: from the second step on W is the previous
window's end, the previous step's last compute or communication task (the same rule as
torch_npu's step from its previous step's last task), and D is never before it; time
counts in the window it ran in. Copies and sets still count whole in ``device_kinds``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profstream import compiled
from profstream.processors.intervals import union
from profstream.processors.model import StepEvents
from profstream.schema.batch import COMMUNICATION, COMPUTE, MEMCPY, MEMSET, NO_VALUE

DEVICE_KINDS = (COMPUTE, COMMUNICATION, MEMCPY, MEMSET)
# How far a device op may seem to start before the call that launched it (clock
# granularity between host and device timestamps): ingest's tolerance (LAUNCH_TOLERANCE_NS);
# a later step's op starts no earlier than its host start less this.
CLOCK_SKEW_NS = 1_000_000
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


_IS_BUSY_KIND = np.zeros(256, bool)  # compute and communication: what msprof counts busy
_IS_BUSY_KIND[[COMPUTE, COMMUNICATION]] = True


def is_ascend_device(device: str) -> bool:
    """An Ascend device (``npu``, ``npu:N``): msprof's definitions of busy and of a step's span."""
    return device == "npu" or device.startswith("npu:")


def is_ascend(ev: StepEvents) -> bool:
    """``ev`` ran on an Ascend device (``is_ascend_device``)."""
    return is_ascend_device(ev.device)


def _bounding(kind: np.ndarray, dev: np.ndarray, ascend: bool) -> np.ndarray:
    """Of the device ops ``dev`` (a mask over ``kind``), those that bound a device window:
    all of them; on Ascend the compute and communication ones where there are any."""
    if ascend:
        busy = dev & _IS_BUSY_KIND[kind]
        if busy.any():
            return busy
    return dev


def _bounding_ops(ev: StepEvents) -> np.ndarray:
    """The step's own ops that bound its device window (``_bounding``)."""
    return _bounding(ev.op_kind, device_ops(ev), is_ascend(ev))


def device_window_end(kind: np.ndarray, start: np.ndarray, dur: np.ndarray, launch: np.ndarray,
                      prev_end: int, ascend: bool = False) -> int | None:
    """End of the device window of a step with these op columns (``prev_end``: the window
    end of step - 1, NO_VALUE if it had none; ``ascend``: on an Ascend device, where the
    step's compute and communication ops bound it); None when no op carries a launch time
    (a host window). The assembler decides with it when a step may close; ``step_window``
    gives the same end."""
    some = compiled.NATIVE.any_launched(launch) if compiled.NATIVE is not None else None
    if some is False:
        return None
    launched = launch >= 0
    if not launched.any():
        return None
    dev = _bounding(kind, _IS_DEVICE_KIND[kind] | launched, ascend)
    end = int((start[dev] + dur[dev]).max())
    return end if prev_end == NO_VALUE else max(end, prev_end)


def ahead_ops(kind: np.ndarray, start: np.ndarray, dur: np.ndarray, launch: np.ndarray,
              before_ns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, start, end) of a later step's device ops (kinds of DEVICE_KINDS) that start
    before ``before_ns``: what they add to an earlier step's device window."""
    sel = _IS_DEVICE_KIND[kind] & (start < before_ns)
    s = start[sel]
    return kind[sel], s, s + dur[sel]


def step_window(ev: StepEvents) -> Window:
    """The window of ``ev`` (see the module docstring)."""
    if not ev.any_launched():
        return Window(False, ev.start_ns, ev.end_ns)
    dev = _bounding_ops(ev)
    start = ev.op_start_ns[dev]
    end = int((start + ev.op_dur_ns[dev]).max())
    prev = ev.prev_device_end_ns
    if prev != NO_VALUE:
        return Window(True, prev, max(end, prev))
    first = int(start.min())
    # a first window starts at the first op that runs in it, of the kinds that bound it
    # (on Ascend with compute or communication of its own: those kinds)
    bounding = ev.ahead_start_ns < end
    if is_ascend(ev) and _IS_BUSY_KIND[ev.op_kind[dev]].any():
        bounding &= _IS_BUSY_KIND[ev.ahead_kind]
    ahead = ev.ahead_start_ns[bounding]
    return Window(True, min(first, int(ahead.min())) if len(ahead) else first, end)


def _clip(start: np.ndarray, end: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    start, end = np.maximum(start, lo), np.minimum(end, hi)
    keep = end > start
    return start[keep], end[keep]


def intervals(ev: StepEvents, kind: int, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the ops of ``kind`` that ``window`` counts: on a device window every
    such op running inside it (the step's own and its ahead ops), clipped to it; on a host
    window the step's, clipped to [S, E], with what earlier steps carried past their end."""
    if window.device:
        sel = ev.op_kind == kind
        start = ev.op_start_ns[sel]
        end = start + ev.op_dur_ns[sel]
        mine = ev.ahead_kind == kind
        if mine.any():
            start = np.concatenate((start, ev.ahead_start_ns[mine]))
            end = np.concatenate((end, ev.ahead_end_ns[mine]))
        return _clip(start, end, window.start_ns, window.end_ns)
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
    what the next steps count. Nothing for a device window (its ops count in the windows
    they ran in)."""
    empty = (np.empty(0, _I64), np.empty(0, _I64))
    if ev.any_launched():
        return empty, empty
    E = ev.end_ns
    if compiled.NATIVE is not None:
        past = compiled.NATIVE.past_end(ev.op_kind, ev.op_start_ns, ev.op_dur_ns, E, COMPUTE, COMMUNICATION,
                                       *ev.carried_compute, *ev.carried_comm)
        if past is not None:  # (the union's starts, its ends) of each kind, as int64 bytes
            return tuple((np.frombuffer(past[i], _I64), np.frombuffer(past[i + 1], _I64)) if past[i] else empty
                         for i in (0, 2))
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
