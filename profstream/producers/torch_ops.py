"""torch.profiler events -> profstream op columns.

A captured step's kineto events are reduced to the ops that partition its time: every
device-side activity (kernels, copies, sets) and, per CPU thread, the outermost CPU op
(``aten::linear`` but not the ``aten::addmm`` inside it; the autograd node
``AddmmBackward0`` but not its ``aten::mm``), so that summing ops by type never counts
the same nanosecond twice. User annotations (``ProfilerStep#N``, ``Optimizer.step#...``,
``record_function`` blocks) are not ops and are left out; the ops inside them stay.

Kinds: collectives (nccl, gloo, all_reduce, broadcast, all_gather, reduce_scatter,
all_to_all, c10d) are communication; device copies memcpy; device sets memset; other
device activities compute; CPU ops are host when the run has a device and compute on a
CPU-only run, where the aten ops are the compute; CPU ops that end before the step's
forward start are the batch being loaded and get the kind data.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from profstream.schema.batch import COMMUNICATION, COMPUTE, DATA, HOST, MEMCPY, MEMSET

_COMM_RE = re.compile(
    r"nccl|gloo|c10d|all_?reduce|broadcast(?!_(?:tensors|to|shapes))|all_?gather|reduce_?scatter|"
    r"all_?to_?all|send_?recv|barrier", re.IGNORECASE)
_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "
# Host streams are numbered from here on device runs, so they never meet a device stream id.
HOST_STREAM_BASE = 1_000_000
# A profiler clock more than a day away from the epoch clock is taken for a monotonic one.
_EPOCH_TOLERANCE_NS = 86_400 * 10**9


def op_kind(name: str, on_device: bool, activity: str, run_has_device: bool) -> int:
    """Kind code of one profiler event (see the module docstring)."""
    if on_device:
        if _COMM_RE.search(name):
            return COMMUNICATION
        low = activity.lower()
        if "memcpy" in low or name.startswith("Memcpy"):
            return MEMCPY
        if "memset" in low or name.startswith("Memset"):
            return MEMSET
        return COMPUTE
    if run_has_device:
        return HOST
    return COMMUNICATION if _COMM_RE.search(name) else COMPUTE


def op_type(name: str) -> str:
    """A short type for an event name: the autograd node of an engine call, a kernel's
    function name without its template arguments and parameters."""
    if name.startswith(_AUTOGRAD_PREFIX):
        return name[len(_AUTOGRAD_PREFIX):]
    if "<" in name or "(" in name:
        cut = min(i for i in (name.find("<"), name.find("(")) if i >= 0)
        short = name[:cut].strip()
        if short.startswith("void "):
            short = short[5:]
        return short or name
    return name


def clock_offset_ns(profiler_ns: int, epoch_ns: int | None = None, monotonic_ns: int | None = None) -> int:
    """What to add to the profiler's timestamps to get nanoseconds since the epoch.

    Recent torch versions report epoch time already (offset 0); a profiler on a
    monotonic clock is moved by the current epoch - monotonic difference."""
    epoch_ns = time.time_ns() if epoch_ns is None else epoch_ns
    if abs(profiler_ns - epoch_ns) < _EPOCH_TOLERANCE_NS:
        return 0
    monotonic_ns = time.monotonic_ns() if monotonic_ns is None else monotonic_ns
    return epoch_ns - monotonic_ns


class RawEvent(NamedTuple):
    """The fields of one profiler event that become an op."""

    name: str
    start_ns: int
    dur_ns: int
    thread: int  # CPU thread id, or the device stream for device events
    on_device: bool
    activity: str
    annotation: bool


def raw_events(kineto_events: Iterable[Any]) -> list[RawEvent]:
    """Read the fields we need from torch's ``_KinetoEvent`` objects."""
    from torch.autograd import DeviceType

    cpu = DeviceType.CPU
    out = []
    for e in kineto_events:
        on_device = e.device_type() != cpu
        out.append(RawEvent(e.name(), e.start_ns(), e.duration_ns(),
                            e.device_resource_id() if on_device else e.start_thread_id(),
                            on_device, str(e.activity_type()) if on_device else "cpu_op",
                            e.is_user_annotation()))
    return out


class OpColumns(NamedTuple):
    names: list[str]
    op_types: list[str]
    kinds: np.ndarray
    streams: np.ndarray
    start_ns: np.ndarray
    dur_ns: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


class HostThreads:
    """Stable small stream numbers for CPU threads, in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}

    def stream(self, thread: int, run_has_device: bool) -> int:
        n = self._ids.setdefault(thread, len(self._ids))
        return HOST_STREAM_BASE + n if run_has_device else n


def to_op_columns(events: Sequence[RawEvent], run_has_device: bool, offset_ns: int = 0,
                  threads: HostThreads | None = None, data_until_ns: int | None = None) -> OpColumns:
    """The ops of a captured window: device events and outermost CPU ops, on the epoch clock.

    CPU ops that end by ``data_until_ns`` (epoch clock: the step's forward start) load
    the batch and get the kind data."""
    threads = threads or HostThreads()
    cpu = [e for e in events if not e.on_device and not e.annotation and e.dur_ns >= 0]
    keep = [e for e in events if e.on_device and not e.annotation and e.dur_ns >= 0]
    if cpu:
        thread = np.fromiter((e.thread for e in cpu), np.int64, len(cpu))
        start = np.fromiter((e.start_ns for e in cpu), np.int64, len(cpu))
        dur = np.fromiter((e.dur_ns for e in cpu), np.int64, len(cpu))
        order = np.lexsort((-dur, start, thread))  # by thread, then start, longest first
        t, s = thread[order], start[order]
        ends = s + dur[order]
        new_thread = np.ones(len(t), bool)
        new_thread[1:] = t[1:] != t[:-1]
        # An op is outermost when it starts at or after the end of every earlier op of its
        # thread (nested ops end inside their parent; a new thread starts afresh).
        outer = order[(s >= _prev_max_end(ends, new_thread)) | new_thread]
        keep.extend(cpu[i] for i in np.sort(outer))
    n = len(keep)
    names = [e.name for e in keep]
    start = np.fromiter((e.start_ns for e in keep), np.int64, n) + offset_ns
    dur = np.fromiter((e.dur_ns for e in keep), np.int64, n)
    kinds = np.fromiter((op_kind(e.name, e.on_device, e.activity, run_has_device) for e in keep), np.uint8, n)
    if data_until_ns is not None:
        on_host = np.fromiter((not e.on_device for e in keep), bool, n)
        kinds[on_host & (start + dur <= data_until_ns)] = DATA
    return OpColumns(
        names=names,
        op_types=[op_type(nm) for nm in names],
        kinds=kinds,
        streams=np.fromiter((e.thread if e.on_device else threads.stream(e.thread, run_has_device)
                             for e in keep), np.int32, n),
        start_ns=start,
        dur_ns=dur,
    )


def _prev_max_end(end: np.ndarray, new_thread: np.ndarray) -> np.ndarray:
    """For each row, the largest end among the earlier rows of the same thread segment."""
    prev = np.full(len(end), np.iinfo(np.int64).min, np.int64)
    starts = np.flatnonzero(new_thread)
    bounds = np.append(starts, len(end))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi - lo > 1:
            prev[lo + 1:hi] = np.maximum.accumulate(end[lo:hi - 1])
    return prev
