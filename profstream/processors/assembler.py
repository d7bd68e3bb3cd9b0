"""Per-rank state: gathers each step's events from any number of batches and closes steps.

A step closes as soon as its end mark has arrived and the producer's watermark
(``complete_through_step``) has reached it; a producer that never sends a watermark gets
a grace period after the mark instead. A step measured on the device's window
(``window.py``) also waits until no later step can still add device ops to that window:
until it, or a later step ready to close, ended on the host after the window's end
(``window.CLOCK_SKEW_NS`` later), or the producer's end mark came (no later step); it
then takes the device ops of the steps in between that ran inside its window
(``StepEvents.ahead_*``). Steps close in order. Events that arrive for a step already
closed are counted as late and never folded in; events of a step that never got its mark
are discarded (and counted) when a later step closes. The producer's end mark (step
``END_MARK``) is no step: the rank is ``finished`` once every step it marked closed.

Restarts: ``snapshot()`` is what the processor checkpoints (no open-step events: the
committed input offset stays at ``min_open_offset`` so they are read again). A batch
whose seq is below the checkpointed next seq of its producer is such a re-read: only
its events of steps not yet closed are folded in, and no counter moves.

Duplicates: the same batch (producer id, seq) can be in the raw topic twice. The
Monitor's idempotent producer resends under a bumped epoch after some broker errors, and
the broker cannot tell that resend from new data (librdkafka issue 4953; seen after a
whole cluster restarted). Each open step remembers which batches fed it, so a batch
feeds a step once however often it is read; a copy that arrives after its step closed
is a re-read of a closed step and is dropped like one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from profstream import compiled
from profstream.processors.collectives import CALL_COLUMNS, Calls, one_per_call
from profstream.processors.model import StepEvents
from profstream.processors.window import (
    CLOCK_SKEW_NS,
    ahead_ops,
    carry_past_end,
    device_window_end,
    is_ascend_device,
    step_window,
)
from profstream.schema.batch import (
    END_MARK,
    NO_VALUE,
    SECTIONS,
    WORK_COLUMNS,
    WORK_ROW,
    EventBatch,
    column,
    empty_section,
    launch_column,
)
from profstream.schema.wire_columns import WireColumns, time_span

_OP_COLS = ("kind", "type", "stream", "start_ns", "dur_ns", "launch_ns")
_MEM_COLS = ("ts_ns", "allocated", "reserved", "peak")
_QUEUE_COLS = ("queue", "ts_ns", "size", "capacity")
_CALL_COLS = tuple(c for c, _ in CALL_COLUMNS)
_CALL_DTYPES = dict(CALL_COLUMNS)
_DEVICE_COLS = tuple(col for col, _ in SECTIONS["device_samples"])
_WORK_COLS = tuple(col for col, _ in WORK_COLUMNS)


@dataclass
class _OpenStep:
    mark: tuple[int, int, int, int] | None = None  # S, E, F, B
    lost: tuple[int, int] = (0, 0)  # (ops, samples) of the step its producer dropped: its mark says
    work: tuple | None = None  # the mark's work columns (WORK_COLUMNS), None: it had none
    late_work: tuple | None = None  # those of a work row (schema.batch.WORK_ROW) for the step
    mark_seen_at: float = 0.0
    ops: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    queues: list[dict] = field(default_factory=list)
    collectives: list[dict] = field(default_factory=list)
    devices: list[dict] = field(default_factory=list)
    events: int = 0
    first_offset: int = -1  # input offset of the first batch that fed this step
    batches: set[tuple[str, int]] = field(default_factory=set)  # (producer id, seq) of each batch that fed it
    # (events and ascend then; the end of its own device ops that bound it, or None: a host step)
    device_end: tuple[int, bool, int | None] = (-1, False, None)

    def op_columns(self) -> dict[str, np.ndarray]:
        """The step's op columns, concatenated once (later parts are concatenated again)."""
        if len(self.ops) != 1:
            self.ops[:] = [_concat(self.ops, _OP_COLS, _DTYPES)]
        return self.ops[0]

    def own_device_end(self, ascend: bool) -> int | None:
        """End of the step's own device ops that bound its window (on an Ascend device, its
        compute and communication ones where it has any: ``window.device_window_end``) if any
        op carries a launch time, else None."""
        if self.device_end[:2] != (self.events, ascend):
            ops = self.op_columns()
            self.device_end = (self.events, ascend, device_window_end(ops["kind"], ops["start_ns"], ops["dur_ns"],
                                                                      ops["launch_ns"], NO_VALUE, ascend))
        return self.device_end[2]


_NO_CARRY = (np.empty(0, np.int64), np.empty(0, np.int64))
_NO_AHEAD = (np.empty(0, np.uint8), np.empty(0, np.int64), np.empty(0, np.int64))
_FLOPS_AT = _WORK_COLS.index("flops_source")


RECENT_READINGS = 64  # batches of host or loader readings kept per rank (a minute of them at 1 s)


def _readings(recent: deque, start_ns: int, end_ns: int, section: str) -> dict[str, np.ndarray]:
    """The rows of the batches in ``recent`` [(first ts, last ts, rows)] whose ts_ns lies in
    [start_ns, end_ns]; the newest batches are looked at first (a step's readings are among
    the latest: the scan stops at the first batch wholly before it)."""
    parts = []
    for first, last, rows in reversed(recent):
        if last < start_ns:
            break
        if first >= start_ns and last <= end_ns:  # the whole batch: no selection to make
            parts.append(rows)
        elif first <= end_ns:
            ts = rows["ts_ns"]
            sel = (ts >= start_ns) & (ts <= end_ns)
            if sel.any():
                parts.append({c: v[sel] for c, v in rows.items()})
    if not parts:
        return empty_section(section)
    if len(parts) == 1:  # a dict of its own, as empty_section's; a decoded batch's readings
        # as they are (read-only WireColumns: host_figures reads their bytes)
        return parts[0] if type(parts[0]) is WireColumns else dict(parts[0])
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


def _merged_work(mark: tuple | None, late: tuple | None) -> tuple | None:
    """A step's work: its mark's, with the FLOPs of a work row where the mark has none
    (FLOPs given or counted win over the captured ops')."""
    if late is None or (mark is not None and mark[_FLOPS_AT] > 0):
        return mark
    if mark is None:
        return late
    return (*mark[:2], *late[2:])  # the mark's tokens and samples, the row's FLOPs, peak and split


def _i64_bytes(values: np.ndarray) -> bytes:
    return np.asarray(values, "<i8").tobytes()


def _by_step(steps: np.ndarray, columns: dict[str, np.ndarray]):
    """Yield (step, columns of that step) for a section of a batch."""
    if len(steps) == 0:
        return
    one = compiled.NATIVE.uniform(steps) if compiled.NATIVE is not None else None
    if one is not None:  # the common case: a batch within one step (compiled, ~0.1 against ~1.5 us)
        yield one, columns
        return
    first = steps[0]
    if (steps == first).all():
        yield int(first), columns
        return
    order = np.argsort(steps, kind="stable")
    sorted_steps = steps[order]
    uniq, starts = np.unique(sorted_steps, return_index=True)
    bounds = list(starts[1:]) + [len(order)]
    for step, lo, hi in zip(uniq, starts, bounds):
        idx = order[lo:hi]
        yield int(step), {k: v[idx] for k, v in columns.items()}


_NO_COLUMNS: dict[tuple[str, ...], dict[str, np.ndarray]] = {}  # the columns of a section without rows


def _concat(parts: list[dict], names: tuple[str, ...], dtypes: dict) -> dict[str, np.ndarray]:
    if not parts:
        empty = _NO_COLUMNS.get(names)
        if empty is None:
            empty = _NO_COLUMNS[names] = {n: np.empty(0, dtypes[n]) for n in names}
        return empty.copy()  # a dict of its own; its zero-length arrays hold nothing to change
    if len(parts) == 1:  # a dict of its own, as empty_section's; a decoded batch's readings
        # as they are (read-only WireColumns: host_figures reads their bytes)
        return parts[0] if type(parts[0]) is WireColumns else dict(parts[0])
    if compiled.NATIVE is not None:  # one compiled copy of every column (~1 us) instead of an np.concatenate each
        blobs = compiled.NATIVE.concat_columns(parts, names)
        if blobs is not None:  # writable, as np.concatenate's are
            first = parts[0]
            return {n: np.frombuffer(blob, first[n].dtype) for n, blob in zip(names, blobs)}
    return {n: np.concatenate([p[n] for p in parts]) for n in names}


_DTYPES = {"kind": np.uint8, "type": np.int32, "stream": np.int32, "start_ns": np.int64, "dur_ns": np.int64,
           "launch_ns": np.int64,
           "ts_ns": np.int64, "allocated": np.int64, "reserved": np.int64, "peak": np.int64,
           "queue": np.int32, "size": np.int64, "capacity": np.int64}
_DEVICE_DTYPES = dict(SECTIONS["device_samples"])


class RankAssembler:
    """Open steps and health counters of one (run, rank)."""

    COUNTERS = ("late_events", "orphan_events", "lost_batches", "dropped_ops", "dropped_samples", "events")

    def __init__(self, run_id: str, rank: int, grace_s: float = 2.0, partition: int = -1) -> None:
        self.run_id = run_id
        self.rank = rank
        self.partition = partition  # input partition carrying this rank
        self.grace_s = grace_s
        self.host = ""
        self.device = ""
        self.world_size: int | None = None
        self.open: dict[int, _OpenStep] = {}
        self.floor = None  # every step < floor is closed
        self.watermark: int | None = None
        self.last_seen = 0.0
        self.next_seq: dict[str, int] = {}
        self.type_names: list[str] = []
        self._type_codes: dict[str, int] = {}
        self.queue_names: list[str] = []
        self._queue_codes: dict[str, int] = {}
        self.collective_names: list[str] = []  # collective and group names of this rank's calls
        self._collective_codes: dict[str, int] = {}
        self._collective_remaps: dict[tuple[str, ...], np.ndarray] = {}  # a batch's names -> their codes
        self._type_remaps: dict[tuple[str, ...], np.ndarray] = {}  # likewise for op types and queue names
        self._queue_remaps: dict[tuple[str, ...], np.ndarray] = {}
        # what the next step to close needs of the last closed one (window.py)
        self.carry: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] = (_NO_CARRY, _NO_CARRY)
        self.device_end: tuple[int, int] | None = None  # (step, end of its device window)
        self.held_step: int | None = None  # a device step ready but for later steps (close_ready)
        self._grace_wait: float | None = None  # mark time of the later step it waits for (no watermark)
        self.ended_ns: int | None = None  # the producer's end mark: it ended normally, at this time
        self.end_signal = 0  # the signal that ended it, as its end mark says (0: it closed)
        # the latest host and data-loader readings, by time (not checkpointed: a restarted
        # processor's first steps may have none)
        self.recent_host: deque = deque(maxlen=RECENT_READINGS)
        self.recent_loader: deque = deque(maxlen=RECENT_READINGS)
        # health counters (totals)
        self.late_events = 0
        self.orphan_events = 0
        self.lost_batches = 0
        self.replayed_batches = 0  # re-read after a restart (not checkpointed)
        self.duplicate_batches = 0  # read again while their steps were open, not folded twice (not checkpointed)
        self.dropped_ops = 0
        self.dropped_samples = 0
        self.events = 0
        self._fresh = True
        self._offset = -1
        self._batch: tuple[str, int] = ("", -1)  # (producer id, seq) of the batch being added
        self._fed: dict[int, _OpenStep | None] = {}  # step -> where that batch's events go (None: a duplicate)

    # -- input ------------------------------------------------------------------------

    def add(self, batch: EventBatch, now: float, offset: int = -1) -> bool:
        """Fold a batch in (``offset``: its input offset). Returns False for a re-read batch."""
        self.last_seen = now
        expected = self.next_seq.get(batch.producer_id)
        fresh = expected is None or batch.seq >= expected
        self._fresh = fresh
        self._offset = offset
        self._batch = (batch.producer_id, batch.seq)
        self._fed = {}
        if batch.world_size is not None:
            self.world_size = batch.world_size
        if fresh:
            if expected is not None:
                self.lost_batches += batch.seq - expected
            self.next_seq[batch.producer_id] = batch.seq + 1
            self.host, self.device = batch.host, batch.device
            self.dropped_ops += batch.dropped_ops
            self.dropped_samples += batch.dropped_samples
        else:
            self.replayed_batches += 1
        if batch.complete_through_step is not None:
            wm = batch.complete_through_step
            self.watermark = wm if self.watermark is None else max(self.watermark, wm)

        ops = batch.ops
        steps = ops["step"]
        if len(steps):
            remap = self._remap(self._type_remaps, self._type_codes, self.type_names, batch.op_types)
            cols = {"kind": ops["kind"], "type": ops["type_idx"] if remap is None else remap[ops["type_idx"]],
                    "stream": ops["stream"], "start_ns": ops["start_ns"], "dur_ns": ops["dur_ns"],
                    "launch_ns": launch_column(ops)}
            self._add_section(steps, "ops", cols, "kind")
        mem = batch.memory
        steps = mem["step"]
        if len(steps):
            cols = {"ts_ns": mem["ts_ns"], "allocated": mem["allocated"], "reserved": mem["reserved"],
                    "peak": mem["peak"]}
            self._add_section(steps, "memory", cols, "ts_ns")
        q = batch.queues
        steps = q["step"]
        if len(steps):
            remap = self._remap(self._queue_remaps, self._queue_codes, self.queue_names, batch.queue_names)
            cols = {"queue": q["name_idx"] if remap is None else remap[q["name_idx"]], "ts_ns": q["ts_ns"],
                    "size": q["size"], "capacity": q["capacity"]}
            self._add_section(steps, "queues", cols, "ts_ns")
        c = batch.collectives
        if len(c["step"]):
            remap = self._remap(self._collective_remaps, self._collective_codes, self.collective_names,
                                batch.collective_names)
            cols = {"name_idx": c["name_idx"] if remap is None else remap[c["name_idx"]],
                    "group_idx": c["group_idx"] if remap is None else remap[c["group_idx"]],
                    "group_size": c["group_size"], "seq": c["seq"], "bytes": np.maximum(c["in_bytes"], c["out_bytes"]),
                    "start_ns": c["start_ns"], "end_ns": c["start_ns"] + c["dur_ns"]}
            self._add_section(c["step"], "collectives", cols, "seq")
        for section, recent in (("host_samples", self.recent_host), ("loader_samples", self.recent_loader)):
            rows = getattr(batch, section)
            span = time_span(rows) if fresh else None
            if span is not None:  # kept by time: a step takes those of its [S, E] when it closes
                recent.append((*span, rows))
        dev = batch.device_samples
        if len(dev["step"]):
            self._add_section(dev["step"], "devices", dev, "ts_ns")
        st = batch.steps
        if len(st["step"]):
            self._add_marks(st, batch, fresh, now)
        if None in self._fed.values():
            self.duplicate_batches += 1
        return fresh

    def _add_section(self, steps: np.ndarray, section: str, cols: dict[str, np.ndarray], first: str) -> None:
        """A batch's rows of a section into the open steps they belong to (``first``: a
        column whose length is the rows')."""
        one = compiled.NATIVE.uniform(steps) if compiled.NATIVE is not None else None
        if one is not None:  # the common case: a batch within one step (compiled, ~0.1 against ~1.5 us)
            self._bucket(one, section, cols, len(cols[first]))
            return
        for step, part in _by_step(steps, cols):
            self._bucket(step, section, part, len(part[first]))

    def _add_marks(self, st: dict[str, np.ndarray], batch: EventBatch, fresh: bool, now: float) -> None:
        """A batch's step marks (and work rows, and the end mark) into their open steps."""
        lost_ops, lost_samples, end_signal = (column(batch, "steps", c).tolist()
                                              for c in ("dropped_ops", "dropped_samples", "end_signal"))
        # a mark's work: tokens or samples given (>= 0), or a FLOPs source (a batch built in
        # memory by code older than v8 has no work columns: none)
        work_rows = list(zip(*(st[c].tolist() for c in _WORK_COLS))) if "flops_source" in st else None
        starts = st["start_ns"].tolist()
        ends = st["end_ns"].tolist()
        fps = st["fp_start_ns"].tolist()
        bps = st["bp_end_ns"].tolist()
        for i, step in enumerate(st["step"].tolist()):
            if step == END_MARK:  # no step: the rank ended (``finished`` once its steps are closed)
                self.ended_ns = ends[i]
                self.end_signal = end_signal[i]
                continue
            if self._closed(step):
                self.late_events += fresh
                continue
            entry = self._feed(step)
            if entry is None:
                continue
            work = None
            if work_rows is not None:
                row = work_rows[i]  # tokens, samples, flops, flops_source, ...
                if row[0] >= 0 or row[1] >= 0 or row[_FLOPS_AT] > 0:
                    work = row
            if starts[i] == WORK_ROW:  # no mark: work for the step (its captured ops' FLOPs)
                entry.late_work = work
                self.events += fresh
                continue
            entry.mark = (starts[i], ends[i], fps[i], bps[i])
            entry.lost = (lost_ops[i], lost_samples[i])
            entry.work = work
            entry.mark_seen_at = now
            self.events += fresh

    def _entry(self, step: int) -> _OpenStep:
        entry = self.open.get(step)
        if entry is None:
            entry = self.open[step] = _OpenStep(first_offset=self._offset)
        return entry

    def _feed(self, step: int) -> _OpenStep | None:
        """The open step that the batch being added feeds with its events of ``step``; None
        when that batch already fed it (a duplicate: see the module docstring)."""
        if step in self._fed:
            return self._fed[step]
        entry: _OpenStep | None = self._entry(step)
        if self._batch in entry.batches:
            entry = None
        else:
            entry.batches.add(self._batch)
        self._fed[step] = entry
        return entry

    @classmethod
    def _remap(cls, remaps: dict[tuple[str, ...], np.ndarray | None], codes: dict[str, int], names: list[str],
               batch_names) -> np.ndarray | None:
        """The rank's code of each name of a batch's dictionary (new names get the next
        codes, in order), kept per distinct dictionary: a rank's batches mostly carry the
        same few (the last 64 kept). None where each name's code is its index in the
        batch's dictionary (the rank's first dictionary, and mostly every later one): the
        batch's index column then holds the codes as it is."""
        key = tuple(batch_names)
        if key in remaps:
            return remaps[key]
        if len(remaps) >= 64:
            remaps.clear()
        got = [cls._code(codes, names, n) for n in key]
        remap = remaps[key] = None if got == list(range(len(got))) else np.array(got, dtype=np.int32)
        return remap

    @staticmethod
    def _code(codes: dict[str, int], names: list[str], name: str) -> int:
        code = codes.get(name)
        if code is None:
            code = codes[name] = len(names)
            names.append(name)
        return code

    def _closed(self, step: int) -> bool:
        return self.floor is not None and step < self.floor

    def _bucket(self, step: int, section: str, part: dict, n: int) -> None:
        fresh = self._fresh
        if fresh:
            self.events += n
        if self._closed(step):
            if fresh:
                self.late_events += n
            return
        entry = self._feed(step)
        if entry is None:
            return
        getattr(entry, section).append(part)
        entry.events += n

    # -- closing ----------------------------------------------------------------------

    def close_ready(self, now: float) -> list[tuple[StepEvents, str]]:
        """Steps that may close now, in order, with the reason ("watermark" or "grace")."""
        out = []
        self.held_step = None
        marked = sorted(s for s, e in self.open.items() if e.mark is not None)
        for i, step in enumerate(marked):
            reason = self._ready(step, now)
            if reason is None:
                break
            through = self._window_complete_through(marked, i, now)
            if through is None:
                self.held_step = step
                break
            out.append((self._close(step, through), reason))
        return out

    def _ready(self, step: int, now: float) -> str | None:
        """Why marked ``step`` may close now ("watermark" or "grace"), or None."""
        if self.watermark is not None:
            return "watermark" if self.watermark >= step else None
        return "grace" if now - self.open[step].mark_seen_at >= self.grace_s else None

    def _prev_device_end(self, step: int) -> int:
        before = self.device_end
        return before[1] if before is not None and before[0] == step - 1 else NO_VALUE

    def _window_complete_through(self, marked: list[int], i: int, now: float) -> int | None:
        """The last step whose device ops the window of ``marked[i]`` takes (``marked``:
        the marked steps in order), or None while a later step may still add to it. A host
        step's is itself; once the producer sent its end mark no later step comes, and the
        last marked step's is the last."""
        step = marked[i]
        own = self.open[step].own_device_end(is_ascend_device(self.device))
        if own is None:
            return step
        prev = self._prev_device_end(step)
        end = own if prev == NO_VALUE else max(own, prev)
        self._grace_wait = None
        for k in marked[i:]:
            if k != step and self._ready(k, now) is None:
                self._grace_wait = self.open[k].mark_seen_at
                return None
            if self.open[k].mark[1] >= end + CLOCK_SKEW_NS:  # step k + 1 launches after the window
                return k
        if self.ended_ns is not None:  # the rank ended: no step after the last marked one
            return marked[-1]
        return None

    def grace_mark(self) -> float | None:
        """The mark time whose grace period the next close waits for (no watermark): the
        first marked step's, or the later step's a device step waits for (``held_step``)."""
        if self.held_step is not None:
            return self._grace_wait
        marked = [s for s, e in self.open.items() if e.mark is not None]
        return self.open[min(marked)].mark_seen_at if marked else None

    @property
    def finished(self) -> bool:
        """The producer sent its end mark and no step it marked is still open."""
        return self.ended_ns is not None and all(e.mark is None for e in self.open.values())

    @property
    def last_step(self) -> int | None:
        """The last closed step, None before one."""
        return None if self.floor is None else self.floor - 1

    def close_all(self) -> list[StepEvents]:
        """Close every step that has its mark (idle run); discard the rest."""
        steps = sorted(s for s, e in self.open.items() if e.mark is not None)
        closed = [self._close(s, steps[-1]) for s in steps]
        self.orphan_events += sum(e.events for e in self.open.values())
        self.open.clear()
        self.held_step = None
        return closed

    def _ahead(self, step: int, through: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Device ops of the marked steps after ``step`` up to ``through`` that start before
        ``end``: (kind, start, end)."""
        parts = []
        for k in range(step + 1, through + 1):
            entry = self.open.get(k)
            if entry is not None and entry.mark is not None and entry.ops:
                ops = entry.op_columns()
                part = ahead_ops(ops["kind"], ops["start_ns"], ops["dur_ns"], ops["launch_ns"], end)
                if len(part[0]):
                    parts.append(part)
        if not parts:
            return _NO_AHEAD
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))

    def _close(self, step: int, through: int) -> StepEvents:
        entry = self.open.pop(step)
        for s in [s for s in self.open if s < step]:  # events of steps that never got a mark
            self.orphan_events += self.open.pop(s).events
        self.floor = step + 1
        S, E, F, B = entry.mark
        ops = entry.op_columns()
        mem = _concat(entry.memory, _MEM_COLS, _DTYPES)
        q = _concat(entry.queues, _QUEUE_COLS, _DTYPES)
        dev = _concat(entry.devices, _DEVICE_COLS, _DEVICE_DTYPES)
        prev = self._prev_device_end(step)
        own = entry.own_device_end(is_ascend_device(self.device))
        ahead = _NO_AHEAD if own is None else self._ahead(step, through, own if prev == NO_VALUE else max(own, prev))
        ev = StepEvents(
            run_id=self.run_id, rank=self.rank, step=step, start_ns=S, end_ns=E,
            fp_start_ns=F, bp_end_ns=B, host=self.host, device=self.device,
            op_kind=ops["kind"], op_type=ops["type"], op_stream=ops["stream"],
            op_start_ns=ops["start_ns"], op_dur_ns=ops["dur_ns"], op_launch_ns=ops["launch_ns"],
            type_names=self.type_names, world_size=self.world_size,
            mem_ts_ns=mem["ts_ns"], mem_allocated=mem["allocated"], mem_reserved=mem["reserved"],
            mem_peak=mem["peak"], queue=q["queue"], queue_ts_ns=q["ts_ns"], queue_size=q["size"],
            queue_capacity=q["capacity"], host_samples=_readings(self.recent_host, S, E, "host_samples"),
            loader_samples=_readings(self.recent_loader, S, E, "loader_samples"),
            queue_names=self.queue_names, carried_compute=self.carry[0], carried_comm=self.carry[1],
            prev_device_end_ns=prev, ahead_kind=ahead[0], ahead_start_ns=ahead[1], ahead_end_ns=ahead[2],
            collectives=one_per_call(Calls(self.collective_names, _concat(entry.collectives, _CALL_COLS, _CALL_DTYPES))),
            device_samples=dev, dropped_ops=entry.lost[0], dropped_samples=entry.lost[1],
            work=_merged_work(entry.work, entry.late_work),
        )
        self.carry = carry_past_end(ev)
        window = step_window(ev)
        self.device_end = (step, window.end_ns) if window.device else None
        return ev

    @property
    def open_events(self) -> int:
        return sum(e.events for e in self.open.values())

    @property
    def min_open_offset(self) -> int | None:
        """Input offset from which every open step's events can be read again."""
        offsets = [e.first_offset for e in self.open.values() if e.first_offset >= 0]
        return min(offsets) if offsets else None

    # -- checkpoint -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The RankCheckpoint fields this assembler owns."""
        (cs, ce), (ms, me) = self.carry
        return {"run_id": self.run_id, "rank": self.rank, "floor": self.floor, "watermark": self.watermark,
                "host": self.host, "device": self.device, "producers": dict(self.next_seq),
                "counters": {c: getattr(self, c) for c in self.COUNTERS},
                "carry": {"compute_start": _i64_bytes(cs), "compute_end": _i64_bytes(ce),
                          "comm_start": _i64_bytes(ms), "comm_end": _i64_bytes(me)},
                "device_end_step": None if self.device_end is None else self.device_end[0],
                "device_end_ns": None if self.device_end is None else self.device_end[1]}

    @classmethod
    def restore(cls, checkpoint: dict, grace_s: float, partition: int, now: float) -> RankAssembler:
        asm = cls(checkpoint["run_id"], checkpoint["rank"], grace_s, partition)
        asm.floor, asm.watermark = checkpoint["floor"], checkpoint["watermark"]
        asm.host, asm.device = checkpoint["host"], checkpoint["device"]
        asm.next_seq = dict(checkpoint["producers"])
        for c in cls.COUNTERS:
            setattr(asm, c, checkpoint["counters"].get(c, 0))
        carry = checkpoint["carry"]
        asm.carry = tuple((np.frombuffer(carry[f"{kind}_start"], "<i8").astype(np.int64),
                           np.frombuffer(carry[f"{kind}_end"], "<i8").astype(np.int64))
                          for kind in ("compute", "comm"))
        if checkpoint["device_end_step"] is not None:
            asm.device_end = (checkpoint["device_end_step"], checkpoint["device_end_ns"])
        asm.last_seen = now
        return asm
