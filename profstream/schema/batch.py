"""The columnar ``EventBatch``: what producers send on the raw topic.

In memory every column is a numpy array; on the wire numeric columns are packed
little-endian arrays inside Avro ``bytes`` (layout documented in event_batch.avsc), so a
batch of thousands of ops costs a handful of buffer copies, not thousands of records. A
decoded batch's host and loader readings are a read-only mapping whose columns are made
arrays when read (``wire_columns.WireColumns``: a few values each, read as bytes by the
host figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from profstream import compiled
from profstream.schema.codec import DecodeError, decode, encode
from profstream.schema.codec import names_blob as _names_blob
from profstream.schema.names import NAME_RULE, is_valid_name
from profstream.schema.wire_columns import WireLayout

# Op kinds (the u8 ``kind`` column).
COMPUTE, COMMUNICATION, MEMCPY, HOST, DATA, MEMSET = range(6)
KIND_NAMES = ("compute", "communication", "memcpy", "host", "data", "memset")
KIND_CODES = {name: code for code, name in enumerate(KIND_NAMES)}
KIND_CODES.update({"comm": COMMUNICATION})

NO_VALUE = -1  # absent value in an optional i64 column
# A step mark whose step is END_MARK is no step: the producer's end mark, sent once when it
# ends normally (the Monitor's close), after every other step mark; end_ns is when.
END_MARK = -1

I32, I64, U8, F64 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1"), np.dtype("<f8")

# Column layout per section: (column name, dtype). The order is the schema's.
OP_COLUMNS = (("name_idx", I32), ("type_idx", I32), ("kind", U8), ("stream", I32),
              ("step", I64), ("start_ns", I64), ("dur_ns", I64), ("launch_ns", I64))
MEMORY_COLUMNS = (("ts_ns", I64), ("step", I64), ("allocated", I64), ("reserved", I64), ("peak", I64))
QUEUE_COLUMNS = (("name_idx", I32), ("ts_ns", I64), ("step", I64), ("size", I64), ("capacity", I64))
# v7: a mark says what its step lost (dropped_ops, dropped_samples: a partial step) and
# the end mark why the producer ended (end_signal: the signal number, 0 for a close)
LOSS_COLUMNS = (("dropped_ops", I64), ("dropped_samples", I64), ("end_signal", I64))
# v8: the step's work after them (WORK_COLUMNS; a mark row without them is filled from
# COLUMN_FILL: absent). A row whose start_ns is WORK_ROW is no mark: it carries work for a
# step whose mark came earlier (the FLOPs of its captured ops, read after it ended).
WORK_COLUMNS = (("tokens", I64), ("samples", I64), ("flops", F64), ("flops_source", U8), ("peak_flops", F64),
                ("matmul_flops", F64), ("attention_flops", F64), ("conv_flops", F64))
STEP_COLUMNS = (("step", I64), ("start_ns", I64), ("end_ns", I64), ("fp_start_ns", I64), ("bp_end_ns", I64),
                *LOSS_COLUMNS, *WORK_COLUMNS)
# The columns a step mark has had since v1; a batch whose marks' later columns hold their
# fill (nothing lost, no signal, no work) is written as an older version (encode_batch)
STEP_MARK_V1_COLUMNS = 5
# ``flops_source`` codes of a step mark: where its model FLOPs came from
FLOPS_SOURCES = ("", "given", "counted", "ops")
FLOPS_GIVEN, FLOPS_COUNTED, FLOPS_OPS = 1, 2, 3
WORK_ROW = -1  # start_ns of a steps row that carries work alone
# v6: one row per rank's part in a collective call; name, group and dtype index collective_names
COLLECTIVE_COLUMNS = (("name_idx", I32), ("group_idx", I32), ("dtype_idx", I32), ("step", I64), ("seq", I64),
                      ("start_ns", I64), ("dur_ns", I64), ("in_bytes", I64), ("out_bytes", I64),
                      ("group_size", I32))
HOST_COLUMNS = (("ts_ns", I64), ("cpu_user", F64), ("cpu_system", F64), ("cpu_idle", F64),
                ("cpu_iowait", F64), ("process_cpu", F64), ("rss_bytes", I64))
# Device counters (v5): -1 in an i64 column, NaN in an f64 one, where the device has no value.
DEVICE_COLUMNS = (("ts_ns", I64), ("step", I64), ("device", I32), ("gpu_util", F64), ("mem_util", F64),
                  ("mem_used", I64), ("mem_total", I64), ("power_w", F64), ("power_limit_w", F64),
                  ("temperature_c", F64), ("sm_clock_mhz", F64), ("throttle_reasons", I64),
                  ("pcie_rx", F64), ("pcie_tx", F64), ("nvlink_rx", F64), ("nvlink_tx", F64))

# v8: readings of the data-loader workers (worker >= 0) and of the machine (worker -1),
# taken off the training thread; NaN / -1 where a value is unknown
LOADER_COLUMNS = (("ts_ns", I64), ("step", I64), ("worker", I32), ("pid", I32), ("interval_s", F64), ("cpu", F64),
                  ("runnable", F64), ("batches", I32), ("ctx_switches_per_s", F64), ("cpu_count", I32))
MACHINE = -1  # the worker of the machine's row

SECTIONS = {
    "ops": OP_COLUMNS,
    "memory": MEMORY_COLUMNS,
    "queues": QUEUE_COLUMNS,
    "steps": STEP_COLUMNS,
    "host_samples": HOST_COLUMNS,
    "device_samples": DEVICE_COLUMNS,
    "collectives": COLLECTIVE_COLUMNS,
    "loader_samples": LOADER_COLUMNS,
}
# A batch without device samples is written as the version before them, which every
# processor since v4 reads: producers with device counters off stay readable by older
# processors (docs/events.md#versions).
WITHOUT_DEVICE_SAMPLES_VERSION = 4
# Likewise a batch without collectives is written as v5 (or v4, without device samples too).
WITHOUT_COLLECTIVES_VERSION = 5
# And a batch whose step marks say nothing past v1's columns (nothing lost, a close, no
# work) and that has no loader readings as v6 or older; v8 for all the others (v7, marks
# with losses but no work, is read but no longer written: the compiled Monitor has one plan
# for marks that say more, and the Python encoder writes what it writes).
WITHOUT_MARK_EXTRAS_VERSION = 6

# Dictionary-coded columns: the header field that holds the dictionary -> the (section,
# column) whose values index it. Codes are given in order of first appearance per batch.
DICTIONARIES = {
    "op_names": ("ops", "name_idx"),
    "op_types": ("ops", "type_idx"),
    "queue_names": ("queues", "name_idx"),
}

# Columns added to a section after it first shipped, with the value they hold where a
# message of an older version (or an EventBatch built without them) has none. A later
# version adds its columns here; a section added later is simply empty in older messages.
COLUMN_FILL = {
    ("ops", "launch_ns"): NO_VALUE,  # v4
    ("steps", "dropped_ops"): 0,  # v7
    ("steps", "dropped_samples"): 0,
    ("steps", "end_signal"): 0,
    **{("steps", col): float("nan") if dtype == F64 else 0 if dtype == U8 else NO_VALUE
       for col, dtype in WORK_COLUMNS},  # v8
}


def launch_column(ops: dict[str, np.ndarray]) -> np.ndarray:
    """``ops["launch_ns"]``, or all -1 for ops built without it (code written for v3)."""
    launch = ops.get("launch_ns")
    return launch if launch is not None else np.full(len(ops["step"]), NO_VALUE, I64)


def column(batch: EventBatch, section: str, col: str) -> np.ndarray:
    """A column of a batch's section, or its fill (``COLUMN_FILL``) for each row of a batch
    built in memory without it (code written for an older version)."""
    cols = getattr(batch, section)
    got = cols.get(col)
    if got is not None:
        return got
    return np.full(len(cols[SECTIONS[section][0][0]]), COLUMN_FILL[section, col], dict(SECTIONS[section])[col])


def dictionary_codes(values: Sequence) -> tuple[np.ndarray, dict]:
    """Dictionary encoding of a column: each value's code (int32, codes given in order of
    first appearance) and {value: code}, whose keys in order are the dictionary."""
    table: dict = {}
    setdefault = table.setdefault
    return np.fromiter([setdefault(v, len(table)) for v in values], I32, len(values)), table


def _read_only_empty(dtype: np.dtype) -> np.ndarray:
    arr = np.empty(0, dtype)
    arr.flags.writeable = False
    return arr


# Zero-length columns are shared, read-only as decoded columns are: a Monitor builds a
# batch every 50 ms, mostly of step marks and memory samples, so most of its five
# sections are empty (with _EMPTY_PACKED: encode_batch of such a batch 58 -> 45 us warm).
_EMPTY_COLUMNS = {dtype: _read_only_empty(dtype) for dtype in (I32, I64, U8, F64)}


_EMPTY_SECTIONS = {section: {col: _EMPTY_COLUMNS[dtype] for col, dtype in spec} for section, spec in SECTIONS.items()}


def empty_section(section: str) -> dict[str, np.ndarray]:
    return _EMPTY_SECTIONS[section].copy()  # a dict of its own: callers may set columns


def _empty(section: str):
    return field(default_factory=lambda: empty_section(section))


class OpNames(Sequence):
    """``op_names`` of a decoded batch: the wire blob (v3), split into strings only when a
    name is read, so consumers that need none (the processors) never pay for them."""

    __slots__ = ("blob", "_names", "_n")

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self._names: list[str] | None = None
        self._n = blob.count(0)

    def _list(self) -> list[str]:
        if self._names is None:
            self._names = self.blob[:-1].decode("utf-8", "replace").split("\0") if self._n else []
        return self._names

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, tuple, OpNames)) and self._list() == list(other)

    def __repr__(self) -> str:
        return f"OpNames({self._list()!r})"


def names_blob(names: Sequence[str]) -> bytes:
    """The v3 wire form of ``op_names``."""
    return names.blob if isinstance(names, OpNames) else _names_blob(list(names))


@dataclass
class EventBatch:
    run_id: str
    rank: int
    world_size: int | None = None
    host: str = ""
    device: str = "cpu"
    producer_id: str = ""
    seq: int = 0
    sent_ns: int = 0
    dropped_ops: int = 0
    dropped_samples: int = 0
    complete_through_step: int | None = None
    buffer_fill_ratio: float = 0.0
    send_latency_ns: int = NO_VALUE
    op_names: Sequence[str] = field(default_factory=list)  # a list, or OpNames once decoded
    op_types: list[str] = field(default_factory=list)
    queue_names: list[str] = field(default_factory=list)
    collective_names: list[str] = field(default_factory=list)
    ops: dict[str, np.ndarray] = _empty("ops")
    memory: dict[str, np.ndarray] = _empty("memory")
    queues: dict[str, np.ndarray] = _empty("queues")
    steps: dict[str, np.ndarray] = _empty("steps")
    host_samples: dict[str, np.ndarray] = _empty("host_samples")
    device_samples: dict[str, np.ndarray] = _empty("device_samples")
    collectives: dict[str, np.ndarray] = _empty("collectives")
    loader_samples: dict[str, np.ndarray] = _empty("loader_samples")

    @property
    def key(self) -> bytes:
        return f"{self.run_id}/{self.rank}".encode()

    def n(self, section: str) -> int:
        return len(getattr(self, section)[SECTIONS[section][0][0]])

    @property
    def event_count(self) -> int:
        return sum(self.n(s) for s in SECTIONS)


_HEADER_FIELDS = ("run_id", "rank", "world_size", "host", "device", "producer_id", "seq", "sent_ns",
                  "dropped_ops", "dropped_samples", "complete_through_step",
                  "buffer_fill_ratio", "send_latency_ns", "op_names", "op_types", "queue_names", "collective_names")


_EMPTY_PACKED = {section: {"count": 0, **{col: b"" for col, _ in spec}} for section, spec in SECTIONS.items()}


def _pack(section: str, columns: dict[str, np.ndarray]) -> dict:
    spec = SECTIONS[section]
    count = len(columns[spec[0][0]])
    if not count and not any(len(columns.get(col, ())) for col, _ in spec):
        return _EMPTY_PACKED[section]  # most sections of most batches: no numpy calls
    out: dict = {"count": count}
    for col, dtype in spec:
        if col not in columns and (section, col) in COLUMN_FILL:
            out[col] = np.full(count, COLUMN_FILL[section, col], dtype).tobytes()
            continue
        arr = np.asarray(columns[col])
        if len(arr) != count:
            raise ValueError(f"{section}.{col} has {len(arr)} values, expected {count}")
        out[col] = arr.astype(dtype, copy=False).tobytes()
    return out


# Per section: (column, dtype, its item size, its COLUMN_FILL or _NO_FILL), in the schema's order
_NO_FILL = object()
_UNPACK = {section: tuple((col, dtype, dtype.itemsize, COLUMN_FILL.get((section, col), _NO_FILL)) for col, dtype in spec)
           for section, spec in SECTIONS.items()}


_FILLED: dict[tuple[str, str, int], np.ndarray] = {}  # (section, column, rows) -> its fill, read-only


def _filled(section: str, col: str, count: int, fill, dtype: np.dtype) -> np.ndarray:
    """A column newer than the message: ``count`` rows of its fill, read-only as decoded
    columns are, and shared between batches of a few rows (a step mark of a v4 batch has
    eleven such columns: np.full of each cost ~1.3 us a batch)."""
    if count > 64:
        arr = np.full(count, fill, dtype)
        arr.flags.writeable = False
        return arr
    key = (section, col, count)
    arr = _FILLED.get(key)
    if arr is None:
        arr = _FILLED[key] = np.full(count, fill, dtype)
        arr.flags.writeable = False
    return arr


# The readings' sections are kept as the wire's bytes (WireColumns): a column is made an
# array when it is read, and the host figures read the bytes as they are. Their columns
# have no fill (every version that has the section has them all).
_WIRE = {section: WireLayout(section, SECTIONS[section]) for section in ("host_samples", "loader_samples")}


# A step mark's columns after v1's (losses, work) hold their fill in most marks: in a v8
# batch (every batch with loader readings is one) they are taken as the shared filled
# columns, as for a message older than them, rather than read into an array each.
_LATER_MARKS = STEP_COLUMNS[STEP_MARK_V1_COLUMNS:]
_UNPACK_MARKS_V1 = _UNPACK["steps"][:STEP_MARK_V1_COLUMNS]
_LATER_NAMES = tuple(col for col, _ in _LATER_MARKS)
_NO_LATER = (None,) * len(_LATER_MARKS)
_LATER_FILLED: dict[int, tuple] = {}  # rows (up to 64) -> (the later columns' fill as bytes, {column: filled})


def _later_filled(count: int) -> tuple[tuple[bytes, ...], dict[str, np.ndarray]]:
    got = _LATER_FILLED.get(count)
    if got is None:
        fills = [(col, dtype, COLUMN_FILL["steps", col]) for col, dtype in _LATER_MARKS]
        got = _LATER_FILLED[count] = (tuple(np.full(count, fill, dtype).tobytes() for _, dtype, fill in fills),
                                      {col: _filled("steps", col, count, fill, dtype) for col, dtype, fill in fills})
    return got


def _unpack(section: str, record: dict) -> dict[str, np.ndarray]:
    count = record["count"]
    if count < 0:
        raise DecodeError("malformed", f"{section}.count is negative")
    if not count and not any(record.values()):  # the count and every column (of its version) empty
        return _EMPTY_SECTIONS[section].copy()  # most sections of most batches: no numpy calls
    wire = _WIRE.get(section)
    if wire is not None:
        return wire.columns(record, count)
    spec = _UNPACK[section]
    filled = None
    if section == "steps" and count <= 64:
        fill_raw, filled = _later_filled(count)
        later = tuple(map(record.get, _LATER_NAMES))
        if later == fill_raw or later == _NO_LATER:  # nothing past v1's columns (v8 or older than v7)
            spec = _UNPACK_MARKS_V1
        else:
            filled = None
    get = record.get
    out = {}
    for col, dtype, size, fill in spec:
        raw = get(col)
        if raw is None and fill is not _NO_FILL:  # a column newer than the message
            # (count was checked against the section's first column, never a filled one)
            out[col] = _filled(section, col, count, fill, dtype)
            continue
        if len(raw) != count * size:
            raise DecodeError("malformed", f"{section}.{col} holds {len(raw)} bytes, expected {count} x {size}")
        out[col] = np.frombuffer(raw, dtype)
    if filled is not None:
        out.update(filled)
    return out


def encode_batch(batch: EventBatch) -> bytes:
    record = {f: getattr(batch, f) for f in _HEADER_FIELDS}
    record["op_names"] = names_blob(batch.op_names)
    for section in SECTIONS:
        record[section] = _pack(section, getattr(batch, section))
    if _marks_say_more(record["steps"]) or record["loader_samples"]["count"]:
        version = None
    elif record["collectives"]["count"]:
        version = WITHOUT_MARK_EXTRAS_VERSION
    else:
        version = WITHOUT_COLLECTIVES_VERSION if record["device_samples"]["count"] else WITHOUT_DEVICE_SAMPLES_VERSION
    return encode("EventBatch", record, version)


_FILL_BYTES = {col: np.full(1, COLUMN_FILL["steps", col], dtype).tobytes()
               for col, dtype in STEP_COLUMNS[STEP_MARK_V1_COLUMNS:]}


def _marks_say_more(packed: dict) -> bool:
    """Whether a packed steps section holds anything but the fill in the columns added
    after v1 (a step that lost events, an end mark on a signal, a step's work): v8 must
    carry it."""
    n = packed["count"]
    return bool(n) and any(packed[col] != fill * n for col, fill in _FILL_BYTES.items())


_SECTION_NAMES = tuple(SECTIONS)
_VALID_NAMES: set[str] = set()  # run ids, hosts and devices already checked (is_valid_name)


def _check_name(what: str, value, may_be_empty: bool) -> None:
    if value in _VALID_NAMES or (may_be_empty and value == ""):
        return
    if not is_valid_name(value):
        raise DecodeError("invalid_name", f"{what} {value[:80]!r}{'...' if len(value) > 80 else ''}: "
                                          f"expected {NAME_RULE}")
    if len(_VALID_NAMES) >= 65536:
        _VALID_NAMES.clear()
    _VALID_NAMES.add(value)


def _below(index: np.ndarray, size: int) -> bool:
    """Whether every index of an int32 dictionary-index column is in its dictionary of
    ``size``: a negative index is a large unsigned one, so one max says both (compiled
    where it is built: ~0.1 against ~1.2 us)."""
    if compiled.NATIVE is not None:
        inside = compiled.NATIVE.below(index, size)
        if inside is not None:
            return inside
    return bool(index.view(np.uint32).max() < size)


def decode_batch(data: bytes) -> EventBatch:
    """Decode a raw-topic message; raises DecodeError (and only that) on bad input."""
    record = decode("EventBatch", data)
    blob = record["op_names"]
    if blob and blob[-1] != 0:
        raise DecodeError("malformed", "op_names does not end with its NUL terminator")
    sections = {section: _unpack(section, record[section]) if section in record else _EMPTY_SECTIONS[section].copy()
                for section in _SECTION_NAMES}  # a section newer than the message: empty
    batch = EventBatch(record["run_id"], record["rank"], record["world_size"], record["host"], record["device"],
                       record["producer_id"], record["seq"], record["sent_ns"], record["dropped_ops"],
                       record["dropped_samples"], record["complete_through_step"], record["buffer_fill_ratio"],
                       record["send_latency_ns"], OpNames(blob), record["op_types"], record["queue_names"],
                       record["collective_names"], **sections)
    ops = batch.ops
    if len(ops["name_idx"]) and not (_below(ops["name_idx"], len(batch.op_names))
                                     and _below(ops["type_idx"], len(batch.op_types))):
        raise DecodeError("malformed", "op name/type index outside its dictionary")
    q = batch.queues["name_idx"]
    if len(q) and not _below(q, len(batch.queue_names)):
        raise DecodeError("malformed", "queue name index outside its dictionary")
    c = batch.collectives
    if len(c["step"]):  # the three index one dictionary; a negative index is a large unsigned one
        idx = np.concatenate((c["name_idx"], c["group_idx"], c["dtype_idx"])).view(np.uint32)
        if idx.max() >= len(batch.collective_names):
            bad = next(k for k in ("name_idx", "group_idx", "dtype_idx")
                       if c[k].view(np.uint32).max() >= len(batch.collective_names))
            raise DecodeError("malformed", f"collectives.{bad} outside collective_names")
    _check_name("run_id", batch.run_id, False)  # host and device may be unknown (empty)
    _check_name("host", batch.host, True)
    _check_name("device", batch.device, True)
    return batch
