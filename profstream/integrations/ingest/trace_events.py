"""Chrome trace events read into columns: the file's JSON text, typed decoding of the
events (only the fields ingest reads, no dict per event), and the one pass over the decoded
events that keeps their keys' codes, timestamps, metadata and memory samples as
``EventColumns``. ``chrome`` turns the columns into a Profile; ``chunks`` makes them in
several processes and merges them.
"""

from __future__ import annotations

import gc
import gzip
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from profstream.integrations.ingest.ascend_scan import AscendColumns, merge_ascend, scan_ascend
from profstream.integrations.ingest.model import I64, IngestError

# Categories of events that ran on a device (GPU, NPU): their ops may carry a launch correlation.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_op", "ai_core", "ai_cpu", "aicore"})

EXPECTED = "a Chrome trace JSON file (an object with traceEvents, or an array of trace events)"
# EventArgs' collective fields as torch names them
COLLECTIVE_ARGS = ("Collective name", "Seq", "Process Group Name", "Group size", "In msg nelems", "Out msg nelems",
                   "dtype")
# Names of the events that may carry them: c10d's record_param_comms and NCCL/gloo ops
_COLLECTIVE_EVENT = re.compile(r"record_param_comms|nccl|gloo|c10d", re.I)


class EventArgs(msgspec.Struct, gc=False):
    """The args ingest reads: a metadata event's name, a [memory] event's totals, the
    correlation that links a device op to the runtime call that launched it, and what
    torch.distributed records of a collective call (``record_param_comms`` and, in newer
    PyTorch, the NCCL kernel itself)."""

    name: Any = None
    allocated: Any = msgspec.field(default=None, name="Total Allocated")
    reserved: Any = msgspec.field(default=None, name="Total Reserved")
    correlation: Any = None
    collective: Any = msgspec.field(default=None, name="Collective name")
    seq: Any = msgspec.field(default=None, name="Seq")
    group: Any = msgspec.field(default=None, name="Process Group Name")
    group_size: Any = msgspec.field(default=None, name="Group size")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    # Ascend (msprof, torch_npu): a hardware task's type and the id of the flow that links
    # it to its launch; an msprof Iteration's forward start and backward end
    task_type: Any = msgspec.field(default=None, name="Task Type")
    connection_id: Any = None
    fp_start: Any = msgspec.field(default=None, name="FP Start")
    bp_end: Any = msgspec.field(default=None, name="BP End")


class TraceEvent(msgspec.Struct, gc=False):
    """The fields of a trace event that ingest reads; the rest are skipped while parsing."""

    ph: str = ""
    name: str = ""
    cat: str | None = None
    pid: int | str = 0
    tid: int | str = 0
    ts: float | str = 0.0
    dur: float | str = 0.0
    args: EventArgs | None = None
    id: Any = None  # a flow event's id (s / f)


class TraceFile(msgspec.Struct, gc=False):
    """A trace that is an object: its events and the header fields ingest reads."""

    traceEvents: list[TraceEvent]
    baseTimeNanoseconds: int | None = None
    host_name: str | None = None
    distributedInfo: Any = None


_TRACE = msgspec.json.Decoder(TraceFile | list[TraceEvent])


@contextmanager
def gc_paused():
    """The cyclic GC off: millions of new objects would run it over and over for nothing,
    and a process forked meanwhile (``chunks``) must not collect in the child what other
    threads of the parent were changing at the fork."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_bytes(path: Path) -> bytes:
    """The JSON text of a plain or gzip trace file; IngestError naming the file when it is
    not one."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise IngestError(f"{path}: cannot read ({e.strerror}): expected {EXPECTED}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise IngestError(f"{path}: truncated or corrupt gzip ({e}): expected {EXPECTED}") from None
    if raw.lstrip()[:1] not in (b"{", b"["):
        raise IngestError(f"{path}: not JSON: expected {EXPECTED}")
    return raw


def decode_trace(path: Path, raw: bytes) -> tuple[list[TraceEvent], dict[str, Any]]:
    """The events and header fields of a trace's JSON text. Typed decoding (no dict per
    event) is the fast path; a trace with odd field types goes through a tolerant generic parse."""
    try:
        trace = _TRACE.decode(raw)
    except msgspec.ValidationError:
        return _tolerant(path, raw)
    except msgspec.DecodeError as e:
        raise IngestError(f"{path}: truncated or invalid JSON ({e}): expected {EXPECTED}") from None
    if isinstance(trace, list):
        return trace, {}
    return trace.traceEvents, {"baseTimeNanoseconds": trace.baseTimeNanoseconds, "host_name": trace.host_name,
                               "distributedInfo": trace.distributedInfo}


def _tolerant(path: Path, raw: bytes) -> tuple[list[TraceEvent], dict[str, Any]]:
    data = msgspec.json.decode(raw)
    meta: dict = {}
    if isinstance(data, dict):
        meta, data = data, data.get("traceEvents")
    if not isinstance(data, list):
        raise IngestError(f"{path}: no trace events: expected {EXPECTED}")
    events = []
    for e in data:
        if not isinstance(e, dict):
            raise IngestError(f"{path}: a trace event is not an object: expected {EXPECTED}")
        pid, tid = e.get("pid", 0), e.get("tid", 0)
        events.append(TraceEvent(str(e.get("ph", "")), str(e.get("name", "")), str(e.get("cat") or ""),
                                 pid if isinstance(pid, (int, str)) else str(pid),
                                 tid if isinstance(tid, (int, str)) else str(tid),
                                 e.get("ts", 0), e.get("dur", 0), _tolerant_args(e.get("args")), e.get("id")))
    return events, meta


def _tolerant_args(args) -> EventArgs | None:
    if not isinstance(args, dict):
        return None
    return EventArgs(args.get("name"), args.get("Total Allocated"), args.get("Total Reserved"),
                     args.get("correlation"), *(args.get(k) for k in COLLECTIVE_ARGS),
                     *(args.get(k) for k in ("Task Type", "connection_id", "FP Start", "BP End")))



def is_plain(path: Path) -> bool:
    """Not gzip (or not readable: ``read_bytes`` says why)."""
    try:
        with path.open("rb") as f:
            return f.read(2) != b"\x1f\x8b"
    except OSError:
        return True


def _floats(values: list) -> np.ndarray:
    try:
        return np.fromiter(values, np.float64, len(values))
    except (TypeError, ValueError):  # numbers as strings (msprof)
        return np.array(values, np.float64)


def us_to_ns(ts_us: np.ndarray) -> np.ndarray:
    """Microseconds (float) to integer ns, whole microseconds kept exact."""
    whole = np.floor(ts_us)
    return whole.astype(I64) * 1000 + np.rint((ts_us - whole) * 1000).astype(I64)


def _exact_ns(value) -> int:
    """ns of one timestamp in µs; a decimal string exactly (``"1736405443881410.320"``: a
    float64 would round it to 0.25 µs), a number as a float."""
    if isinstance(value, str):
        text = value.strip()
        sign = -1 if text.startswith("-") else 1
        whole, _, frac = text.lstrip("+-").partition(".")
        if whole.isdigit() and (not frac or frac.isdigit()):
            ns = int(whole) * 1000 + int((frac + "000")[:3])
            if len(frac) > 3 and frac[3] >= "5":  # half up on the fourth decimal
                ns += 1
            return sign * ns
    return int(us_to_ns(np.array([float(value)], np.float64))[0])


def timestamps_ns(values: list) -> np.ndarray:
    """Per value in µs: integer ns since the same origin. Numbers go through float64 (their
    own precision); strings, as msprof and torch_npu write them, are read exactly (a file
    writes all its timestamps one way: its first and last say which)."""
    if values and (type(values[0]) is str or type(values[-1]) is str):
        return np.array([_exact_ns(v) for v in values], I64)
    try:
        return us_to_ns(np.fromiter(values, np.float64, len(values)))
    except (TypeError, ValueError):
        return np.array([_exact_ns(v) for v in values], I64)


@dataclass
class EventColumns:
    """What ingest keeps of a run of trace events, in file order: columns and small tables,
    no object per event, so that a worker process sends it cheaply."""

    keys: list[tuple]  # distinct (ph, name, cat, pid, tid), in order of first appearance
    key_code: np.ndarray  # per complete (X) event: its key (int32)
    ts_ns: np.ndarray  # per complete event (int64 ns on the trace's clock: its µs x 1000)
    dur_us: np.ndarray  # per complete event (float64)
    metadata: list[tuple[str, Any, Any, str]]  # (process_name | thread_name, pid, tid, name)
    correlation: np.ndarray  # per complete event: its args.correlation (int64), -1 without one
    mem_ts_ns: np.ndarray  # [memory] samples (int64 as ts_ns, int64, int64; reserved -1 when absent)
    mem_allocated: np.ndarray
    mem_reserved: np.ndarray
    begin_end: int  # B/E events (not read)
    # per complete event with collective args: (its index among the complete events,
    # collective, group, seq, group size, in nelems, out nelems, dtype)
    collectives: list[tuple]
    ascend: AscendColumns | None = None  # task types, flows, step marks of msprof and torch_npu traces


def scan_events(path: Path, events: list[TraceEvent]) -> EventColumns:
    """The one pass over the decoded events: a hashed key each (phase, name, category and
    track are coded later from the distinct keys), the timestamps of the complete events,
    their launch correlations when the trace has device events, and the few metadata and
    memory events."""
    # setdefault in the comprehension: building a list of a million tuples first costs 1.6x as much
    key_ix: dict = {}
    setdefault = key_ix.setdefault
    all_code = np.fromiter([setdefault((e.ph, e.name, e.cat, e.pid, e.tid), len(key_ix)) for e in events],
                           np.int32, len(events))
    keys = list(key_ix)
    is_complete = np.array([k[0] == "X" for k in keys] or [False], bool)[all_code]
    complete = np.flatnonzero(is_complete)
    try:
        ts_ns = timestamps_ns([e.ts for e in events])[complete]
        dur_us = _floats([e.dur for e in events])[complete]
    except (TypeError, ValueError):
        raise IngestError(f"{path}: an event's ts or dur is not a number: expected {EXPECTED}") from None
    if any(k[0] == "X" and isinstance(k[2], str) and k[2].lower() in DEVICE_CATEGORIES for k in keys):
        correlation = _correlations([events[i] for i in complete.tolist()])
    else:  # no device events: nothing to correlate (a CPU trace pays no pass for it)
        correlation = np.full(len(complete), -1, I64)

    collectives = _collectives(events, keys, all_code[complete], complete)
    ascend = scan_ascend(events, keys, all_code, complete)
    metadata = []
    mem_ts, mem_alloc, mem_resv = [], [], []
    begin_end = 0
    for i in np.flatnonzero(~is_complete).tolist():
        e = events[i]
        ph, nm, args = e.ph, e.name, e.args
        if ph in ("B", "E"):
            begin_end += 1
        if args is None:
            continue
        if ph == "M":
            if nm in ("process_name", "thread_name"):
                metadata.append((nm, e.pid, e.tid, str(args.name)))
        elif ph == "i" and nm == "[memory]" and isinstance(args.allocated, int):
            mem_ts.append(e.ts)
            mem_alloc.append(args.allocated)
            mem_resv.append(args.reserved if isinstance(args.reserved, int) else -1)
    return EventColumns(keys, all_code[complete], ts_ns, dur_us, metadata, correlation, timestamps_ns(mem_ts),
                        np.array(mem_alloc, I64), np.array(mem_resv, I64), begin_end, collectives, ascend)


def _collectives(events: list[TraceEvent], keys: list[tuple], key_code: np.ndarray,
                 complete: np.ndarray) -> list[tuple]:
    """EventColumns.collectives: only events whose name may be a collective are looked at."""
    named = [i for i, k in enumerate(keys) if k[0] == "X" and isinstance(k[1], str) and _COLLECTIVE_EVENT.search(k[1])]
    if not named:
        return []
    out = []
    for j in np.flatnonzero(np.isin(key_code, named)).tolist():
        a = events[int(complete[j])].args
        if a is not None and isinstance(a.collective, str) and type(a.seq) is int:
            out.append((j, a.collective, str(a.group if a.group is not None else "0"), a.seq,
                        a.group_size if type(a.group_size) is int else -1,
                        a.in_nelems if type(a.in_nelems) is int else -1,
                        a.out_nelems if type(a.out_nelems) is int else -1, str(a.dtype or "")))
    return out


def _correlations(events: list[TraceEvent]) -> np.ndarray:
    values = [c if (a := e.args) is not None and (c := a.correlation) is not None else -1 for e in events]
    try:
        return np.array(values, I64)
    except (TypeError, ValueError, OverflowError):  # a string or float somewhere: the odd ones are -1
        return np.array([v if type(v) is int and 0 <= v < 2**63 else -1 for v in values], I64)


def merge_columns(parts: list[EventColumns]) -> EventColumns:
    """The columns of consecutive runs of events as one: codes of the keys remapped so that
    they are what one pass over all the events gives."""
    key_ix: dict = {}
    setdefault = key_ix.setdefault
    codes = []
    for part in parts:
        remap = np.array([setdefault(k, len(key_ix)) for k in part.keys] or [0], np.int32)
        codes.append(remap[part.key_code])

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(part, name) for part in parts])

    offsets = np.cumsum([0] + [len(part.ts_ns) for part in parts]).tolist()
    return EventColumns(list(key_ix), np.concatenate(codes), joined("ts_ns"), joined("dur_us"),
                        [m for part in parts for m in part.metadata], joined("correlation"), joined("mem_ts_ns"),
                        joined("mem_allocated"), joined("mem_reserved"), sum(part.begin_end for part in parts),
                        [(j + off, *rest) for part, off in zip(parts, offsets) for j, *rest in part.collectives],
                        merge_ascend([part.ascend for part in parts], offsets))
