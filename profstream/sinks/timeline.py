"""Timeline files: Chrome Trace Event Format (JSON, gzip) per run, rank and window of steps.

Three layers, usable apart (replay and offline tools take the first two):

- ``timeline_events(steps)``: the trace events of closed steps as dicts, a pure function.
  ``step_timeline(ev)`` builds the columnar form both renderers share.
- ``TimelineWriter``: the same events as JSON text, built from numpy arrays (no
  per-event Python work), gzipped and written atomically: a temporary name, then a
  rename. A window larger than ``max_bytes`` (of JSON text) is split, never cut.
- ``TimelineSink``: a ``SinkLoop`` sink on the raw topic. One ``RankAssembler`` per
  (run, rank) gathers steps; closed steps wait in a window until ``window_steps`` or
  ``max_bytes`` is reached; ``durable_offsets()`` never passes a batch whose steps are
  not in a renamed file yet.

Layout: ``<out>/<run_id>/rank-<rank>/steps-<first>-<last>.json.gz`` (a step too big for
one file: ``steps-<k>-<k>.part<i>of<n>.json.gz``), and ``<out>/<run_id>/stacks.json.gz``,
the run's latest stacks (``timeline_stacks.py``). Timestamps are microseconds since the
UTC midnight before the window's first step (``otherData.base_time_ns``), so that a
float64 keeps every nanosecond; docs/timeline.md describes the tracks.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from profstream.config import ConfigError, check_name
from profstream.processors.assembler import RankAssembler
from profstream.processors.close_schedule import CloseSchedule
from profstream.processors.intervals import union
from profstream.processors.model import StepEvents
from profstream.processors.steptrace import step_trace
from profstream.processors.utilization import ops_measured
from profstream.processors.window import Window as StepWindow
from profstream.processors.window import intervals, step_window
from profstream.schema.batch import COMMUNICATION, COMPUTE, KIND_NAMES, decode_batch
from profstream.schema.codec import DecodeError, decode, is_rank_progress
from profstream.sinks.gzfile import write_gzip_atomic
from profstream.sinks.timeline_collectives import (
    TID_COLLECTIVES,
    TRACK_NAME,
    Arrivals,
    collective_slices,
    slice_columns,
)
from profstream.sinks.timeline_devices import device_counter_events
from profstream.sinks.timeline_host import host_counter_events
from profstream.sinks.timeline_stacks import StacksFiles
from profstream.sinks.timeline_work import work_counter_events

log = logging.getLogger("profstream.sink.timeline")

DEFAULT_WINDOW_STEPS = 100
DEFAULT_MAX_BYTES = 20 * 1000**2
MIN_MAX_BYTES = 16 * 1024
DEFAULT_COMPRESSLEVEL = 1

# pid = rank + 1: Perfetto treats pid 0 as the kernel's swapper. Tids 1-6 are the
# analysis tracks; stream s is tid 100 + s (a negative stream: 2**32 + s).
TID_STEPS, TID_COMPUTE, TID_COMM, TID_PURE_COMM, TID_FREE = 1, 2, 3, 4, 5
TID_DEVICE_STEPS = 6  # steps measured on the device's window, beside the host's Steps
# TID_COLLECTIVES = 7: each collective call's wait and transfer (timeline_collectives.py)
STREAM_TID_BASE = 100
OVERLAP_TRACKS = ((TID_COMPUTE, "compute", "Overlap: merged compute"),
                  (TID_COMM, "communication", "Overlap: merged communication"),
                  (TID_PURE_COMM, "pure communication", "Overlap: pure communication"),
                  (TID_FREE, "free", "Overlap: free"))
PHASES = ("data_wait", "fp_bp", "tail")
_DAY_NS = 86_400 * 10**9
_FILE_RE = re.compile(r"^steps-(-?\d+)-(-?\d+)(?:\.part(\d+)of(\d+))?\.json\.gz$")


class UnsafePath(ValueError):
    """A run id or a link under the output directory would put a file outside it."""


def pid_of(rank: int) -> int:
    return rank + 1


def stream_tid(stream: int) -> int:
    return STREAM_TID_BASE + stream if stream >= 0 else 2**32 + stream


def midnight_ns(ts_ns: int) -> int:
    """The UTC midnight at or before ``ts_ns``: the origin (``base_time_ns``) of a file's
    ``ts``, which keeps them below 2**42 us for 50 days, where a float64 still holds ns."""
    return ts_ns // _DAY_NS * _DAY_NS


# -- the events of one step, as columns ------------------------------------------------

# A complete event's head, everything but ts and dur: (name, cat, tid, op_type or None).
# pid and step come from the step; ``head_event`` turns a head into the event's fields.
Head = tuple[str, str, int, "str | None"]


def head_event(head: Head, pid: int, step: int) -> dict:
    name, cat, tid, op_type = head
    args = {"op_type": op_type, "step": step} if op_type is not None else {"step": step}
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "args": args}


@dataclass
class StepTimeline:
    """The trace events of one step. Complete events ("X") are columns: event i is
    ``heads[head[i]]`` with ``ts`` from ``x_start_ns[i]`` and ``dur`` from ``x_dur_ns[i]``."""

    run_id: str
    rank: int
    step: int
    start_ns: int
    heads: list[Head]
    head: np.ndarray
    x_start_ns: np.ndarray
    x_dur_ns: np.ndarray
    counters: list[tuple[dict, int]]  # (event without ts, ts_ns)
    tids: set[int]
    ops: int  # events [0, ops) are the ops; their heads are heads[:op_heads]
    op_heads: int
    host: str = ""
    device: str = ""


def overlap_tracks(ev: StepEvents, window: StepWindow | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Merged compute, merged communication, pure communication and free time of a step,
    as (start, end) intervals inside its window (``processors.window``: [S, E], or the
    device's): the intervals behind utilization's figures.

    One sweep over the boundaries of both unions and of the window: between two boundaries
    the time is covered by compute, by communication alone, or by neither (free). A step
    whose ops were not captured has no track: its time is not known to be free."""
    if not ops_measured(ev):
        return [_NO_INTERVALS] * 4
    w = window or step_window(ev)
    S, E = w.start_ns, w.end_ns
    compute = union(*intervals(ev, COMPUTE, w))
    comm = union(*intervals(ev, COMMUNICATION, w))
    if E <= S:
        return [compute, comm, comm, comm]  # nothing but empty intervals
    (cs, ce), (ms, me) = compute, comm
    sizes = (len(cs), len(ce), len(ms), len(me), 2)
    points = np.concatenate((cs, ce, ms, me, (S, E)))
    order = np.argsort(points, kind="stable")
    points = points[order]
    in_compute = np.cumsum(np.repeat(_COMPUTE_DELTA, sizes)[order])[:-1] > 0
    in_comm = np.cumsum(np.repeat(_COMM_DELTA, sizes)[order])[:-1] > 0
    start, end = points[:-1], points[1:]
    idle = (end > start) & ~in_compute
    pure, free = idle & in_comm, idle & ~in_comm
    return [compute, comm, (start[pure], end[pure]), (start[free], end[free])]


_NO_INTERVALS = (np.empty(0, np.int64), np.empty(0, np.int64))
_COMPUTE_DELTA = np.array([1, -1, 0, 0, 0], np.int64)  # per boundary kind: compute start, end,
_COMM_DELTA = np.array([0, 0, 1, -1, 0], np.int64)  # communication start, end, S or E


def step_timeline(ev: StepEvents, arrivals: Arrivals | None = None) -> StepTimeline:
    """Ops per stream, the Steps track, the overlap tracks, the counters and, with the
    run's ``arrivals``, the Collectives track of one step."""
    pid, step, S, E = pid_of(ev.rank), ev.step, ev.start_ns, ev.end_ns
    heads: list[Head] = []
    heads_idx: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    durs: list[np.ndarray] = []

    n = len(ev.op_kind)
    tids = {TID_STEPS, *(t for t, _, _ in OVERLAP_TRACKS)}
    if n:  # one head per (type, kind, stream) of the step
        key = ((ev.op_type.astype(np.int64) << 40) | (ev.op_kind.astype(np.int64) << 32)
               | (ev.op_stream.astype(np.int64) & 0xFFFFFFFF))
        ordered = np.sort(key)
        combos = ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
        inverse = np.searchsorted(combos, key)
        for c in combos.tolist():
            type_name = ev.type_names[c >> 40]
            kind = (c >> 32) & 0xFF
            stream = c & 0xFFFFFFFF
            tid = stream_tid(stream - 2**32 if stream >= 2**31 else stream)
            tids.add(tid)
            heads.append((type_name, KIND_NAMES[kind] if kind < len(KIND_NAMES) else f"kind-{kind}", tid, type_name))
        heads_idx.append(inverse)
        starts.append(ev.op_start_ns)
        durs.append(ev.op_dur_ns)

    op_heads = len(heads)
    window = step_window(ev)
    trace = step_trace(ev, window)
    W, D = window.start_ns, window.end_ns  # [S, E], or the device's window
    F = W + trace["data_wait_ns"]
    B = F + trace["fp_bp_ns"]
    steps_tid = TID_DEVICE_STEPS if window.device else TID_STEPS
    if window.device:  # the host step alone on Steps, the phases on Device steps
        heads_idx.append(np.array([len(heads)]))
        heads.append((f"step {step}", "step", TID_STEPS, None))
        starts.append(np.array([S], np.int64))
        durs.append(np.array([E - S], np.int64))
        tids.add(TID_DEVICE_STEPS)
    heads_idx.append(np.arange(len(heads), len(heads) + 4))
    heads.append((f"step {step}", "device_step" if window.device else "step", steps_tid, None))
    heads += [(p, "step_phase", steps_tid, None) for p in PHASES]
    starts.append(np.array([W, W, F, B], np.int64))
    durs.append(np.array([D - W, F - W, B - F, D - B], np.int64))

    for (tid, name, _), (start, end) in zip(OVERLAP_TRACKS, overlap_tracks(ev, window)):
        heads_idx.append(np.full(len(start), len(heads)))
        heads.append((name, "overlap", tid, None))
        starts.append(start)
        durs.append(end - start)

    slices = collective_slices(ev, arrivals)
    if slices:
        names, idx, start, dur = slice_columns(slices)
        heads_idx.append(idx + len(heads))
        heads += [(name, cat, TID_COLLECTIVES, None) for name, cat in names]
        starts.append(start)
        durs.append(dur)
        tids.add(TID_COLLECTIVES)

    counters: list[tuple[dict, int]] = []
    memory = zip(ev.mem_ts_ns.tolist(), ev.mem_allocated.tolist(), ev.mem_reserved.tolist(), ev.mem_peak.tolist())
    for ts, *values in memory:
        for what, value in zip(("allocated", "reserved", "peak"), values):
            if value >= 0:  # -1: not reported
                counters.append(({"ph": "C", "name": f"memory {what}", "pid": pid, "args": {"bytes": value}}, ts))
    for q, ts, size in zip(ev.queue.tolist(), ev.queue_ts_ns.tolist(), ev.queue_size.tolist()):
        counters.append(({"ph": "C", "name": f"queue {ev.queue_names[q]}", "pid": pid, "args": {"size": size}}, ts))
    counters += device_counter_events(ev, pid)
    counters += work_counter_events(ev, pid, window, trace["step_time_ns"])
    counters += host_counter_events(ev, pid)

    # on the run's clock: every time of the rank less its clock offset, where one is known
    shift = arrivals.clock_offset(ev.rank) if arrivals is not None else 0
    if shift:
        counters = [(e, ts - shift) for e, ts in counters]
    return StepTimeline(ev.run_id, ev.rank, step, S - shift, heads, np.concatenate(heads_idx),
                        np.concatenate(starts, dtype=np.int64) - shift, np.concatenate(durs, dtype=np.int64),
                        counters, tids, n, op_heads, ev.host, ev.device)


def metadata_events(run_id: str, rank: int, host: str, device: str, tids: Iterable[int]) -> list[dict]:
    """Names and sort order of the process (one per rank) and its threads."""
    pid = pid_of(rank)
    where = " on ".join(x for x in (device, host) if x)
    out = [{"ph": "M", "name": "process_name", "pid": pid,
            "args": {"name": f"{run_id} rank {rank}" + (f" ({where})" if where else "")}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rank}}]
    names = {TID_STEPS: "Steps", TID_DEVICE_STEPS: "Device steps", TID_COLLECTIVES: TRACK_NAME,
             **{t: label for t, _, label in OVERLAP_TRACKS}}
    for order, tid in enumerate(sorted(tids, key=lambda t: (t >= STREAM_TID_BASE, t))):
        stream = tid - STREAM_TID_BASE if tid < 2**31 else tid - 2**32
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": names.get(tid, f"stream {stream}")}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": order}})
    return out


@functools.lru_cache(maxsize=4096)  # a (run, rank)'s entry is used for each of its steps: room for 1,024 ranks
def _metadata_text(run_id: str, rank: int, host: str, device: str, tids: frozenset[int]) -> bytes:
    return b",\n".join(_dumps(m) for m in metadata_events(run_id, rank, host, device, tids))


def timeline_events(steps: Sequence[StepEvents], arrivals: Arrivals | None = None) -> list[dict]:
    """Every trace event of ``steps`` (closed steps of one run and rank, in order) as
    dicts: metadata first, ``ts``/``dur`` in float microseconds since ``base_time_ns``."""
    if not steps:
        return []
    base = midnight_ns(steps[0].start_ns)
    timelines = [step_timeline(ev, arrivals) for ev in steps]
    first = steps[0]
    events = metadata_events(first.run_id, first.rank, first.host, first.device,
                             set().union(*(t.tids for t in timelines)))
    for t in timelines:
        pid = pid_of(t.rank)
        for h, ts, dur in zip(t.head.tolist(), (t.x_start_ns - base).tolist(),
                              np.maximum(t.x_dur_ns, 0).tolist()):
            events.append({**head_event(t.heads[h], pid, t.step), "ts": ts / 1000, "dur": dur / 1000})
        for event, ts in t.counters:
            events.append({**event, "args": dict(event["args"]), "ts": (ts - base) / 1000})
    return events


# -- JSON text from columns ------------------------------------------------------------
#
# A complete event is one row of 4-byte columns: ``,\n{"ph":"X","pid":1,"ts":`` | ts |
# ``,"dur": `` | dur | the head's other fields and ``}``. Numbers are right-aligned with
# leading spaces and heads end in trailing spaces (both JSON whitespace), so all rows of
# a file's op events have one width, and those of its Steps/overlap events another: a
# file's text is a few array operations, whatever its number of events, and its size is
# known from row counts and column widths alone (``_Shape``) before it is built.

def _table(fmt: bytes, values: Iterable[int], first: bytes = b"") -> np.ndarray:
    return np.frombuffer(first + b"".join(fmt % i for i in values), "<u4")


_DIGITS = _table(b"%04d", range(10000))  # a chunk below a non-zero one: "0042"
_LEADING = _table(b"%4d", range(1, 10000), first=b"    ")  # the first non-zero chunk: "  42"
_UNITS = _table(b"%4d", range(10000))  # the last chunk when all above are zero: "   0"
_FRACTION = _table(b".%03d", range(1000))  # ".042"
_DUR_KEY = np.frombuffer(b',"dur": ', "<u4")
_FOOTER = b"\n]}\n"
_EXTRA_RESERVE = 256  # bytes of otherData kept for the caller's extra fields


def _micros_cols(ns: np.ndarray) -> int:
    """4-byte columns that ``_write_micros`` needs for these values."""
    if not len(ns):
        return 0
    top = max(int(ns.max()), -int(ns.min()) * 10) // 1000  # room for a minus sign
    return -(-len(str(top)) // 4) + 1


def _write_micros(out: np.ndarray, ns: np.ndarray) -> None:
    """Nanoseconds as microseconds with 3 decimals, right-aligned, into the (n, k) uint32
    columns ``out`` (k at least ``_micros_cols``): ``   12.345``."""
    neg = ns < 0
    us, frac = np.divmod(np.abs(ns), 1000)
    chunks = out.shape[1] - 1
    out[:, chunks] = _FRACTION[frac]
    x = us
    for c in range(chunks - 1, -1, -1):
        q = x // 10000
        r = x - q * 10000
        blank = _UNITS if c == chunks - 1 else _LEADING
        if c == 0:
            out[:, c] = blank[r]
        elif q.min() > 0:  # a non-zero chunk above in every row: plain digits
            out[:, c] = _DIGITS[r]
        else:
            out[:, c] = np.where(q == 0, blank[r], _DIGITS[r])
        x = q
    if neg.any():  # rare (an event before the window's midnight): those rows one by one
        rows = np.flatnonzero(neg)
        width = 4 * out.shape[1]
        text = b"".join((b"-%d.%03d" % (u, f)).rjust(width) for u, f in zip(us[rows].tolist(), frac[rows].tolist()))
        out[rows] = np.frombuffer(text, "<u4").reshape(len(rows), -1)


@functools.lru_cache(maxsize=16384)
def _head_prefix(head: Head) -> str:
    """``head_event`` as JSON text after ph, pid, ts and dur, up to the step: ``,"name":..."step":``."""
    name, cat, tid, op_type = head
    text = f',"name":{json.dumps(name)},"cat":{json.dumps(cat)},"tid":{tid},"args":{{'
    if op_type is not None:
        text += f'"op_type":{json.dumps(op_type)},'
    return text + '"step":'


@functools.lru_cache(maxsize=1024)
def _row_prefix(pid: int) -> np.ndarray:
    """``,\\n{"ph":"X","pid":<pid>,"ts":`` padded with spaces to 4-byte columns."""
    text = b',\n{"ph":"X","pid":%d,"ts":' % pid
    return np.frombuffer(text + b" " * (-len(text) % 4), "<u4")


def _pad_rows(texts: list[bytes], width: int, prefix: bytes = b"") -> np.ndarray:
    """``prefix`` + text + trailing spaces to ``width`` per row: an (n, width) uint8 matrix."""
    joined = b"".join(prefix + t + b" " * (width - len(prefix) - len(t)) for t in texts)
    return np.frombuffer(joined, np.uint8).reshape(len(texts), width)


def _dumps(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode()


@dataclass(frozen=True)
class _Shape:
    """Row counts and column widths of some steps' text, which give its size in bytes."""

    op: tuple[int, int, int, int] = (0, 0, 0, 0)  # rows; head, ts and dur columns (4 bytes)
    other: tuple[int, int, int, int] = (0, 0, 0, 0)  # the same for Steps/overlap events
    counters: tuple[int, int] = (0, 0)  # rows; bytes per row

    def merge(self, o: _Shape) -> _Shape:
        def m(a: tuple, b: tuple) -> tuple:
            return (a[0] + b[0], *map(max, a[1:], b[1:]))
        return _Shape(m(self.op, o.op), m(self.other, o.other), m(self.counters, o.counters))

    def nbytes(self, prefix_cols: int) -> int:
        rows = sum(4 * n * (prefix_cols + head + ts + 2 + dur) for n, head, ts, dur in (self.op, self.other) if n)
        return rows + self.counters[0] * self.counters[1]


@dataclass
class _Prepared:
    """A step bound for a file: head and counter texts timed from ``base_ns``, and its shape."""

    timeline: StepTimeline
    base_ns: int
    heads: list[bytes]
    counters: list[bytes]
    shape: _Shape


def _prepare(t: StepTimeline, base_ns: int) -> _Prepared:
    end = f"{t.step}}}}}"
    heads = [(_head_prefix(h) + end).encode() for h in t.heads]
    counters = [_dumps({**e, "ts": (ts - base_ns) / 1000}) for e, ts in t.counters]
    starts = t.x_start_ns - base_ns
    durs = np.maximum(t.x_dur_ns, 0)
    k, n = t.op_heads, t.ops

    def cols(texts: list[bytes], rows: slice) -> tuple[int, int, int, int]:
        return (len(starts[rows]), -(-max(map(len, texts), default=0) // 4),
                _micros_cols(starts[rows]), _micros_cols(durs[rows]))

    shape = _Shape(cols(heads[:k], slice(0, n)), cols(heads[k:], slice(n, None)),
                   (len(counters), 2 + max(map(len, counters), default=0)))
    return _Prepared(t, base_ns, heads, counters, shape)


def _x_rows(prefix: np.ndarray, heads: np.ndarray, head: np.ndarray, starts: np.ndarray,
            durs: np.ndarray, ts_cols: int, dur_cols: int) -> np.ndarray:
    """Complete events as one (n, width) uint8 matrix of JSON rows."""
    p = len(prefix)
    a = p + ts_cols
    b = a + 2 + dur_cols
    rows = np.empty((len(starts), b + heads.shape[1]), np.uint32)
    rows[:, :p] = prefix
    _write_micros(rows[:, p:a], starts)
    rows[:, a:a + 2] = _DUR_KEY
    _write_micros(rows[:, a + 2:b], durs)
    np.take(heads, head, axis=0, out=rows[:, b:], mode="clip")
    return rows.view(np.uint8)


_BLOCK_ROWS = 32768  # rows rendered and compressed at a time: stays in the CPU's caches


def _render(steps: Sequence[_Prepared], shape: _Shape) -> Iterator[np.ndarray]:
    """The events of steps bound for one file, in blocks: uint8 matrices whose rows each
    hold ``,\\n<event>``; concatenated, valid JSON array elements, ``shape.nbytes`` in all."""
    prefix = _row_prefix(pid_of(steps[0].timeline.rank))
    for ops, (n_rows, head_cols, ts_cols, dur_cols) in ((True, shape.op), (False, shape.other)):
        if not n_rows:
            continue
        texts: list[bytes] = []
        head, starts, durs = [], [], []
        for p in steps:
            t = p.timeline
            rows = slice(0, t.ops) if ops else slice(t.ops, None)
            first_head = 0 if ops else t.op_heads
            head.append(t.head[rows] + (len(texts) - first_head))
            texts += p.heads[:t.op_heads] if ops else p.heads[t.op_heads:]
            starts.append(t.x_start_ns[rows] - p.base_ns)
            durs.append(t.x_dur_ns[rows])
        heads = _pad_rows(texts, 4 * head_cols).view("<u4")
        head_all, starts_all = np.concatenate(head), np.concatenate(starts)
        durs_all = np.maximum(np.concatenate(durs), 0)
        for i in range(0, n_rows, _BLOCK_ROWS):
            block = slice(i, i + _BLOCK_ROWS)
            yield _x_rows(prefix, heads, head_all[block], starts_all[block], durs_all[block], ts_cols, dur_cols)
    if shape.counters[0]:
        yield _pad_rows([c for p in steps for c in p.counters], shape.counters[1], b",\n")


@dataclass
class Window:
    """Closed steps of one (run, rank) bound for one file, timed from one base."""

    base_ns: int | None = None
    steps: list[_Prepared] = field(default_factory=list)
    first_offsets: list[int] = field(default_factory=list)  # input offset that first fed each step
    shape: _Shape = _Shape()
    tids: set[int] = field(default_factory=set)
    ops: int = 0

    def prepare(self, t: StepTimeline) -> _Prepared:
        """``t`` timed from this window's base (the step's own midnight when empty)."""
        return _prepare(t, self.base_ns if self.base_ns is not None else midnight_ns(t.start_ns))

    def append(self, p: _Prepared, first_offset: int = -1) -> None:
        if self.base_ns is None:
            self.base_ns = p.base_ns
        elif p.base_ns != self.base_ns:
            p = _prepare(p.timeline, self.base_ns)
        self.steps.append(p)
        self.first_offsets.append(first_offset)
        self.shape = self.shape.merge(p.shape)
        self.tids |= p.timeline.tids
        self.ops += p.timeline.ops

    @property
    def first_offset(self) -> int | None:
        offsets = [o for o in self.first_offsets if o >= 0]
        return min(offsets) if offsets else None


# -- files -----------------------------------------------------------------------------

def written_floor(rank_dir: Path) -> int | None:
    """One past the last step whose file (every part of it) is in ``rank_dir``, or None."""
    if not rank_dir.is_dir():
        return None
    last = None
    parts: dict[int, set[int]] = {}
    of: dict[int, int] = {}
    for p in rank_dir.iterdir():
        m = _FILE_RE.match(p.name)
        if m is None:
            continue
        hi = int(m.group(2))
        if m.group(3) is None:
            last = hi if last is None else max(last, hi)
        else:
            parts.setdefault(hi, set()).add(int(m.group(3)))
            of[hi] = int(m.group(4))
    for step, got in parts.items():
        if len(got) == of[step]:
            last = step if last is None else max(last, step)
    return None if last is None else last + 1


def window_files(out_dir: str | os.PathLike, run_id: str, rank: int, first: int, last: int) -> list[Path]:
    """The files of ``<out_dir>/<run_id>/rank-<rank>`` holding any of steps ``first``..``last``, in step order."""
    rank_dir = Path(out_dir) / run_id / f"rank-{int(rank)}"
    if not rank_dir.is_dir():
        return []
    found = []
    for p in rank_dir.iterdir():
        m = _FILE_RE.match(p.name)
        if m is not None and int(m.group(1)) <= last and int(m.group(2)) >= first:
            found.append((int(m.group(1)), int(m.group(3) or 0), p))
    return [p for _lo, _part, p in sorted(found)]


class TimelineWriter:
    """Writes windows of steps of one run and rank as gzip Chrome trace files, atomically."""

    def __init__(self, out_dir: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 compresslevel: int = DEFAULT_COMPRESSLEVEL) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ConfigError(f"max_bytes {max_bytes}: use at least {MIN_MAX_BYTES} (16KiB)")
        self.out_dir = Path(out_dir)
        self.max_bytes = max_bytes
        self.compresslevel = compresslevel
        self.files_written = 0

    def rank_dir(self, run_id: str, rank: int) -> Path:
        """``<out>/<run_id>/rank-<rank>``; raises UnsafePath if that is not inside ``out``."""
        try:
            check_name(run_id, "run id")
        except ConfigError as e:
            raise UnsafePath(str(e)) from None
        root = self.out_dir.resolve()
        path = (root / run_id / f"rank-{int(rank)}").resolve()
        if not path.is_relative_to(root) or path == root:
            raise UnsafePath(f"{path} is outside the output directory {root}")
        return path

    def write(self, steps: Sequence[StepEvents], extra: dict | None = None) -> list[Path]:
        """Write closed steps of one run and rank, in order, into as few files as fit."""
        window = Window()
        for ev in steps:
            window.append(window.prepare(step_timeline(ev)))
        return self.write_window(window, extra)

    def fits(self, window: Window, step: _Prepared | None = None) -> bool:
        """Whether the window (plus ``step``) fits in one file of ``max_bytes`` of JSON text."""
        return self._size(window, step) <= self.max_bytes

    def write_window(self, window: Window, extra: dict | None = None) -> list[Path]:
        """Pack the window's steps, in order, into files of at most ``max_bytes`` of JSON
        text; a step too big alone is split row by row into parts. Returns the paths."""
        extra = dict(extra or {})
        if len(_dumps(extra)) > _EXTRA_RESERVE:
            raise ValueError(f"extra otherData takes more than {_EXTRA_RESERVE} bytes")
        groups: list[Window] = []
        for p in window.steps:
            if not groups or not self.fits(groups[-1], p):
                groups.append(Window(window.base_ns))
            groups[-1].append(p)
        written = []
        for group in groups:
            if self.fits(group):
                written.append(self._write_file(group, _render(group.steps, group.shape), None, extra))
            else:
                written += self._write_parts(group, extra)
        return written

    def _size(self, window: Window, step: _Prepared | None = None) -> int:
        """Bytes of JSON text in the file of the window's steps (and ``step``)."""
        steps, shape, tids, ops = window.steps, window.shape, window.tids, window.ops
        if step is not None:
            steps, shape = steps + [step], shape.merge(step.shape)
            tids, ops = tids | step.timeline.tids, ops + step.timeline.ops
        return self._overhead(steps, tids, ops) + shape.nbytes(len(_row_prefix(pid_of(steps[0].timeline.rank))))

    def _overhead(self, steps: Sequence[_Prepared], tids: set[int], ops: int,
                  part: tuple[int, int] | None = None) -> int:
        """Bytes of a file's JSON text besides its event rows (the caller's extra reserved)."""
        first = steps[0]
        header = self._header(first.timeline, steps[-1].timeline.step, len(steps), ops, first.base_ns, tids, part, {})
        return len(header) + _EXTRA_RESERVE + len(_FOOTER)

    def _write_parts(self, window: Window, extra: dict) -> list[Path]:
        """One step bigger than max_bytes: its rows, in order, over as many files as needed."""
        budget = self.max_bytes - self._overhead(window.steps, window.tids, window.ops, (10**6, 10**6))
        parts: list[list[np.ndarray]] = [[]]
        room = budget
        for m in _render(window.steps, window.shape):
            width = m.shape[1]
            i = 0
            while i < len(m):
                take = min(len(m) - i, room // width)
                if take == 0 and not parts[-1]:
                    log.warning("an event of step %d is larger than max_bytes: written alone",
                                window.steps[0].timeline.step)
                    take = 1
                if take == 0:
                    parts.append([])
                    room = budget
                    continue
                parts[-1].append(m[i:i + take])
                room -= take * width
                i += take
        return [self._write_file(window, rows, (k + 1, len(parts)), extra) for k, rows in enumerate(parts)]

    def _header(self, first: StepTimeline, last_step: int, steps: int, ops: int, base_ns: int,
                tids: set[int], part: tuple[int, int] | None, extra: dict) -> bytes:
        other: dict[str, Any] = {
            "producer": "profstream", "format": "profstream-timeline/1",
            "run_id": first.run_id, "rank": first.rank, "host": first.host, "device": first.device,
            "first_step": first.step, "last_step": last_step, "steps": steps, "ops": ops,
            "base_time_ns": base_ns, "base_time": datetime.fromtimestamp(base_ns // 10**9, UTC).isoformat(),
            "ts_unit": "microseconds since base_time_ns",
        }
        if part is not None:
            other["part"], other["parts"] = part
        other.update(extra)
        return (b'{"displayTimeUnit":"ns","otherData":' + _dumps(other) + b',"traceEvents":[\n'
                + _metadata_text(first.run_id, first.rank, first.host, first.device, frozenset(tids)))

    def _write_file(self, window: Window, rows: Iterable[np.ndarray], part: tuple[int, int] | None,
                    extra: dict) -> Path:
        first, last = window.steps[0].timeline, window.steps[-1].timeline
        name = f"steps-{first.step}-{last.step}" + (f".part{part[0]}of{part[1]}" if part else "")
        directory = self.rank_dir(first.run_id, first.rank)
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{name}.json.gz"
        if final.resolve().parent != directory:  # resolve-and-verify, links included
            raise UnsafePath(f"{final} resolves outside {directory}")
        header = self._header(first, last.step, len(window.steps), window.ops, window.base_ns, window.tids,
                              part, extra)
        write_gzip_atomic(final, itertools.chain((header,), rows, (_FOOTER,)), self.compresslevel)
        self.files_written += 1
        return final


# -- the sink --------------------------------------------------------------------------

@dataclass
class _RankTimeline:
    assembler: RankAssembler
    topic: str
    order: int  # when it entered the sink: time-based closes visit ranks in this order
    window: Window = field(default_factory=Window)
    clock: tuple[int, int] | None = None  # the clock offset and error its newest step was drawn with

    @property
    def pending_offset(self) -> int | None:
        """Lowest input offset whose events are not in a file yet."""
        offsets = [o for o in (self.assembler.min_open_offset, self.window.first_offset) if o is not None]
        return min(offsets) if offsets else None


class TimelineSink:
    """Raw topic -> timeline files. ``handle`` and ``durable_offsets`` are called by
    ``SinkLoop``; ``close`` writes the windows of steps already closed."""

    def __init__(self, out_dir: str | os.PathLike, window_steps: int = DEFAULT_WINDOW_STEPS,
                 max_bytes: int = DEFAULT_MAX_BYTES, grace_s: float = 2.0, idle_timeout_s: float = 60.0,
                 compresslevel: int = DEFAULT_COMPRESSLEVEL, clock=time.monotonic,
                 control_topic: str | None = None, run_topic: str | None = None) -> None:
        if window_steps < 1:
            raise ConfigError(f"window_steps {window_steps}: use at least 1")
        self.writer = TimelineWriter(out_dir, max_bytes, compresslevel)
        self.window_steps = window_steps
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.ranks: dict[tuple[str, int], _RankTimeline] = {}
        self._orders = itertools.count()
        # After every poll only the ranks that may close a step by time are visited, and
        # only the ranks that changed have their pending offset looked at again: with
        # 1,024 ranks a visit of each cost more than the steps (docs/benchmarks.md §10).
        self.schedule = CloseSchedule(grace_s, idle_timeout_s)
        self._pending_changed: set[tuple[str, int]] = set()
        self._pending_at: dict[tuple[str, int], dict[tuple[str, int], int]] = {}  # where -> rank -> offset
        self._pending_where: dict[tuple[str, int], tuple[str, int]] = {}  # rank -> its where in _pending_at
        self.arrivals: dict[str, Arrivals] = {}  # per run: collective calls seen on every rank
        self._run_ranks: Counter[str] = Counter()  # per run: its ranks open here
        self._floors: dict[tuple[str, int], int] = {}  # steps below are in files (ranks closed as idle)
        self._positions: dict[tuple[str, int], int] = {}
        self._warned: set[str] = set()
        self.decode_errors: Counter[str] = Counter()
        self.rejected_batches = 0
        self.rejected_steps = 0
        self.steps_written = 0
        self.ops_written = 0
        # Captures that started (docs/capture.md): their steps get a file of their own.
        self.control_topic = control_topic
        self._captures: dict[tuple[str, int], tuple[int, int]] = {}
        self.stacks = StacksFiles(out_dir)  # the runs' latest stacks, from the same topic
        # The run stage's RunStepMetrics, for the ranks' clock offsets (rank tracks on the run's clock)
        self.run_topic = run_topic

    @property
    def files_written(self) -> int:
        return self.writer.files_written

    # -- SinkLoop interface -----------------------------------------------------------

    def handle(self, records: Sequence[Any]) -> None:
        now = self.clock()
        touched: set[tuple[str, int]] = set()
        for rec in records:
            self._positions[(rec.topic, rec.partition)] = rec.offset + 1
            ident = self._fold(rec, now)
            if ident is not None:
                touched.add(ident)
        for ident in touched:
            self._close_ready(ident, now)
            self.schedule.visited(ident, self.ranks[ident].assembler)

    def durable_offsets(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the offset below which every event is in a file.

        SinkLoop asks after every poll; time-based closes (grace, idle) happen here, and
        the stacks files of the runs whose stacks came are written."""
        self._tick(self.clock())
        self.stacks.flush()
        at = self._pending_at
        for ident in self._pending_changed:
            where = self._pending_where.pop(ident, None)
            if where is not None:
                del at[where][ident]
            rank = self.ranks.get(ident)
            offset = rank.pending_offset if rank is not None else None
            if offset is not None:
                where = self._pending_where[ident] = (rank.topic, rank.assembler.partition)
                at.setdefault(where, {})[ident] = offset
        self._pending_changed.clear()
        return {where: min(position, *at[where].values()) if at.get(where) else position
                for where, position in self._positions.items()}

    def close(self) -> None:
        """Write every window of closed steps (open steps are read again after a restart)."""
        for ident in list(self.ranks):
            self._flush(ident)
        self.stacks.flush()

    def stats(self) -> dict[str, Any]:
        late = sum(r.assembler.late_events for r in self.ranks.values())
        return {"files_written": self.files_written, "steps_written": self.steps_written,
                "ops_written": self.ops_written, "decode_errors": dict(self.decode_errors),
                "rejected_batches": self.rejected_batches, "rejected_steps": self.rejected_steps,
                "open_ranks": len(self.ranks), "late_events": late}

    # -- inside -----------------------------------------------------------------------

    def _fold(self, rec, now: float) -> tuple[str, int] | None:
        if rec.topic == self.control_topic:
            self._capture_status(rec.value)
            return None
        if rec.topic == self.run_topic:
            self._clock_offsets(rec.value)
            return None
        if is_rank_progress(rec.value):  # where a rank is now: nothing to draw
            return None
        try:
            batch = decode_batch(rec.value)
        except DecodeError as e:
            self.decode_errors[e.reason] += 1
            log.debug("skipped %s/%d/%d: %s", rec.topic, rec.partition, rec.offset, e)
            return None
        ident = (batch.run_id, batch.rank)
        rank = self.ranks.get(ident)
        if rank is None:
            try:
                rank_dir = self.writer.rank_dir(batch.run_id, batch.rank)
            except UnsafePath as e:
                self.rejected_batches += 1
                if batch.run_id not in self._warned:
                    self._warned.add(batch.run_id)
                    log.warning("batches of run %r are not written: %s", batch.run_id, e)
                return None
            asm = RankAssembler(batch.run_id, batch.rank, self.grace_s, rec.partition)
            floors = [f for f in (self._floors.get(ident), written_floor(rank_dir)) if f is not None]
            if floors:  # a restart or a rank back from idle: never write a step twice
                asm.floor = max(floors)
            rank = self.ranks[ident] = _RankTimeline(asm, rec.topic, next(self._orders))
            self._run_ranks[batch.run_id] += 1
            self.schedule.add(ident, asm)
        rank.assembler.add(batch, now, rec.offset)  # handle() visits the rank next
        if len(batch.collectives["step"]):
            self.arrivals.setdefault(batch.run_id, Arrivals()).add(batch)
        return ident

    def _clock_offsets(self, value: bytes) -> None:
        """The ranks' clock offsets of a RunStepMetrics: the steps closed from now on are drawn
        on the run's clock."""
        try:
            m = decode("RunStepMetrics", value)
        except DecodeError as e:
            self.decode_errors[e.reason] += 1
            return
        if m["clock_offsets"]:
            self.arrivals.setdefault(m["run_id"], Arrivals()).learned_offsets(m["clock_offsets"])

    def _close_ready(self, ident: tuple[str, int], now: float) -> None:
        rank = self.ranks[ident]
        self._pending_changed.add(ident)
        first_offsets = {s: e.first_offset for s, e in rank.assembler.open.items()}
        for ev, _reason in rank.assembler.close_ready(now):
            self._add(ident, ev, first_offsets.get(ev.step, -1))

    def _tick(self, now: float) -> None:
        ranks = self.ranks
        due = self.schedule.due(now, lambda ident: ranks[ident].assembler.last_seen)
        for ident in sorted(due, key=lambda ident: ranks[ident].order):
            rank = ranks[ident]
            self._close_ready(ident, now)
            if now - rank.assembler.last_seen >= self.idle_timeout_s:
                self._close_idle(ident)
            else:
                self.schedule.visited(ident, rank.assembler)

    def _close_idle(self, ident: tuple[str, int]) -> None:
        """A rank silent for the idle timeout: its marked steps written, the rest dropped,
        the rank forgotten (its floor kept: a rank back later writes no step twice)."""
        rank = self.ranks[ident]
        first_offsets = {s: e.first_offset for s, e in rank.assembler.open.items()}
        for ev in rank.assembler.close_all():
            self._add(ident, ev, first_offsets.get(ev.step, -1))
        self._flush(ident)
        if rank.assembler.floor is not None:
            self._floors[ident] = rank.assembler.floor
        del self.ranks[ident]
        self.schedule.forget(ident)
        self._captures.pop(ident, None)
        self._run_ranks[ident[0]] -= 1
        if not self._run_ranks[ident[0]]:  # the run's last rank here
            del self._run_ranks[ident[0]]
            self.arrivals.pop(ident[0], None)

    def _capture_status(self, value: bytes) -> None:
        """A capture that started on a rank: its steps first..last become a file of their own; a
        rank's stacks: the run's stacks file."""
        from profstream.control.records import STARTED, STATUS, decode_control

        try:
            name, status = decode_control(value)
        except DecodeError:
            return  # the guard (profstream autocapture) dead-letters those
        if name == STATUS:
            self.stacks.add(status)
        if name == STATUS and status["state"] == STARTED and status["rank"] is not None:
            ident = (status["run_id"], status["rank"])
            first, last = status["first_step"], status["last_step"]
            self._captures[ident] = (first, last)
            if ident in self.ranks:  # the status may come after some of the captured steps: cut them out now
                self._cut(ident, first)
                if self._cut(ident, last + 1):
                    del self._captures[ident]

    def _cut(self, ident: tuple[str, int], step: int) -> bool:
        """Write the window's steps before ``step`` as a file and keep the others; True
        when the window holds ``step`` or later ones."""
        rank = self.ranks[ident]
        window = rank.window
        if not window.steps or window.steps[-1].timeline.step < step:
            return False
        if window.steps[0].timeline.step < step:
            head, tail = Window(), Window()
            for p, offset in zip(window.steps, window.first_offsets):
                (head if p.timeline.step < step else tail).append(p, offset)
            rank.window = head
            self._flush(ident)
            rank.window = tail
        return True

    def _add(self, ident: tuple[str, int], ev: StepEvents, first_offset: int) -> None:
        rank = self.ranks[ident]
        arrivals = self.arrivals.get(ident[0])
        p = rank.window.prepare(step_timeline(ev, arrivals))
        clock = arrivals.clocks.get(ident[1]) if arrivals is not None else None
        capture = self._captures.get(ident)
        fits = None  # whether the window with this step fits in a file, once known
        if rank.window.steps:
            fits = self.writer.fits(rank.window, p)
            if not fits or (capture and ev.step == capture[0]):
                self._flush(ident)  # the size cap, or a capture's first step, closes the window before this step
                fits = None
        rank.window.append(p, first_offset)
        rank.clock = clock
        if capture is not None and ev.step >= capture[1]:
            del self._captures[ident]
            self._flush(ident)  # the capture's last step
        elif len(rank.window.steps) >= self.window_steps or not (self.writer.fits(rank.window) if fits is None
                                                                 else fits):
            self._flush(ident)  # N steps, or one step bigger than the cap (split into parts)

    def _flush(self, ident: tuple[str, int]) -> None:
        rank = self.ranks[ident]
        self._pending_changed.add(ident)
        window = rank.window
        if not window.steps:
            return
        asm = rank.assembler
        extra = {"late_events": asm.late_events, "orphan_events": asm.orphan_events,
                 "lost_batches": asm.lost_batches, "dropped_ops": asm.dropped_ops}
        if rank.clock is not None:  # its newest step's (each step has the one known when it closed)
            extra["clock_offset_ns"], extra["clock_error_ns"] = rank.clock
        try:
            self.writer.write_window(window, extra)
        except UnsafePath as e:  # a link planted under the output directory
            self.rejected_steps += len(window.steps)
            log.error("steps %d-%d of %s rank %d not written: %s", window.steps[0].timeline.step,
                      window.steps[-1].timeline.step, ident[0], ident[1], e)
        else:
            self.steps_written += len(window.steps)
            self.ops_written += window.ops
        rank.window = Window()

